"""Where a step of the engine spends its time: torch.profiler over the decode and prefill
paths of the built-in tiny Llama (or the hidden-2048 one), one torch thread.

Workloads (fresh prompts, 4 shared 512-token prefixes, each with its own 96-token suffix):
- decode: 16 and 64 sequences decoding together (steps after every prompt is done);
- prefill: one cold 576-token prompt, and 64 new tokens on a cached 512-token prefix.
For each: the mean step time, the share of each aten op (self CPU time), and what the
ops leave (Python: scheduler, batch building, sampling, dispatch).

    .venv/bin/python bench/engine/profile.py [--model wide] [--json results/engine/profile.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

# Run as `python bench/engine/profile.py`, the script's folder would come first on
# sys.path and this file would shadow the standard library's `profile` (cProfile imports
# it): the repo root takes its place, before anything else is imported.
if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
from torch.profiler import ProfilerActivity, profile

from bench._lib import RESULTS
from bench._lib.models import wide_llama
from bench._lib.report import write_json
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.engine.loader import load_model


def engine_for(model: torch.nn.Module) -> LLMEngine:
    return LLMEngine(model, None, EngineConfig(num_blocks=6144, block_size=16, scheduler=SchedulerConfig(
        max_num_batched_tokens=4096, max_num_seqs=256)))


def profiled(fn, steps: int) -> dict:
    """Profile `fn` (one engine step or request) `steps` times: wall per call, top ops."""
    fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = (time.perf_counter() - t0) / steps
    rows = [(e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps)
            for e in prof.key_averages()]
    rows = [r for r in rows if r[1] > 0]
    ops_ms = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    return {"step_ms": 1e3 * wall, "ops_ms": ops_ms,
            "outside_ops_ms": max(0.0, 1e3 * wall - ops_ms),
            "top": [{"op": k, "ms": ms, "calls": n, "share": ms / (1e3 * wall)}
                    for k, ms, n in rows[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "wide"], default="tiny")
    ap.add_argument("--json", default=str(RESULTS / "engine" / "profile.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.model == "tiny":
        model, _, cfg = load_model(None, "llama")
        vocab = cfg.vocab_size
    else:
        model, cfg = wide_llama(2)
        vocab = cfg.vocab_size
    rng = random.Random(0)

    def rp(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    out: dict = {"model": a.model, "torch": torch.__version__, "threads": 1}
    for n in (16, 64):
        e = engine_for(model)
        heads = [rp(512) for _ in range(4)]
        for i in range(n):
            e.add_request(heads[i % 4] + rp(96), SamplingParams(max_tokens=64, ignore_eos=True))
        while e.stats.decode_tokens < 2 * n:
            e.step()
        out[f"decode_{n}"] = profiled(e.step, 10)
    e = engine_for(model)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    out["prefill_cold_576"] = profiled(lambda: e.generate([rp(576)], one), 3)
    head = rp(512)
    e.generate([head], one)
    out["prefill_64_on_512_cached"] = profiled(lambda: e.generate([head + rp(64)], one), 5)
    for name, r in out.items():
        if not isinstance(r, dict):
            continue
        print(f"\n{name}: {r['step_ms']:.1f} ms a step; outside aten ops {r['outside_ops_ms']:.1f} ms")
        for t in r["top"]:
            print(f"  {t['op']:<52} {t['ms']:7.2f} ms {100 * t['share']:5.1f}%  x{t['calls']}")
    write_json(a.json, out)


if __name__ == "__main__":
    main()
