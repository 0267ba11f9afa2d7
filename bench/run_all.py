"""`make bench`: the main jobs on their built-in defaults, each printing its table.

1. bench/engine/table.py (the engine on a multi-turn workload), when the engine is installed;
2. `kvheat replay` on the built-in workload, and on the shared Mooncake traces when present;
3. bench/cache/ops.py, the block-cache operation benchmark.
Results (JSON, PNG) land in results/<area>/ (git-ignored).

    python bench/run_all.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as `python bench/run_all.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench._lib import RESULTS, ROOT, TRACES


def run(*args: str) -> None:
    print(f"\n$ {' '.join(args)}", flush=True)
    subprocess.run(args, cwd=ROOT, check=True)


def main() -> None:
    cmd = [sys.executable, "-m", "kvheat.cli"]
    from kvheat.cache import policy_names

    policies = [p for p in ("lru", "fifo", "lfu", "arc", "s3fifo", "twoq", "kvheat", "belady")
                if p in policy_names()]
    replay = RESULTS / "replay"
    replay.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("torch") is not None:
        run(sys.executable, "bench/engine/table.py", "--json", str(RESULTS / "engine" / "table.json"))
    run(*cmd, "replay", "builtin", "--policy", ",".join(policies), "--no-misses",
        "--json", str(replay / "builtin.json"), "--plot", str(replay / "builtin.png"))
    for name in ("mooncake_conversation_part1", "mooncake_synthetic_trace"):
        trace = TRACES / f"{name}.jsonl"
        if trace.exists():
            run(*cmd, "replay", str(trace), "--policy", ",".join(policies),
                "--json", str(replay / f"{name}.json"), "--plot", str(replay / f"{name}.png"))
    run(sys.executable, "bench/cache/ops.py", "--json", str(RESULTS / "cache" / "ops.json"))


if __name__ == "__main__":
    main()
