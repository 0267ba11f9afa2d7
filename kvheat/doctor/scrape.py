"""Reading a live `/metrics` (and optionally `/admin/stats`) over HTTP, bounded.

A scrape is a flat `{(sample name, sorted labels): value}` dict; two of them, taken
`window` seconds apart, make a `Snapshot` (kvheat.doctor.causes). Anything that is not a
bounded, parseable Prometheus text answer with kvheat series in it raises `DoctorError`
with one line that says why.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

MAX_BYTES = 16 * 1024 * 1024  # a server's /metrics is tens of KiB; more is not a kvheat one

Key = tuple[str, tuple[tuple[str, str], ...]]
Scrape = dict[Key, float]


class DoctorError(Exception):
    """A scrape that cannot be used: unreachable, refused, too large or not parseable."""


def _error_detail(e: urllib.error.HTTPError) -> str:
    """The `error` of a JSON error answer (Prometheus' API gives one), else nothing."""
    try:
        body = json.loads(e.read(4096))
    except (ValueError, OSError):
        return ""
    if not isinstance(body, dict) or not body.get("error"):
        return ""
    kind = f"{body['errorType']}: " if body.get("errorType") else ""
    return f": {kind}{' '.join(str(body['error']).split())[:300]}"


def fetch(url: str, token: str | None = None, max_bytes: int = MAX_BYTES,
          timeout_s: float = 10.0, accept: str = "text/plain", where: str | None = None) -> bytes:
    """The answer's body, at most `max_bytes`; `where` names the URL in errors (a query URL
    is long)."""
    where = where or url
    req = urllib.request.Request(url, headers={"Accept": accept})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (operator URL)
            body = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise DoctorError(f"{where}: HTTP {e.code} {e.reason}"
                          + (" (wrong or missing token?)" if e.code in (401, 403) else "")
                          + _error_detail(e)) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DoctorError(f"{where}: cannot read it ({getattr(e, 'reason', e)})") from None
    if len(body) > max_bytes:
        raise DoctorError(f"{where}: the answer is larger than {max_bytes} bytes (raise "
                          "--max-bytes if it really is kvheat's)")
    return body


def parse_metrics(body: bytes, where: str = "/metrics") -> Scrape:
    """Prometheus text -> {(name, labels): value}; `_created` samples are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = body.decode("utf-8")
        out: Scrape = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except (ValueError, UnicodeDecodeError, TypeError, IndexError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DoctorError(f"{where}: not Prometheus text format ({first})") from None
    if not any(name.startswith("kvheat_") for name, _ in out):
        raise DoctorError(f"{where}: no kvheat_ series in it (is it a `kvheat serve` /metrics?)")
    return out


def scrape(url: str, token: str | None = None, max_bytes: int = MAX_BYTES) -> Scrape:
    return parse_metrics(fetch(url, token, max_bytes), url)


def admin_stats(url: str, token: str | None = None, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    try:
        out = json.loads(fetch(url, token, max_bytes))
    except ValueError as e:
        raise DoctorError(f"{url}: not JSON ({e})") from None
    if not isinstance(out, dict):
        raise DoctorError(f"{url}: not a JSON object")
    return out
