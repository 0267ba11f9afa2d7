"""Tables read through a pipe (CI logs, `| tee`, `make bench > log`) are whole: rich
assumes 80 columns where there is no terminal and cuts cells with an ellipsis; kvheat's
tables are as wide as they need there. Real CLI runs in a subprocess, stdout a pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from kvheat.replay.report import print_uncut

ELLIPSIS = "…"


def _kvheat(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvheat.cli", *args], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_replay_tables_through_a_pipe_are_whole() -> None:
    out = _kvheat("replay", "builtin", "--capacity", "50K,200K,1M",
                  "--policy", "lru,arc,s3fifo,kvheat,belady", "--limit", "300", "--misses")
    assert "compulsory" in out and "capacity miss" in out and "gap)" in out
    assert ELLIPSIS not in out
    assert max(len(line) for line in out.splitlines()) > 80  # wider than rich's guess


def test_cluster_table_through_a_pipe_is_whole() -> None:
    out = _kvheat("replay", "builtin", "--capacity", "100K", "--replicas", "2",
                  "--limit", "300", "--router", "rr,prefix-hash,sglang-like,kvheat")
    assert "prefill max/mean" in out and ELLIPSIS not in out


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them() -> None:
    t = Table(title="ratios")
    for col in ("system", "kvheat ÷ peer, median and range of the rounds"):
        t.add_column(col, no_wrap=True)
    t.add_row("vllm", "x0.39 (0.38-0.41)")
    buf = io.StringIO()
    print_uncut(t, Console(file=buf, width=30, force_terminal=True, color_system=None))
    text = buf.getvalue()
    assert ELLIPSIS not in text
    assert "0.41" in text.replace("\n", "").replace("│", "").replace(" ", "")
