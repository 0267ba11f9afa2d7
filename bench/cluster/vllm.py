"""vLLM replicas running kvheat's KV connector, behind each router in turn: `kvheat route`
against sglang-router (`smg`, cache_aware) and round robin, on the same multi-turn load
with long agentic contexts.

Each replica is vLLM's CPU server (the wide Llama of bench/vllm/connector.py: hidden
2048, `--layers` layers, float32, one compute thread bound to a core of its own, 32-token
blocks, its own pool shrunk to `--pool-blocks`) with `KVHeatConnector` holding blocks in
a host tier of its own (`--tier host`) or a host tier plus one shared `redis-server`
(`--tier redis`), and publishing vLLM's KV events (`--kv-events-config`, a bound ZMQ PUB
and replay socket): vLLM's own for the blocks of its pool (medium GPU), and the
connector's, which vLLM publishes in the same batches, for the blocks its tiers take or
lose (medium CPU / STORAGE, locality LOCAL or REMOTE). `kvheat route` subscribes to them
(`--replica URL,kind=vllm,events=...,replay=...,block_size=32`), indexes them by content
(their token ids) and counts a block in a replica's host tier as held at the local
tier's efficiency (0.9 of its prefill saved), one in the shared Redis tier at the shared
tier's (0.5), after the device prefix.

One tenant: sglang-router drops the request's `cache_salt` on the way to vLLM (seen here:
sessions of different tenants hit each other's blocks behind smg), so tenants salted apart
behind `kvheat route` would share nothing that smg's replicas share; without tenants the
replicas hash alike whichever router is in front.

Rounds are interleaved (rr, sglang, kvheat, rr, ...). The replicas stay up for the whole
run (a vLLM start costs minutes of this machine's CPU); each round runs its own
conversations (another seed: no round reuses another's text) behind a fresh router, so a
round inherits only cold blocks of earlier rounds. Per round: hit rate (the clients'
usage: cached / prompt tokens, vLLM's prefix hits plus the connector's tier hits), TTFT
P50 / P99, wall time and requests/s at the client, per-replica requests and prefill
tokens (vLLM's /metrics), and what `kvheat route`'s index held per place at the end.

    python bench/cluster/vllm.py --smg /tmp/sglr/bin/smg --json docs/results/cluster/vllm.json
    python bench/cluster/vllm.py --quick                      # one round, a small load
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as `python bench/cluster/vllm.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, ROOT
from bench._lib.load import (
    Conversation,
    LoadSpec,
    Reply,
    metric_sums,
    run_timed,
)
from bench._lib.models import save_wide_model
from bench._lib.peers import NO_VLLM, check_quiet, find_vllm_python, spread, vllm_env
from bench._lib.procs import (
    Redis,
    free_port,
    smg_command,
    stop,
    vllm_pool_command,
    wait_ready,
    wait_router_healthy,
)
from bench._lib.report import (
    Round,
    markdown,
    max_over_mean,
    pct,
    print_table,
    summarize,
    write_json,
)
from bench.vllm.connector import BLOCK, CONNECTOR_MODULE, SECRET, Shape, sessions

MODEL = "cluster-llama"  # bench/cluster/real.py's run_load asks for this model
KINDS = ("rr", "sglang", "kvheat")
# The load: agentic sessions (a tools head shared by all sessions, a long context
# of their own, tool-result turns) and chat sessions; several in flight per replica.
LOAD = Shape(agentic=6, agentic_head=50, agentic_context=80, agentic_turns=4,
             tool_result=(30, 45), chat=3, chat_system=80, chat_turns=3, question=(8, 14),
             in_flight=4)
QUICK = replace(LOAD, agentic=3, agentic_turns=3, chat=1, in_flight=3)


# ---- the load ----------------------------------------------------------------------------------
def run_load(base: str, convs: list[Conversation], in_flight: int, max_tokens: int,
             timeout_s: float) -> tuple[list[Reply], float]:
    """The conversations on `in_flight` workers; the replies (their `start` in seconds
    from the load's start) and the wall time. TTFT counts a first event that only ends
    the turn (a random-weights model may stream empty text first)."""
    spec = LoadSpec(MODEL, max_tokens, ignore_eos=True, timeout_s=timeout_s,
                    ttft_on_finish=True, require_done=True)
    return run_timed(base, convs, in_flight, spec)


# ---- the processes -----------------------------------------------------------------------------
@dataclass
class Replica:
    port: int
    events: int
    replay: int
    core: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        """How `kvheat route --replica` names it."""
        return (f"{self.url},kind=vllm,events=tcp://127.0.0.1:{self.events},"
                f"replay=tcp://127.0.0.1:{self.replay},block_size={BLOCK}")


def start_replica(r: Replica, a: argparse.Namespace, python: str, model_dir: Path,
                  redis_url: str | None, tmp: Path, log: Path) -> None:
    extra: dict[str, Any] = {"host_tier_size": a.host_tier_mib << 20, "tier_secret": SECRET}
    if redis_url is not None:
        extra.update(redis_tier_url=redis_url, redis_tier_size=a.redis_tier_mib << 20)
    transfer = {"kv_connector": "KVHeatConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{r.events}", "replay_endpoint": f"tcp://*:{r.replay}"}
    cmd = vllm_pool_command(python, model_dir, MODEL, r.port, BLOCK, a.pool_blocks,
                            kv_transfer=transfer)
    cmd += ["--kv-events-config", json.dumps(events)]
    # One compute thread per replica, each on a core of its own.
    env = dict(vllm_env(1, tmp), PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND=str(r.core))
    r.proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def start_router(kind: str, port: int, replicas: list[Replica], a: argparse.Namespace,
                 model_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    if kind == "kvheat":
        cmd = [sys.executable, "-m", "kvheat.cli", "route", "--port", str(port), "--model",
               str(model_dir), "--block-size", str(BLOCK),
               "--health-interval", "0.5", "--log-level", "warning"]
        for r in replicas:
            cmd += ["--replica", r.spec]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    else:
        cmd = smg_command(a.smg, kind, port, [r.url for r in replicas])
        env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


VLLM_SERVED = {"vllm:request_success_total": "requests",
               "vllm:prompt_tokens_total": "prompt_tokens",
               "vllm:prompt_tokens_cached_total": "cached_tokens"}


def served(replicas: list[Replica]) -> list[dict[str, float]]:
    out = []
    for r in replicas:
        try:
            out.append(metric_sums(httpx.get(r.url + "/metrics", timeout=10).text, VLLM_SERVED))
        except httpx.HTTPError:
            out.append(dict.fromkeys(VLLM_SERVED.values(), 0.0))
    return out


def router_view(base: str) -> dict[str, Any] | None:
    """`kvheat route`'s /admin/replicas is behind its admin token; its /health says how
    many replicas are in rotation, /metrics what its index holds per place."""
    try:
        text = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    held: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvheat_router_index_blocks{"):
            labels, value = line.rsplit(" ", 1)
            held[labels[len("kvheat_router_index_blocks"):]] = float(value)
    return held


class Bench:
    def __init__(self, a: argparse.Namespace, tmp: Path, python: str) -> None:
        self.a, self.tmp, self.python = a, tmp, python
        self.model_dir = save_wide_model(tmp / "wide-llama", a.layers)
        self.redis = Redis(tmp / "redis") if a.tier == "redis" else None
        cores = os.cpu_count() or 1
        self.replicas = [Replica(free_port(), free_port(), free_port(), i % cores)
                         for i in range(a.replicas)]
        self.logs = tmp / "logs"
        self.logs.mkdir()

    def start(self) -> None:
        url = self.redis.start().url if self.redis is not None else None
        for i, r in enumerate(self.replicas):
            start_replica(r, self.a, self.python, self.model_dir, url, self.tmp,
                          self.logs / f"replica{i}.log")
        for i, r in enumerate(self.replicas):
            wait_ready(r.url, r.proc, 900, self.logs / f"replica{i}.log")

    def router(self, kind: str) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        log = self.logs / f"router-{kind}.log"
        proc = start_router(kind, port, self.replicas, self.a, self.model_dir, log)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, 120, log)
        if kind == "kvheat":  # every replica in rotation and its events subscribed
            wait_router_healthy(base, len(self.replicas))
        time.sleep(1.0)
        return proc, base

    def one_round(self, kind: str, k: int, convs: list[Conversation], in_flight: int
                  ) -> tuple[Round, dict[str, Any]]:
        proc, base = self.router(kind)
        before = served(self.replicas)
        try:
            results, wall = run_load(base, convs, in_flight, self.a.max_tokens, self.a.timeout)
            index = router_view(base) if kind == "kvheat" else None
        finally:
            stop(proc)
        after = served(self.replicas)
        loads = [{m: y[m] - x[m] for m in x} for x, y in zip(before, after, strict=True)]
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
        print(f"  {kind:7s} round {k}: hit {rd.hit_rate:.1%}  TTFT p50 "
              f"{1000 * (rd.ttft_p50_s or 0):.0f} ms p99 {1000 * (rd.ttft_p99_s or 0):.0f} ms  "
              f"wall {wall:.1f} s  errors {rd.errors}  requests per replica "
              f"{[int(x['requests']) for x in loads]}  prefill per replica "
              f"{[int(x['prompt_tokens'] - x['cached_tokens']) for x in loads]}"
              + (f"  index {index}" if index else ""), flush=True)
        if rd.errors:
            print("    first error: " + next(r.error for r in results if r.status != "ok"),
                  flush=True)
        return rd, {"router": kind, "round": k, "wall_s": wall, "router_index": index}

    def close(self) -> None:
        for r in self.replicas:
            stop(r.proc)
        if self.redis is not None:
            self.redis.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smg", default=shutil.which("smg"),
                    help="sglang-router's smg binary (its own venv); without it only kvheat route")
    ap.add_argument("--routers", default=",".join(KINDS), help="in this order each round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one round, a smaller load")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tier", choices=["host", "redis"], default="host",
                    help="the connector's tiers: a host tier per replica, or that plus one "
                         "shared redis-server")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pool-blocks", type=int, default=32, help="vLLM's own pool per replica")
    ap.add_argument("--host-tier-mib", type=int, default=256)
    ap.add_argument("--redis-tier-mib", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", default=str(RESULTS / "cluster" / "vllm.json"))
    ap.add_argument("--markdown", metavar="JSON", default=None,
                    help="print the doc's table from a saved report and exit (no run)")
    a = ap.parse_args()
    if a.markdown:
        print(markdown(json.loads(Path(a.markdown).read_text())), end="")
        return 0
    routers = a.routers.split(",")
    if set(routers) - set(KINDS):
        ap.error(f"--routers: known kinds are {', '.join(KINDS)}")
    if a.quick:
        a.rounds = 1
    if not a.smg:
        print("sglang-router (smg) not found: only kvheat route runs (--smg PATH)")
        routers = [k for k in routers if k == "kvheat"]
    python = find_vllm_python(a.vllm_python)
    if python is None:
        print(f"{NO_VLLM}: nothing to run", file=sys.stderr)
        return 0
    shape = QUICK if a.quick else LOAD
    report: dict[str, Any] = {"command": " ".join(["python bench/cluster/vllm.py",
                                                   *sys.argv[1:]]),
                              "config": {k: v for k, v in vars(a).items() if k != "json"},
                              "load": asdict(shape), "machine": {"cpus": os.cpu_count()}}
    check_quiet(report, "start")
    rounds: list[Round] = []
    extras: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvheat-vcluster-") as td:
        b = Bench(a, Path(td), python)
        try:
            t = time.perf_counter()
            b.start()
            print(f"{a.replicas} vLLM replicas with KVHeatConnector ({a.tier}) up in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
            for k in range(a.rounds):
                for j, kind in enumerate(routers):
                    convs = sessions(shape, 1000 + 10 * k + j)
                    rd, extra = b.one_round(kind, k, convs, shape.in_flight)
                    rounds.append(rd)
                    extras.append(extra)
        finally:
            b.close()
    check_quiet(report, "end", after_own_run=True)
    summary = summarize(rounds)
    report["summary"] = summary
    report["rounds"] = [asdict(r) for r in rounds]
    report["round_extras"] = extras
    report["wall_s"] = {kind: spread(e["wall_s"] for e in extras if e["router"] == kind)
                        for kind in routers}
    print()
    print_table(summary)
    for k, w in report["wall_s"].items():
        print(f"  {k}: wall {w['median']:.1f} s ({w['min']:.1f}-{w['max']:.1f})")
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
