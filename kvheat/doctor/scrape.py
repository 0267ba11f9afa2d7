"""Reading a live `/metrics` (and optionally `/admin/stats`) over HTTP, bounded.

A scrape is a flat `{(sample name, sorted labels): value}` dict; two of them, taken
`window` seconds apart, make a `Snapshot` (kvheat.doctor.causes). Anything that is not a
bounded, parseable Prometheus text answer with kvheat series in it raises `DoctorError`
with one line that says why. Every fetch is bounded in bytes and in time: `timeout_s` is
the deadline of the whole fetch (connect, headers and body), not of each read, so a peer
that drips a byte at a time cannot hold the doctor.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import math
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MAX_BYTES = 16 * 1024 * 1024  # a server's /metrics is tens of KiB; more is not a kvheat one
TIMEOUT_S = 10.0  # the default deadline of one fetch, body included
# The largest magnitude a sample may have. Counters and gauges of a real server stay far
# below it (a byte counter at 100 GB/s for a century is ~3e20); a bound far under float's
# 1.8e308 keeps every sum and ratio the causes take finite.
MAX_VALUE = 1e30

Key = tuple[str, tuple[tuple[str, str], ...]]
Scrape = dict[Key, float]


class DoctorError(Exception):
    """A scrape that cannot be used.

    Unreachable, refused, too slow, too large or not parseable."""


def sample_value(v: float, series: str, where: str) -> float:
    """A parsed sample, checked: NaN or a finite value within `MAX_VALUE`.

    NaN passes (legal in Prometheus: "no data", which `Snapshot` drops); ±Inf, or a
    magnitude above `MAX_VALUE` (an overflowing number parses as Inf), is no figure kvheat
    exports and makes the answer unusable."""
    if math.isnan(v) or abs(v) <= MAX_VALUE:
        return v
    raise DoctorError(f"{where}: {series} = {v:g} is not a finite value (at most "
                      f"{MAX_VALUE:g} in magnitude)")


def _json_number(text: str, where: str) -> float:
    v = float(text)
    if not math.isfinite(v) or abs(v) > MAX_VALUE:
        raise DoctorError(f"{where}: the number {text[:40]} is not finite or too large")
    return v


def _json_int(text: str, where: str) -> int:
    if len(text.lstrip("-")) > 30:  # > MAX_VALUE; Python would parse up to 4300 digits
        raise DoctorError(f"{where}: the number {text[:40]}... is too large")
    return int(text)


def _json_constant(name: str, where: str) -> float:
    raise DoctorError(f"{where}: {name} is not a JSON number")


def loads_json(body: bytes, where: str) -> Any:
    """JSON with every number finite and at most `MAX_VALUE`.

    Python's json reads NaN, Infinity and 1e999 as floats and any integer, however long; a
    bad one raises DoctorError, as does text that is not JSON."""
    try:
        return json.loads(body, parse_float=functools.partial(_json_number, where=where),
                          parse_int=functools.partial(_json_int, where=where),
                          parse_constant=functools.partial(_json_constant, where=where))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DoctorError(f"{where}: not JSON ({e})") from None


class _Deadline:
    """Shuts down every socket a fetch opens once `seconds` have passed, which wakes a
    read blocked on a slow peer (a socket timeout bounds each read, never their sum)."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for s in self._socks:
                self._shut(s)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # already closed
            sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


class _WatchedHTTP(http.client.HTTPConnection):
    def __init__(self, *args: Any, deadline: _Deadline, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self._deadline.watch(self.sock)


class _WatchedHTTPS(http.client.HTTPSConnection):
    def __init__(self, *args: Any, deadline: _Deadline, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()  # TCP and the TLS handshake: under urlopen's per-read timeout
        self._deadline.watch(self.sock)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTP, deadline=self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTPS, deadline=self._deadline), req)


def _error_detail(e: urllib.error.HTTPError) -> str:
    """The `error` of a JSON error answer (Prometheus' API gives one), else nothing."""
    try:
        body = json.loads(e.read(4096))
    except (ValueError, OSError, http.client.HTTPException):
        return ""
    if not isinstance(body, dict) or not body.get("error"):
        return ""
    kind = f"{body['errorType']}: " if body.get("errorType") else ""
    return f": {kind}{' '.join(str(body['error']).split())[:300]}"


def with_path(url: str, path: str) -> str:
    """`url` with `path` put in when it has none ("http://host:8000" or ".../").

    An operator gives the server's address, the doctor knows where its endpoint is."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme and parts.netloc and parts.path in ("", "/"):
        return urllib.parse.urlunsplit(parts._replace(path=path))
    return url


def fetch(url: str, token: str | None = None, max_bytes: int = MAX_BYTES,
          timeout_s: float = TIMEOUT_S, accept: str = "text/plain", where: str | None = None,
          expect: str = "") -> bytes:
    """The answer's body, at most `max_bytes`, whole within `timeout_s` seconds.

    `where` names the URL in errors (a query URL is long), `expect` says what the URL should
    be when it answers 404."""
    where = where or url
    req = urllib.request.Request(url, headers={"Accept": accept})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    deadline = _Deadline(timeout_s)
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            body = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        hint = (" (wrong or missing token?)" if e.code in (401, 403)
                else f" (expected {expect})" if e.code == 404 and expect else "")
        raise DoctorError(f"{where}: HTTP {e.code} {e.reason}{hint}{_error_detail(e)}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        if deadline.expired:
            raise _too_slow(where, timeout_s) from None
        raise DoctorError(f"{where}: cannot read it ({getattr(e, 'reason', e)})") from None
    finally:
        deadline.cancel()
    if deadline.expired:  # the shutdown read as the end of the body: it is cut short
        raise _too_slow(where, timeout_s)
    if len(body) > max_bytes:
        raise DoctorError(f"{where}: the answer is larger than {max_bytes} bytes (raise "
                          "--max-bytes if it really is kvheat's)")
    return body


def _too_slow(where: str, timeout_s: float) -> DoctorError:
    return DoctorError(f"{where}: no whole answer within {timeout_s:g} s (--timeout)")


def parse_metrics(body: bytes, where: str = "/metrics") -> Scrape:
    """Prometheus text as {(name, labels): value}.

    `_created` samples are left out, every value is checked (`sample_value`)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = body.decode("utf-8")
        out: Scrape = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = sample_value(
                    float(s.value), s.name, where)
    except (ValueError, UnicodeDecodeError, TypeError, IndexError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DoctorError(f"{where}: not Prometheus text format ({first})") from None
    if not any(name.startswith("kvheat_") for name, _ in out):
        raise DoctorError(f"{where}: no kvheat_ series in it (is it a `kvheat serve` /metrics?)")
    return out


METRICS_EXPECTED = "a `kvheat serve` /metrics URL, e.g. http://host:8000/metrics"


def scrape(url: str, token: str | None = None, max_bytes: int = MAX_BYTES,
           timeout_s: float = TIMEOUT_S) -> Scrape:
    """One /metrics scrape of `url`, parsed."""
    return parse_metrics(fetch(url, token, max_bytes, timeout_s, expect=METRICS_EXPECTED), url)


def admin_stats(url: str, token: str | None = None, max_bytes: int = MAX_BYTES,
                timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The JSON object a server's /admin/stats at `url` answers."""
    out = loads_json(fetch(url, token, max_bytes, timeout_s,
                           expect="the server's /admin/stats URL, e.g. "
                                  "http://host:8000/admin/stats"), url)
    if not isinstance(out, dict):
        raise DoctorError(f"{url}: not a JSON object")
    return out
