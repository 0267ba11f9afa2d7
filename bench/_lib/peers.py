"""Side-by-side runs against a peer engine (vLLM's CPU build) that hold when someone else
reruns them: the same dtype and threads on both sides, the arms interleaved (A B A B ...,
at least three each), every ratio taken between runs next to each other in time and
reported as median and range, a warning when the machine is not idle, and every raw
sample kept in the JSON.

Used by bench/engine/prefix.py, bench/server/load.py, bench/server/chat.py and
bench/cache/ops.py (their servers: bench/_lib/procs.py).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench._lib import ROOT


# ---- is the machine quiet? -----------------------------------------------------------
def _cpu_times() -> tuple[int, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks), idle


def machine_load(sample_s: float = 1.0) -> dict[str, Any]:
    """The load average, and how busy the CPUs were over `sample_s` seconds while this
    process slept (other work that would share the cores with a benchmark)."""
    total0, idle0 = _cpu_times()
    time.sleep(sample_s)
    total1, idle1 = _cpu_times()
    busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    return {"loadavg_1m": os.getloadavg()[0], "busy_fraction": busy, "cpus": os.cpu_count()}


# An idle machine of this kind: under 10% of its CPU time busy, load average under 0.5
# (background daemons only).
IDLE_BUSY_FRACTION = 0.10
IDLE_LOADAVG = 0.5


def load_warning(load: dict[str, Any], after_own_run: bool = False) -> str | None:
    """A warning when other work shares the machine. Right after this benchmark's own
    run the 1-minute load average still counts that run, so only the busy sample
    (taken while everything of ours sleeps) tells then."""
    loaded = not after_own_run and load["loadavg_1m"] > IDLE_LOADAVG
    if load["busy_fraction"] > IDLE_BUSY_FRACTION or loaded:
        return (f"WARNING: the machine is not idle (CPUs {100 * load['busy_fraction']:.0f}% "
                f"busy, load average {load['loadavg_1m']:.2f}): other work shares the cores "
                f"and memory bandwidth, so these figures are not the peers' own. Rerun on an "
                f"idle machine before quoting them.")
    return None


def check_quiet(report: dict[str, Any], where: str, after_own_run: bool = False) -> None:
    """Measure the load now, record it in `report["machine_load"]`, print a warning."""
    load = machine_load()
    report.setdefault("machine_load", []).append({"when": where, **load})
    msg = load_warning(load, after_own_run)
    if msg:
        print(msg, flush=True)


# ---- interleaving and summaries ------------------------------------------------------
def interleaved(arms: dict[str, Callable[[int], dict[str, Any]]], repeats: int
                ) -> dict[str, list[dict[str, Any]]]:
    """Run each arm `repeats` times in the order A B A B ...; each call gets the repeat
    number (so both arms of a repeat see the same fresh inputs)."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for rep in range(repeats):
        for name, run in arms.items():
            out[name].append(run(rep))
    return out


def spread(values: Iterable[float]) -> dict[str, float]:
    v = list(values)
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def paired_ratio(mine: list[float], theirs: list[float]) -> dict[str, Any]:
    """Ratios of runs taken next to each other (repeat i of both arms), summarised."""
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {**spread(ratios), "ratios": ratios}


def fmt_ratio(r: dict[str, Any]) -> str:
    return f"x{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


# ---- vLLM --------------------------------------------------------------------------------
# What a bench says when `find_vllm_python` finds none.
NO_VLLM = "no python with vLLM found (--vllm-python, $KVHEAT_VLLM_PYTHON, `make vllm`)"


def find_vllm_python(explicit: str | None) -> str | None:
    """A python that imports vllm: the one given, $KVHEAT_VLLM_PYTHON, or the project's
    .venv when `make vllm` installed the vLLM CPU build there."""
    for cand in (explicit, os.environ.get("KVHEAT_VLLM_PYTHON"), str(ROOT / ".venv/bin/python")):
        if not cand or not (Path(cand).exists() or shutil.which(cand)):
            continue
        r = subprocess.run([cand, "-c", "import vllm"], capture_output=True, timeout=120)
        if r.returncode == 0:
            return cand
        if cand == explicit:
            raise SystemExit(f"{cand} cannot import vllm: {r.stderr.decode()[-400:]}")
    return None


def vllm_env(threads: int, tmp: str | Path) -> dict[str, str]:
    """vLLM's CPU backend binds its OpenMP threads to cores: `threads` of them, the same
    number kvheat's torch runs on."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cores, "OMP_NUM_THREADS": str(threads),
            "VLLM_CACHE_ROOT": str(Path(tmp) / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": "WARNING"}
