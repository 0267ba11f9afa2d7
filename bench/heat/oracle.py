"""What a perfect reuse signal would be worth: kvheat told, for each new block, whether
any later request uses it (the replayer's Belady oracle), against kvheat as it is.

The gap between kvheat and Belady is mostly first reuses: a block seen once looks, to every
online signal a trace carries, like the three quarters of blocks never used again. A server
knows more than a trace (which conversation a request belongs to, whether its answer was
delivered, what waits in the queue); this bounds what such a signal could add if it were
perfect, at the same memory.

    .venv/bin/python bench/heat/oracle.py --json docs/results/heat/oracle.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if not __package__:  # run as `python bench/heat/oracle.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.traces import prepared
from bench.heat.grid import ONLINE
from kvheat.cache.block import Block
from kvheat.heat import KVHeat
from kvheat.heat.penalties import ONE_OFF
from kvheat.replay import parse_tokens, replay


class OracleAdmission(KVHeat):
    """kvheat whose admission penalty falls on exactly the blocks no later request uses
    (and on no other), read from the replayer's future."""

    name = "kvheat+oracle"
    needs_future = True

    def __init__(self, dead_penalty: float = 16.0) -> None:
        # The bit is charged whatever the regime and from the first request (admit_now off,
        # no warm-up, no floor: the previous default's admission, as oracle.json measured).
        super().__init__(admit_penalty=dead_penalty, penalty_fade=math.inf, admit_now=False,
                         regime_warmup=False, admit_floor=None)
        self.next_use: dict[bytes, float] = {}

    def on_insert(self, b: Block, now: float) -> None:
        super().on_insert(b, now)
        dead = self.next_use.get(b.key, math.inf) == math.inf  # type: ignore[arg-type]
        r = b.rec
        r.flags = (r.flags | ONE_OFF) if dead else (r.flags & ~ONE_OFF)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="conv,synth")
    ap.add_argument("--capacity", default="1M,3M")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    caps = [parse_tokens(c) for c in a.capacity.split(",")]
    rows = []
    for tname in a.trace.split(","):
        pt = prepared(tname, 512)
        for cap in caps:
            rate = {p: replay(pt, p, cap).hit_rate for p in ["lru", *ONLINE[1:], "kvheat", "belady"]}
            rate["kvheat+oracle"] = replay(pt, OracleAdmission, cap).hit_rate
            lru, bel = rate["lru"], rate["belady"]
            gap = {p: (v - lru) / (bel - lru) for p, v in rate.items()}
            rows.append({"trace": tname, "capacity_tokens": cap, "hit_rate": rate, "gap_closed": gap})
            print(f"{tname} {cap / 1e6:g}M: " + "  ".join(
                f"{p} {100 * rate[p]:.2f}% ({gap[p]:+.0%})" for p in ("lru", "kvheat", "kvheat+oracle", "belady")),
                flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
