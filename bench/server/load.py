"""Load test of `kvheat serve` on loopback: N concurrent clients running multi-turn chats
(streaming, a few shared system prompts, 2-4 turns each) for a fixed time.

Reports errors (the target is zero), throughput (requests/s, generated tokens/s), P50/P99
TTFT and end-to-end latency measured by the clients, the prompt tokens each server reports
as cached (`usage.prompt_tokens_details`), and the server's resident memory over time (flat
after warm-up: growth in the second half of the run against the end of warm-up). With
`--peer vllm` the same load runs against vLLM's CPU OpenAI server on the same model
directory, and the ratios are printed.

    python bench/server/load.py                   # 64 clients, 60 s, built-in tiny Llama
    python bench/server/load.py --clients 8 --duration 10
    python bench/server/load.py --peer vllm --vllm-python /tmp/vllm/bin/python

Writes a JSON report (`--json`, default results/server/load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run as `python bench/server/load.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.load import Conversation, LoadSpec, UserTurn, run_conversations
from bench._lib.peers import NO_VLLM, check_quiet, find_vllm_python, fmt_ratio, paired_ratio
from bench._lib.procs import (
    free_port,
    rss_mib,
    start_kvheat_server,
    start_vllm_server,
    stop,
    wait_ready,
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant. Please answer the question below in one short paragraph. "
    "Hot blocks stay on the device, warm ones move to host memory, cold ones go to disk.",
    "You summarise conversations. The user asked about the weather; the assistant said it "
    "would rain in the afternoon and be sunny tomorrow morning, with a light wind.",
    "You write Python. def main(): print('hello, world') return 0. Answer with code only, "
    "and keep every answer shorter than ten lines.",
    "You are a travel guide. Paris is the capital of France. There are seven days in a week: "
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
]
QUESTIONS = [
    "What is the capital of France?", "How many days are in a week?",
    "Summarise the following conversation.", "What does the cache keep?",
    "Why do hot blocks stay on the device?", "Print hello world in Python.",
    "What will the weather be tomorrow morning?", "Name the days of the week.",
]


@dataclass
class Sample:
    start: float
    ttft: float | None
    e2e: float
    tokens: int
    cached: int
    prompt: int
    error: str | None = None


@dataclass
class RunResult:
    name: str
    clients: int
    duration_s: float
    warmup_s: float
    samples: list[Sample] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)
    server_hit_rate: float | None = None

    def summary(self) -> dict[str, Any]:
        measured = [s for s in self.samples if s.start >= self.warmup_s]
        ok = [s for s in measured if s.error is None]
        window = self.duration_s - self.warmup_s
        ttft = np.array([s.ttft for s in ok if s.ttft is not None])
        e2e = np.array([s.e2e for s in ok])
        prompt = sum(s.prompt for s in ok)

        def pct(a: np.ndarray, q: float) -> float | None:
            return float(np.percentile(a, q)) if a.size else None

        rss = [m for t, m in self.rss_mb if t >= self.warmup_s]
        half = [m for t, m in self.rss_mb if t >= self.warmup_s + window / 2]
        base = rss[0] if rss else None
        return {
            "name": self.name, "clients": self.clients, "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "requests": len(measured), "errors": len(measured) - len(ok),
            "errors_total": sum(1 for s in self.samples if s.error is not None),
            "error_examples": sorted({s.error for s in self.samples if s.error})[:5],
            "requests_per_s": len(ok) / window if window > 0 else None,
            "tokens_per_s": sum(s.tokens for s in ok) / window if window > 0 else None,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
            "client_cached_fraction": sum(s.cached for s in ok) / prompt if prompt else None,
            "server_hit_rate": self.server_hit_rate,
            "rss_mib_after_warmup": base, "rss_mib_max_second_half": max(half) if half else None,
            "rss_growth_pct_second_half": (100 * (max(half) - base) / base
                                           if half and base else None),
        }


def conversation(cid: int, rng: random.Random) -> Conversation:
    """A chat on one of the shared system prompts, 2-4 turns, its questions drawn turn by
    turn (so a conversation cut short by the deadline or an error draws no more)."""
    system = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
    n = rng.randint(2, 4)

    def turns() -> Iterator[UserTurn]:
        for turn in range(n):
            yield UserTurn(f"[{cid}.{turn}] " + QUESTIONS[rng.randrange(len(QUESTIONS))])

    return Conversation(cid, system, turns(), body={"user": f"user-{cid}"})


async def run_load(name: str, base: str, model: str, pid: int, clients: int, duration: float,
                   warmup: float, max_tokens: int, seed: int) -> RunResult:
    res = RunResult(name, clients, duration, warmup)
    # Idle connections expire on the client first (uvicorn closes them after 5 s): reusing
    # one the server is closing at that moment fails with a ReadError that is no server fault.
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0),
                                 limits=limits) as http:
        t0 = time.perf_counter()
        deadline = t0 + duration
        stop = asyncio.Event()

        async def sample_rss() -> None:
            while not stop.is_set():
                m = rss_mib(pid, children=True)
                if m is not None:
                    res.rss_mb.append((time.perf_counter() - t0, m))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

        sampler = asyncio.create_task(sample_rss())
        rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
        # Each client runs its own chats until the deadline; a failed turn ends its chat
        # (its history would be wrong) and a new one starts.
        spec = LoadSpec(model, max_tokens, ttft_on_finish=True, stop_on_error=True)
        replies = await run_conversations(base, lambda i: conversation(i, rngs[i]), clients,
                                          spec, http=http, deadline=deadline)
        res.samples += [Sample(r.start - t0, r.ttft, r.e2e, r.completion_tokens,
                               r.cached_tokens, r.prompt_tokens, r.error) for r in replies]
        res.duration_s = time.perf_counter() - t0  # the last requests finish after the deadline
        stop.set()
        await sampler
        try:
            text = (await http.get("/metrics")).text
            res.server_hit_rate = _hit_rate(text)
        except httpx.HTTPError:
            pass
    return res


def _hit_rate(metrics_text: str) -> float | None:
    cached = prompt = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("kvheat_cached_tokens_total{"):
            cached += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvheat_prompt_tokens_total{"):
            prompt += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total") or \
                line.startswith("vllm:prefix_cache_hits{"):
            cached += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total") or \
                line.startswith("vllm:prefix_cache_queries{"):
            prompt += float(line.rsplit(" ", 1)[1])
    return cached / prompt if prompt else None


def bench_one(name: str, proc: subprocess.Popen[bytes], base: str, model: str,
              args: argparse.Namespace, seed: int) -> RunResult:
    return asyncio.run(run_load(name, base, model, proc.pid, args.clients, args.duration,
                                args.warmup, args.max_tokens, seed))


def fmt(x: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if x is None else format(x * scale, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'server':<8} {'clients':>7} {'req':>6} {'err':>4} {'req/s':>7} {'tok/s':>7} "
            f"{'TTFT P50 ms':>11} {'TTFT P99 ms':>11} {'E2E P99 ms':>10} {'cached':>8} "
            f"{'RSS MiB':>8} {'RSS growth':>10}")
    print(head)
    for r in rows:
        print(f"{r['name']:<8} {r['clients']:>7} {r['requests']:>6} {r['errors']:>4} "
              f"{fmt(r['requests_per_s'], 1, '.2f'):>7} {fmt(r['tokens_per_s']):>7} "
              f"{fmt(r['ttft_p50_s'], 1000):>11} {fmt(r['ttft_p99_s'], 1000):>11} "
              f"{fmt(r['e2e_p99_s'], 1000):>10} {fmt(r['client_cached_fraction'], 100):>7}% "
              f"{fmt(r['rss_mib_after_warmup']):>8} "
              f"{fmt(r['rss_growth_pct_second_half'], 1, '+.1f'):>9}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds excluded from the figures (default: a sixth of the run)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    ap.add_argument("--policy", default=None, help="kvheat's eviction policy (default kvheat)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="also run the same load against this peer server, interleaved")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per server (default 3 with --peer, else 1)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", default=str(RESULTS / "server" / "load.json"))
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = args.duration / 6
    repeats = args.repeats or (3 if args.peer else 1)
    report: dict[str, Any] = {"args": vars(args)}
    check_quiet(report, "start")
    vllm_python = find_vllm_python(args.vllm_python) if args.peer == "vllm" else None
    if args.peer and vllm_python is None:
        print(f"{NO_VLLM}: skipping the peer run", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvheat-load-") as tmp:
        model_dir = None
        if vllm_python:
            from kvheat.engine.loader import save_tiny_model

            model_dir = str(save_tiny_model(Path(tmp) / "tiny-llama"))
        servers: dict[str, tuple[str, subprocess.Popen[bytes], Path, str]] = {}
        port = free_port()
        log = Path(tmp) / "kvheat.log"
        extra = ["--policy", args.policy] if args.policy else []
        proc = start_kvheat_server(model_dir, port, log, args.threads, args.clients,
                                   args.batched_tokens, args.num_blocks, extra)
        servers["kvheat"] = (f"http://127.0.0.1:{port}", proc, log,
                             "tiny" if model_dir else "kvheat-tiny-llama")
        if vllm_python and model_dir:
            port = free_port()
            vlog = Path(tmp) / "vllm.log"
            servers["vllm"] = (f"http://127.0.0.1:{port}", start_vllm_server(
                vllm_python, model_dir, port, vlog, tmp, args.threads, args.clients,
                args.batched_tokens), vlog, "tiny")
        runs: dict[str, list[RunResult]] = {name: [] for name in servers}
        try:
            for base, proc, log, _ in servers.values():
                wait_ready(base, proc, 600, log)
            for rep in range(repeats):
                for name, (base, proc, log, model) in servers.items():
                    print(f"{name}: {args.clients} clients x {args.duration:.0f} s (repeat {rep}) ...",
                          file=sys.stderr)
                    res = bench_one(name, proc, base, model, args, args.seed + rep)
                    runs[name].append(res)
                    if any(s.error for s in res.samples):
                        print(f"{name} had errors; its log ends:\n"
                              f"{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        finally:
            for _, proc, _, _ in servers.values():
                stop(proc)
    check_quiet(report, "end", after_own_run=True)
    rows = [r.summary() for name in servers for r in runs[name]]
    print_table(rows)
    report["runs"] = rows
    report["rss_series"] = {f"{r.name}-{i}": r.rss_mb for name in servers
                            for i, r in enumerate(runs[name])}
    if "vllm" in runs:
        k = [r.summary() for r in runs["kvheat"]]
        v = [r.summary() for r in runs["vllm"]]
        ratios = {m: paired_ratio([x[m] for x in k], [y[m] for y in v])
                  for m in ("requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s")
                  if all(x[m] for x in k) and all(y[m] for y in v)}
        report["kvheat_over_vllm"] = ratios
        print("kvheat / vLLM (median, range): " + ", ".join(
            f"{m} {fmt_ratio(r)}" for m, r in ratios.items()) + " (lower TTFT is better)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["errors_total"] == 0 for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
