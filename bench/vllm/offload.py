"""vLLM's offload tier, side by side: its `lru` and `arc` against kvheat's policy (and the
Belady bound) inside vLLM's own CPUOffloadingManager, at equal capacity (chunks).

Replays the Mooncake traces (when ../shared/traces has them) and the built-in generator
through `kvheat.integrations.vllm_replay.replay_offload` at several offload capacities and
time scales, prints the offload prefix hit rate of each policy and the time per manager
call, and writes JSON. Needs the `vllm` extra.

    python bench/vllm/offload.py [--capacity 1M,3M,10M] [--time-scale 0.1,1,10] [--limit N]

With `--overhead ROUNDS` it measures only the per-call cost: lru, arc and kvheat in turn
on each cell (A B C A B C ...), ROUNDS times, printing the median and range of each
policy's µs per manager call and of the per-round ratios kvheat/arc and kvheat/lru (the
machine may be shared: the ratios of neighbouring runs are what compare). `--gc collect`
(the default) starts every run from a collected heap, so each pays for the garbage it
makes itself; `--gc keep` leaves the collector alone, and a full collection lands on
whichever run crosses its threshold. `--side-by-side N` runs the three in one replay instead,
in turns of N events each (`replay_side_by_side`: each manager sees exactly its own calls):
a burst of load on a shared machine then falls on all three alike, so the ratios spread
less; the turns cost each policy some cache misses it would not have alone, so keep N in
the thousands. In that mode the startup heap is frozen first, as vLLM's engine core does
(`freeze_gc_heap`): otherwise the full collection the three caches' objects together
trigger scans the whole process (vLLM and torch imports, ~0.35 s) inside whichever
policy's call it lands on.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

if not __package__:  # run as `python bench/vllm/offload.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

try:
    from kvheat.integrations.vllm_replay import replay_offload, replay_side_by_side, request_keys
except ImportError as e:  # pragma: no cover - the extra is missing
    sys.exit(f"needs vLLM (pip install -e '.[vllm]'): {e}")
from bench._lib import RESULTS, TRACES
from kvheat.replay import generate_workload, load_trace, parse_tokens
from kvheat.replay.traces import WorkloadConfig

# Generator shapes no default was chosen on (`--traces gen-a,gen-b,gen-c,gen-d`): other
# seeds, flatter or steeper prompt popularity, longer think times, more turns, tenants.
HELD_OUT = {
    "gen-a": WorkloadConfig(seed=7),
    "gen-b": WorkloadConfig(seed=3, zipf_s=0.8, think_time_s=600.0, single_turn_frac=0.6),
    "gen-c": WorkloadConfig(seed=5, mean_turns=8.0, arrival_rate=4.0),
    "gen-d": WorkloadConfig(seed=9, num_system_prompts=40, zipf_s=1.4, think_time_s=60.0,
                            tenants=4),
    # High-entropy shapes (thousands of prompts, flat popularity), added with the admission
    # penalty that no longer fades: the four above never reach kvheat's high regime.
    "gen-e": WorkloadConfig(seed=11, num_system_prompts=3000, zipf_s=0.6, single_turn_frac=0.6),
    "gen-f": WorkloadConfig(seed=13, num_system_prompts=800, zipf_s=1.0, mean_turns=3.0,
                            think_time_s=120.0, tenants=2),
    "gen-g": WorkloadConfig(seed=17, num_system_prompts=5000, zipf_s=0.9, mean_turns=6.0,
                            think_time_s=400.0, arrival_rate=3.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", default="1M,3M,10M", help="offload capacity in tokens")
    ap.add_argument("--time-scale", default="0.1,1,10", help="timestamps multiplied by")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--traces", default="conversation,synthetic,builtin",
                    help="conversation, synthetic, builtin, or held-out generator shapes "
                         + ",".join(HELD_OUT))
    ap.add_argument("--policies", default="lru,arc,kvheat,belady",
                    help="hit-rate runs: lru, arc, kvheat, belady, kvheat-fixed (multiple 1)")
    ap.add_argument("--json", default=str(RESULTS / "vllm" / "offload.json"))
    ap.add_argument("--overhead", type=int, default=0, metavar="ROUNDS",
                    help="only the per-call cost, interleaved, ROUNDS rounds")
    ap.add_argument("--gc", choices=("collect", "keep"), default="collect",
                    help="--overhead: collect before every run, or leave gc alone")
    ap.add_argument("--side-by-side", type=int, default=0, metavar="EVENTS",
                    help="--overhead: the three policies in one replay, in turns of EVENTS")
    a = ap.parse_args()
    ct = a.chunk_tokens
    caps = [parse_tokens(c) for c in a.capacity.split(",")]
    scales = [float(s) for s in a.time_scale.split(",")]
    policies = a.policies.split(",")
    if not {"lru", "arc", "kvheat"} <= set(policies):
        sys.exit("--policies needs lru, arc and kvheat (the comparison)")
    files = {"conversation": "mooncake_conversation_part1.jsonl",
             "synthetic": "mooncake_synthetic_trace.jsonl"}
    rows = []
    for name in a.traces.split(","):
        if name == "builtin":
            trace = generate_workload(block_tokens=ct)
        elif name in HELD_OUT:
            trace = generate_workload(HELD_OUT[name], block_tokens=ct)
        elif (TRACES / files[name]).exists():
            trace = load_trace(TRACES / files[name], ct)
        else:
            print(f"skip {name}: {TRACES / files[name]} not present")
            continue
        trace = trace[: a.limit] if a.limit else trace
        keys = request_keys(trace, ct)
        if a.overhead:
            if a.side_by_side:
                from vllm.utils.gc_utils import freeze_gc_heap

                freeze_gc_heap()  # the trace and imports are the static heap
            rows += overhead(name, trace, keys, caps, scales, ct, a.overhead, a.gc == "collect",
                             a.side_by_side)
            continue
        print(f"\n{name}: {len(trace)} requests, {ct}-token chunks")
        print(f"{'capacity':>9} {'scale':>6} " + " ".join(f"{p:>12}" for p in policies)
              + "   kvheat-best  us/call lru/arc/kvheat")
        for cap in caps:
            for ts in scales:
                res = {p: replay_offload(trace, p, cap // ct, ct, time_scale=ts, keys=keys)
                       for p in policies}
                hr = {p: r.hit_rate for p, r in res.items()}
                us = {p: r.manager_s / r.calls * 1e6 for p, r in res.items()}
                best = max(hr["lru"], hr["arc"])
                print(f"{cap / 1e6:>8g}M {ts:>6g} " + " ".join(f"{hr[p]:>12.2%}" for p in policies)
                      + f"   {100 * (hr['kvheat'] - best):>+8.2f}pt  "
                      + "/".join(f"{us[p]:.0f}" for p in ("lru", "arc", "kvheat")), flush=True)
                rows.append({"trace": name, "capacity_tokens": cap, "time_scale": ts,
                             "results": {p: r.as_dict() for p, r in res.items()}})
    if a.overhead:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"chunk_tokens": ct, "rounds": a.overhead, "gc": a.gc,
                       "side_by_side_events": a.side_by_side, "rows": rows}, f, indent=1)
        print(f"wrote {a.json}")
        return
    ratios = [r["results"]["kvheat"]["manager_s"] / r["results"]["kvheat"]["calls"]
              / (r["results"]["arc"]["manager_s"] / r["results"]["arc"]["calls"]) for r in rows]
    wins = sum(r["results"]["kvheat"]["hit_rate"] > max(r["results"]["lru"]["hit_rate"],
                                                         r["results"]["arc"]["hit_rate"])
               for r in rows)
    if rows:
        print(f"\nkvheat above lru and arc in {wins} of {len(rows)} cells; time per manager call "
              f"kvheat/arc: median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump({"chunk_tokens": ct, "rows": rows,
                   "overhead_ratio_kvheat_arc": ratios}, f, indent=1)
    print(f"wrote {a.json}")


def overhead(name, trace, keys, caps, scales, ct, rounds, collect, side_by_side=0) -> list[dict]:
    """Per-call cost of lru, arc and kvheat, interleaved run by run (or in turns of
    `side_by_side` events within one replay), `rounds` times."""
    pols = ("lru", "arc", "kvheat")
    how = f"side by side in turns of {side_by_side} events" if side_by_side else "in turn"
    print(f"\n{name}: {len(trace)} requests; {rounds} rounds of {'/'.join(pols)} {how}, "
          f"gc {'collected before each run' if collect else 'left alone'}")
    print(f"{'capacity':>9} {'scale':>6}  us/call median [min-max] lru / arc / kvheat"
          f"{'':>20}kvheat/arc          kvheat/lru")
    rows = []
    for cap in caps:
        for ts in scales:
            us: dict[str, list[float]] = {p: [] for p in pols}
            hits: dict[str, set[float]] = {p: set() for p in pols}
            for i in range(rounds):
                if side_by_side:
                    if collect:
                        gc.collect()
                    order = pols[i % 3:] + pols[:i % 3]  # who goes first rotates
                    runs = replay_side_by_side(trace, order, cap // ct, ct, time_scale=ts,
                                               keys=keys, slice_events=side_by_side)
                else:
                    runs = []
                    for p in pols:
                        if collect:
                            gc.collect()
                        runs.append(replay_offload(trace, p, cap // ct, ct, time_scale=ts,
                                                   keys=keys))
                for r in runs:
                    us[r.policy].append(r.manager_s / r.calls * 1e6)
                    hits[r.policy].add(r.hit_rate)
            ka = [k / x for k, x in zip(us["kvheat"], us["arc"])]
            kl = [k / x for k, x in zip(us["kvheat"], us["lru"])]

            def span(v: list[float], f: str = ".1f") -> str:
                return f"{statistics.median(v):{f}} [{min(v):{f}}-{max(v):{f}}]"
            print(f"{cap / 1e6:>8g}M {ts:>6g}  " + " / ".join(span(us[p]) for p in pols)
                  + f"   {span(ka, '.2f')}   {span(kl, '.2f')}", flush=True)
            assert all(len(h) == 1 for h in hits.values()), hits  # same decisions each run
            rows.append({"trace": name, "capacity_tokens": cap, "time_scale": ts,
                         "us_per_call": us, "kvheat_over_arc": ka, "kvheat_over_lru": kl,
                         "hit_rate": {p: h.pop() for p, h in hits.items()}})
    return rows


if __name__ == "__main__":
    main()
