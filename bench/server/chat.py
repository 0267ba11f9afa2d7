"""Multi-turn chat through the servers, kvheat against vLLM's CPU build side by side.

32 conversations x 4 turns on one shared system prompt of about 300 tokens, streaming,
8 conversations in flight, greedy, the same model directory on both servers (the built-in
tiny Llama, or `--model wide`: a Llama of TinyLlama's width, hidden 2048, 2 layers, seeded
random weights). Both servers run at float32 with the same threads and batch limits
(bench/_lib/peers.py) and stay up for the whole run; the repeats alternate kvheat, vLLM,
kvheat, vLLM ... with a fresh system prompt and fresh questions for each repeat (both
servers see the same ones). Per run: wall time, TTFT mean / P50 / P99 over all turns,
prompt tokens served from cache (the servers' own usage counts), and whether the two
servers' completions are the same; ratios are kvheat / vLLM of the runs of one repeat,
reported as median and range. The idle server's CPU time during the other's run is
recorded (it must stay near zero for the comparison to be fair).

    .venv/bin/python bench/server/chat.py [--model tiny|wide] [--repeats 3] [--json results/server/chat.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run as `python bench/server/chat.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.load import Conversation, LoadSpec, UserTurn, from_list, run_conversations
from bench._lib.models import save_wide_model
from bench._lib.peers import NO_VLLM, check_quiet, find_vllm_python, fmt_ratio, paired_ratio, spread
from bench._lib.procs import (
    cpu_seconds,
    free_port,
    start_kvheat_server,
    start_vllm_server,
    stop,
    wait_ready,
)
from bench._lib.report import write_json
from kvheat.engine.loader import save_tiny_model

_TEXT = ("the cache keeps hot blocks on the device while cold ones move to host memory "
         "disk or redis and every request that shares a prefix reuses its keys and values "
         "so the first token comes sooner monday tuesday wednesday thursday friday saturday "
         "sunday paris france weather rain sunny wind python code print hello world answer "
         "question summary travel guide seven days numbers one two three four five")
WORDS = _TEXT.split(" ")


def conversation_plan(seed: int, conversations: int, turns: int) -> dict[str, Any]:
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(230))  # ~300 tokens of the tiny BPE
    questions = [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(18, 30)))
                  for _ in range(turns)] for _ in range(conversations)]
    return {"system": system, "questions": questions}


async def run_chat(base: str, plan: dict[str, Any], concurrency: int,
                   max_tokens: int) -> dict[str, Any]:
    convs = [Conversation(c, plan["system"], [UserTurn(q) for q in qs])
             for c, qs in enumerate(plan["questions"])]
    limits = httpx.Limits(max_connections=concurrency + 2, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0),
                                 limits=limits) as http:
        t0 = time.perf_counter()
        replies = await run_conversations(base, from_list(convs), concurrency,
                                          LoadSpec("tiny", max_tokens), http=http)
        wall = time.perf_counter() - t0
    failed = [r.error for r in replies if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} turns failed, the first: {failed[0]}")
    turns = {(r.conv, r.turn): r for r in replies}
    order = sorted(turns)
    ttft = np.array([turns[k].ttft for k in order if turns[k].ttft is not None])
    prompt = sum(turns[k].prompt_tokens for k in order)
    cached = sum(turns[k].cached_tokens for k in order)
    return {"wall_s": wall, "turns": len(order), "ttft_mean_s": float(ttft.mean()),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_fraction": cached / prompt if prompt else 0.0,
            "texts": [turns[k].text for k in order]}


def make_model(kind: str, tmp: str) -> str:
    if kind == "tiny":
        return str(save_tiny_model(Path(tmp) / "tiny-llama"))
    return str(save_wide_model(Path(tmp) / "wide-llama", 2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "wide"], default="tiny")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (A B A B ...)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads, both servers")
    ap.add_argument("--batched-tokens", type=int, default=2048,
                    help="tokens per step, both servers (vLLM's server default on CPU)")
    ap.add_argument("--num-blocks", type=int, default=8192, help="kvheat's device blocks")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", default=str(RESULTS / "server" / "chat.json"))
    a = ap.parse_args()
    vllm_python = find_vllm_python(a.vllm_python)
    if vllm_python is None:
        print(f"{NO_VLLM}: nothing to compare", file=sys.stderr)
        return 0
    report: dict[str, Any] = {"args": vars(a), "vllm_python": vllm_python}
    check_quiet(report, "start")
    with tempfile.TemporaryDirectory(prefix="kvheat-chat-") as tmp:
        model_dir = make_model(a.model, tmp)
        kport, vport = free_port(), free_port()
        klog, vlog = Path(tmp) / "kvheat.log", Path(tmp) / "vllm.log"
        kproc = start_kvheat_server(model_dir, kport, klog, a.threads, a.concurrency,
                                    a.batched_tokens, a.num_blocks)
        vproc = start_vllm_server(vllm_python, model_dir, vport, vlog, tmp, a.threads,
                                  a.concurrency, a.batched_tokens)
        servers = {"kvheat": (f"http://127.0.0.1:{kport}", kproc),
                   "vllm": (f"http://127.0.0.1:{vport}", vproc)}
        runs: dict[str, list[dict[str, Any]]] = {"kvheat": [], "vllm": []}
        try:
            wait_ready(servers["kvheat"][0], kproc, 180, klog)
            wait_ready(servers["vllm"][0], vproc, 600, vlog)
            # Warm both up (first-call costs) with a conversation of their own.
            for base, _ in servers.values():
                asyncio.run(run_chat(base, conversation_plan(999, 2, 2), 2, 4))
            for rep in range(a.repeats):
                plan = conversation_plan(rep, a.conversations, a.turns)
                for name, (base, _) in servers.items():
                    other = servers["vllm" if name == "kvheat" else "kvheat"][1]
                    idle0 = cpu_seconds(other.pid, tree=True)
                    res = asyncio.run(run_chat(base, plan, a.concurrency, a.max_tokens))
                    res["idle_peer_cpu_s"] = cpu_seconds(other.pid, tree=True) - idle0
                    runs[name].append(res)
                    print(f"repeat {rep} {name}: wall {res['wall_s']:.2f} s, TTFT mean "
                          f"{1000 * res['ttft_mean_s']:.1f} ms, P99 {1000 * res['ttft_p99_s']:.1f} ms, "
                          f"cached {100 * res['cached_fraction']:.1f}%, idle peer used "
                          f"{res['idle_peer_cpu_s']:.2f} CPU s", flush=True)
        finally:
            for _, proc in servers.values():
                stop(proc)
    check_quiet(report, "end", after_own_run=True)
    summary: dict[str, Any] = {}
    for metric in ("wall_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "cached_fraction"):
        summary[metric] = {"kvheat": spread(r[metric] for r in runs["kvheat"]),
                           "vllm": spread(r[metric] for r in runs["vllm"]),
                           "ratio": paired_ratio([r[metric] for r in runs["kvheat"]],
                                                 [r[metric] for r in runs["vllm"]])}
    same = [sum(x == y for x, y in zip(rk["texts"], rv["texts"], strict=True))
            for rk, rv in zip(runs["kvheat"], runs["vllm"], strict=True)]
    summary["same_completions"] = {"per_repeat": same, "turns": runs["kvheat"][0]["turns"]}
    report["summary"] = summary
    report["runs"] = runs
    print(f"\nmulti-turn chat, {a.model} model, {a.conversations} conversations x {a.turns} turns, "
          f"{a.concurrency} in flight, {a.repeats} interleaved repeats (kvheat / vLLM, median "
          f"and range; below 1 is better):")
    print(f"{'measure':<22} {'kvheat':>10} {'vLLM':>10} {'ratio':>20}")
    for metric, label, scale in (("wall_s", "wall time (s)", 1), ("ttft_mean_s", "TTFT mean (ms)", 1000),
                                 ("ttft_p50_s", "TTFT P50 (ms)", 1000),
                                 ("ttft_p99_s", "TTFT P99 (ms)", 1000),
                                 ("cached_fraction", "prompt tokens cached", 100)):
        m = summary[metric]
        print(f"{label:<22} {scale * m['kvheat']['median']:>10.1f} {scale * m['vllm']['median']:>10.1f} "
              f"{fmt_ratio(m['ratio']):>20}")
    print(f"identical completions: {same} of {summary['same_completions']['turns']} turns per repeat")
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
