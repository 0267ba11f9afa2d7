"""Ablation of the kvheat policy: what each component adds, on both Mooncake traces.

    .venv/bin/python bench/heat_ablation.py --json docs/heat_ablation.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from heat_replay import prepared

from kvheat.heat import KVHeat
from kvheat.replay import replay

OFF = dict(ghost=0, tail_penalty_s=0, regime=False, extension_penalty_s=0, adapt_extension=False)
GHOST = 8.0  # the default: keeps the last ~8x capacity evictions (5.3-10.7x)
VARIANTS = {
    "LRU-like (hl=1s, nothing else)": dict(OFF, half_life_s=1.0),
    "decayed count (hl=150s)": dict(OFF),
    "+ history (ghost ~8x capacity)": dict(OFF, ghost=GHOST),
    "+ partial-tail demotion": dict(OFF, ghost=GHOST, tail_penalty_s=1000.0),
    "+ entropy regime (one-off demotion)": dict(OFF, ghost=GHOST, tail_penalty_s=1000.0, regime=True),
    "+ fixed extension demotion (200s)": dict(extension_penalty_s=200.0, adapt_extension=False),
    "+ learned extension demotion = kvheat default": dict(),
    "default + online half-life tuning": dict(tune=True),
    "default + drift detector": dict(drift=True),
    "default, counts capped at 3": dict(max_count=3.0),
    "default, half-life 75s": dict(half_life_s=75.0),
    "default, half-life 300s": dict(half_life_s=300.0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="conv,synth")
    ap.add_argument("--capacity", default="1M,3M,10M")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    caps = [int(float(c[:-1]) * 1_000_000) for c in a.capacity.split(",")]
    rows = []
    for tname in a.trace.split(","):
        trace = prepared(tname)
        for label, kw in VARIANTS.items():
            hits = [replay(trace, partial(KVHeat, **kw), c).hit_rate for c in caps]
            rows.append({"trace": tname, "variant": label, "capacities": caps, "hit_rate": hits})
            print(f"{tname:6s} {label:46s} " + "  ".join(f"{100 * h:6.2f}%" for h in hits), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
