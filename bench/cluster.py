"""A real cluster on this machine: 3 `kvheat serve` replicas sharing one 3-node Redis
Cluster as their lower KV tier, behind each router in turn, under the same multi-turn,
multi-tenant chat load; then one replica killed under load.

Routers: round robin and cache_aware from `sglang-router` (its `smg` binary, in its own
venv: `--smg PATH`; those rows are skipped without it), and `kvheat route`. Every round
starts from fresh replicas and an empty Redis, and the rounds are interleaved (rr, sglang,
kvheat, rr, sglang, kvheat, ...), so the machine's noise falls on all alike; the table
shows the median and the range over rounds.

Measured per router: prefix hit rate (the replicas' usage: cached / prompt tokens), TTFT
P50 / P99 and request throughput at the client, per-replica requests and prefill tokens
(max/mean); then with a replica SIGKILLed a third of the way into the load: requests that
failed, hung (no answer within the client's timeout) or answered wrong (a completion
different from the no-failure run: greedy decoding is deterministic), and the time from
the kill to the last failure; then the replica restarted: the time until it serves again.
Last, the router's own cost: the same small request straight to a replica and through
each router, interleaved, P50 difference.

    python bench/cluster.py --smg /tmp/sglr/bin/smg          # the whole run (~10 min)
    python bench/cluster.py --rounds 1 --conversations 12    # a quick look

Writes results/cluster.json (`--json`) and a plot (`--plot`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "cluster-llama"
SECRET = "kvheat-bench-cluster-tier-secret"
TENANTS = {"acme": "sk-acme", "globex": "sk-globex", "initech": "sk-initech"}
# System prompts are shared across tenants (as a framework's default prompt is): the same
# text, but each tenant's KV is salted apart, so text alone says nothing about what a
# replica holds for a given tenant.
SYSTEM_PROMPTS = [
    "You are a support assistant. Answer about orders, refunds and shipping in two "
    "sentences. Orders ship within two days; refunds take five days. " * 3,
    "You are a coding helper. Answer with short Python snippets only. Keep every function "
    "under ten lines and name variables clearly. " * 3,
    "You are a travel guide. Paris is the capital of France; Rome of Italy; Madrid of "
    "Spain. Answer in one short paragraph. " * 3,
    "You summarise meetings. Keep decisions, owners and dates; drop small talk. Answer as "
    "a bullet list of at most five items. " * 3,
]
QUESTIONS = ["What should I do next?", "Can you explain that again, more briefly?",
             "What is the most important point?", "Give me an example.",
             "How long will it take?", "Is there anything I forgot?"]


def free_port(pair: bool = False) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if not pair:
            return p
        if p + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port")


# ---- the model -------------------------------------------------------------------------------
def make_model(path: Path, hidden: int, layers: int) -> None:
    """A Llama wider than the built-in tiny one (so a prefill costs what a cache saves),
    seeded random weights, the tiny tokenizer; saved as a Hugging Face directory."""
    from kvheat.engine.config import ModelConfig
    from kvheat.engine.loader import Tokenizer, build_model, init_random_weights, save_model

    cfg = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=hidden,
                      intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      head_dim=64, max_position_embeddings=4096, rope_theta=10000.0,
                      bos_token_id=0, eos_token_id=1)
    model = build_model(cfg)
    init_random_weights(model, 0)
    save_model(model, Tokenizer.tiny(1024), path)


# ---- processes -------------------------------------------------------------------------------
class RedisCluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ports = [free_port(pair=True) for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise SystemExit("redis-server and redis-cli are needed (apt-get install redis-server)")
        for i, p in enumerate(self.ports):
            d = self.workdir / f"redis{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.procs.append(subprocess.Popen(
                [binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in self.ports:
            _wait(lambda p=p: subprocess.run([cli, "-p", str(p), "ping"], capture_output=True,
                                             text=True).stdout.strip() == "PONG", 10)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)
        _wait(lambda: "cluster_state:ok" in subprocess.run(
            [cli, "-p", str(self.ports[0]), "cluster", "info"], capture_output=True,
            text=True).stdout, 30)

    def flush(self) -> None:
        cli = shutil.which("redis-cli")
        for p in self.ports:
            subprocess.run([cli, "-p", str(p), "flushall"], capture_output=True)  # type: ignore[list-item]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)


def _wait(cond: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.1)


@dataclass
class Replica:
    port: int
    events: int
    replay: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replica(r: Replica, args: argparse.Namespace, model_dir: Path, config: Path,
                  redis_url: str, log: Path) -> None:
    cmd = [sys.executable, "-m", "kvheat.server.cli", "serve", "--port", str(r.port),
           "--model", str(model_dir), "--served-model-name", MODEL, "--config", str(config),
           "--num-blocks", str(args.num_blocks), "--threads", "1", "--max-num-seqs", "8",
           "--redis-tier-url", redis_url, "--redis-cluster", "--redis-tier-size", "512MiB",
           "--kv-events-endpoint", f"tcp://127.0.0.1:{r.events}",
           "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{r.replay}",
           "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVHEAT_TIER_SECRET=SECRET,
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    r.proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become ready")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_router(kind: str, port: int, replicas: list[Replica], args: argparse.Namespace,
                 model_dir: Path, config: Path, log: Path) -> subprocess.Popen[bytes]:
    urls = [r.url for r in replicas]
    if kind == "kvheat":
        cmd = [sys.executable, "-m", "kvheat.cli", "route", "--port", str(port), "--model",
               str(model_dir), "--config", str(config), "--health-interval", "0.5",
               "--log-level", "warning"]
        for u in urls:
            cmd += ["--replica", u]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    else:
        policy = "round_robin" if kind == "rr" else "cache_aware"
        cmd = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
               *urls, "--policy", policy, "--health-check-interval-secs", "1",
               "--prometheus-port", str(free_port()), "--log-level", "warn"]
        env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


# ---- the load --------------------------------------------------------------------------------
@dataclass
class Turn:
    conv: int
    turn: int
    tenant: str
    messages: list[dict[str, str]]


def workload(n_conv: int, turns: int, seed: int) -> list[list[Turn]]:
    """Conversations of `turns` turns; the history holds fixed assistant answers, so a
    prompt never depends on what a replica generated (and every router sees the same)."""
    rng = random.Random(seed)
    convs = []
    names = list(TENANTS)
    for c in range(n_conv):
        tenant = names[c % len(names)]
        sysp = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
        msgs = [{"role": "system", "content": sysp}]
        conv = []
        for t in range(turns):
            q = f"[{c}] {rng.choice(QUESTIONS)} " + " ".join(
                rng.choice(QUESTIONS) for _ in range(rng.randint(1, 3)))
            msgs = msgs + [{"role": "user", "content": q}]
            conv.append(Turn(c, t, tenant, list(msgs)))
            msgs = msgs + [{"role": "assistant", "content": f"Answer {t} to conversation {c}: "
                            + rng.choice(QUESTIONS)}]
        convs.append(conv)
    return convs


def fresh_prompts(n: int) -> list[list[Turn]]:
    """One-turn requests on prompts nobody has sent before (a restarted replica has no
    cache, so only new prefixes show where a router places fresh work)."""
    return [[Turn(10_000 + i, 0, "acme", [
        {"role": "system", "content": f"Session {i}: you are a new assistant with new rules. "
                                      * 4},
        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])] for i in range(n)]


@dataclass
class Result:
    conv: int
    turn: int
    start: float
    end: float
    ttft: float | None = None
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    status: str = "ok"  # ok, error, hung
    replica: str | None = None  # as kvheat route reports it (x-kvheat-replica)


async def one_request(http: httpx.AsyncClient, base: str, t: Turn, max_tokens: int,
                      timeout_s: float, t0: float) -> Result:
    res = Result(t.conv, t.turn, time.perf_counter() - t0, 0.0)
    body = {"model": MODEL, "messages": t.messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {TENANTS[t.tenant]}"}
    start = time.perf_counter()

    async def go() -> None:
        async with http.stream("POST", base + "/v1/chat/completions", json=body,
                               headers=headers) as r:
            res.replica = r.headers.get("x-kvheat-replica")
            if r.status_code != 200:
                await r.aread()
                res.status = "error"
                return
            buf = b""
            done = False
            async for chunk in r.aiter_bytes():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        res.status = "error"
                        continue
                    if d.get("usage"):
                        u = d["usage"]
                        res.prompt_tokens = u["prompt_tokens"]
                        res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0) or 0
                    for c in d.get("choices", []):
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            if res.ttft is None:
                                res.ttft = time.perf_counter() - start
                            res.text += piece
            if not done:
                res.status = "error"

    try:
        await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        res.status = "hung"
    except (httpx.HTTPError, json.JSONDecodeError):
        res.status = "error"
    res.end = time.perf_counter() - t0
    return res


async def run_load(base: str, convs: list[list[Turn]], clients: int, max_tokens: int,
                   timeout_s: float, on_progress: Any = None) -> tuple[list[Result], float]:
    queue: asyncio.Queue[list[Turn]] = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    results: list[Result] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + 5)) as http:
            while not queue.empty():
                conv = queue.get_nowait()
                for t in conv:
                    r = await one_request(http, base, t, max_tokens, timeout_s, t0)
                    results.append(r)
                    if on_progress is not None:
                        on_progress(len(results))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.perf_counter() - t0


def replica_load(replicas: list[Replica]) -> list[dict[str, float]]:
    out = []
    for r in replicas:
        try:
            text = httpx.get(r.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            out.append({"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            continue
        m = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
        for line in text.splitlines():
            for name, key in (("kvheat_requests_total", "requests"),
                              ("kvheat_prompt_tokens_total", "prompt_tokens"),
                              ("kvheat_cached_tokens_total", "cached_tokens")):
                if line.startswith(name + "{"):
                    m[key] += float(line.rsplit(" ", 1)[1])
        out.append(m)
    return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def max_over_mean(xs: list[float]) -> float | None:
    m = sum(xs) / len(xs) if xs else 0
    return max(xs) / m if m else None


@dataclass
class Round:
    router: str
    round: int
    hit_rate: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    requests_per_s: float
    errors: int
    per_replica: list[dict[str, float]] = field(default_factory=list)
    imbalance_requests: float | None = None
    imbalance_prefill: float | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)  # per request, for analysis


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.model_dir = tmp / "model"
        make_model(self.model_dir, args.hidden, args.layers)
        self.config = tmp / "tenants.toml"
        self.config.write_text("".join(f'[[tenants]]\nname = "{n}"\napi_keys = ["{k}"]\n\n'
                                       for n, k in TENANTS.items()))
        self.redis = RedisCluster(tmp)
        self.replicas = [Replica(free_port(), free_port(), free_port()) for _ in range(3)]
        self.log = tmp / "logs"
        self.log.mkdir()

    def fresh_replicas(self) -> None:
        for r in self.replicas:
            stop(r.proc)
        self.redis.flush()
        for i, r in enumerate(self.replicas):
            start_replica(r, self.args, self.model_dir, self.config, self.redis.url,
                          self.log / f"replica{i}.log")
        for r in self.replicas:
            wait_http(r.url, r.proc)

    def router(self, kind: str) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        proc = start_router(kind, port, self.replicas, self.args, self.model_dir, self.config,
                            self.log / f"router-{kind}.log")
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http(base, proc, 60)
        except RuntimeError:
            print((self.log / f"router-{kind}.log").read_text()[-3000:], file=sys.stderr)
            raise
        if kind == "kvheat":  # every replica in rotation and subscribed
            _wait(lambda: _healthy_count(base) == len(self.replicas), 60)
        time.sleep(1.0)
        return proc, base

    def one_round(self, kind: str, k: int, convs: list[list[Turn]]) -> tuple[Round, list[Result]]:
        self.fresh_replicas()
        proc, base = self.router(kind)
        try:
            results, wall = asyncio.run(run_load(base, convs, self.args.clients,
                                                 self.args.max_tokens, self.args.timeout))
        finally:
            stop(proc)
        loads = replica_load(self.replicas)
        ok = [r for r in results if r.status == "ok"]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        rd = Round(kind, k, cached / prompt if prompt else 0.0, pct(ttfts, 0.5),
                   pct(ttfts, 0.99), len(ok) / wall, len(results) - len(ok), loads,
                   max_over_mean([x["requests"] for x in loads]),
                   max_over_mean([x["prompt_tokens"] - x["cached_tokens"] for x in loads]),
                   [{"conv": r.conv, "turn": r.turn, "start": round(r.start, 3),
                     "ttft": None if r.ttft is None else round(r.ttft, 4),
                     "prompt": r.prompt_tokens, "cached": r.cached_tokens,
                     "replica": r.replica, "status": r.status} for r in results])
        print(f"  {kind:8s} round {k}: hit {rd.hit_rate:.1%}  TTFT p50 "
              f"{1000 * (rd.ttft_p50_s or 0):.0f} ms p99 {1000 * (rd.ttft_p99_s or 0):.0f} ms  "
              f"{rd.requests_per_s:.2f} req/s  errors {rd.errors}  req max/mean "
              f"{rd.imbalance_requests or 0:.2f}  prefill max/mean {rd.imbalance_prefill or 0:.2f}",
              flush=True)
        return rd, results

    def kill_round(self, kind: str, convs: list[list[Turn]],
                   reference: dict[tuple[int, int], str]) -> dict[str, Any]:
        """Kill replica 0 a third of the way into the load, restart it at two thirds."""
        self.fresh_replicas()
        proc, base = self.router(kind)
        total = sum(len(c) for c in convs)
        victim = self.replicas[0]
        marks: dict[str, float] = {}
        t0 = time.perf_counter()

        def progress(n: int) -> None:
            if "kill" not in marks and n >= total // 3:
                marks["kill"] = time.perf_counter() - t0
                victim.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            if "restart" not in marks and n >= 2 * total // 3:
                marks["restart"] = time.perf_counter() - t0
                start_replica(victim, self.args, self.model_dir, self.config, self.redis.url,
                              self.log / "replica0.log")

        try:
            results, wall = asyncio.run(run_load(base, convs, self.args.clients,
                                                 self.args.max_tokens, self.args.timeout,
                                                 progress))
            served_again = probe_s = None
            if "restart" in marks:
                wait_http(victim.url, victim.proc)
                ready = time.perf_counter() - t0
                # Requests after the restart until the router sends one to it again.
                before = replica_load([victim])[0]["requests"]
                extra = fresh_prompts(24)
                t_extra = time.perf_counter()
                for conv in extra:
                    asyncio.run(run_load(base, [conv], 1, 2, self.args.timeout))
                    if replica_load([victim])[0]["requests"] > before:
                        served_again = time.perf_counter() - t_extra + (ready - marks["restart"])
                        break
                probe_s = time.perf_counter() - t_extra
        finally:
            stop(proc)
        failed = [r for r in results if r.status == "error"]
        hung = [r for r in results if r.status == "hung"]
        wrong = [r for r in results if r.status == "ok" and
                 reference.get((r.conv, r.turn)) not in (None, r.text)]
        last_fail = max((r.end for r in failed + hung), default=None)
        out = {"router": kind, "requests": len(results), "failed": len(failed),
               "hung": len(hung), "wrong": len(wrong), "kill_at_s": marks.get("kill"),
               "recovery_s": None if last_fail is None else max(0.0, last_fail - marks["kill"]),
               "restart_to_served_s": served_again, "rejoin_probe_s": probe_s,
               "rejoin_probe_requests": 24, "wall_s": wall}
        print(f"  {kind:8s} kill: {out['failed']} failed, {out['hung']} hung, {out['wrong']} "
              f"wrong of {out['requests']}; last failure {out['recovery_s']} s after the kill; "
              f"restarted replica served again after {served_again} s", flush=True)
        return out

    def overhead(self, routers: list[str], n: int) -> dict[str, Any]:
        """P50 latency of one small request, direct and through each router, interleaved."""
        self.fresh_replicas()
        procs = {k: self.router(k) for k in routers}
        target = self.replicas[0].url
        bases = {"direct": target, **{k: b for k, (_, b) in procs.items()}}
        lat: dict[str, list[float]] = {k: [] for k in bases}
        body = {"model": MODEL, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        hdr = {"Authorization": "Bearer sk-acme"}
        try:
            with httpx.Client(timeout=30) as http:
                for base in bases.values():  # warm each path once
                    http.post(base + "/v1/completions", json=body, headers=hdr)
                for i in range(n):
                    for k in (list(bases) if i % 2 == 0 else list(reversed(bases))):
                        t = time.perf_counter()
                        http.post(bases[k] + "/v1/completions", json=body, headers=hdr)
                        lat[k].append(time.perf_counter() - t)
        finally:
            for p, _ in procs.values():
                stop(p)
        d = statistics.median(lat["direct"])
        out = {k: {"p50_ms": 1000 * statistics.median(v),
                   "over_direct_ms": 1000 * (statistics.median(v) - d)} for k, v in lat.items()}
        print("  overhead (P50 ms): " + ", ".join(f"{k} {v['p50_ms']:.2f} ({v['over_direct_ms']:+.2f})"
                                               for k, v in out.items()), flush=True)
        return out

    def close(self) -> None:
        for r in self.replicas:
            stop(r.proc)
        self.redis.stop()


def _healthy_count(base: str) -> int:
    try:
        return int(httpx.get(base + "/health", timeout=2).json().get("healthy_replicas", 0))
    except (httpx.HTTPError, ValueError):
        return 0


def summarize(rounds: list[Round]) -> list[dict[str, Any]]:
    out = []
    for kind in dict.fromkeys(r.router for r in rounds):
        rs = [r for r in rounds if r.router == kind]

        def agg(attr: str, rs: list[Round] = rs) -> dict[str, float | None]:
            xs = [getattr(r, attr) for r in rs if getattr(r, attr) is not None]
            if not xs:
                return {"median": None, "min": None, "max": None}
            return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        out.append({"router": kind, "rounds": len(rs), **{a: agg(a) for a in (
            "hit_rate", "ttft_p50_s", "ttft_p99_s", "requests_per_s", "imbalance_requests",
            "imbalance_prefill")}, "errors": sum(r.errors for r in rs)})
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    def cell(d: dict[str, float | None], scale: float = 1.0, spec: str = ".1f") -> str:
        if d["median"] is None:
            return "-"
        return f"{d['median'] * scale:{spec}} ({d['min'] * scale:{spec}}-{d['max'] * scale:{spec}})"
    print(f"{'router':10} {'hit rate %':>20} {'TTFT P50 ms':>20} {'TTFT P99 ms':>22} "
          f"{'req/s':>18} {'req max/mean':>18} {'prefill max/mean':>18} {'errors':>7}")
    for s in summary:
        print(f"{s['router']:10} {cell(s['hit_rate'], 100):>20} {cell(s['ttft_p50_s'], 1000, '.0f'):>20} "
              f"{cell(s['ttft_p99_s'], 1000, '.0f'):>22} {cell(s['requests_per_s'], 1, '.2f'):>18} "
              f"{cell(s['imbalance_requests'], 1, '.2f'):>18} "
              f"{cell(s['imbalance_prefill'], 1, '.2f'):>18} {s['errors']:>7}")


def markdown(report: dict[str, Any]) -> str:
    """docs/cluster.md's tables from a report (`--markdown JSON` re-renders a saved run)."""
    def cell(d: dict[str, float | None], scale: float, spec: str) -> str:
        if d["median"] is None:
            return "-"
        return (f"{d['median'] * scale:{spec}} ({d['min'] * scale:{spec}} – "
                f"{d['max'] * scale:{spec}})")
    n = report["summary"][0]["rounds"] if report["summary"] else 0
    lines = [f"Median (min – max) over {n} interleaved rounds:", "",
             "| router | hit rate % | TTFT P50 ms | TTFT P99 ms | requests/s | "
             "max/mean requests | max/mean prefill | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["summary"]:
        lines.append(f"| {s['router']} | {cell(s['hit_rate'], 100, '.1f')} | "
                     f"{cell(s['ttft_p50_s'], 1000, '.0f')} | "
                     f"{cell(s['ttft_p99_s'], 1000, '.0f')} | "
                     f"{cell(s['requests_per_s'], 1, '.2f')} | "
                     f"{cell(s['imbalance_requests'], 1, '.2f')} | "
                     f"{cell(s['imbalance_prefill'], 1, '.2f')} | {s['errors']} |")
    if report.get("kill"):
        lines += ["", "A replica SIGKILLed a third of the way in, restarted at two thirds:", "",
                  "| router | requests | failed (error event) | hung | wrong output | "
                  "last failure after the kill s | restart to served again s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k in report["kill"]:
            def sec(x: float | None) -> str:
                return "-" if x is None else f"{x:.2f}"
            lines.append(f"| {k['router']} | {k['requests']} | {k['failed']} | {k['hung']} | "
                         f"{k['wrong']} | {sec(k['recovery_s'])} | "
                         f"{sec(k['restart_to_served_s'])} |")
    if report.get("overhead"):
        lines += ["", "The router's own cost (one small completion, interleaved):", "",
                  "| path | P50 ms | over direct ms |", "|---|---:|---:|"]
        for name, o in report["overhead"].items():
            lines.append(f"| {name} | {o['p50_ms']:.2f} | {o['over_direct_ms']:+.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = report["summary"]
    names = [s["router"] for s in summ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    palette = {"rr": "tab:gray", "sglang": "tab:orange", "kvheat": "black"}
    colors = [palette.get(n, "tab:blue") for n in names]
    for ax, key, scale, label in ((axes[0], "hit_rate", 100, "prefix hit rate (%)"),
                                  (axes[1], "ttft_p99_s", 1000, "TTFT P99 (ms)")):
        med = [s[key]["median"] * scale if s[key]["median"] is not None else 0 for s in summ]
        lo = [m - (s[key]["min"] or 0) * scale for m, s in zip(med, summ)]
        hi = [(s[key]["max"] or 0) * scale - m for m, s in zip(med, summ)]
        ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=4)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    rounds = [r for r in report["rounds"] if r["round"] == 0]
    width = 0.8 / max(1, len(rounds))
    for k, r in enumerate(rounds):
        pre = [x["prompt_tokens"] - x["cached_tokens"] for x in r["per_replica"]]
        axes[2].bar([i + (k - (len(rounds) - 1) / 2) * width for i in range(len(pre))], pre,
                    width, label=r["router"], color=palette.get(r["router"], "tab:blue"))
    axes[2].set_xticks(range(3), [f"replica {i}" for i in range(3)])
    axes[2].set_ylabel("prefill tokens computed (round 1)")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle("3 kvheat serve replicas + 3-node Redis Cluster tier, same multi-turn "
                 "multi-tenant load (median, range over rounds)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smg", default=shutil.which("smg"),
                    help="sglang-router's smg binary (its own venv); without it only kvheat route")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=36)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=160, help="device KV blocks per replica")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout: hung past it")
    ap.add_argument("--overhead-requests", type=int, default=200)
    ap.add_argument("--overhead-runs", type=int, default=1,
                    help="--overhead-only: runs in a row, each from fresh replicas (median)")
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the router overhead, direct and through each router (--json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "results" / "cluster.json"))
    ap.add_argument("--plot", default=str(ROOT / "results" / "cluster.png"))
    ap.add_argument("--markdown", metavar="JSON", default=None,
                    help="print the doc's tables from a saved report and exit (no run)")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0
    routers = (["rr", "sglang"] if args.smg else []) + ["kvheat"]
    if not args.smg:
        print("sglang-router (smg) not found: only kvheat route runs (--smg PATH)")
    convs = workload(args.conversations, args.turns, args.seed)
    with tempfile.TemporaryDirectory(prefix="kvheat-cluster-") as td:
        b = Bench(args, Path(td))
        try:
            b.redis.start()
            if args.overhead_only:
                runs = [b.overhead(routers, args.overhead_requests)
                        for _ in range(args.overhead_runs)]
                report = {"command": " ".join(["bench/cluster.py", *sys.argv[1:]]),
                          "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
                          "runs": runs, "median_over_direct_ms": {
                              k: statistics.median(r[k]["over_direct_ms"] for r in runs)
                              for k in runs[0]}}
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
                return 0
            rounds: list[Round] = []
            reference: dict[tuple[int, int], str] = {}
            for k in range(args.rounds):
                for kind in routers:
                    rd, results = b.one_round(kind, k, convs)
                    rounds.append(rd)
                    if kind == "kvheat" and not reference:
                        reference = {(r.conv, r.turn): r.text for r in results if r.status == "ok"}
            summary = summarize(rounds)
            print()
            print_table(summary)
            kills = [] if args.no_kill else [b.kill_round(k, convs, reference)
                                             for k in routers if k != "rr"]
            overhead = b.overhead(routers, args.overhead_requests)
        finally:
            b.close()
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
              "machine": {"cpus": os.cpu_count()}, "summary": summary,
              "rounds": [asdict(r) for r in rounds], "kill": kills, "overhead": overhead}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(args.plot))
    print()
    print(markdown(report), end="")
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
