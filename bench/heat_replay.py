"""A small, self-contained trace replayer for tuning the heat policies.

It drives `KVCacheManager` exactly as the project's replayer does (one request at a time,
allocate then free, cache clock = trace time) and feeds Belady its oracle. Used by the
heat benchmarks; `kvheat replay` is the user-facing tool.

    .venv/bin/python bench/heat_replay.py --trace conv --policies lru,twoq,kvheat
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import kvheat.heat  # noqa: F401  (registers the heat policies)
from kvheat.cache import CacheConfig, EvictionPolicy, KVCacheManager, make_policy
from kvheat.replay.traces import TraceRequest, WorkloadConfig, generate_workload, load_trace

TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACE_FILES = {
    "conv": "mooncake_conversation_part1.jsonl",
    "synth": "mooncake_synthetic_trace.jsonl",
}
BLOCK = 512


def get_trace(name: str) -> list[TraceRequest]:
    if name == "gen":
        return generate_workload(WorkloadConfig(), BLOCK)
    if name.startswith("gen"):  # gen<seed>: the generator with another seed
        return generate_workload(WorkloadConfig(seed=int(name[3:])), BLOCK)
    return load_trace(TRACES_DIR / TRACE_FILES.get(name, name), BLOCK)


def next_uses(trace: list[TraceRequest]) -> list[list[float]]:
    """For each request and block position, the index of the next request using that
    prefix (inf when none): Belady's oracle."""
    last: dict[int, int] = {}
    out: list[list[float]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        out[i] = [float(last.get(h, float("inf"))) for h in ids]
        for h in ids:
            last[h] = i
    return out


def replay(trace: list[TraceRequest], policy: str | Callable[[], EvictionPolicy],
           capacity_tokens: int, oracle: list[list[float]] | None = None) -> dict[str, float]:
    pol = make_policy(policy) if isinstance(policy, str) else policy()
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(capacity_tokens // BLOCK, BLOCK), pol, clock=lambda: now[0])
    if pol.needs_future and oracle is None:
        oracle = next_uses(trace)
    skipped = 0
    t0 = time.perf_counter()
    for i, r in enumerate(trace):
        now[0] = r.timestamp_ms / 1000.0
        if len(r.hash_ids) > mgr.config.num_blocks:
            skipped += 1
            continue
        req = mgr.make_hashed_request(str(i), r.hash_ids, r.input_length, r.tenant, r.session)
        if oracle is not None:
            nu = pol.next_use  # type: ignore[attr-defined]
            for k, v in zip(req.keys, oracle[i]):
                nu[k] = v
        mgr.allocate(req)
        mgr.free(req)
    wall = time.perf_counter() - t0
    return {"hit_rate": mgr.stats.hit_rate, "wall_s": wall, "skipped": skipped,
            **{k: float(v) for k, v in pol.stats().items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="conv,synth,gen")
    ap.add_argument("--policies", default="lru,fifo,lfu,arc,s3fifo,twoq,kvheat,belady")
    ap.add_argument("--capacity", default="1M,3M,10M")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    caps = [int(float(c[:-1]) * 1_000_000) if c.endswith("M") else int(c) for c in a.capacity.split(",")]
    results = []
    for tname in a.trace.split(","):
        trace = get_trace(tname)
        oracle = next_uses(trace)
        for pname in a.policies.split(","):
            row = []
            for cap in caps:
                r = replay(trace, pname, cap, oracle if pname == "belady" else None)
                results.append({"trace": tname, "policy": pname, "capacity": cap, **r})
                row.append(f"{100 * r['hit_rate']:6.2f}% ({r['wall_s']:.1f}s)")
            print(f"{tname:6s} {pname:10s} " + "  ".join(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
