"""The `kvheat doctor` command."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
import prometheus_client.parser  # noqa: F401 (the command needs the server extra's parser)
from rich.table import Table

from ..replay.report import print_uncut
from .causes import FLOOR, Finding, Snapshot, diagnose
from .prometheus import parse_time, snapshot
from .replay import with_recent_keys
from .scrape import MAX_BYTES, TIMEOUT_S, DoctorError, admin_stats, scrape, with_path


def run_doctor(url: str, window: float, token: str | None = None,
               admin_url: str | None = None, admin_token: str | None = None,
               floor: float = FLOOR, max_bytes: int = MAX_BYTES,
               timeout_s: float = TIMEOUT_S) -> list[Finding]:
    """Scrape twice, `window` seconds apart, and return the findings, most likely first.

    A URL with no path is the server's address: its /metrics (and /admin/stats) is read."""
    url = with_path(url, "/metrics")
    admin_url = with_path(admin_url, "/admin/stats") if admin_url else None
    adm_a = admin_stats(admin_url, admin_token, max_bytes, timeout_s) if admin_url else None
    a = scrape(url, token, max_bytes, timeout_s)
    t0 = time.monotonic()
    time.sleep(window)
    b = scrape(url, token, max_bytes, timeout_s)
    dt = time.monotonic() - t0
    adm_b = admin_stats(admin_url, admin_token, max_bytes, timeout_s) if admin_url else None
    adm_b = with_recent_keys(adm_b, admin_url, admin_token, max_bytes,
                             timeout_s)  # capacity's replay
    return diagnose(Snapshot(a, b, dt, adm_a, adm_b), floor)


def run_doctor_prometheus(prometheus: str, start: float, end: float, match: str | None = None,
                          token: str | None = None, floor: float = FLOOR,
                          max_bytes: int = MAX_BYTES,
                          timeout_s: float = TIMEOUT_S) -> list[Finding]:
    """The same findings from a Prometheus server's samples at `start` and `end`."""
    return diagnose(snapshot(prometheus, start, end, match, token, max_bytes, timeout_s),
                    floor)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.4g}"


def print_findings(findings: list[Finding], span: str) -> None:
    """`span`: what the findings cover ("the 10 s window", "... from Prometheus")."""
    if not findings:
        click.echo(f"healthy: no cause scored {FLOOR} or more over {span}.")
        return
    t = Table(title=f"kvheat doctor: likely causes over {span}")
    for col in ("#", "cause", "score", "evidence", "action"):
        t.add_column(col, justify="right" if col in ("#", "score") else "left")
    for i, f in enumerate(findings, 1):
        ev = "\n".join(f"{k} = {_fmt(v)}" for k, v in f.evidence.items())
        t.add_row(str(i), f.cause, f"{f.score:.2f}", ev, f.action)
    print_uncut(t)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@click.command("doctor")
@click.argument("url", required=False)
@click.option("--token", default=None, envvar="KVHEAT_METRICS_TOKEN",
              help="Bearer token of /metrics (the server's metrics_token).")
@click.option("--window", type=click.FloatRange(min=0.1), default=None,
              help="Seconds between the two scrapes of URL.  [default: 10]")
@click.option("--admin-url", default=None,
              help="/admin/stats URL: adds the entropy regime, tenant quotas, block size "
                   "(live state: not with --prometheus).")
@click.option("--admin-token", default=None, envvar="KVHEAT_ADMIN_TOKEN",
              help="Bearer token of /admin/stats.")
@click.option("--prometheus", default=None, metavar="URL",
              help="Instead of URL: read kvheat's series from this Prometheus server, at "
                   "--start and at --end.")
@click.option("--start", default="-15m", show_default=True,
              help="With --prometheus: the range's start (RFC 3339 with a zone, unix "
                   "seconds, or relative to now like -15m).")
@click.option("--end", default="now", show_default=True,
              help="With --prometheus: the range's end (as --start, or now).")
@click.option("--selector", default=None,
              help='With --prometheus: label matchers of the servers to read, e.g. '
                   'job="kvheat" or instance=~"10.0.0.5:.*" (a bare host:port means that '
                   "instance). Default: every kvheat series, summed (the service's view).")
@click.option("--prometheus-token", default=None, envvar="KVHEAT_PROMETHEUS_TOKEN",
              help="Bearer token of the Prometheus API, if it needs one.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"findings": [{cause, score, evidence, action}]} (empty: healthy).')
@click.option("--fail-on-findings", is_flag=True, help="Exit 1 when anything is found.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=MAX_BYTES, show_default=True,
              help="Refuse a /metrics (or Prometheus) answer larger than this.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1, max=3600),
              default=TIMEOUT_S, show_default=True,
              help="Seconds each fetch (of URL, the admin API or Prometheus) may take in "
                   "all, body included; past it: an error, exit 2.")
def doctor_command(url: str | None, token: str | None, window: float | None,
                   admin_url: str | None, admin_token: str | None, prometheus: str | None,
                   start: str, end: str, selector: str | None, prometheus_token: str | None,
                   as_json: bool, fail_on_findings: bool, max_bytes: int,
                   timeout_s: float) -> None:
    """Rank the likely causes of an SLO breach or a hit-rate drop.

    On a live server, from two scrapes of its /metrics URL `--window` seconds apart (a URL
    with no path, like http://host:8000, means its /metrics); or, with `--prometheus`, from
    that server's samples of kvheat's series at `--start` and `--end`.

    Exit codes: 0 done, 1 findings with --fail-on-findings, 2 an unusable input (one
    `error:` line)."""
    if (url is None) == (prometheus is None):
        raise click.UsageError("give a /metrics URL or --prometheus URL (one of them)")
    if prometheus is not None and (window is not None or admin_url is not None):
        raise click.UsageError("--window and --admin-url read a live server; with "
                               "--prometheus the range is --start..--end")
    try:
        if prometheus is not None:
            now = time.time()
            t0, t1 = parse_time(start, now), parse_time(end, now)
            findings = run_doctor_prometheus(prometheus, t0, t1, selector, prometheus_token,
                                             max_bytes=max_bytes, timeout_s=timeout_s)
            span = f"{_utc(t0)}..{_utc(t1)} ({t1 - t0:g} s, from Prometheus)"
        else:
            assert url is not None
            w = 10.0 if window is None else window
            findings = run_doctor(url, w, token, admin_url, admin_token, max_bytes=max_bytes,
                                  timeout_s=timeout_s)
            span = f"a {w:g} s window"
    except DoctorError as e:
        click.echo(f"kvheat doctor: error: {e}", err=True)
        sys.exit(2)
    if as_json:
        out: dict[str, Any] = {"findings": [f.as_json() for f in findings]}
        click.echo(json.dumps(out, indent=2))
    else:
        print_findings(findings, span)
    if fail_on_findings and findings:
        sys.exit(1)
