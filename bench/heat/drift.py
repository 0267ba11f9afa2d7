"""Injected drift: a generated trace whose second half switches to a few new hot prefixes.

Phase A: eight long system prompts, flat popularity, which build up high heat. Phase B:
two new system prompts take all traffic (the entropy of the prefixes drops by ~2 bits). The drift detector (§4.2)
notices the drop and re-weights (drops the stale counts, forgets the ghost history); the online
tuner (§2.4) adapts the half-life from hit feedback. Hit rates with and without.

    .venv/bin/python bench/heat/drift.py --json docs/results/heat/drift.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

if not __package__:  # run as `python bench/heat/drift.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from kvheat.heat import KVHeat
from kvheat.replay import replay
from kvheat.replay.traces import TraceRequest, WorkloadConfig, generate_workload


def drift_trace(seed: int = 0) -> tuple[list[TraceRequest], int]:
    a = generate_workload(WorkloadConfig(num_conversations=2500, num_system_prompts=8, zipf_s=0.3,
                                         system_tokens=(6000, 12000), arrival_rate=4.0,
                                         think_time_s=200.0, seed=seed))
    b = generate_workload(WorkloadConfig(num_conversations=2500, num_system_prompts=2, zipf_s=1.0,
                                         system_tokens=(6000, 12000), arrival_rate=4.0,
                                         think_time_s=200.0, seed=seed + 1))
    offset_ids = 1 + max(h for r in a for h in r.hash_ids)
    t0 = a[-1].timestamp_ms
    for r in b:  # phase B: new ids (new prefixes) after phase A's end
        r.hash_ids = [h + offset_ids for h in r.hash_ids]
        r.timestamp_ms += t0
        r.session = None if r.session is None else "b" + r.session
    return a + b, len(a)


VARIANTS = {
    "kvheat (no adaptation)": {},
    "kvheat + drift detector": {"drift": True},
    "kvheat + online tuning": {"tune": True},
    "kvheat + drift + tuning": {"drift": True, "tune": True},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", default="250K,500K")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    trace, split = drift_trace()
    caps = [int(float(c[:-1]) * (1_000 if c.endswith("K") else 1_000_000)) for c in a.capacity.split(",")]
    rows = []
    print(f"{len(trace)} requests, drift injected at request {split}")
    for cap in caps:
        for label, kw in {"lru": None, "arc": None, **VARIANTS}.items():
            pol = label if kw is None else partial(KVHeat, **kw)
            whole = replay(trace, pol, cap)
            first = replay(trace[:split], pol, cap)
            # Phase-B hit rate: the whole run minus phase A (same prefix of the run).
            hit_b = (whole.hit_tokens - first.hit_tokens) / (whole.total_tokens - first.total_tokens)
            near = replay(trace[:split + 1000], pol, cap)  # the 1000 requests right after
            hit_near = (near.hit_tokens - first.hit_tokens) / (near.total_tokens - first.total_tokens)
            rows.append({"capacity": cap, "policy": label, "hit_rate": whole.hit_rate,
                         "hit_rate_after_drift": hit_b, "hit_rate_first_1000_after": hit_near,
                         "policy_stats": whole.policy_stats})
            extra = "".join(f" {k}={v:.0f}" for k, v in whole.policy_stats.items()
                            if k in ("drifts", "retunes", "half_life_accesses"))
            print(f"{cap:>9,} {label:26s} whole {100 * whole.hit_rate:6.2f}%  after drift "
                  f"{100 * hit_b:6.2f}%  next 1000 {100 * hit_near:6.2f}%{extra}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
