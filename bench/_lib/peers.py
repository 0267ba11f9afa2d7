"""Side-by-side runs against a peer engine (vLLM's CPU build) that hold when someone else
reruns them: the same dtype and threads on both sides, the arms interleaved (A B A B ...,
at least three each), every ratio taken between runs next to each other in time and
reported as median and range, a warning when the machine is not idle, and every raw
sample kept in the JSON.

Used by bench/engine.py, bench/load.py, bench/chat.py and bench/cache_ops.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


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


# ---- server-sent events --------------------------------------------------------------------
class SSEDecoder:
    """The `data:` payloads of an SSE stream fed as text chunks, split on line feeds only:
    a JSON line may carry U+2028 or U+0085 raw, which str.splitlines (and httpx's
    iter_lines) would cut in two."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, chunk: str) -> list[str]:
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        return [line.rstrip("\r")[5:].lstrip(" ") for line in lines
                if line.startswith("data:")]

    def close(self) -> list[str]:
        rest, self._buf = self._buf, ""
        return [rest[5:].lstrip(" ")] if rest.startswith("data:") else []


# ---- servers -------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kvheat_server(model_dir: str | None, port: int, log: Path, threads: int,
                        max_seqs: int, batched_tokens: int, num_blocks: int,
                        extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    """`kvheat serve` with its engine thread on the cores vLLM binds its compute to."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    cmd = [os.environ.get("KVHEAT_PYTHON", str(ROOT / ".venv/bin/python")), "-m",
           "kvheat.server.cli", "serve", "--port", str(port), "--num-blocks", str(num_blocks),
           "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(batched_tokens),
           "--threads", str(threads), "--engine-cores", cores, "--log-level", "warning",
           *(extra or [])]
    if model_dir:
        cmd += ["--model", model_dir, "--served-model-name", "tiny"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def start_vllm_server(python: str, model_dir: str, port: int, log: Path, tmp: str,
                      threads: int, max_seqs: int, batched_tokens: int,
                      max_model_len: int = 2048) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server at float32 (it would turn a float32 checkpoint into bfloat16),
    prefix caching on, cached tokens reported in usage, the same batch limits and threads."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(batched_tokens),
           "--seed", "0", "--disable-log-stats"]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env=vllm_env(threads, tmp))


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: "
                               + log.read_text(errors="replace")[-2000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready: " + log.read_text(errors="replace")[-2000:])


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its children, from /proc: what an idle
    peer spends while the other side runs (it should be near zero)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids, i = [pid], 0
    while i < len(pids):  # the whole process tree (vLLM's engine core is a grandchild)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pids[i]}/task").iterdir():
                pids += [int(k) for k in (task / "children").read_text().split()]
        i += 1
    for p in set(pids):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total
