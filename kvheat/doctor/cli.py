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
from .causes import FLOOR, UNSUPPORTED, Finding, Snapshot, diagnose
from .replay import with_recent_keys
from .scrape import MAX_BYTES, DoctorError, admin_stats, scrape


def run_doctor(url: str, window: float, token: str | None = None,
               admin_url: str | None = None, admin_token: str | None = None,
               floor: float = FLOOR, max_bytes: int = MAX_BYTES) -> list[Finding]:
    """Scrape twice, `window` seconds apart; the findings, most likely first."""
    adm_a = admin_stats(admin_url, admin_token, max_bytes) if admin_url else None
    a = scrape(url, token, max_bytes)
    t0 = time.monotonic()
    time.sleep(window)
    b = scrape(url, token, max_bytes)
    dt = time.monotonic() - t0
    adm_b = admin_stats(admin_url, admin_token, max_bytes) if admin_url else None
    adm_b = with_recent_keys(adm_b, admin_url, admin_token, max_bytes)  # capacity's replay
    return diagnose(Snapshot(a, b, dt, adm_a, adm_b), floor)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.4g}"


def print_findings(findings: list[Finding], window: float) -> None:
    if not findings:
        click.echo(f"healthy: no cause scored {FLOOR} or more over the {window:g} s window "
                   f"(not checked: {', '.join(UNSUPPORTED)}, no series for it).")
        return
    t = Table(title=f"kvheat doctor: likely causes over a {window:g} s window")
    for col in ("#", "cause", "score", "evidence", "action"):
        t.add_column(col, justify="right" if col in ("#", "score") else "left")
    for i, f in enumerate(findings, 1):
        ev = "\n".join(f"{k} = {_fmt(v)}" for k, v in f.evidence.items())
        t.add_row(str(i), f.cause, f"{f.score:.2f}", ev, f.action)
    print_uncut(t)


@click.command("doctor")
@click.argument("url")
@click.option("--token", default=None, envvar="KVHEAT_METRICS_TOKEN",
              help="Bearer token of /metrics (the server's metrics_token).")
@click.option("--window", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds between the two scrapes.")
@click.option("--admin-url", default=None,
              help="/admin/stats URL: adds the entropy regime, tenant quotas, block size.")
@click.option("--admin-token", default=None, envvar="KVHEAT_ADMIN_TOKEN",
              help="Bearer token of /admin/stats.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"findings": [{cause, score, evidence, action}]} (empty: healthy).')
@click.option("--fail-on-findings", is_flag=True, help="Exit 1 when anything is found.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=MAX_BYTES, show_default=True,
              help="Refuse a /metrics answer larger than this.")
def doctor_command(url: str, token: str | None, window: float, admin_url: str | None,
                   admin_token: str | None, as_json: bool, fail_on_findings: bool,
                   max_bytes: int) -> None:
    """Rank the likely causes of an SLO breach or a hit-rate drop on a live server, from
    two scrapes of its /metrics URL `--window` seconds apart."""
    try:
        findings = run_doctor(url, window, token, admin_url, admin_token, max_bytes=max_bytes)
    except DoctorError as e:
        click.echo(f"kvheat doctor: error: {e}", err=True)
        sys.exit(2)
    if as_json:
        out: dict[str, Any] = {"findings": [f.as_json() for f in findings]}
        click.echo(json.dumps(out, indent=2))
    else:
        print_findings(findings, window)
    if fail_on_findings and findings:
        sys.exit(1)
