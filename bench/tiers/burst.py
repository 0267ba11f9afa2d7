"""Bytes read from each lower tier per byte served, under bursty multi-client load.

    python bench/tiers/burst.py [--json results/tiers/burst.json] [--clients 16]

The built-in tiny Llama on a small device pool. A warm-up round caches `--prefixes`
prompt prefixes, which a second round of other prompts pushes down to the lower tier
(host, disk or Redis, one at a time). Then bursts of `--clients` requests arrive at once,
each a cached prefix plus a fresh turn, so most of them wait several steps for blocks
while their lower-tier loads are planned. Reported per tier: bytes the tier read for
promotions (`read_bytes`), bytes written into device blocks from it (`promoted_bytes`),
their ratio (the target is at most 1.1: each block read once per promotion), the store's
own `get_bytes`, plans made, wall time, and whether every greedy output equals a plain
engine's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # run as `python bench/tiers/burst.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.procs import Redis
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from kvheat.tiers import TierSpec

SP = SamplingParams(max_tokens=4, ignore_eos=True)


def run_burst(e: LLMEngine, reqs: list[list[int]]) -> list[list[int]]:
    ids = [e.add_request(p, SP) for p in reqs]
    while e.has_unfinished:
        e.step()
    return [e.release(i).output_token_ids for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(RESULTS / "tiers" / "burst.json"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=96)
    ap.add_argument("--device-blocks", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok, _ = load_model(None, "llama")
    rng = random.Random(0)
    heads = [[rng.randrange(2, 1000) for _ in range(args.prefix_tokens)]
             for _ in range(args.prefixes)]
    fillers = [[rng.randrange(2, 1000) for _ in range(args.prefix_tokens)]
               for _ in range(args.prefixes)]
    bursts = [[rng.choice(heads) + [rng.randrange(2, 1000) for _ in range(16)]
               for _ in range(args.clients)] for _ in range(args.bursts)]
    plain = LLMEngine(model, tok, EngineConfig(num_blocks=1024))
    want = [run_burst(plain, b) for b in bursts]
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        redis = Redis(Path(tmp) / "redis").start()
        try:
            for tier in ("host", "disk", "redis"):
                spec = {
                    "host": TierSpec(host_blocks=256),
                    "disk": TierSpec(disk_dir=str(Path(tmp) / "disk"), disk_bytes=1 << 28),
                    "redis": TierSpec(redis_url=redis.url,
                                      redis_bytes=1 << 28,
                                      secret="bench-tier-secret-0123456789"),
                }[tier]
                e = LLMEngine(model, tok, EngineConfig(num_blocks=args.device_blocks,
                                                       policy="lru", tiers=spec))
                run_burst(e, heads)
                run_burst(e, fillers)  # pushes the prefixes down to the tier
                e.tiers.flush()
                st = e.tiers.stores[0]
                g0 = st.stats.get_bytes
                c = e.tiers.counters
                r0, p0, plans0 = c.read_bytes, c.promoted_bytes, c.prefetch_plans
                t0 = time.perf_counter()
                same = all(run_burst(e, b) == w for b, w in zip(bursts, want, strict=True))
                wall = time.perf_counter() - t0
                read, promoted = c.read_bytes - r0, c.promoted_bytes - p0
                results[tier] = {
                    "read_bytes": read, "promoted_bytes": promoted,
                    "read_per_served": read / promoted if promoted else None,
                    "store_get_bytes": st.stats.get_bytes - g0,
                    "unused_read_bytes": c.unused_read_bytes,
                    "plans": c.prefetch_plans - plans0, "requests": args.clients * args.bursts,
                    "wall_s": round(wall, 2), "outputs_equal_plain": same,
                }
                e.close()
        finally:
            redis.kill()
    for tier, r in results.items():
        ratio = r["read_per_served"]
        print(f"{tier:6s} read {r['read_bytes'] / 2**20:7.2f} MiB  served "
              f"{r['promoted_bytes'] / 2**20:7.2f} MiB  read/served "
              f"{ratio if ratio is None else round(ratio, 3)}  store get "
              f"{r['store_get_bytes'] / 2**20:7.2f} MiB  plans {r['plans']}/{r['requests']}  "
              f"{r['wall_s']} s  outputs equal: {r['outputs_equal_plain']}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
