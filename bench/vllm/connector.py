"""vLLM with kvheat's tiers as its KV connector, side by side with vLLM alone and with
vLLM's own `ExampleConnector`, on multi-turn chat with long agentic contexts.

One model on every row: a Llama of TinyLlama-1.1B's width (hidden 2048, 16 heads of 128,
4 KV heads, intermediate 5632; bench/_lib/models.save_wide_model) with `--layers` layers
(default 2, seeded random weights), float32, one compute thread (vLLM binds its OpenMP
threads to core 0, its front end runs on the other), 32-token blocks, vLLM's own pool
shrunk to `--pool-blocks` blocks (`--num-gpu-blocks-override`).

Rows (one `python -m vllm.entrypoints.openai.api_server` each, up together: about 3 GB
resident each; when the free memory does not take them all, or `--max-servers` says so,
the rows run in groups, each group with its own vLLM-alone server):
- `vllm`: vLLM alone (prefix caching on);
- `example`: vLLM with its `ExampleConnector` (saves every request's KV to files, loads
  only a whole earlier prompt: a growing conversation never hits it);
- `kvheat-host`: `KVHeatConnector` with a host-memory tier larger than the working set;
- `kvheat-disk`: a host tier the size of vLLM's own pool, then a local disk tier;
- `kvheat-redis`: a host tier the size of vLLM's own pool, then a real `redis-server`;
- `noop` (not run unless named): vLLM with a connector that does nothing
  (`bench/vllm/noop_connector.py`), so every change vLLM makes for a connector and no
  cache: with vLLM's automatic thread binding (`--bind auto`) a connector's server gets
  other cores than vLLM alone's (docs/vllm.md, "What a KV connector changes in vLLM
  itself"); against this row only the cache's effect remains.

Two loads, each drawn several times (new text every draw: nothing one draw computed helps
another), each draw sent to every row's server in turn, the order reversed every other
draw (A B C D E, E D C B A, ...): the machine's load falls on all rows alike, and each
ratio to vLLM alone is taken within one draw. A server keeps what earlier draws left in
its caches (cold blocks of other text), as a serving vLLM does.
- `fits` (first): two conversations whose whole working set fits vLLM's pool, so a
  connector can only cost (its lookups, its saves);
- `overflow`: agentic sessions (a shared tool-definitions head, then a session's own long
  context, then turns that each append a tool result and a short tool call: the shape of
  ../shared/traces/agentic, compressed: no think time between turns) and chat sessions on
  a shared system prompt, three in flight, so one session's blocks are pushed out of
  vLLM's pool between two of its turns; its working set (distinct full blocks of every
  prompt, tokenized with the model's chat template) must be at least `--min-overflow`
  (4) times the pool.
Histories carry fixed assistant answers, so every row sees the same prompts.

Per run: TTFT mean and P99 (over all turns), wall time, prompt tokens, cached tokens
(`prompt_tokens_details.cached_tokens`: vLLM's own prefix hits plus what a connector
supplied) and prompt tokens computed (their difference), errors, the server's CPU seconds;
at the end the connector's `kvheat_*` Prometheus counters. Each row's figure is the
median (and range) over its draws.

    python bench/vllm/connector.py --json docs/results/vllm/connector.json
    python bench/vllm/connector.py --quick          # one repeat, small loads, a check
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as `python bench/vllm/connector.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, ROOT
from bench._lib.load import Conversation, LoadSpec, Reply, UserTurn, from_list, run_conversations
from bench._lib.models import save_wide_model
from bench._lib.peers import NO_VLLM, check_quiet, find_vllm_python, spread, vllm_env
from bench._lib.procs import Redis, cpu_seconds, free_port, stop, vllm_pool_command, wait_ready
from bench._lib.report import pct, write_json
from kvheat.cache.hashing import block_keys, root_key, tokens_to_bytes
from kvheat.engine.loader import Tokenizer

BLOCK = 32  # tokens per block: vLLM's CPU attention wants multiples of 32
MODEL = "wide"
ROWS = ("vllm", "example", "kvheat-host", "kvheat-disk", "kvheat-redis", "noop")
DEFAULT_ROWS = ROWS[:5]
SECRET = "kvheat-bench-connector-tier-secret"
CONNECTOR_MODULE = "kvheat.integrations.vllm_connector"
# Targets of the issue, against vLLM alone in the same repeat.
TARGET_P99, TARGET_WALL, TARGET_FITS_OVERHEAD = 0.7, 0.85, 0.03

_TEXT = ("the cache keeps hot blocks on the device while cold ones move to host memory disk "
         "or redis and every request that shares a prefix reuses its keys and values so the "
         "first token comes sooner def class import return self value error file path line "
         "tool result grep found test passed failed build module function argument")
WORDS = _TEXT.split(" ")


# ---- the loads ---------------------------------------------------------------------------------
def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class Shape:
    """A load's size, in words (the wide model's tokenizer gives about two tokens a
    word; the run reports tokens)."""

    agentic: int  # sessions
    agentic_head: int  # the shared tool-definitions head
    agentic_context: int  # each session's own context after it
    agentic_turns: int
    tool_result: tuple[int, int]  # a tool result's length, drawn in this range
    chat: int  # sessions
    chat_system: int
    chat_turns: int
    question: tuple[int, int]
    in_flight: int


SHAPES = {
    "overflow": Shape(agentic=5, agentic_head=50, agentic_context=80, agentic_turns=4,
                      tool_result=(30, 45), chat=3, chat_system=80, chat_turns=3,
                      question=(8, 14), in_flight=3),
    "fits": Shape(agentic=1, agentic_head=30, agentic_context=80, agentic_turns=3,
                  tool_result=(20, 30), chat=1, chat_system=40, chat_turns=3,
                  question=(8, 12), in_flight=2),
}
QUICK = {
    "overflow": Shape(agentic=3, agentic_head=40, agentic_context=100, agentic_turns=3,
                      tool_result=(30, 50), chat=1, chat_system=60, chat_turns=2,
                      question=(8, 12), in_flight=3),
    "fits": SHAPES["fits"],
}


def sessions(shape: Shape, seed: int) -> list[Conversation]:
    """Agentic sessions first (so several long contexts are in flight together), then
    chat sessions; assistant answers are fixed text (a tool call, a short reply)."""
    rng = random.Random(seed)
    head = "You are a coding agent. Tools: " + _words(rng, shape.agentic_head)
    out = []
    for s in range(shape.agentic):
        context = f"Session {seed}-{s}. Repository: " + _words(rng, shape.agentic_context)
        turns = [UserTurn(f"<tool_result> {_words(rng, rng.randint(*shape.tool_result))} "
                          "</tool_result>",
                          f"<tool_use name=grep> {_words(rng, 6)} </tool_use>")
                 for _ in range(shape.agentic_turns)]
        out.append(Conversation(len(out), head + "\n" + context, turns))
    system = f"Chat {seed}. You are a helpful assistant. " + _words(rng, shape.chat_system)
    for _ in range(shape.chat):
        turns = [UserTurn(f"[{len(out)}] " + _words(rng, rng.randint(*shape.question)),
                          "Sure: " + _words(rng, 10)) for _ in range(shape.chat_turns)]
        out.append(Conversation(len(out), system, turns))
    return out


def working_set_blocks(model_dir: Path, convs: list[Conversation]) -> int:
    """Distinct full blocks of the load's prompts (shared heads once): each session's last
    prompt (it holds every earlier one), tokenized with the model's chat template as the
    server does, keyed in blocks of 32 tokens."""
    tok = Tokenizer.from_dir(model_dir)
    keys: set[bytes] = set()
    for c in convs:
        turns = list(c.turns)
        msgs = [{"role": "system", "content": c.system}]
        for t in turns[:-1]:
            msgs += [{"role": "user", "content": t.content},
                     {"role": "assistant", "content": t.answer or ""}]
        msgs.append({"role": "user", "content": turns[-1].content})
        tokens = tok.apply_chat_template(msgs, True)
        keys.update(block_keys(tokens_to_bytes(tokens), BLOCK, root_key(None))[0])
    return len(keys)


# ---- the servers ------------------------------------------------------------------------------
def transfer_config(row: str, tmp: Path, redis_url: str | None, pool_bytes: int,
                    tier_bytes: int) -> dict[str, Any] | None:
    """The row's `--kv-transfer-config` (None: vLLM alone)."""
    if row == "vllm":
        return None
    if row == "noop":
        return {"kv_connector": "NoopConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "bench.vllm.noop_connector"}
    if row == "example":
        store = tmp / "example-store"
        store.mkdir(exist_ok=True)
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    extra: dict[str, Any] = {"tier_secret": SECRET}
    if row == "kvheat-host":
        extra["host_tier_size"] = tier_bytes
    else:  # the lower tier behind a host tier as small as vLLM's own pool
        extra["host_tier_size"] = pool_bytes
        if row == "kvheat-disk":
            d = tmp / "disk-tier"
            d.mkdir(exist_ok=True)
            extra.update(disk_tier_dir=str(d), disk_tier_size=tier_bytes)
        elif row == "kvheat-redis":
            if redis_url is None:
                raise ValueError("the kvheat-redis row needs a redis-server")
            extra.update(redis_tier_url=redis_url, redis_tier_size=tier_bytes)
        else:
            raise ValueError(f"unknown row {row!r}; known: {', '.join(ROWS)}")
    return {"kv_connector": "KVHeatConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def start_server(python: str, model_dir: Path, port: int, log: Path, tmp: Path,
                 args: argparse.Namespace, kv_transfer: dict[str, Any] | None
                 ) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server as bench/_lib/procs.start_vllm_server starts it (float32,
    prefix caching, cached tokens in usage, one compute thread; stats on, as the connector's
    metrics need them), with vLLM's pool shrunk
    to `--pool-blocks` blocks of 32 tokens and the row's connector."""
    cmd = vllm_pool_command(python, model_dir, MODEL, port, BLOCK, args.pool_blocks,
                            args.max_seqs, args.batched_tokens, kv_transfer)
    env = dict(vllm_env(args.threads, tmp), PYTHONPATH=str(ROOT))
    if args.bind == "auto":  # vLLM's own binding: a connector's server reserves a core more
        env.pop("VLLM_CPU_OMP_THREADS_BIND")
        env.pop("OMP_NUM_THREADS")
    elif args.bind:  # every row on the same cores, but other ones than vLLM's default
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.bind
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def connector_metrics(base: str) -> dict[str, float]:
    """The connector's own counters in vLLM's /metrics (`kvheat_*`, summed per name and
    label set as printed)."""
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvheat_") and " " in line:
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


# ---- one run ----------------------------------------------------------------------------------
def load_once(base: str, convs: list[Conversation], in_flight: int, max_tokens: int,
              timeout_s: float) -> tuple[list[Reply], float]:
    spec = LoadSpec(MODEL, max_tokens, ignore_eos=True, timeout_s=timeout_s,
                    ttft_on_finish=True, require_done=True)

    async def go() -> tuple[list[Reply], float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + 5)) as http:
            t0 = time.perf_counter()
            replies = await run_conversations(base, from_list(convs), in_flight, spec, http=http)
            return replies, time.perf_counter() - t0

    return asyncio.run(go())


def figures(replies: list[Reply], wall: float) -> dict[str, Any]:
    ok = [r for r in replies if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {"wall_s": wall, "turns": len(replies), "errors": len(replies) - len(ok),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p99_s": pct(ttft, 0.99), "ttft_max_s": max(ttft, default=None),
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "first_error": next((r.error for r in replies if not r.ok), None),
            "ttfts": [round(t, 4) for t in ttft]}


@dataclass
class Server:
    row: str
    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    redis: Redis | None

    def stop(self) -> None:
        stop(self.proc)
        if self.redis is not None:
            self.redis.kill()


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, python: str) -> None:
        self.args, self.tmp, self.python = args, tmp, python
        self.model_dir = save_wide_model(tmp / "wide-llama", args.layers)
        self.logs = tmp / "logs"
        self.logs.mkdir()
        # KV bytes of one block: K and V, every layer, 4 KV heads of 128, float32.
        self.block_bytes = 2 * args.layers * 4 * 128 * BLOCK * 4
        self.shapes = QUICK if args.quick else SHAPES
        self.warmup = [Conversation(0, "Warm-up. " + _words(random.Random(7), 60),
                                    [UserTurn(_words(random.Random(8), 20), "ok")] * 2)]
        self.working_set = {phase: working_set_blocks(self.model_dir, self.load(phase, 0))
                            for phase in self.shapes}

    def load(self, phase: str, n: int) -> list[Conversation]:
        """The phase's conversations, draw `n` (each draw its own text)."""
        return sessions(self.shapes[phase], (101 if phase == "fits" else 202) + 1000 * n)

    def start(self, row: str, tag: str) -> Server:
        a = self.args
        run_dir = self.tmp / f"{row}-{tag}"
        run_dir.mkdir()
        redis = Redis(run_dir / "redis").start() if row == "kvheat-redis" else None
        cfg = transfer_config(row, run_dir, redis.url if redis else None,
                              a.pool_blocks * self.block_bytes, a.tier_mib << 20)
        port = free_port()
        log = self.logs / f"{row}-{tag}.log"
        proc = start_server(self.python, self.model_dir, port, log, run_dir, a, cfg)
        return Server(row, proc, f"http://127.0.0.1:{port}", log, redis)

    def ready(self, srv: Server) -> None:
        wait_ready(srv.base, srv.proc, 900, srv.log)
        # A fresh server's first forwards pay one-time costs (kernel selection, first
        # allocations): two short requests on text of their own, untimed.
        load_once(srv.base, self.warmup, 1, self.args.max_tokens, self.args.timeout)

    def measure(self, srv: Server, phase: str, convs: list[Conversation], label: str
                ) -> dict[str, Any]:
        a = self.args
        cpu0 = cpu_seconds(srv.proc.pid, tree=True)
        replies, wall = load_once(srv.base, convs, self.shapes[phase].in_flight, a.max_tokens,
                                  a.timeout)
        f = figures(replies, wall)
        f["server_cpu_s"] = cpu_seconds(srv.proc.pid, tree=True) - cpu0
        print(f"  {srv.row:13s} {label:10s} {phase:8s}: wall {wall:6.2f} s  TTFT mean "
              f"{1000 * (f['ttft_mean_s'] or 0):6.0f} ms  P99 "
              f"{1000 * (f['ttft_p99_s'] or 0):6.0f} ms  prompt {f['prompt_tokens']:6d}"
              f"  computed {f['computed_tokens']:6d}  errors {f['errors']}"
              + (f"  ({f['first_error']})" if f["first_error"] else ""), flush=True)
        return f

    def run(self, rows: list[str], draws: dict[str, int], out: dict[str, Any]) -> None:
        """Every row's server up at once; each phase's load `draws[phase]` times, each
        draw (new text) sent to each server in turn, the order reversed every other draw
        (A B C, C B A, ...), so the machine's load falls on all rows alike; each run's
        ratios to the vLLM-alone run of its draw are kept with it (`vs_vllm`). A server
        keeps what earlier draws left in its caches (cold blocks of other text), as a
        serving vLLM does. A server that does not start is reported and left out. Adds
        to `out[phase][row]`."""
        servers = [self.start(row, f"group{len(out['groups'])}") for row in rows]
        out["groups"].append(rows)
        try:
            t = time.perf_counter()
            for srv in list(servers):
                try:
                    self.ready(srv)
                except RuntimeError as e:
                    print(f"{srv.row} did not start, left out: {str(e)[-2000:]}",
                          file=sys.stderr, flush=True)
                    out["failed"].append({"row": srv.row, "error": str(e)[-2000:]})
                    srv.stop()
                    servers.remove(srv)
            print(f"{len(servers)} servers up in {time.perf_counter() - t:.0f} s", flush=True)
            for phase, n_draws in draws.items():
                for n in range(n_draws):
                    convs = self.load(phase, n)
                    got = {srv.row: self.measure(srv, phase, convs, f"draw {n}")
                           for srv in (servers if n % 2 == 0 else servers[::-1])}
                    base = got.get("vllm")
                    for row, f in got.items():
                        if base is not None and row != "vllm":
                            f["vs_vllm"] = {m: f[m] / base[m] if f[m] is not None and base[m]
                                            else None for m in METRICS}
                        out[phase].setdefault(row, []).append(f)
            for srv in servers:
                out["connector_metrics"][srv.row] = connector_metrics(srv.base)
        except Exception:
            for srv in servers:
                print(f"--- {srv.row}:\n" + srv.log.read_text(errors="replace")[-3000:],
                      file=sys.stderr)
            raise
        finally:
            for srv in servers:
                srv.stop()


def groups_of(rows: list[str], max_servers: int) -> list[list[str]]:
    """The rows in groups of at most `max_servers` servers, each with vLLM alone first
    (every ratio is to the vLLM-alone run of its own draw, in its own group)."""
    others = [r for r in rows if r != "vllm"]
    size = max(1, max_servers - 1)
    return [["vllm", *others[i:i + size]] for i in range(0, len(others), size)] or [["vllm"]]


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


# ---- the report -------------------------------------------------------------------------------
METRICS = ("ttft_mean_s", "ttft_p99_s", "wall_s", "computed_tokens")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per row: each metric's median and range over its runs, and of its ratios to vLLM
    alone in the same draw."""
    rows: dict[str, Any] = {}
    for row, rs in runs.items():
        cell: dict[str, Any] = {"runs": len(rs), "errors": sum(r["errors"] for r in rs),
                                "prompt_tokens": round(statistics.median(
                                    r["prompt_tokens"] for r in rs))}
        for m in METRICS:
            vals = [r[m] for r in rs]
            if any(v is None for v in vals):
                cell[m] = None
                continue
            cell[m] = spread(vals)
            ratios = [r["vs_vllm"][m] for r in rs if r.get("vs_vllm", {}).get(m) is not None]
            if ratios:
                cell[m + "_ratio"] = {**spread(ratios), "ratios": ratios}
        cell["ttft_p99_pooled_s"] = pct([t for r in rs for t in r["ttfts"]], 0.99)
        rows[row] = cell
    return rows


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for row, cell in summary["overflow"].items():
        if row == "vllm" or "wall_s_ratio" not in cell:
            continue
        p99, wall = cell["ttft_p99_s_ratio"]["median"], cell["wall_s_ratio"]["median"]
        fits = summary.get("fits", {}).get(row, {}).get("wall_s_ratio", {}).get("median")
        res[row] = {"p99_ratio": p99, "p99_met": p99 <= TARGET_P99,
                    "wall_ratio": wall, "wall_met": wall <= TARGET_WALL,
                    "fits_wall_ratio": fits,
                    "fits_met": None if fits is None else fits <= 1 + TARGET_FITS_OVERHEAD}
    return res


def _cell(d: dict[str, Any] | None, scale: float, spec: str) -> str:
    if not d:
        return "-"
    return f"{d['median'] * scale:{spec}} ({d['min'] * scale:{spec}}-{d['max'] * scale:{spec}})"


def table(rows: dict[str, Any]) -> str:
    lines = ["| row | TTFT mean ms | TTFT P99 ms | wall s | prompt tokens computed | "
             "P99 / vLLM | wall / vLLM | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row, c in rows.items():
        lines.append(
            f"| {row} | {_cell(c['ttft_mean_s'], 1000, '.0f')} | "
            f"{_cell(c['ttft_p99_s'], 1000, '.0f')} | {_cell(c['wall_s'], 1, '.2f')} | "
            f"{_cell(c['computed_tokens'], 1, '.0f')} of {c['prompt_tokens']} | "
            f"{_cell(c.get('ttft_p99_s_ratio'), 1, '.2f')} | "
            f"{_cell(c.get('wall_s_ratio'), 1, '.3f')} | {c['errors']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                    help=f"some of {', '.join(ROWS)}")
    ap.add_argument("--repeats", type=int, default=3,
                    help="draws of the overflow load, each sent to every row in turn")
    ap.add_argument("--fits-draws", type=int, default=6,
                    help="draws of the fits load, each sent to every row in turn")
    ap.add_argument("--phases", default="fits,overflow", help="the loads to run, in order")
    ap.add_argument("--bind", default=None,
                    help="cores every row's compute threads bind to (VLLM_CPU_OMP_THREADS_BIND;"
                         " default 0 .. threads-1; `auto`: vLLM's own binding, which gives "
                         "a connector's server other cores than vLLM alone's)")
    ap.add_argument("--max-servers", type=int, default=0,
                    help="servers up at once (0: as many as the free memory takes, about 3 "
                         "GB each); more rows run in groups, each with vLLM alone")
    ap.add_argument("--quick", action="store_true",
                    help="one overflow draw, two fits draws, a smaller overflow load: a check")
    ap.add_argument("--layers", type=int, default=2, help="layers of the wide model")
    ap.add_argument("--pool-blocks", type=int, default=32,
                    help="vLLM's own KV pool, in blocks of 32 tokens")
    ap.add_argument("--tier-mib", type=int, default=512,
                    help="the kvheat tier (host, disk or Redis) behind vLLM: more than the "
                         "working set")
    ap.add_argument("--min-overflow", type=float, default=4.0,
                    help="the overflow load's working set must be this x vLLM's pool")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="vLLM's compute threads, every row")
    ap.add_argument("--timeout", type=float, default=300.0, help="a turn past it counts as hung")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", default=str(RESULTS / "vllm" / "connector.json"))
    a = ap.parse_args()
    # A SIGTERM unwinds like an error: the servers started so far are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = a.rows.split(",")
    if set(rows) - set(ROWS) or len(set(rows)) != len(rows):
        ap.error(f"--rows: some of {', '.join(ROWS)}, each once")
    phases = [p for p in a.phases.split(",") if p]
    if not phases or set(phases) - {"fits", "overflow"}:
        ap.error("--phases: fits, overflow or both")
    if a.quick:
        a.repeats, a.fits_draws = 1, 2
    if a.repeats < 1 or a.fits_draws < 1 or a.layers < 1 or a.pool_blocks < 4:
        ap.error("--repeats, --fits-draws and --layers at least 1, --pool-blocks at least 4")
    python = find_vllm_python(a.vllm_python)
    if python is None:
        print(f"{NO_VLLM}: nothing to run", file=sys.stderr)
        return 0
    if shutil.which("redis-server") is None:
        print("redis-server not found: the kvheat-redis row is left out", file=sys.stderr)
        rows = [r for r in rows if r != "kvheat-redis"]
    report: dict[str, Any] = {"command": " ".join(["python bench/vllm/connector.py",
                                                   *sys.argv[1:]]),
                              "config": {k: v for k, v in vars(a).items() if k != "json"},
                              "machine": {"cpus": os.cpu_count()}}
    check_quiet(report, "start")
    with tempfile.TemporaryDirectory(prefix="kvheat-vconn-") as td:
        b = Bench(a, Path(td), python)
        report["block_bytes"] = b.block_bytes
        report["shapes"] = {k: vars(v) for k, v in b.shapes.items()}
        report["working_set_blocks"] = b.working_set
        report["working_set_x_pool"] = {k: v / a.pool_blocks for k, v in b.working_set.items()}
        print(f"working set: {b.working_set} blocks of {BLOCK} tokens; vLLM's pool "
              f"{a.pool_blocks} blocks", flush=True)
        if b.working_set["overflow"] < a.min_overflow * a.pool_blocks and not a.quick:
            raise SystemExit(f"the overflow working set is {b.working_set['overflow']} blocks, "
                             f"under {a.min_overflow} x the pool")
        if b.working_set["fits"] > a.pool_blocks:
            raise SystemExit(f"the fits working set ({b.working_set['fits']} blocks) does "
                             "not fit vLLM's pool")
        runs: dict[str, Any] = {"fits": {}, "overflow": {}, "connector_metrics": {},
                                "groups": [], "failed": []}
        # About 3 GB resident per server: as many at once as the memory takes.
        max_servers = a.max_servers or max(2, int((mem_available_gib() - 3) / 3.2))
        for group in groups_of(rows, max_servers):
            b.run(group, {p: {"fits": a.fits_draws, "overflow": a.repeats}[p]
                          for p in phases}, runs)
    check_quiet(report, "end", after_own_run=True)
    summary = {phase: summarize(runs[phase]) for phase in ("fits", "overflow")
               if runs[phase]}
    report["summary"] = summary
    report["targets"] = targets(summary) if "overflow" in summary else {}
    report["runs"] = runs
    print(f"\nvLLM CPU, wide Llama (hidden 2048, {a.layers} layers, float32, 1 thread), pool "
          f"{a.pool_blocks} blocks x {BLOCK}")
    for phase, what in (("overflow", f"{a.repeats} draws"), ("fits", f"{a.fits_draws} draws")):
        if phase in summary:
            print(f"\n{phase}: working set {report['working_set_x_pool'][phase]:.1f}x vLLM's "
                  f"pool; median (range) over {what}")
            print(table(summary[phase]))
    for row, t in report["targets"].items():
        fits = "-" if t["fits_wall_ratio"] is None else \
            f"x{t['fits_wall_ratio']:.3f} ({'met' if t['fits_met'] else 'NOT met'})"
        print(f"{row}: P99 x{t['p99_ratio']:.2f} (target {TARGET_P99}: "
              f"{'met' if t['p99_met'] else 'NOT met'}), wall x{t['wall_ratio']:.2f} (target "
              f"{TARGET_WALL}: {'met' if t['wall_met'] else 'NOT met'}), fits wall {fits} "
              f"(target {1 + TARGET_FITS_OVERHEAD})")
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
