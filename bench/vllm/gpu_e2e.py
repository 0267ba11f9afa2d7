"""vLLM end to end on a GPU, once per offload cache policy: lru, arc, kvheat.

For each policy: start `vllm serve MODEL` (CUDA vLLM 0.32) with prefix caching, a small GPU
KV cache (so the offload tier matters) and the OffloadingConnector running that policy;
replay a multi-turn chat load (the built-in generator, shrunk) through the OpenAI API with
streaming; report mean / P50 / P99 time to first token, and the offload tier's hits from
the server's Prometheus metrics (`vllm:external_prefix_cache_hits` / `_queries`, the
tokens served by the connector). Prints a table and writes JSON (`--out`, default
results/vllm/gpu_e2e.json, the servers' logs beside it).

Skips (exit 0, says why) where there is no CUDA GPU or no vLLM: the project passes its tests
without one. Usage on a GPU machine:

    python bench/vllm/gpu_e2e.py --model Qwen/Qwen2.5-0.5B-Instruct --cpu-gb 4
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

if not __package__:  # run as `python bench/vllm/gpu_e2e.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.procs import stop, wait_ready

POLICIES = ("lru", "arc", "kvheat")


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    try:
        import httpx  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as e:
        return f"needs CUDA vLLM 0.32 and httpx: {e}"
    return None


def transfer_config(policy: str, cpu_bytes: int) -> dict:
    """The --kv-transfer-config JSON that runs `policy` in vLLM's CPU offloading tier."""
    from kvheat.integrations.vllm_replay import VLLM_OFFLOAD_POLICIES  # imports vLLM: only here

    name, module = VLLM_OFFLOAD_POLICIES[policy]
    extra: dict = {"cpu_bytes_to_use": cpu_bytes, "eviction_policy": name}
    if module:
        extra["cache_policy_module_path"] = module
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def _metrics(client, base: str) -> dict[str, float]:
    """Token counters of both prefix caches, summed over label sets."""
    out: dict[str, float] = {}
    names = ("external_prefix_cache_hits", "external_prefix_cache_queries",
             "prefix_cache_hits", "prefix_cache_queries")
    for line in client.get(f"{base}/metrics").text.splitlines():
        for name in names:
            if line.startswith("vllm:" + name) and "_created" not in line:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_policy(policy: str, a: argparse.Namespace, conversations: list[list[int]]) -> dict:
    import httpx

    port = a.port
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model,
           "--port", str(port), "--host", "127.0.0.1", "--enable-prefix-caching",
           "--gpu-memory-utilization", str(a.gpu_mem), "--max-model-len", str(a.max_len),
           "--kv-transfer-config", json.dumps(transfer_config(policy, int(a.cpu_gb * 1e9)))]
    log = Path(a.out).with_suffix(f".{policy}.log")
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, 900, log)
        with httpx.Client(timeout=600) as client:
            before = _metrics(client, base)
            ttft: list[float] = []
            history: list[list[int]] = [[] for _ in conversations]
            # Turn by turn across conversations, so other conversations run between two
            # turns of one (the reuse distance the offload tier is for).
            for turn in range(max(len(c) for c in conversations)):
                for ci, conv in enumerate(conversations):
                    if turn >= len(conv):
                        continue
                    history[ci] += [100 + (ci * 7919 + turn * 104729 + j) % 20000
                                    for j in range(conv[turn])]
                    body = {"model": a.model, "prompt": history[ci][-(a.max_len - 64):],
                            "max_tokens": a.output_tokens, "stream": True, "temperature": 0}
                    t0 = time.perf_counter()
                    first = None
                    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                        for line in r.iter_raw():
                            if first is None and b"data:" in line:
                                first = time.perf_counter() - t0
                    ttft.append(first if first is not None else float("nan"))
            after = _metrics(client, base)
    finally:
        stop(proc)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ttft.sort()
    return {"policy": policy, "requests": len(ttft), "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
            "offload_hit_tokens": delta.get("external_prefix_cache_hits", 0.0),
            "offload_query_tokens": delta.get("external_prefix_cache_queries", 0.0),
            "gpu_prefix_hit_tokens": delta.get("prefix_cache_hits", 0.0), "metrics": delta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    ap.add_argument("--policies", default="lru,arc,kvheat")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--cpu-gb", type=float, default=2.0, help="offload tier size")
    ap.add_argument("--gpu-mem", type=float, default=0.15, help="--gpu-memory-utilization")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", default=str(RESULTS / "vllm" / "gpu_e2e.json"))
    a = ap.parse_args()
    why = _skip_reason()
    if why:
        print(f"skipped: {why}")
        return
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    import random

    rng = random.Random(0)
    # Prompt growth per turn in tokens (system prompt + user turns), 2-6 turns each.
    conversations = [[rng.randint(600, 1500)] + [rng.randint(100, 400) for _ in range(rng.randint(1, 5))]
                     for _ in range(a.conversations)]
    rows = [run_policy(p, a, conversations) for p in a.policies.split(",")]
    print(f"{'policy':>8} {'requests':>8} {'TTFT mean':>10} {'P50':>8} {'P99':>8} "
          f"{'offload hits':>13} {'of queried':>11}")
    for r in rows:
        q = r["offload_query_tokens"] or float("nan")
        print(f"{r['policy']:>8} {r['requests']:>8} {r['ttft_mean_s'] * 1e3:>8.1f}ms "
              f"{r['ttft_p50_s'] * 1e3:>6.1f}ms {r['ttft_p99_s'] * 1e3:>6.1f}ms "
              f"{r['offload_hit_tokens']:>13.0f} {r['offload_hit_tokens'] / q:>10.1%}")
    Path(a.out).write_text(json.dumps({"model": a.model, "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
