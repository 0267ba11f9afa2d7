"""Trace loading for the heat benchmarks, and a quick policy grid on the project replayer.

Every heat benchmark replays through `kvheat.replay.replay` on a `PreparedTrace` (keys
hashed once per trace; Belady's oracle and the miss breakdown come from the replayer), as
`kvheat replay` does.

    .venv/bin/python bench/heat_replay.py --trace conv --policies lru,twoq,kvheat
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from pathlib import Path

from kvheat.replay import PreparedTrace, parse_tokens, replay
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


@cache
def prepared(name: str) -> PreparedTrace:
    """The named trace with its keys computed once per process."""
    return PreparedTrace(get_trace(name), BLOCK)


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
