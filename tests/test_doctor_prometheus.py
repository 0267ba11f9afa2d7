"""`kvheat doctor --prometheus`: a real `prometheus` scraping a live `kvheat serve` every
second; overload injected; the doctor reading Prometheus over the range ranks the same cause
first, on the same counters, as the live path on the same run; and each way the input can be
wrong gives one clear line."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from conftest import require_binary
from test_doctor import _complete
from test_server import SYSTEM, Served, _free_port, start, stop

from kvheat.cli import main
from kvheat.doctor import DoctorError, Snapshot, diagnose, scrape
from kvheat.doctor.prometheus import parse_time, query, selector
from kvheat.server.config import ServerConfig


@dataclass
class Prom:
    base: str
    proc: subprocess.Popen[bytes]


def _start_prometheus(tmp: Path, target: str) -> Prom:
    binary = require_binary("prometheus", "prometheus")
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kvheat\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "prometheus did not get ready"
        try:
            if httpx.get(base + "/-/ready", timeout=1).status_code == 200:
                return Prom(base, proc)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def _scraped_since(p: Prom, t: float) -> bool:
    """Whether Prometheus holds a kvheat sample taken at `t` or later."""
    got = query(p.base, 'max(timestamp(kvheat_requests_total) or timestamp(kvheat_blocks))',
                time.time())
    return bool(got) and got[0][1] >= t


def _wait_scrape_after(p: Prom, t: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _scraped_since(p, t):
        assert time.monotonic() < deadline, "prometheus did not scrape kvheat"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served_and_prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Prom]]:
    s = start(ServerConfig(num_blocks=192, threads=1, max_num_seqs=1, max_queued_requests=2,
                           max_tokens_limit=32))
    try:
        p = _start_prometheus(tmp_path_factory.mktemp("prom"), s.base.removeprefix("http://"))
        try:
            yield s, p
        finally:
            p.proc.terminate()
            p.proc.wait(timeout=30)
    finally:
        stop(s)


def _doctor(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["doctor", *args])
    return r.exit_code, r.output


def test_overload_from_prometheus_ranks_as_the_live_path(
        served_and_prom: tuple[Served, Prom]) -> None:
    s, p = served_and_prom
    url = s.base + "/metrics"
    _wait_scrape_after(p, time.time())  # the range starts on a sample before the load
    t_start = time.time()
    a = scrape(url)
    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda i: _complete(s.base, SYSTEM + f" Q{i}", 24), range(32)))
    assert outcomes.count("503") > 0 and outcomes.count("ok") > 0
    s.wait_idle()
    b = scrape(url)
    t_b = time.time()
    live = diagnose(Snapshot(a, b, t_b - t_start))
    assert live and live[0].cause == "overload", [(f.cause, f.score) for f in live]

    _wait_scrape_after(p, t_b)
    t_end = time.time()
    code, out = _doctor("--prometheus", p.base, "--start", f"{t_start:.3f}",
                        "--end", f"{t_end:.3f}", "--selector", 'job="kvheat"', "--json")
    assert code == 0, out
    found = json.loads(out)["findings"]
    # The same cause first (a cause near its floor may come and go with gauges read a
    # scrape apart, so only the top one is compared).
    assert found and found[0]["cause"] == live[0].cause == "overload", found
    # The same counters moved by the same amounts: one Snapshot, two ways to read it.
    moved = {e["series"]: e["value"] for e in found[0]["evidence"] if e["series"].endswith(" Δ")}
    assert moved and moved == {k: v for k, v in live[0].evidence.items() if k.endswith(" Δ")}
    # A bare instance selects the same server; RFC 3339 and relative times read the same.
    code, out = _doctor("--prometheus", p.base, "--selector", s.base.removeprefix("http://"),
                        "--start", time.strftime("%Y-%m-%dT%H:%M:%S+00:00",
                                                 time.gmtime(t_start)),
                        "--end", "now")
    assert code == 0 and "overload" in out and "from Prometheus" in out, out
    # A range that ends before any kvheat sample: nothing to read, one line.
    code, out = _doctor("--prometheus", p.base, "--start", "0", "--end", "1")
    assert code == 2 and "no kvheat_ series" in out, out


def test_bad_input_gives_one_clear_line(served_and_prom: tuple[Served, Prom]) -> None:
    s, p = served_and_prom
    cases = [
        (["--prometheus", "http://127.0.0.1:1"], "cannot read it"),  # unreachable
        (["--prometheus", s.base], "HTTP 404"),  # not a Prometheus
        (["--prometheus", p.base, "--start", "-1m", "--end", "-2m"], "bad range"),
        (["--prometheus", p.base, "--end", "-5m", "--start", "now"], "bad range"),
        (["--prometheus", p.base, "--start", "yesterday"], "not now, -15m"),
        (["--prometheus", p.base, "--start", "2026-01-01T00:00:00"], "give the zone"),
        (["--prometheus", p.base, "--selector", 'job="nope"'], "no kvheat_ series"),
        (["--prometheus", p.base, "--selector", 'job=~"("'], "bad_data"),  # Prometheus' error
        (["--prometheus", p.base, "--max-bytes", "100"], "larger than 100 bytes"),
    ]
    for args, why in cases:
        code, out = _doctor(*args)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1, (args, out)
        assert lines[0].startswith("kvheat doctor: error:") and why in lines[0], (args, out)
    # A live URL and --prometheus, or neither, or a live-only option: usage errors.
    for args in (["http://x/metrics", "--prometheus", p.base], [],
                 ["--prometheus", p.base, "--window", "5"]):
        code, out = _doctor(*args)
        assert code == 2 and "Usage" in out, (args, out)


def test_times_and_selectors() -> None:
    now = 1_800_000_000.0
    assert parse_time("now", now) == now
    assert parse_time("-1h30m", now) == now - 5400
    assert parse_time("-250ms", now) == now - 0.25
    assert parse_time("1700000000.5", now) == 1700000000.5
    assert parse_time("2027-01-15T08:00:00Z", now) == 1800000000.0
    assert parse_time("2027-01-15T09:00:00+01:00", now) == 1800000000.0
    for bad in ("-15", "-15x", "-1h-2m", "tomorrow", "-inf", "nan"):
        with pytest.raises(DoctorError):
            parse_time(bad, now)
    assert selector(None) == '{__name__=~"kvheat_.*"}'
    assert selector(' {job="kvheat"} ') == '{__name__=~"kvheat_.*",job="kvheat"}'
    assert selector('10.0.0.5:8000') == '{__name__=~"kvheat_.*",instance="10.0.0.5:8000"}'
    assert selector('a"b') == '{__name__=~"kvheat_.*",instance="a\\"b"}'
