"""`make bench`: the main jobs on their built-in defaults, each printing its table.

1. bench/engine_bench.py (the engine on a multi-turn workload), when the engine is installed;
2. `kvheat replay` on the built-in workload, and on the shared Mooncake traces when present;
3. the block-cache operation benchmark.
Results (JSON, PNG) land in results/.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
OUT = ROOT / "results"


def run(*args: str) -> None:
    print(f"\n$ {' '.join(args)}", flush=True)
    subprocess.run(args, cwd=ROOT, check=True)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "kvheat.cli"]
    from kvheat.cache import policy_names

    policies = [p for p in ("lru", "fifo", "lfu", "arc", "s3fifo", "twoq", "kvheat", "belady")
                if p in policy_names()]
    if importlib.util.find_spec("torch") is not None:
        run(sys.executable, "bench/engine_bench.py", "--json", str(OUT / "engine_bench.json"))
    run(*cmd, "replay", "builtin", "--policy", ",".join(policies), "--no-misses",
        "--json", str(OUT / "replay_builtin.json"), "--plot", str(OUT / "replay_builtin.png"))
    for name in ("mooncake_conversation_part1", "mooncake_synthetic_trace"):
        trace = TRACES / f"{name}.jsonl"
        if trace.exists():
            run(*cmd, "replay", str(trace), "--policy", ",".join(policies),
                "--json", str(OUT / f"replay_{name}.json"), "--plot", str(OUT / f"replay_{name}.png"))
    run(sys.executable, "bench/cache_ops.py", "--json", str(OUT / "cache_ops.json"))


if __name__ == "__main__":
    main()
