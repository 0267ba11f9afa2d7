"""Ablation of the kvheat policy: what each component adds, on both Mooncake traces.

    .venv/bin/python bench/heat/ablation.py --json docs/results/heat/ablation.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

if not __package__:  # run as `python bench/heat/ablation.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.traces import prepared
from kvheat.heat import KVHeat
from kvheat.replay import replay

OFF = dict(ghost=0, tail_penalty=0, regime=False, extension_penalty=0, adapt_extension=False,
           adapt="off")
FIXED = dict(adapt="off")  # the multiple held at its start (the default before issue 16)
GHOST = 8.0  # the default: keeps the last ~8x capacity evictions (5.3-10.7x)
# Every time is in the policy's own units: block accesses, or half-lives (the half-life
# itself is the workload's median reuse gap, measured online).
VARIANTS = {
    "LRU-like (half-life 30 accesses, nothing else)": dict(OFF, half_life=30.0),
    "decayed count (half-life = median reuse gap)": dict(OFF),
    "+ history (ghost ~8x capacity)": dict(OFF, ghost=GHOST),
    "+ partial-tail demotion": dict(OFF, ghost=GHOST, tail_penalty=6.67),
    "+ entropy regime (one-off demotion)": dict(OFF, ghost=GHOST, tail_penalty=6.67, regime=True),
    "+ fixed extension demotion (1.33 half-lives)": dict(FIXED, extension_penalty=1.33,
                                                         adapt_extension=False),
    "+ learned extension demotion": dict(FIXED),
    "+ the multiple following returning victims (the previous default)": dict(adapt="victims"),
    "+ the multiple by miniature simulation = kvheat default": dict(),
    "default, half-life 0.5x the reuse gap": dict(FIXED, reuse_mult=0.5),
    "default, half-life 2x the reuse gap": dict(FIXED, reuse_mult=2.0),
    "default, admission penalty 0.8 (was the default)": dict(admit_penalty=0.8),
    "default, penalties that never fade": dict(penalty_fade=math.inf),
    "default + online tuning of the multiplier": dict(tune=True),
    "default + drift detector": dict(drift=True),
    "default, counts capped at 3": dict(max_count=3.0),
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
