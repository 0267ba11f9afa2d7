"""vLLM alone, LMCache and KVHeatConnector side by side inside vLLM's CPU server, each
connector given the same host budget in bytes, on interleaved multi-turn chat that
overflows vLLM's own pool.

One model on every row: the built-in tiny Llama (`kvheat.engine.loader.save_tiny_model`:
4 layers, 2 KV heads of 64, seeded random weights; 128 KiB of KV per 32-token block at
float32), `--dtype float32`, one compute thread (vLLM binds it to core 0), vLLM's pool
shrunk to 48 blocks of 32 tokens (`--num-gpu-blocks-override 48 --block-size 32`), prefix
caching on, greedy decoding of `--max-tokens` tokens per turn (`ignore_eos`).

Rows, one `python -m vllm.entrypoints.openai.api_server` each:
- `vllm`: vLLM alone (its own prefix cache only);
- `lmcache`: LMCache 0.5.6 in its multiprocess mode: the bench starts `python -m
  lmcache.v1.multiprocess.http_server --chunk-size 32 --l1-size-gb B/1024 --eviction-policy
  LRU --supported-transfer-mode auto` (B the budget in MiB), and vLLM runs its
  `LMCacheMPConnector` against it (LMCache's in-process `LMCacheConnectorV1` has no CPU
  path in vLLM's CPU build). Both run from LMCache's own venv (`make lmcache`,
  `--lmcache-python`); the row is skipped, with the reason printed, when it is absent;
- `kvheat`: `KVHeatConnector` with a host tier only, `host_tier_size` = the budget, from
  this checkout (PYTHONPATH).

Workload: 12 conversations of 4 turns, interleaved round-robin (turn t of every
conversation before turn t+1 of any), sent one request at a time. Each conversation has a
system prompt of its own (about 8 blocks) and each turn adds about 4 blocks of new user
text after a fixed assistant answer, so every row gets identical prompts whatever it
generates. vLLM's pool (48 blocks) holds about two conversations: what a turn can reuse
from the earlier ones comes from the connector's tier, or is computed again.

Per budget (8, 16, 32, 64, 256 MiB; `--quick`: 16 and 256, one repeat) the rows' servers
are up together; each repeat (new text each repeat, the same across budgets) is sent to
every row in turn, the order rotated each repeat (A B C, B C A, C A B), so the machine's
load falls on all rows alike. A server keeps what earlier repeats left in its caches (cold
blocks of other text), as a serving vLLM does; `--fresh` starts new servers for every
repeat instead. Per run: prompt tokens, prompt tokens
served from cache (`usage.prompt_tokens_details.cached_tokens`: vLLM's own prefix hits
plus what a connector supplied), TTFT mean and P99, time per output token after the first
(TPOT), wall time, errors, the server's CPU seconds (LMCache's server included). Each
figure is the median (and range) over the repeats. Greedy outputs must be identical in
every row and budget for the same prompt: each mismatch is reported.

    python bench/vllm/lmcache.py                      # all budgets, 3 repeats (docs/results)
    python bench/vllm/lmcache.py --quick --json /tmp/lmcache_quick.json   # a check
    python bench/vllm/lmcache.py --fresh --budgets 32 --json /tmp/lmcache_fresh.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as `python bench/vllm/lmcache.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import ROOT
from bench._lib.load import Reply, stream_turn
from bench._lib.peers import NO_VLLM, check_quiet, find_vllm_python, spread, vllm_env
from bench._lib.procs import cpu_seconds, free_port, vllm_pool_command, wait_ready
from bench._lib.report import pct, write_json
from bench.vllm.connector import connector_metrics

BLOCK = 32  # tokens per block: vLLM's CPU attention wants multiples of 32; LMCache's chunk
POOL_BLOCKS = 48
MODEL = "tiny"
ROWS = ("vllm", "lmcache", "kvheat")
ROW_NAMES = {"vllm": "vLLM alone", "lmcache": "LMCache (MP, LRU)",
             "kvheat": "KVHeatConnector (host)"}
BUDGETS_MIB = (8, 16, 32, 64, 256)
QUICK_BUDGETS_MIB = (16, 256)
CONVERSATIONS, TURNS = 12, 4
SYSTEM_TOKENS, TURN_TOKENS, ANSWER_TOKENS = 8 * BLOCK, 4 * BLOCK, 16
# KV bytes of one block of the tiny Llama: K and V, 4 layers, 2 KV heads of 64, float32.
BLOCK_BYTES = 2 * 4 * 2 * 64 * BLOCK * 4
CONNECTOR_MODULE = "kvheat.integrations.vllm_connector"
LMCACHE_VENV = ROOT / ".venv-lmcache"
START_TIMEOUT_S = 900.0  # a server's start on a loaded 2-core machine

_TEXT = ("the cache keeps hot blocks on the device while cold ones move to host memory and "
         "every request that shares a prefix reuses its keys and values so the first token "
         "comes sooner a user asks about the weather the news a recipe a bug in the build "
         "the answer lists steps numbers names places and dates in order")
WORDS = _TEXT.split(" ")


# ---- the workload ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chat:
    """One conversation: its system prompt, then (user text, fixed assistant answer) per
    turn."""

    system: str
    turns: tuple[tuple[str, str], ...]


def _text(tok: Any, rng: random.Random, head: str, n_tokens: int) -> str:
    """`head` then random words until the text is at least `n_tokens` tokens long."""
    words = [head]
    while len(tok.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words += [rng.choice(WORDS) for _ in range(4)]
    return " ".join(words)


def chats(tok: Any, seed: int, n: int = CONVERSATIONS, turns: int = TURNS) -> list[Chat]:
    """The `n` conversations of repeat `seed`: each its own system prompt (about
    SYSTEM_TOKENS), each turn about TURN_TOKENS of new user text and a fixed answer of about
    ANSWER_TOKENS. The same `seed` gives the same text."""
    out = []
    for c in range(n):
        rng = random.Random(1_000_003 * seed + c)
        system = _text(tok, rng, f"Conversation {seed}-{c}. You are assistant {c}.",
                       SYSTEM_TOKENS)
        out.append(Chat(system, tuple(
            (_text(tok, rng, f"Question {t}:", TURN_TOKENS),
             _text(tok, rng, f"Answer {t}:", ANSWER_TOKENS)) for t in range(turns))))
    return out


def schedule(n: int, turns: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order sent: round-robin, turn t of every conversation
    before turn t+1 of any."""
    return [(c, t) for t in range(turns) for c in range(n)]


def messages(chat: Chat, turn: int) -> list[dict[str, str]]:
    """The chat messages of `turn`: the system prompt, the earlier turns with their fixed
    answers, then this turn's user text."""
    msgs = [{"role": "system", "content": chat.system}]
    for user, answer in chat.turns[:turn]:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": chat.turns[turn][0]}]


def rotation(rows: Sequence[str], repeat: int) -> list[str]:
    """The rows' order in `repeat`: rotated by one each repeat (A B C, B C A, C A B, ...)."""
    k = repeat % len(rows) if rows else 0
    return [*rows[k:], *rows[:k]]


def working_set_blocks(tok: Any, convs: Sequence[Chat]) -> int:
    """Distinct full blocks of every prompt (each conversation's last turn holds the
    earlier ones), tokenized with the model's chat template as the server does."""
    from kvheat.cache.hashing import block_keys, root_key, tokens_to_bytes

    keys: set[bytes] = set()
    for chat in convs:
        tokens = tok.apply_chat_template(messages(chat, len(chat.turns) - 1), True)
        keys.update(block_keys(tokens_to_bytes(tokens), BLOCK, root_key(None))[0])
    return len(keys)


def lmcache_l1_gb(budget_mib: int) -> float:
    """LMCache's `--l1-size-gb` for a budget in MiB (LMCache's GB is 2**30 bytes)."""
    return budget_mib / 1024


# ---- the servers ------------------------------------------------------------------------------
def transfer_config(row: str, budget_mib: int, lmcache_port: int | None
                    ) -> dict[str, Any] | None:
    """The row's `--kv-transfer-config` (None: vLLM alone)."""
    if row == "vllm":
        return None
    if row == "lmcache":
        if lmcache_port is None:
            raise ValueError("the lmcache row needs its server's port")
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": lmcache_port}}
    if row == "kvheat":
        return {"kv_connector": "KVHeatConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"host_tier_size": budget_mib << 20}}
    raise ValueError(f"unknown row {row!r}; known: {', '.join(ROWS)}")


def lmcache_env() -> dict[str, str]:
    """LMCache's processes: no usage reports sent anywhere."""
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false"}


def _popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process in a session (process group) of its own, so that stopping it stops its
    children too (vLLM's engine core, LMCache's workers)."""
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop_group(proc: subprocess.Popen[bytes] | None, grace_s: float = 20.0) -> None:
    """SIGTERM to the process's group (a server drains), SIGKILL to the group if it has not
    exited within `grace_s`."""
    if proc is None:
        return
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if proc.poll() is None and pgid is not None:
        os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # what is left of the group (children)
    if proc.poll() is None:
        proc.wait(timeout=10)


def vllm_command(python: str, model_dir: Path, port: int, args: argparse.Namespace,
                 kv_transfer: dict[str, Any] | None) -> list[str]:
    """vLLM's OpenAI server as every row runs it: float32, prefix caching, cached tokens in
    usage, vLLM's pool shrunk to POOL_BLOCKS blocks of BLOCK tokens, the row's connector."""
    return vllm_pool_command(python, model_dir, MODEL, port, BLOCK, POOL_BLOCKS,
                             kv_transfer=kv_transfer)


def lmcache_command(python: str, port: int, http_port: int, metrics_port: int,
                    budget_mib: int) -> list[str]:
    """LMCache's multiprocess server: 32-token chunks (vLLM's block), an L1 (host memory)
    of the budget, LRU eviction, the transfer mode vLLM's CPU worker needs (`auto`); its
    other settings are its defaults (it starts evicting at 80% of L1, 20% at a time). Its
    request, HTTP and Prometheus ports are free ones on loopback."""
    return [python, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1",
            "--port", str(port), "--http-port", str(http_port),
            "--prometheus-port", str(metrics_port), "--chunk-size", str(BLOCK),
            "--l1-size-gb", repr(lmcache_l1_gb(budget_mib)), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto"]


@dataclass
class Server:
    """One row's vLLM server (and LMCache's server behind it, for the lmcache row)."""

    row: str
    budget_mib: int
    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    side: subprocess.Popen[bytes] | None = None  # LMCache's server
    side_log: Path | None = None

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server's process tree (and LMCache's)."""
        return cpu_seconds(self.proc.pid, tree=True) + (
            cpu_seconds(self.side.pid, tree=True) if self.side is not None else 0.0)

    def stop(self) -> None:
        """Stop vLLM first (it says goodbye to LMCache's server), then LMCache's server."""
        stop_group(self.proc)
        stop_group(self.side)

    def tail(self) -> str:
        """The end of the logs, for an error report."""
        out = self.log.read_text(errors="replace")[-3000:]
        if self.side_log is not None:
            out += "\n--- LMCache server:\n" + self.side_log.read_text(errors="replace")[-2000:]
        return out


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Until something accepts TCP connections on `port`; fails at once when `proc` exits."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"LMCache's server exited with {proc.returncode}: "
                               + log.read_text(errors="replace")[-2000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"LMCache's server did not listen on {port} in {timeout_s:.0f} s: "
                       + log.read_text(errors="replace")[-2000:])


# ---- one run ----------------------------------------------------------------------------------
@dataclass
class Run:
    """One row's run of one repeat: the replies, keyed (conversation, turn), and the wall
    time."""

    row: str
    budget_mib: int
    repeat: int
    wall_s: float
    cpu_s: float
    replies: dict[tuple[int, int], Reply] = field(default_factory=dict)


async def _send_all(base: str, convs: Sequence[Chat], max_tokens: int, timeout_s: float
                    ) -> dict[tuple[int, int], Reply]:
    """Every turn of `convs` in the round-robin order, one request at a time, streamed."""
    out: dict[tuple[int, int], Reply] = {}
    turns = min(len(c.turns) for c in convs)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + 5)) as http:
        for c, t in schedule(len(convs), turns):
            body = {"model": MODEL, "messages": messages(convs[c], t), "max_tokens": max_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            r = await stream_turn(http, base + "/v1/chat/completions", body, None, timeout_s,
                                  ttft_on_finish=True, require_done=True)
            r.conv, r.turn = c, t
            out[(c, t)] = r
    return out


def send_all(base: str, convs: Sequence[Chat], max_tokens: int, timeout_s: float
             ) -> tuple[dict[tuple[int, int], Reply], float]:
    """`_send_all` in a fresh event loop: the replies and the wall time."""
    t0 = time.perf_counter()
    replies = asyncio.run(_send_all(base, convs, max_tokens, timeout_s))
    return replies, time.perf_counter() - t0


def figures(run: Run) -> dict[str, Any]:
    """A run's figures (see the module's docstring); the per-request TTFTs kept raw."""
    replies = list(run.replies.values())
    ok = [r for r in replies if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpots = [x for x in (r.tpot for r in ok) if x is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {"row": run.row, "budget_mib": run.budget_mib, "repeat": run.repeat,
            "wall_s": run.wall_s, "server_cpu_s": run.cpu_s, "requests": len(replies),
            "errors": len(replies) - len(ok),
            "first_error": next((r.error for r in replies if not r.ok), None),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "served": cached / prompt if prompt else None,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p99_s": pct(ttft, 0.99),
            "tpot_mean_s": statistics.fmean(tpots) if tpots else None,
            "completion_tokens": sum(r.completion_tokens for r in ok),
            "ttfts": [round(x, 5) for x in ttft]}


def mismatches(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Every answer that differs from the first run's answer to the same prompt (same
    repeat, conversation and turn): greedy decoding must give the same text in every row
    and budget."""
    first: dict[tuple[int, int, int], tuple[Run, str]] = {}
    out = []
    for run in runs:
        for (c, t), r in sorted(run.replies.items()):
            if not r.ok:
                continue
            key = (run.repeat, c, t)
            if key not in first:
                first[key] = (run, r.text)
                continue
            ref, text = first[key]
            if r.text != text:
                out.append({"repeat": run.repeat, "conversation": c, "turn": t,
                            "row": run.row, "budget_mib": run.budget_mib,
                            "reference_row": ref.row, "reference_budget_mib": ref.budget_mib,
                            "text": r.text[:120], "reference_text": text[:120]})
    return out


# ---- the bench ---------------------------------------------------------------------------------
class Bench:
    """The model, the workload, and one group of servers per budget."""

    def __init__(self, args: argparse.Namespace, tmp: Path, pythons: dict[str, str]) -> None:
        from kvheat.engine.loader import Tokenizer, save_tiny_model

        self.args, self.tmp, self.pythons = args, tmp, pythons
        self.model_dir = save_tiny_model(tmp / "tiny-llama", seed=0)
        self.tok = Tokenizer.from_dir(self.model_dir)
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.loads = [chats(self.tok, rep) for rep in range(args.repeats)]
        warm_rng = random.Random(99)
        self.warmup = [Chat("Warm-up. " + " ".join(warm_rng.choice(WORDS) for _ in range(60)),
                            (("hello " * 20, "ok"), ("again " * 20, "ok")))]

    def start(self, row: str, budget_mib: int, suffix: str = "") -> Server:
        """The row's server(s) for `budget_mib`, started (not yet ready); `suffix` tells
        apart the logs of servers started again for the same budget (`--fresh`)."""
        a, tag = self.args, f"{row}-{budget_mib}MiB{'-' + suffix if suffix else ''}"
        run_dir = self.tmp / tag
        run_dir.mkdir()
        side = side_log = None
        lmc_port = None
        if row == "lmcache":
            lmc_port, http_port = free_port(), free_port()
            side_log = self.logs / f"{tag}-server.log"
            side = _popen(lmcache_command(self.pythons[row], lmc_port, http_port, free_port(),
                                          budget_mib), side_log, lmcache_env())
            try:
                wait_port(lmc_port, side, 300, side_log)
            except RuntimeError:
                stop_group(side)
                raise
        port = free_port()
        log = self.logs / f"{tag}.log"
        env = dict(vllm_env(a.threads, run_dir), PYTHONPATH=str(ROOT))
        if row == "lmcache":
            env.update(lmcache_env())
        if a.bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = a.bind
        proc = _popen(vllm_command(self.pythons[row], self.model_dir, port, a,
                                   transfer_config(row, budget_mib, lmc_port)), log, env)
        return Server(row, budget_mib, proc, f"http://127.0.0.1:{port}", log, side, side_log)

    def ready(self, srv: Server) -> None:
        """Until the server answers; then two short untimed turns of text of their own (a
        fresh server's first forwards pay one-time costs)."""
        wait_ready(srv.base, srv.proc, START_TIMEOUT_S, srv.log)
        if srv.side is not None and srv.side.poll() is not None:
            raise RuntimeError(f"LMCache's server exited with {srv.side.returncode}")
        replies, _ = send_all(srv.base, self.warmup, self.args.max_tokens, self.args.timeout)
        bad = [r.error for r in replies.values() if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad[0]}")

    def measure(self, srv: Server, repeat: int) -> Run:
        """One repeat's load through one server."""
        cpu0 = srv.cpu_s()
        replies, wall = send_all(srv.base, self.loads[repeat], self.args.max_tokens,
                                 self.args.timeout)
        run = Run(srv.row, srv.budget_mib, repeat, wall, srv.cpu_s() - cpu0, replies)
        f = figures(run)
        print(f"  {srv.budget_mib:4d} MiB {srv.row:8s} repeat {repeat}: served "
              f"{100 * (f['served'] or 0):5.1f}%  TTFT mean {1000 * (f['ttft_mean_s'] or 0):6.1f}"
              f" ms  P99 {1000 * (f['ttft_p99_s'] or 0):6.1f} ms  TPOT "
              f"{1000 * (f['tpot_mean_s'] or 0):5.2f} ms  wall {wall:6.2f} s  errors "
              f"{f['errors']}" + (f"  ({f['first_error']})" if f["first_error"] else ""),
              flush=True)
        return run

    def group(self, rows: list[str], budget_mib: int, runs: list[Run],
              failed: list[dict[str, Any]], metrics: dict[str, dict[str, float]]) -> None:
        """Every repeat at `budget_mib` on the same servers, or (`--fresh`) each repeat on
        servers of its own, started for it."""
        reps = list(range(self.args.repeats))
        for batch in ([[r] for r in reps] if self.args.fresh else [reps]):
            self.batch(rows, budget_mib, batch, runs, failed, metrics)

    def batch(self, rows: list[str], budget_mib: int, repeats: list[int], runs: list[Run],
              failed: list[dict[str, Any]], metrics: dict[str, dict[str, float]]) -> None:
        """Every row's server for `budget_mib` up at once; each of `repeats` sent to each
        row in the rotated order; at the end the kvheat row's `kvheat_*` counters into
        `metrics`. A server that does not start is reported and left out."""
        servers: list[Server] = []
        tag = f"r{repeats[0]}" if self.args.fresh else ""
        try:
            t = time.perf_counter()
            for row in rows:
                try:
                    servers.append(self.start(row, budget_mib, tag))
                except RuntimeError as e:
                    print(f"{row} at {budget_mib} MiB did not start, left out: {str(e)[-1500:]}",
                          file=sys.stderr, flush=True)
                    failed.append({"row": row, "budget_mib": budget_mib, "error": str(e)[-2000:]})
            for srv in list(servers):
                try:
                    self.ready(srv)
                except RuntimeError as e:
                    print(f"{srv.row} at {budget_mib} MiB did not start, left out: "
                          f"{str(e)[-1500:]}\n{srv.tail()}", file=sys.stderr, flush=True)
                    failed.append({"row": srv.row, "budget_mib": budget_mib,
                                   "error": str(e)[-2000:]})
                    srv.stop()
                    servers.remove(srv)
            print(f"{budget_mib} MiB: {len(servers)} servers up in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
            by_row = {s.row: s for s in servers}
            for rep in repeats:
                for row in rotation([r for r in rows if r in by_row], rep):
                    runs.append(self.measure(by_row[row], rep))
            if "kvheat" in by_row:  # the connector's own counters: loads, misses, puts
                metrics[f"kvheat@{budget_mib}{'/' + tag if tag else ''}"] = \
                    connector_metrics(by_row["kvheat"].base)
        except Exception:
            for srv in servers:
                print(f"--- {srv.row} {budget_mib} MiB:\n{srv.tail()}", file=sys.stderr)
            raise
        finally:
            for srv in servers:
                srv.stop()


# ---- the report -------------------------------------------------------------------------------
METRICS = ("served", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "wall_s", "server_cpu_s")


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget and row: each metric's median and range over the repeats, the prompt
    tokens (the same in every run) and the errors summed."""
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for f in results:
        cells.setdefault((f["budget_mib"], f["row"]), []).append(f)
    out = []
    for (budget, row), fs in sorted(cells.items(), key=lambda kv: (kv[0][0],
                                                                   ROWS.index(kv[0][1]))):
        cell: dict[str, Any] = {"budget_mib": budget, "row": row, "runs": len(fs),
                                "errors": sum(f["errors"] for f in fs),
                                "prompt_tokens": round(statistics.median(
                                    f["prompt_tokens"] for f in fs))}
        for m in METRICS:
            vals = [f[m] for f in fs if f[m] is not None]
            cell[m] = spread(vals) if vals else None
        out.append(cell)
    return out


def _cell(d: dict[str, float] | None, scale: float, spec: str, ranged: bool = True,
          unit: str = "") -> str:
    """A median with its unit, then (min-max) when there are several runs."""
    if not d:
        return "-"
    med = f"{d['median'] * scale:{spec}}{unit}"
    if not ranged or d["n"] < 2:
        return med
    return f"{med} ({d['min'] * scale:{spec}}-{d['max'] * scale:{spec}})"


def table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a markdown table: budget, row, served %, TTFT mean and P99, TPOT,
    wall, server CPU, errors (medians, ranges over the repeats in brackets)."""
    lines = ["| budget | row | prompt tokens served | TTFT mean ms | TTFT P99 ms | TPOT ms | "
             "wall s | server CPU s | errors |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in summary:
        lines.append(
            f"| {c['budget_mib']} MiB | {ROW_NAMES.get(c['row'], c['row'])} | "
            f"{_cell(c['served'], 100, '.1f', unit='%')} | {_cell(c['ttft_mean_s'], 1000, '.1f')} | "
            f"{_cell(c['ttft_p99_s'], 1000, '.1f')} | {_cell(c['tpot_mean_s'], 1000, '.2f')} | "
            f"{_cell(c['wall_s'], 1, '.2f')} | {_cell(c['server_cpu_s'], 1, '.1f')} | "
            f"{c['errors']} |")
    return "\n".join(lines)


def served_table(summary: Sequence[dict[str, Any]]) -> str:
    """Prompt tokens served from cache (median over the repeats), one row per row of the
    bench and one column per budget."""
    budgets = sorted({c["budget_mib"] for c in summary})
    rows = [r for r in ROWS if any(c["row"] == r for c in summary)]
    by = {(c["row"], c["budget_mib"]): c for c in summary}
    lines = ["| row | " + " | ".join(f"{b} MiB" for b in budgets) + " |",
             "|---|" + "---:|" * len(budgets)]
    for row in rows:
        cells = [_cell(by[(row, b)]["served"], 100, ".1f", ranged=False, unit="%")
                 if (row, b) in by and by[(row, b)]["served"] else "-" for b in budgets]
        lines.append(f"| {ROW_NAMES[row]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def repeats_table(report: dict[str, Any]) -> str:
    """Prompt tokens served in each repeat, per budget and row (whether a server kept the
    earlier repeats' blocks: `fresh` in the config)."""
    runs = report["runs"]
    reps = sorted({r["repeat"] for r in runs})
    by = {(r["budget_mib"], r["row"], r["repeat"]): r for r in runs}
    cells = sorted({(r["budget_mib"], r["row"]) for r in runs},
                   key=lambda k: (k[0], ROWS.index(k[1])))
    lines = ["| budget | row | " + " | ".join(f"repeat {i + 1}" for i in reps) + " |",
             "|---|---|" + "---:|" * len(reps)]
    for budget, row in cells:
        vals = [by.get((budget, row, i), {}).get("served") for i in reps]
        lines.append(f"| {budget} MiB | {ROW_NAMES[row]} | " + " | ".join(
            "-" if v is None else f"{100 * v:.1f}%" for v in vals) + " |")
    return "\n".join(lines)


def outputs_line(report: dict[str, Any]) -> str:
    """Whether the greedy answers agreed across every row and budget."""
    n, bad = report["compared_answers"], len(report["mismatches"])
    if not bad:
        return f"Greedy outputs: identical in every row and budget ({n} answers compared)."
    return (f"Greedy outputs: **{bad} of {n} answers differ** from the first run's answer to "
            "the same prompt (`mismatches` in the result file).")


def load_line(report: dict[str, Any]) -> str:
    """How busy the machine was when the run started and ended (other work shares the
    cores: then the times are not the peers' own)."""
    parts = [f"{x['when']}: CPUs {100 * x['busy_fraction']:.0f}% busy, load average "
             f"{x['loadavg_1m']:.1f}" for x in report.get("machine_load", [])]
    return "Machine load (" + "; ".join(parts) + f"), {report['machine']['cpus']} CPUs."


def python_versions(python: str) -> dict[str, str] | None:
    """vLLM's, torch's and (when there) LMCache's versions as `python` imports them; None
    when it cannot import vLLM."""
    code = ("import json, importlib.metadata as m, torch, vllm\n"
            "v = {'vllm': vllm.__version__, 'torch': torch.__version__}\n"
            "try:\n    v['lmcache'] = m.version('lmcache')\n"
            "except m.PackageNotFoundError:\n    pass\nprint(json.dumps(v))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, timeout=300,
                           env=lmcache_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return dict(json.loads(r.stdout.decode().strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"some of {', '.join(ROWS)}")
    ap.add_argument("--budgets", default=None,
                    help="host budgets in MiB, comma-separated (default "
                         f"{','.join(map(str, BUDGETS_MIB))}; --quick: "
                         f"{','.join(map(str, QUICK_BUDGETS_MIB))})")
    ap.add_argument("--repeats", type=int, default=3,
                    help="repeats (new text each), each sent to every row, the order rotated")
    ap.add_argument("--quick", action="store_true", help="one repeat, budgets 16 and 256: a check")
    ap.add_argument("--fresh", action="store_true",
                    help="new servers for every repeat (default: the repeats of a budget share "
                         "servers, which keep what earlier repeats left in their caches)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--threads", type=int, default=1, help="vLLM's compute threads, every row")
    ap.add_argument("--bind", default=None,
                    help="cores every row's compute threads bind to (VLLM_CPU_OMP_THREADS_BIND;"
                         " default vLLM's: 0 .. threads-1)")
    ap.add_argument("--timeout", type=float, default=120.0, help="a turn past it counts as hung")
    ap.add_argument("--vllm-python", default=None,
                    help="the python with vLLM for the vllm and kvheat rows (default: .venv)")
    ap.add_argument("--lmcache-python", default=str(LMCACHE_VENV / "bin" / "python"),
                    help="the python with vLLM and LMCache for the lmcache row (`make lmcache`)")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "vllm" / "lmcache.json"))
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: servers stopped
    rows = a.rows.split(",")
    if set(rows) - set(ROWS) or len(set(rows)) != len(rows):
        ap.error(f"--rows: some of {', '.join(ROWS)}, each once")
    if a.quick:
        a.repeats = 1
    budgets = [int(b) for b in a.budgets.split(",")] if a.budgets else \
        list(QUICK_BUDGETS_MIB if a.quick else BUDGETS_MIB)
    if a.repeats < 1 or not budgets or min(budgets) < 1:
        ap.error("--repeats at least 1, budgets at least 1 MiB")
    python = find_vllm_python(a.vllm_python)
    if python is None:
        print(f"{NO_VLLM}: nothing to run", file=sys.stderr)
        return 0
    versions = {"vllm_python": python_versions(python)}
    pythons = {"vllm": python, "kvheat": python}
    if "lmcache" in rows:
        lmc = python_versions(a.lmcache_python) if Path(a.lmcache_python).exists() else None
        versions["lmcache_python"] = lmc
        if lmc is None or "lmcache" not in lmc:
            print(f"the lmcache row is skipped: {a.lmcache_python} does not import vLLM and "
                  "LMCache (`make lmcache` builds .venv-lmcache)", flush=True)
            rows.remove("lmcache")
        else:
            pythons["lmcache"] = a.lmcache_python
            if lmc["vllm"] != (versions["vllm_python"] or {}).get("vllm"):
                print(f"WARNING: vLLM {lmc['vllm']} in LMCache's venv, "
                      f"{(versions['vllm_python'] or {}).get('vllm')} in the others'", flush=True)
    print(f"versions: {versions}", flush=True)
    report: dict[str, Any] = {
        "command": " ".join(["python bench/vllm/lmcache.py", *sys.argv[1:]]),
        "config": {**{k: v for k, v in vars(a).items() if k not in ("json",)},
                   "rows": rows, "budgets_mib": budgets, "pool_blocks": POOL_BLOCKS,
                   "block_tokens": BLOCK, "block_bytes": BLOCK_BYTES,
                   "conversations": CONVERSATIONS, "turns": TURNS,
                   "system_tokens": SYSTEM_TOKENS, "turn_tokens": TURN_TOKENS,
                   "answer_tokens": ANSWER_TOKENS},
        "versions": versions, "machine": {"cpus": os.cpu_count()}}
    check_quiet(report, "start")
    t0 = time.perf_counter()
    runs: list[Run] = []
    failed: list[dict[str, Any]] = []
    metrics: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvheat-lmcache-") as td:
        b = Bench(a, Path(td), pythons)
        ws = working_set_blocks(b.tok, b.loads[0])
        report["working_set_blocks"] = ws
        print(f"working set {ws} blocks of {BLOCK} tokens ({ws * BLOCK_BYTES / 2**20:.1f} MiB); "
              f"vLLM's pool {POOL_BLOCKS} blocks; budgets {budgets} MiB = "
              f"{[(m << 20) // BLOCK_BYTES for m in budgets]} blocks", flush=True)
        for budget in budgets:
            b.group(rows, budget, runs, failed, metrics)
    report["bench_wall_s"] = time.perf_counter() - t0
    check_quiet(report, "end", after_own_run=True)
    results = [figures(r) for r in runs]
    report["summary"] = summarize(results)
    report["mismatches"] = mismatches(runs)
    report["outputs_identical"] = not report["mismatches"]
    report["compared_answers"] = sum(len(r.replies) for r in runs)
    report["failed"] = failed
    report["connector_metrics"] = metrics
    report["runs"] = results
    print(f"\nvLLM CPU, tiny Llama (float32, {a.threads} thread), pool {POOL_BLOCKS} blocks x "
          f"{BLOCK}; {CONVERSATIONS} conversations x {TURNS} turns; median (range) over "
          f"{a.repeats} repeat(s)")
    print(table(report["summary"]))
    print()
    print(served_table(report["summary"]))
    print(outputs_line(report) + f" Bench wall {report['bench_wall_s']:.0f} s.")
    for m in report["mismatches"][:10]:
        print(f"  mismatch: {m}")
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
