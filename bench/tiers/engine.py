"""Time to first token with lower KV tiers under a small device pool, real forward passes.

    python bench/tiers/engine.py [--json results/tiers/engine.json] [--quick]

A Llama of representative width (hidden 2048, 16 heads / 4 KV heads, 2 layers, seeded
random weights; 128 KiB of KV per 16-token block) serves requests that share long
system prompts: `--prefixes` prompts of `--prefix-tokens` tokens, each followed by short
user turns, in rounds, so a device pool of `--device-blocks` blocks holds only a few of
the prefixes at a time. The same requests, one at a time (`max_tokens=1`, so the time is
the prefill), run on:

- device only: an evicted prefix is recomputed;
- + host tier: evicted blocks copied to host memory and back;
- + disk tier, and + Redis tier (a redis-server started on a free loopback port);
- disk after a restart: a new engine over the disk folder the previous run filled, its
  device pool empty; every prefix comes from disk or is recomputed.

Each run reports mean and P90 TTFT, tokens served from the device and from each lower
tier, and the load-or-recompute decisions made at the engine's measured prefill speed.
Every run's first tokens must equal the device-only run's (checked).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # run as `python bench/tiers/engine.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.models import wide_llama
from bench._lib.procs import Redis
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.tiers import TierSpec

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def workload(prefixes: int, prefix_tokens: int, turns: int, vocab: int,
             seed: int = 0) -> list[list[int]]:
    """Rounds over the prefixes, each request a prefix plus a fresh 48-token user turn."""
    rng = random.Random(seed)
    systems = [[rng.randrange(2, vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    reqs = []
    for _ in range(turns):
        order = list(range(prefixes))
        rng.shuffle(order)
        reqs += [systems[i] + [rng.randrange(2, vocab) for _ in range(48)] for i in order]
    return reqs


def run(model: torch.nn.Module, cfg: EngineConfig, reqs: list[list[int]]) -> dict:
    e = LLMEngine(model, None, cfg)
    ttft, firsts, cached = [], [], []
    try:
        for p in reqs:
            t0 = time.perf_counter()
            out = e.generate([p], ONE)[0]
            ttft.append(time.perf_counter() - t0)
            firsts.append(out.output_token_ids[0])
            cached.append(out.metrics.num_cached_tokens)
        stats = e.tiers.stats() if e.tiers is not None else None
    finally:
        e.close()
    prompt_tokens = sum(len(p) for p in reqs)
    res: dict = {"mean_ttft_ms": 1e3 * statistics.mean(ttft),
                 "p90_ttft_ms": 1e3 * sorted(ttft)[int(0.9 * (len(ttft) - 1))],
                 "hit_rate": sum(cached) / prompt_tokens, "firsts": firsts,
                 "prefill_tokens_per_s": e.prefill_tokens_per_s()}
    if stats is not None:
        # By tier from absolute counts: the tiers see only the prompt chunks they loaded.
        res["tiers"] = {name: {"hit_rate": t["hit_tokens"] / prompt_tokens,
                               "hit_blocks": t["hit_blocks"],
                               "read_latency_s": t["read_latency_s"],
                               "read_bandwidth_Bps": t["read_bandwidth_Bps"]}
                        for name, t in stats["tiers"].items()}  # type: ignore[union-attr]
        res["decisions"] = {k: stats[k] for k in ("decisions_load", "decisions_partial",
                                                  "decisions_recompute", "load_failed")}
    res["device_hit_rate"] = res["hit_rate"] - sum(t["hit_rate"] for t in
                                                   res.get("tiers", {}).values())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(RESULTS / "tiers" / "engine.json"))
    ap.add_argument("--quick", action="store_true", help="a smaller run (a smoke test)")
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=384)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--device-blocks", type=int, default=80)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.prefixes, args.prefix_tokens, args.turns, args.device_blocks = 3, 128, 2, 16
    torch.set_num_threads(args.threads)
    model, mcfg = wide_llama(2)
    reqs = workload(args.prefixes, args.prefix_tokens, args.turns, mcfg.vocab_size)
    prompt_blocks = -(-(args.prefix_tokens + 48) // 16)
    big = 4 * args.prefixes * prompt_blocks  # lower tiers that hold every prefix
    sched = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=4)

    def cfg(**kw: object) -> EngineConfig:
        return EngineConfig(num_blocks=args.device_blocks, block_size=16, scheduler=sched,
                            tiers=TierSpec(**kw))  # type: ignore[arg-type]

    block_bytes = 2 * 2 * 4 * 128 * 4 * 16
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvheat-tiers-engine-") as tmp:
        disk = str(Path(tmp) / "disk")
        runs: list[tuple[str, dict]] = [
            ("device only", {}),
            ("+ host tier", {"host_blocks": big}),
            ("+ disk tier", {"disk_dir": disk, "disk_bytes": 2 * big * block_bytes}),
            ("disk after restart", {"disk_dir": disk, "disk_bytes": 2 * big * block_bytes}),
        ]
        redis = None
        if shutil.which("redis-server"):
            redis = Redis(Path(tmp) / "redis").start()
            runs.append(("+ Redis tier", {"redis_url": redis.url,
                                          "redis_bytes": 2 * big * block_bytes}))
        try:
            for name, kw in runs:
                results[name] = run(model, cfg(**kw), reqs)
                print(f"  {name}: {results[name]['mean_ttft_ms']:.1f} ms", file=sys.stderr)
        finally:
            if redis is not None:
                redis.kill()
    ref = results["device only"]["firsts"]
    for name, r in results.items():
        if r.pop("firsts") != ref:
            raise SystemExit(f"{name}: first tokens differ from the device-only run")
    head = ("run", "mean TTFT", "P90 TTFT", "hit rate", "device", "lower tiers", "decisions")
    rows = []
    for name, r in results.items():
        lower = ", ".join(f"{k.split(':')[1]} {v['hit_rate']:.1%}"
                          for k, v in r.get("tiers", {}).items())
        d = r.get("decisions")
        dec = (f"load {d['decisions_load']}, partial {d['decisions_partial']}, "
               f"recompute {d['decisions_recompute']}") if d else "-"
        rows.append((name, f"{r['mean_ttft_ms']:.1f} ms", f"{r['p90_ttft_ms']:.1f} ms",
                     f"{r['hit_rate']:.1%}", f"{r['device_hit_rate']:.1%}", lower or "-", dec))
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    speed = results["device only"]["prefill_tokens_per_s"]
    print(f"prefill speed {speed:,.0f} tokens/s; {len(reqs)} requests of "
          f"{args.prefix_tokens}+48 tokens over {args.prefixes} prefixes; device pool "
          f"{args.device_blocks} blocks of 16 tokens")
    out = {"args": vars(args), "requests": len(reqs), "block_bytes": block_bytes,
           "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
