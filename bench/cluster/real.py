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

    python bench/cluster/real.py --smg /tmp/sglr/bin/smg          # the whole run (~10 min)
    python bench/cluster/real.py --rounds 1 --conversations 12    # a quick look

Writes results/cluster/real.json (`--json`) and a plot (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as `python bench/cluster/real.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, ROOT
from bench._lib.load import (
    Conversation,
    LoadSpec,
    Reply,
    UserTurn,
    run_timed,
    served,
)
from bench._lib.models import save_llama
from bench._lib.procs import (
    RedisCluster,
    cpu_seconds,
    free_port,
    smg_command,
    stop,
    wait_ready,
    wait_router_healthy,
)
from bench._lib.report import Round, markdown, max_over_mean, pct, plot, print_table, summarize

MODEL = "cluster-llama"
SECRET = "kvheat-bench-cluster-tier-secret"
TENANTS = {"acme": "sk-acme", "globex": "sk-globex", "initech": "sk-initech"}
REPLICA_ADMIN = "cluster-bench-admin"  # the replicas' admin API (loopback only)

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


# ---- the load --------------------------------------------------------------------------------
def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANTS[tenant]}"}


def workload(n_conv: int, turns: int, seed: int) -> list[Conversation]:
    """Conversations of `turns` turns; the history holds fixed assistant answers, so a
    prompt never depends on what a replica generated (and every router sees the same)."""
    rng = random.Random(seed)
    convs = []
    names = list(TENANTS)
    for c in range(n_conv):
        tenant = names[c % len(names)]
        sysp = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
        conv = []
        for t in range(turns):
            q = f"[{c}] {rng.choice(QUESTIONS)} " + " ".join(
                rng.choice(QUESTIONS) for _ in range(rng.randint(1, 3)))
            conv.append(UserTurn(q, f"Answer {t} to conversation {c}: " + rng.choice(QUESTIONS)))
        convs.append(Conversation(c, sysp, conv, _auth(tenant)))
    return convs


def fresh_prompts(n: int) -> list[Conversation]:
    """One-turn requests on prompts nobody has sent before (a restarted replica has no
    cache, so only new prefixes show where a router places fresh work)."""
    return [Conversation(10_000 + i, f"Session {i}: you are a new assistant with new rules. " * 4,
                         [UserTurn(QUESTIONS[i % len(QUESTIONS)])], _auth("acme"))
            for i in range(n)]


def run_load(base: str, convs: list[Conversation], clients: int, max_tokens: int,
             timeout_s: float, on_progress: Callable[[int], None] | None = None
             ) -> tuple[list[Reply], float]:
    """The conversations on `clients` workers, each with its own HTTP client; the replies
    (their `start` in seconds from the load's start) and the wall time."""
    spec = LoadSpec(MODEL, max_tokens, ignore_eos=False, timeout_s=timeout_s, require_done=True)
    count = 0

    def progress(_: Reply) -> None:
        nonlocal count
        count += 1
        if on_progress is not None:
            on_progress(count)

    return run_timed(base, convs, clients, spec, progress if on_progress else None)


# ---- the processes ---------------------------------------------------------------------------
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
               KVHEAT_EVENTS_SECRET=SECRET, KVHEAT_ADMIN_TOKEN=REPLICA_ADMIN, TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    r.proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def start_router(kind: str, port: int, replicas: list[Replica], args: argparse.Namespace,
                 model_dir: Path, config: Path, log: Path) -> subprocess.Popen[bytes]:
    urls = [r.url for r in replicas]
    if kind.startswith("kvheat"):
        cmd = [sys.executable, "-m", "kvheat.cli", "route", "--port", str(port), "--model",
               str(model_dir), "--config", str(config), "--health-interval", "0.5",
               "--log-level", "warning"]
        for u in urls:
            cmd += ["--replica", u]
        cmd += args.route_arg
        if kind == "kvheat-1":  # new prefixes by the hash alone (one choice)
            cmd += ["--shard-choices", "1"]
        # the replicas' admin token: kvheat route reports the cluster's entropy to them
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   KVHEAT_REPLICA_ADMIN_TOKEN=REPLICA_ADMIN, KVHEAT_EVENTS_SECRET=SECRET)
    else:
        cmd = smg_command(args.smg, kind, port, urls)
        env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def replica_load(replicas: list[Replica]) -> list[dict[str, float]]:
    return served([r.url for r in replicas])


def _pid(proc: subprocess.Popen[bytes] | None) -> int | None:
    return None if proc is None else proc.pid


KINDS = {"rr", "sglang", "kvheat", "kvheat-1"}  # routers a round can run


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.model_dir = tmp / "model"
        save_llama(self.model_dir, args.hidden, args.layers)
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
            wait_ready(r.url, r.proc)

    def router(self, kind: str) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        proc = start_router(kind, port, self.replicas, self.args, self.model_dir, self.config,
                            self.log / f"router-{kind}.log")
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc, 60)
        except RuntimeError:
            print((self.log / f"router-{kind}.log").read_text()[-3000:], file=sys.stderr)
            raise
        if kind.startswith("kvheat"):  # every replica in rotation and subscribed
            wait_router_healthy(base, len(self.replicas))
        time.sleep(1.0)
        return proc, base

    def one_round(self, kind: str, k: int, convs: list[Conversation]
                  ) -> tuple[Round, list[Reply]]:
        self.fresh_replicas()
        proc, base = self.router(kind)

        def cpu() -> tuple[float, float]:
            return cpu_seconds(proc.pid), sum(cpu_seconds(_pid(r.proc)) for r in self.replicas)

        cpu0, first = cpu(), []
        timer = threading.Timer(1.0, lambda: first.append(cpu()))
        timer.start()
        try:
            results, wall = run_load(base, convs, self.args.clients, self.args.max_tokens,
                                     self.args.timeout)
            cpu1 = cpu()
        finally:
            timer.cancel()
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
                     "replica": r.replica, "status": r.status} for r in results],
                   cpu1[0] - cpu0[0], cpu1[1] - cpu0[1],
                   first[0][0] - cpu0[0] if first else None,
                   first[0][1] - cpu0[1] if first else None)
        print(f"  {kind:8s} round {k}: hit {rd.hit_rate:.1%}  TTFT p50 "
              f"{1000 * (rd.ttft_p50_s or 0):.0f} ms p99 {1000 * (rd.ttft_p99_s or 0):.0f} ms  "
              f"{rd.requests_per_s:.2f} req/s  errors {rd.errors}  req max/mean "
              f"{rd.imbalance_requests or 0:.2f}  prefill max/mean {rd.imbalance_prefill or 0:.2f}"
              f"  cpu s router {rd.router_cpu_s:.2f} replicas {rd.replica_cpu_s:.2f} (first s: "
              f"{rd.router_cpu_first_s or 0:.2f} / {rd.replica_cpu_first_s or 0:.2f})",
              flush=True)
        return rd, results

    def kill_round(self, kind: str, convs: list[Conversation],
                   reference: dict[tuple[int, int], str]) -> dict[str, Any]:
        """Kill replica 0 a third of the way into the load, restart it at two thirds."""
        self.fresh_replicas()
        proc, base = self.router(kind)
        total = sum(len(list(c.turns)) for c in convs)
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
            results, wall = run_load(base, convs, self.args.clients, self.args.max_tokens,
                                     self.args.timeout, progress)
            served_again = probe_s = None
            if "restart" in marks:
                wait_ready(victim.url, victim.proc)
                ready = time.perf_counter() - t0
                # Requests after the restart until the router sends one to it again.
                before = replica_load([victim])[0]["requests"]
                extra = fresh_prompts(24)
                t_extra = time.perf_counter()
                for conv in extra:
                    run_load(base, [conv], 1, 2, self.args.timeout)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smg", default=shutil.which("smg"),
                    help="sglang-router's smg binary (its own venv); without it only kvheat route")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routers", default="rr,sglang,kvheat",
                    help="in this order each round; kvheat-1: kvheat route --shard-choices 1")
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
    ap.add_argument("--route-arg", action="append", default=[],
                    help="an extra option for `kvheat route` (repeatable), e.g. --no-prewarm")
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the router overhead, direct and through each router (--json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(RESULTS / "cluster" / "real.json"))
    ap.add_argument("--plot", default=str(RESULTS / "cluster" / "real.png"))
    ap.add_argument("--markdown", metavar="JSON", default=None,
                    help="print the doc's tables from a saved report and exit (no run)")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0
    routers = args.routers.split(",")
    if set(routers) - KINDS:
        ap.error(f"--routers: known kinds are {', '.join(sorted(KINDS))}")
    if not args.smg:
        print("sglang-router (smg) not found: only kvheat route runs (--smg PATH)")
        routers = [k for k in routers if k.startswith("kvheat")]
    convs = workload(args.conversations, args.turns, args.seed)
    with tempfile.TemporaryDirectory(prefix="kvheat-cluster-") as td:
        b = Bench(args, Path(td))
        try:
            b.redis.start()
            if args.overhead_only:
                runs = [b.overhead(routers, args.overhead_requests)
                        for _ in range(args.overhead_runs)]
                report = {"command": " ".join(["bench/cluster/real.py", *sys.argv[1:]]),
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
                    if kind.startswith("kvheat") and not reference:
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
