"""A fresh `kvheat serve`'s first requests: TTFT of the first chat request and of the next
ones, each run from a new server process (what a replica that just joined a cluster, or
one restarted by its HPA, serves first). With `--baseline ROOT` (another checkout, e.g.
`git worktree add /tmp/base COMMIT`) the two source trees run alternately, A B A B.

    python bench/server/cold_start.py --runs 6
    python bench/server/cold_start.py --runs 6 --baseline /tmp/base

The model is the cluster bench's (a Llama of hidden 512, 4 layers, seeded random weights),
one torch thread. Prints a table and writes JSON (`--json`, default
results/server/cold_start.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

if not __package__:  # run as `python bench/server/cold_start.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, ROOT
from bench._lib.models import save_llama
from bench._lib.procs import free_port, stop, wait_ready


def first_ttfts(root: Path, model_dir: Path, requests: int) -> list[float]:
    """TTFT (s) of `requests` chat requests, one after another, to a new server run from
    the source tree `root`."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(root), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kvheat.server.cli", "serve", "--port", str(port),
           "--model", str(model_dir), "--served-model-name", "m", "--num-blocks", "160",
           "--threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        time.sleep(1.0)  # started and idle, as a replica is before its first request
        out = []
        for i in range(requests):
            body = {"model": "m", "stream": True, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": "You answer briefly. " * 8},
                                 {"role": "user", "content": f"question {i}: " + "why? " * 30}]}
            t = time.perf_counter()
            ttft = None
            with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                              timeout=60) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if ttft is None and line.startswith("data:"):
                        ttft = time.perf_counter() - t
            out.append(ttft if ttft is not None else float("nan"))
        return out
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=4, help="new server processes per tree")
    ap.add_argument("--requests", type=int, default=5, help="requests per server")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another source tree to run alternately with this one")
    ap.add_argument("--json", default=str(RESULTS / "server" / "cold_start.json"))
    args = ap.parse_args()
    trees = {"this": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory(prefix="kvheat-cold-") as tmp:
        model_dir = Path(tmp) / "model"
        save_llama(model_dir, 512, 4)
        runs: dict[str, list[list[float]]] = {k: [] for k in trees}
        for i in range(args.runs):
            for name, root in trees.items():
                ttfts = first_ttfts(root, model_dir, args.requests)
                runs[name].append(ttfts)
                print(f"run {i + 1} {name:9s} " + " ".join(f"{1000 * t:6.1f}" for t in ttfts)
                      + " ms", flush=True)

    def summary(xs: list[float]) -> dict[str, float]:
        return {"median_ms": 1000 * statistics.median(xs), "min_ms": 1000 * min(xs),
                "max_ms": 1000 * max(xs)}

    rows = {}
    print("\n| tree | first request TTFT ms | later requests TTFT ms |\n|---|---:|---:|")
    for name, rs in runs.items():
        first = summary([r[0] for r in rs])
        later = summary([t for r in rs for t in r[1:]])
        rows[name] = {"first": first, "later": later, "runs": rs}
        print(f"| {name} | {first['median_ms']:.0f} ({first['min_ms']:.0f} – "
              f"{first['max_ms']:.0f}) | {later['median_ms']:.0f} ({later['min_ms']:.0f} – "
              f"{later['max_ms']:.0f}) |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": vars(args) | {
        "baseline": str(args.baseline) if args.baseline else None}, "trees": rows},
        indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
