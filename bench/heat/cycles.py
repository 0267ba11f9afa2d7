"""A cycle of conversations longer than the cache: the commonest state of a small host tier
(more active sessions than fit), and the cliff of issue 55.

`--conversations` conversations of `--turns` turns, interleaved round-robin (turn t of every
one before turn t+1 of any), each its own system prompt of `--system-blocks` blocks and
`--turn-blocks` new blocks a turn; `--sets` sets of new conversations one after the other
(a server's sessions end and others start). Each policy replays it through the real cache
(`kvheat.replay.replay`, prefix semantics) at each capacity in blocks; the hit rate is given
over everything and per set. The cycle (all conversations' blocks at their last turn) is
printed: a capacity below it is where recency keeps nothing.

    python bench/heat/cycles.py --json docs/results/heat/cycles.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/heat/cycles.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.report import write_json
from bench.heat.sessions import policy_spec, split_policies
from kvheat.replay import replay
from kvheat.replay.traces import TraceRequest

BLOCK = 16  # tokens per block
POLICIES = "lru,arc,s3fifo,lruk,lirs,kvheat[protect=false],kvheat,belady"
CAPACITIES = "64,96,128,192,256,384"


def cyclic(conversations: int, turns: int, system_blocks: int, turn_blocks: int,
           sets: int) -> list[list[TraceRequest]]:
    """The trace, one list of requests per set: turn t of every conversation, then t + 1."""
    out: list[list[TraceRequest]] = []
    next_id, t = 0, 0.0
    for _ in range(sets):
        reqs: list[TraceRequest] = []
        chats = []
        for _ in range(conversations):
            chats.append(list(range(next_id, next_id + system_blocks)))
            next_id += system_blocks
        for _ in range(turns):
            for c in range(conversations):
                chats[c] = chats[c] + list(range(next_id, next_id + turn_blocks))
                next_id += turn_blocks
                reqs.append(TraceRequest(t, len(chats[c]) * BLOCK, 1, list(chats[c])))
                t += 1000.0
        out.append(reqs)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay every policy at every capacity; hit rates overall and per set."""
    sets = cyclic(args.conversations, args.turns, args.system_blocks, args.turn_blocks,
                  args.sets)
    cycle = args.conversations * (args.system_blocks + args.turns * args.turn_blocks)
    cells = []
    for cap in (int(c) for c in args.capacity.split(",")):
        for pol in split_policies(args.policy):
            per_set, hit_before, total_before = [], 0, 0
            for n in range(1, len(sets) + 1):
                trace = [r for s in sets[:n] for r in s]
                r = replay(trace, policy_spec(pol), cap * BLOCK, BLOCK)
                per_set.append((r.hit_tokens - hit_before) / (r.total_tokens - total_before))
                hit_before, total_before = r.hit_tokens, r.total_tokens
            cells.append({"policy": pol, "capacity_blocks": cap,
                          "hit_rate": hit_before / total_before, "per_set": per_set})
            print(f"{cap:5d} blocks {pol:7s} {100 * hit_before / total_before:6.2f}%  per set "
                  + " / ".join(f"{100 * x:.1f}" for x in per_set))
    return {"command": "python bench/heat/cycles.py " + " ".join(sys.argv[1:]),
            "block_tokens": BLOCK, "conversations": args.conversations, "turns": args.turns,
            "system_blocks": args.system_blocks, "turn_blocks": args.turn_blocks,
            "sets": args.sets, "cycle_blocks": cycle,
            "policies": split_policies(args.policy), "cells": cells}


def table(d: dict[str, Any]) -> str:
    """Markdown: a row per policy, a column per capacity, the hit rate over every set and,
    in brackets, per set."""
    caps = sorted({c["capacity_blocks"] for c in d["cells"]})
    by = {(c["policy"], c["capacity_blocks"]): c for c in d["cells"]}
    lines = ["| policy | " + " | ".join(f"{c} blocks" for c in caps) + " |",
             "|---|" + "---:|" * len(caps)]
    for pol in d["policies"]:
        row = []
        for cap in caps:
            c = by[(pol, cap)]
            row.append(f"{100 * c['hit_rate']:.1f}% ("
                       + " / ".join(f"{100 * x:.1f}" for x in c["per_set"]) + ")")
        lines.append(f"| {pol} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-blocks", type=int, default=8)
    ap.add_argument("--turn-blocks", type=int, default=4)
    ap.add_argument("--sets", type=int, default=3, help="sets of new conversations, in turn")
    ap.add_argument("--policy", default=POLICIES)
    ap.add_argument("--capacity", default=CAPACITIES, help="cache sizes in blocks")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if min(a.conversations, a.turns, a.system_blocks, a.turn_blocks, a.sets) < 1:
        ap.error("every count at least 1")
    report = run(a)
    print(f"cycle: {report['cycle_blocks']} blocks")
    print(table(report))
    if a.json:
        write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
