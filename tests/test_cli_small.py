"""The small things a new user meets first: `kvheat --version`, a `--help` that does not
import torch, `kvheat replay`'s default policies and its "gap" column, a port in use
(`kvheat serve`, `kvheat route`), the built-in model's random weights said where it is
used, `python -m kvheat.integrations.vllm_env` without vLLM, and bench/cache/ops.py's
table without a peer. Real subprocesses where the process is what is tested."""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvheat.cli import main
from kvheat.replay import report
from kvheat.replay.report import gap_closed, print_table

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "200"}


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


# ---- --version, and no torch for --help / --version / doctor -------------------------------
def test_version() -> None:
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"kvheat {importlib.metadata.version('kvheat')}"


def test_help_version_and_doctor_do_not_import_torch() -> None:
    # torch takes seconds to import; none of these needs it. `kvheat --help` still lists
    # every command (their modules are imported only when run).
    r = _python(
        "import sys\n"
        "from kvheat.cli import main\n"
        "for args in (['--help'], ['--version'], ['doctor', '--help'],\n"
        "             ['doctor', 'http://127.0.0.1:1/metrics', '--window', '0.1']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        print('exit', args[0], e.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    assert "torch imported: False" in r.stdout, r.stdout
    for cmd in ("arms", "doctor", "replay", "route", "serve"):
        assert re.search(rf"^\s+{cmd}\s+\S", r.stdout, re.M), (cmd, r.stdout)
    assert "exit doctor 2" in r.stdout  # the unreachable URL: the doctor ran, no torch


def test_a_lazy_command_still_runs_and_has_its_help() -> None:
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0, r.output
    assert "--num-blocks" in r.stdout
    # Said where a user meets the built-in model: it has random weights.
    assert "random weights" in r.stdout and "gibberish" in r.stdout
    r = CliRunner().invoke(main, ["nosuch"])
    assert r.exit_code == 2 and "No such command" in r.stderr


def test_the_listed_help_of_a_lazy_command_is_its_own() -> None:
    from kvheat.cli import _LAZY

    ctx = main.make_context("kvheat", ["--help"], resilient_parsing=True)
    for name, lazy in _LAZY.items():
        cmd = main.get_command(ctx, name)  # imports it (torch: fine here)
        assert cmd is not None and cmd.help is not None
        assert cmd.help.startswith(lazy.short_help.rstrip(".")), (name, lazy.short_help)


# ---- kvheat replay: default policies, the gap column ---------------------------------------
def test_replay_defaults_include_kvheat_and_lruk() -> None:
    r = CliRunner().invoke(main, ["replay", "builtin", "--capacity", "50K", "--limit", "150",
                                  "--no-misses"])
    assert r.exit_code == 0, (r.output, r.exception)
    rows = {line.split("│")[1].strip() for line in r.stdout.splitlines() if line.count("│") > 2}
    assert {"lru", "arc", "s3fifo", "twoq", "lruk", "lirs", "kvheat", "belady"} <= rows, rows
    assert "gap: the share of the LRU→Belady gap" in " ".join(r.stdout.split())


def _summary(lru: float, belady: float, other: float) -> dict:
    rows = [{"policy": p, "capacity_tokens": 1_000_000, "hit_rate": v,
             "gap_closed": gap_closed(v, lru, belady)}
            for p, v in (("lru", lru), ("arc", other), ("belady", belady))]
    return {"trace": "t", "block_tokens": 512, "infinite": 0.6, "results": rows}


def _printed(summary: dict) -> str:
    buf = io.StringIO()
    print_table(summary, Console(file=buf, width=300, color_system=None))
    return buf.getvalue()


def test_gap_is_a_dash_when_lru_and_belady_are_under_a_point_apart() -> None:
    # 0.1 point between LRU and Belady; 0.103 points below LRU read "-103% gap" before.
    assert gap_closed(0.49897, 0.50000, 0.50100) is None
    out = _printed(_summary(0.50000, 0.50100, 0.49897))
    assert "(– gap)" in out and "103%" not in out


def test_gap_is_the_share_of_the_lru_to_belady_gap_closed() -> None:
    assert gap_closed(0.55, 0.50, 0.60) == pytest.approx(0.5)
    assert gap_closed(0.45, 0.50, 0.60) == pytest.approx(-0.5)
    out = _printed(_summary(0.50, 0.60, 0.55))
    assert "55.00% (+50% gap)" in out
    legend = report.GAP_LEGEND
    assert " ".join(legend.split()) in " ".join(out.split())  # the legend, under the table
    assert "(Belady − LRU)" in legend


# ---- a port in use -------------------------------------------------------------------------
@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("cmd", [["serve", "--num-blocks", "64"],
                                 ["route", "--replica", "http://127.0.0.1:1"]],
                         ids=["serve", "route"])
def test_a_port_in_use_is_one_error_before_any_serving_line(taken_port: int,
                                                            cmd: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "kvheat.cli", *cmd, "--port", str(taken_port)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode != 0, r.stderr
    assert "serving" not in r.stderr and " on http://" not in r.stderr, r.stderr
    assert f"cannot listen on 127.0.0.1:{taken_port}" in r.stderr
    assert "another server listens there" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_says_the_builtin_model_is_random_and_serves_on_its_port() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvheat.cli", "serve", "--port", "0",
                             "--num-blocks", "64", "--threads", "1", "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            if "serving" in line:
                break
        log = "".join(lines)
        assert "random weights" in log and "gibberish" in log, log
        m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", log)
        assert m and int(m.group(1)) > 0, log  # the port the OS picked, not 0
        url = f"http://127.0.0.1:{m.group(1)}/health"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ---- vllm_env without vLLM -----------------------------------------------------------------
def test_vllm_env_says_vllm_is_missing() -> None:
    # A Python where `import vllm` fails as it does where vLLM is not installed.
    r = _python("import runpy, sys\n"
                "sys.modules['vllm'] = None\n"
                "runpy.run_module('kvheat.integrations.vllm_env', run_name='__main__')\n")
    assert r.returncode != 0, r.stdout
    assert "ok" not in r.stdout
    assert "vLLM is not installed" in r.stderr and "make vllm" in r.stderr


# ---- bench/cache/ops.py without a peer -----------------------------------------------------
def _ops_table(res: dict, absent: dict[str, str]) -> str:
    from bench.cache.ops import load_b_table

    buf = io.StringIO()
    Console(file=buf, width=300, color_system=None).print(load_b_table(res, absent))
    return buf.getvalue()


KV_B = {"hash_us": 1.0, "lookup_us": 2.0, "allocate_us": 3.0, "free_us": 1.0, "hit_rate": 0.8}


def test_ops_table_without_a_peer_says_why_and_has_no_empty_column() -> None:
    out = _ops_table({"kvheat": {"B": KV_B}}, {"vllm": "vLLM is not installed (`make vllm`)"})
    assert "kvheat ÷ peer" not in out
    assert "no vllm: vLLM is not installed" in out
    out = _ops_table({"kvheat": {"B": KV_B}}, {"vllm": "--no-peer"})
    assert "no vllm: --no-peer" in out


def test_ops_table_with_a_peer_has_the_ratio() -> None:
    peer = {**KV_B, "kvheat_over_peer": {"median": 0.5, "min": 0.4, "max": 0.6}}
    out = _ops_table({"kvheat": {"B": KV_B}, "vllm": peer}, {})
    assert "kvheat ÷ peer" in out and "x0.50 (0.40-0.60)" in out and "no vllm" not in out
