"""Load test of `kvheat serve` on loopback: N concurrent clients running multi-turn chats
(streaming, a few shared system prompts, 2-4 turns each) for a fixed time.

Reports errors (the target is zero), throughput (requests/s, generated tokens/s), P50/P99
TTFT and end-to-end latency measured by the clients, the server's prefix hit rate, and the
server's resident memory over time (flat after warm-up: growth in the second half of the
run against the end of warm-up). With `--peer vllm` the same load runs against vLLM's
CPU OpenAI server on the same model directory, and the ratios are printed.

    python bench/load.py                          # 64 clients, 60 s, built-in tiny Llama
    python bench/load.py --clients 8 --duration 10
    python bench/load.py --peer vllm --vllm-python /tmp/vllm/bin/python

Writes a JSON report (`--json`, default results/load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent

SYSTEM_PROMPTS = [
    "You are a helpful assistant. Please answer the question below in one short paragraph. "
    "Hot blocks stay on the device, warm ones move to host memory, cold ones go to disk.",
    "You summarise conversations. The user asked about the weather; the assistant said it "
    "would rain in the afternoon and be sunny tomorrow morning, with a light wind.",
    "You write Python. def main(): print('hello, world') return 0. Answer with code only, "
    "and keep every answer shorter than ten lines.",
    "You are a travel guide. Paris is the capital of France. There are seven days in a week: "
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
]
QUESTIONS = [
    "What is the capital of France?", "How many days are in a week?",
    "Summarise the following conversation.", "What does the cache keep?",
    "Why do hot blocks stay on the device?", "Print hello world in Python.",
    "What will the weather be tomorrow morning?", "Name the days of the week.",
]


@dataclass
class Sample:
    start: float
    ttft: float | None
    e2e: float
    tokens: int
    cached: int
    prompt: int
    error: str | None = None


@dataclass
class RunResult:
    name: str
    clients: int
    duration_s: float
    warmup_s: float
    samples: list[Sample] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)
    server_hit_rate: float | None = None

    def summary(self) -> dict[str, Any]:
        measured = [s for s in self.samples if s.start >= self.warmup_s]
        ok = [s for s in measured if s.error is None]
        window = self.duration_s - self.warmup_s
        ttft = np.array([s.ttft for s in ok if s.ttft is not None])
        e2e = np.array([s.e2e for s in ok])
        prompt = sum(s.prompt for s in ok)

        def pct(a: np.ndarray, q: float) -> float | None:
            return float(np.percentile(a, q)) if a.size else None

        rss = [m for t, m in self.rss_mb if t >= self.warmup_s]
        half = [m for t, m in self.rss_mb if t >= self.warmup_s + window / 2]
        base = rss[0] if rss else None
        return {
            "name": self.name, "clients": self.clients, "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "requests": len(measured), "errors": len(measured) - len(ok),
            "errors_total": sum(1 for s in self.samples if s.error is not None),
            "error_examples": sorted({s.error for s in self.samples if s.error})[:5],
            "requests_per_s": len(ok) / window if window > 0 else None,
            "tokens_per_s": sum(s.tokens for s in ok) / window if window > 0 else None,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
            "client_cached_fraction": sum(s.cached for s in ok) / prompt if prompt else None,
            "server_hit_rate": self.server_hit_rate,
            "rss_mib_after_warmup": base, "rss_mib_max_second_half": max(half) if half else None,
            "rss_growth_pct_second_half": (100 * (max(half) - base) / base
                                           if half and base else None),
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process and its children (vLLM runs its engine in one)."""
    total = 0.0
    pids = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total or None


async def one_client(http: httpx.AsyncClient, model: str, cid: int, t0: float, deadline: float,
                     max_tokens: int, out: list[Sample], rng: random.Random) -> None:
    while time.perf_counter() < deadline:
        system = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
        for turn in range(rng.randint(2, 4)):
            if time.perf_counter() >= deadline:
                return
            msgs.append({"role": "user",
                         "content": f"[{cid}.{turn}] " + QUESTIONS[rng.randrange(len(QUESTIONS))]})
            body = {"model": model, "messages": msgs, "max_tokens": max_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}, "user": f"user-{cid}"}
            start = time.perf_counter()
            ttft = None
            text: list[str] = []
            usage: dict[str, Any] = {}
            err = None
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        err = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                err = str(ev["error"])[:200]
                                break
                            if ev.get("usage"):
                                usage = ev["usage"]
                            for ch in ev.get("choices") or []:
                                delta = ch.get("delta") or {}
                                if delta.get("content") or ch.get("finish_reason"):
                                    if ttft is None:
                                        ttft = time.perf_counter() - start
                                    text.append(delta.get("content") or "")
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                err = f"{type(e).__name__}: {e}"[:200]
            end = time.perf_counter()
            details = usage.get("prompt_tokens_details") or {}
            out.append(Sample(start - t0, ttft, end - start, int(usage.get("completion_tokens", 0)),
                              int(details.get("cached_tokens") or 0),
                              int(usage.get("prompt_tokens", 0)), err))
            if err is not None:
                break  # a new conversation
            msgs.append({"role": "assistant", "content": "".join(text)})


async def run_load(name: str, base: str, model: str, pid: int, clients: int, duration: float,
                   warmup: float, max_tokens: int, seed: int) -> RunResult:
    res = RunResult(name, clients, duration, warmup)
    # Idle connections expire on the client first (uvicorn closes them after 5 s): reusing
    # one the server is closing at that moment fails with a ReadError that is no server fault.
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0),
                                 limits=limits) as http:
        t0 = time.perf_counter()
        deadline = t0 + duration
        stop = asyncio.Event()

        async def sample_rss() -> None:
            while not stop.is_set():
                m = rss_mib(pid)
                if m is not None:
                    res.rss_mb.append((time.perf_counter() - t0, m))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

        sampler = asyncio.create_task(sample_rss())
        rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
        await asyncio.gather(*(one_client(http, model, i, t0, deadline, max_tokens, res.samples,
                                          rngs[i]) for i in range(clients)))
        res.duration_s = time.perf_counter() - t0  # the last requests finish after the deadline
        stop.set()
        await sampler
        try:
            text = (await http.get("/metrics")).text
            res.server_hit_rate = _hit_rate(text)
        except httpx.HTTPError:
            pass
    return res


def _hit_rate(metrics_text: str) -> float | None:
    cached = prompt = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("kvheat_cached_tokens_total{"):
            cached += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvheat_prompt_tokens_total{"):
            prompt += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total") or \
                line.startswith("vllm:prefix_cache_hits{"):
            cached += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total") or \
                line.startswith("vllm:prefix_cache_queries{"):
            prompt += float(line.rsplit(" ", 1)[1])
    return cached / prompt if prompt else None


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def start_kvheat(args: argparse.Namespace, model_dir: str | None, port: int,
                 log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvheat.server.cli", "serve", "--port", str(port),
           "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.clients),
           "--max-num-batched-tokens", str(args.batched_tokens), "--log-level", "warning"]
    if model_dir:
        cmd += ["--model", model_dir, "--served-model-name", "tiny"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.policy:
        cmd += ["--policy", args.policy]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def start_vllm(args: argparse.Namespace, model_dir: str, port: int, tmp: str,
               log: Path) -> subprocess.Popen[bytes]:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--enable-prefix-caching", "--max-model-len", "2048",
           "--max-num-seqs", str(args.clients)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_CACHE_ROOT=os.path.join(tmp, "vllm-cache"), TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "all"
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def bench_one(name: str, proc: subprocess.Popen[bytes], base: str, model: str,
              args: argparse.Namespace, ready_s: float) -> RunResult:
    try:
        wait_ready(base, proc, ready_s)
        return asyncio.run(run_load(name, base, model, proc.pid, args.clients, args.duration,
                                    args.warmup, args.max_tokens, args.seed))
    finally:
        stop_proc(proc)


def fmt(x: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if x is None else format(x * scale, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'server':<8} {'clients':>7} {'req':>6} {'err':>4} {'req/s':>7} {'tok/s':>7} "
            f"{'TTFT P50 ms':>11} {'TTFT P99 ms':>11} {'E2E P99 ms':>10} {'hit rate':>8} "
            f"{'RSS MiB':>8} {'RSS growth':>10}")
    print(head)
    for r in rows:
        print(f"{r['name']:<8} {r['clients']:>7} {r['requests']:>6} {r['errors']:>4} "
              f"{fmt(r['requests_per_s'], 1, '.2f'):>7} {fmt(r['tokens_per_s']):>7} "
              f"{fmt(r['ttft_p50_s'], 1000):>11} {fmt(r['ttft_p99_s'], 1000):>11} "
              f"{fmt(r['e2e_p99_s'], 1000):>10} {fmt(r['server_hit_rate'], 100):>7}% "
              f"{fmt(r['rss_mib_after_warmup']):>8} "
              f"{fmt(r['rss_growth_pct_second_half'], 1, '+.1f'):>9}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds excluded from the figures (default: a sixth of the run)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    ap.add_argument("--policy", default=None, help="kvheat's eviction policy (default lru)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="also run the same load against this peer server")
    ap.add_argument("--vllm-python", default="/tmp/vllm/bin/python")
    ap.add_argument("--json", default=str(ROOT / "results" / "load.json"))
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = args.duration / 6
    with tempfile.TemporaryDirectory(prefix="kvheat-load-") as tmp:
        model_dir = None
        if args.peer == "vllm":
            if not Path(args.vllm_python).exists():
                print(f"vLLM not found at {args.vllm_python}: skipping the peer run",
                      file=sys.stderr)
                args.peer = None
            else:
                from kvheat.engine.loader import save_tiny_model

                model_dir = str(save_tiny_model(Path(tmp) / "tiny-llama"))
        results: list[RunResult] = []
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = Path(tmp) / "kvheat.log"
        proc = start_kvheat(args, model_dir, port, log)
        model = "tiny" if model_dir else "kvheat-tiny-llama"
        print(f"kvheat: {args.clients} clients x {args.duration:.0f} s ...", file=sys.stderr)
        try:
            results.append(bench_one("kvheat", proc, base, model, args, 120))
        except RuntimeError as e:
            print(f"kvheat failed: {e}\n{log.read_text()[-3000:]}", file=sys.stderr)
            return 1
        if any(s.error for s in results[-1].samples):
            print(f"kvheat had errors; its log ends:\n{log.read_text()[-3000:]}", file=sys.stderr)
        if args.peer == "vllm" and model_dir:
            port = free_port()
            vlog = Path(tmp) / "vllm.log"
            vproc = start_vllm(args, model_dir, port, tmp, vlog)
            print("vLLM: starting (about 35 s) ...", file=sys.stderr)
            try:
                results.append(bench_one("vllm", vproc, f"http://127.0.0.1:{port}", "tiny", args,
                                         300))
            except RuntimeError as e:
                print(f"vLLM failed: {e}\n{vlog.read_text()[-3000:]}", file=sys.stderr)
    rows = [r.summary() for r in results]
    print_table(rows)
    report: dict[str, Any] = {"runs": rows, "args": vars(args),
                              "rss_series": {r.name: r.rss_mb for r in results}}
    if len(rows) == 2:
        k, v = rows

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        report["kvheat_over_vllm"] = {
            "requests_per_s": ratio(k["requests_per_s"], v["requests_per_s"]),
            "tokens_per_s": ratio(k["tokens_per_s"], v["tokens_per_s"]),
            "ttft_p50": ratio(k["ttft_p50_s"], v["ttft_p50_s"]),
            "ttft_p99": ratio(k["ttft_p99_s"], v["ttft_p99_s"]),
        }
        rr = report["kvheat_over_vllm"]
        print("kvheat / vLLM: throughput x" + fmt(rr["tokens_per_s"], 1, ".2f")
              + ", TTFT P50 x" + fmt(rr["ttft_p50"], 1, ".2f")
              + ", TTFT P99 x" + fmt(rr["ttft_p99"], 1, ".2f") + " (lower TTFT is better)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["errors_total"] == 0 for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
