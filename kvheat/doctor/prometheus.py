"""The doctor's other input: kvheat's series from a Prometheus server over a time range.

Two instant queries, at the range's start and at its end, of every `kvheat_*` series the
selector matches make the same two scrapes a live `/metrics` gives (kvheat.doctor.scrape),
so `diagnose` and every cause read them unchanged. The scrape keys keep Prometheus' target
labels (`instance`, `job`, ...): the causes sum over the labels they do not ask for, so a
selector that matches several instances gives the service-wide view, and a counter is
differenced per series (a restart inside the range reads as the counter's value at the end,
as on the live path).
"""

from __future__ import annotations

import math
import re
import time
import urllib.parse
from datetime import datetime

from .causes import Snapshot
from .scrape import MAX_BYTES, TIMEOUT_S, DoctorError, Scrape, fetch, loads_json, sample_value

SERIES = "kvheat_.*"
# A relative time: "-15m", "-1h30m", "-90s" (Prometheus' duration units).
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
# A bare instance (host:port) rather than a list of label matchers.
_MATCHER = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)")


def parse_time(text: str, now: float) -> float:
    """`now`, a relative `-15m`, unix seconds, or RFC 3339 with a zone -> unix seconds."""
    t = text.strip()
    if t == "now":
        return now
    if t.startswith("-"):
        parts = _DURATION.findall(t[1:])
        if not parts or "".join(n + u for n, u in parts) != t[1:]:
            raise DoctorError(f"time {text!r}: not a duration like -15m or -1h30m")
        return now - sum(float(n) * _UNITS[u] for n, u in parts)
    try:
        v = float(t)
    except ValueError:
        pass
    else:
        if not math.isfinite(v) or v < 0:
            raise DoctorError(f"time {text!r}: not a unix time")
        return v
    try:
        d = datetime.fromisoformat(t)
    except ValueError:
        raise DoctorError(f"time {text!r}: not now, -15m, unix seconds or RFC 3339") from None
    if d.tzinfo is None:  # the operator's zone or the server's? refuse to guess
        raise DoctorError(f"time {text!r}: give the zone (Z or +hh:mm)")
    return d.timestamp()


def selector(match: str | None) -> str:
    """The PromQL selector of kvheat's series.

    `match` is label matchers (`job="kvheat",instance=~"a.*"`) or a bare instance
    (`10.0.0.5:8000`)."""
    inner = f'__name__=~"{SERIES}"'
    m = (match or "").strip().strip("{}").strip()
    if not m:
        return "{" + inner + "}"
    if not _MATCHER.match(m):
        m = 'instance="' + m.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "{" + inner + "," + m + "}"


def _samples(answer: bytes, where: str) -> list[tuple[dict[str, str], float]]:
    out = loads_json(answer, where)  # every number finite (a time, here)
    try:
        if not isinstance(out, dict):
            raise ValueError("not a JSON object")
        if out.get("status") != "success":
            raise DoctorError(f"{where}: Prometheus says {out.get('errorType', 'error')}: "
                              f"{out.get('error', '(no error text)')}")
        data = out["data"]
        if data["resultType"] != "vector":
            raise ValueError(f"a {data['resultType']}, not an instant vector")
        res: list[tuple[dict[str, str], float]] = []
        for r in data["result"]:
            labels = {str(k): str(v) for k, v in r["metric"].items()}
            # The value is a string: "NaN" is legal (no data; Snapshot drops it), ±Inf
            # or an overflowing number is not a kvheat figure.
            v = sample_value(float(r["value"][1]), labels.get("__name__", "?"), where)
            res.append((labels, v))
        return res
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise DoctorError(f"{where}: not a Prometheus query answer ({e})") from None


def query(base: str, promql: str, at: float, token: str | None = None,
          max_bytes: int = MAX_BYTES, timeout_s: float = TIMEOUT_S) -> list[tuple[dict[str, str], float]]:
    """One instant query at unix time `at`: [(labels with __name__, value)]."""
    qs = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}",
                                 "timeout": f"{max(1, int(timeout_s))}s"})
    where = base.rstrip("/") + "/api/v1/query"
    return _samples(fetch(where + "?" + qs, token, max_bytes, timeout_s,
                          accept="application/json", where=where,
                          expect="a Prometheus server's base URL, e.g. http://prom:9090"),
                    where)


def kvheat_scrape(base: str, at: float, match: str | None = None, token: str | None = None,
                  max_bytes: int = MAX_BYTES, timeout_s: float = TIMEOUT_S) -> Scrape:
    """Every kvheat series the selector matches at `at`, as a /metrics scrape gives them.

    `_created` samples are left out, as parse_metrics does."""
    out: Scrape = {}
    for labels, v in query(base, selector(match), at, token, max_bytes, timeout_s):
        name = labels.pop("__name__", "")
        if name.endswith("_created"):
            continue
        out[(name, tuple(sorted(labels.items())))] = v
    return out


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def snapshot(base: str, start: float, end: float, match: str | None = None,
             token: str | None = None, max_bytes: int = MAX_BYTES,
             timeout_s: float = TIMEOUT_S) -> Snapshot:
    """The two scrapes, at `start` and at `end`, as a Snapshot.

    No /admin/stats: it is live state, not history. A series missing at `start` (the server
    started inside the range) counts from zero, as a fresh server's counters do."""
    if not end > start:
        raise DoctorError(f"bad range: the end ({_iso(end)}) is not after the start "
                          f"({_iso(start)})")
    if end > time.time() + 60:
        raise DoctorError(f"bad range: the end ({_iso(end)}) is in the future")
    b = kvheat_scrape(base, end, match, token, max_bytes, timeout_s)
    if not b:
        raise DoctorError(f"{base}: no kvheat_ series matching {selector(match)} at the "
                          f"range's end ({_iso(end)}; Prometheus looks back 5m by default): "
                          "check --selector, and that it scraped kvheat then")
    a = kvheat_scrape(base, start, match, token, max_bytes, timeout_s)
    return Snapshot(a, b, end - start)

