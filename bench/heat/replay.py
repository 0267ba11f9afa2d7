"""A quick policy grid on the project replayer (the traces: bench/_lib/traces.py).

Every heat benchmark replays through `kvheat.replay.replay` on a `PreparedTrace` (keys
hashed once per trace; Belady's oracle and the miss breakdown come from the replayer), as
`kvheat replay` does.

    .venv/bin/python bench/heat/replay.py --trace conv --policies lru,twoq,kvheat
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as `python bench/heat/replay.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.traces import prepared
from kvheat.replay import parse_tokens, replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="conv,synth,gen")
    ap.add_argument("--policies", default="lru,fifo,lfu,arc,s3fifo,twoq,kvheat,belady")
    ap.add_argument("--capacity", default="1M,3M,10M")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    caps = [parse_tokens(c) for c in a.capacity.split(",")]
    results = []
    for tname in a.trace.split(","):
        pt = prepared(tname)
        for pname in a.policies.split(","):
            row = []
            for cap in caps:
                r = replay(pt, pname, cap)
                results.append({"trace": tname, **r.as_dict()})
                row.append(f"{100 * r.hit_rate:6.2f}% ({r.seconds:.1f}s)")
            print(f"{tname:6s} {pname:10s} " + "  ".join(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
