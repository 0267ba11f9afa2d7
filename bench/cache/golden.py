"""Behaviour of a checkout, without timings, for a byte-for-byte compare across a refactor.

Records, as JSON files in OUT, what the cache decides on every shared trace (each eviction
policy at 1M/3M/10M tokens, 64-token blocks on the generator, `--hold` at a tenth of the
traffic's time scale), the cluster simulation (every router; a shared tier with the
overload guard) and the hit rates of vLLM's own offload manager under each policy. Every
field that is a time is dropped. Run it on two checkouts and diff the folders:

    python bench/cache/golden.py OUT_BEFORE --repo ../before-checkout
    python bench/cache/golden.py OUT_AFTER
    diff -r OUT_BEFORE OUT_AFTER    # compare the *.json, not the *.raw.json

`--only replay_conv,vllm` runs a subset; a full run takes 10-15 minutes of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/cache/golden.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import ROOT, TRACES

POLICIES = "lru,arc,s3fifo,twoq,belady,kvheat,lruk,fused,lfu,fifo"
TIMINGS = {"seconds", "wall_s", "elapsed", "time_s", "manager_s", "overhead_ratio_kvheat_arc"}


def untimed(o: Any) -> Any:
    """`o` without the fields that measure time (they differ on every run)."""
    if isinstance(o, dict):
        return {k: untimed(v) for k, v in o.items()
                if k not in TIMINGS and not k.startswith("us") and "seconds" not in k}
    if isinstance(o, list):
        return [untimed(v) for v in o]
    return o


def runs() -> list[tuple[str, list[str]]]:
    """(name, `kvheat` arguments) of every replay recorded."""
    traces = {"conv": TRACES / "mooncake_conversation_part1.jsonl",
              "synth": TRACES / "mooncake_synthetic_trace.jsonl",
              "agentic": TRACES / "agentic" / "agentic_dev.jsonl"}
    found = {n: str(p) for n, p in traces.items() if p.exists()} | {"builtin": "builtin"}
    out = []
    for n, t in found.items():
        out.append((f"replay_{n}", ["replay", t, "--policy", POLICIES]))
        out.append((f"replay_{n}_hold_ts", ["replay", t, "--policy", POLICIES, "--hold",
                                            "--time-scale", "0.1", "--limit", "2500",
                                            "--capacity", "1M,3M"]))
    # 64-token blocks: the generator only (the traces' block ids are 512-token blocks)
    out.append(("replay_builtin_b64", ["replay", "builtin", "--policy", POLICIES,
                                       "--block-tokens", "64", "--limit", "1500",
                                       "--capacity", "300K,1M"]))
    for n in ("conv", "agentic"):
        if n in found:
            out.append((f"cluster_{n}", ["replay", found[n], "--replicas", "4", "--capacity",
                                         "1M", "--limit", "2500"]))
            out.append((f"cluster_{n}_shared", ["replay", found[n], "--replicas", "3",
                                                "--capacity", "500K", "--limit", "2000",
                                                "--shared-capacity", "2M", "--overload-guard",
                                                "--policy", "lru"]))
    return out


def record(repo: Path, out: Path, name: str, cmd: list[str], raw: Path) -> bool:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    r = subprocess.run([sys.executable, *cmd], cwd=repo, env=env, capture_output=True, text=True)
    if r.returncode:
        print(f"{name}: FAILED\n{r.stderr[-2000:]}", flush=True)
        return False
    (out / f"{name}.json").write_text(json.dumps(untimed(json.loads(raw.read_text())),
                                                 indent=1, sort_keys=True))
    print(f"{name}: ok", flush=True)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout to record")
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    a = ap.parse_args()
    repo, out = a.repo.resolve(), a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, a.only.split(",")))
    ok = True
    for name, args in runs():
        if not only or name in only:
            raw = out / f"{name}.raw.json"
            ok &= record(repo, out, name, ["-m", "kvheat.cli", *args, "--json", str(raw)], raw)
    if not only or "vllm" in only:
        bench = repo / "bench" / "vllm" / "offload.py"
        if not bench.exists():  # a checkout from before bench/<area>/ (issue 38)
            bench = repo / "bench" / "vllm_offload.py"
        raw = out / "vllm.raw.json"
        ok &= record(repo, out, "vllm", [str(bench), "--limit", "2000", "--capacity", "1M,3M",
                                         "--time-scale", "0.1,1", "--traces",
                                         "conversation,synthetic,builtin,gen-d", "--policies",
                                         "lru,arc,kvheat,belady,kvheat-fixed", "--json",
                                         str(raw)], raw)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
