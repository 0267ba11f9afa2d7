"""What a KV connector costs vLLM's CPU server per output token and per fresh prefill,
when there is nothing to load: vLLM alone, vLLM with a connector that does nothing
(`bench/vllm/noop_connector.py`) and vLLM with `KVHeatConnector` on a host tier.

One model on every row: the built-in tiny Llama (`kvheat.engine.loader.save_tiny_model`),
float32, 32-token blocks, vLLM's pool `--pool-blocks` blocks (48), prefix caching on.

Two loads, each draw sent to every row's server in turn, the order reversed every other
draw (A B C, C B A, ...), every prompt new (random token ids; nothing any server holds):
- `decode`: `--seqs` requests at once, each a `--prompt-tokens` prompt and
  `--output-tokens` greedy tokens (`ignore_eos`): time per output token (TPOT: from a
  request's first token to its last, over the tokens after the first), the median over
  the draw's requests. The whole batch fits vLLM's pool (no preemption); every 32nd token
  of a request fills a block, which the connector saves.
- `prefill`: `--prefill-prompts` prompts of `--prefill-tokens` tokens, one after the other,
  one output token each: time to first token (TTFT).

`--bind` sets each server's `VLLM_CPU_OMP_THREADS_BIND` (several: a server per row and
binding): a core list (default `0`, as the other vLLM benches bind) or `auto` (vLLM's
default, which sizes its compute threads by the cores left after its reservations; with a
KV connector it reserves one core more). Each server's binding as vLLM logged it is kept
in the JSON (`bindings`).

    python bench/vllm/decode.py --json docs/results/vllm/decode.json
    python bench/vllm/decode.py --bind 0,auto --rows vllm,noop,kvheat-host \
        --json docs/results/vllm/decode_bind.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
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

if not __package__:  # run as `python bench/vllm/decode.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, ROOT
from bench._lib.load import Reply, stream_turn
from bench._lib.peers import NO_VLLM, check_quiet, find_vllm_python, spread, vllm_env
from bench._lib.procs import free_port, stop, vllm_pool_command, wait_ready
from bench._lib.report import write_json
from kvheat.engine.loader import save_tiny_model

BLOCK = 32
MODEL = "tiny"
ROWS = ("vllm", "noop", "kvheat-host")
SECRET = "kvheat-bench-decode-tier-secret"
VOCAB_LO, VOCAB_HI = 10, 1000  # token ids drawn for prompts (the tiny vocabulary: 1,024)


def transfer_config(row: str, tier_bytes: int) -> dict[str, Any] | None:
    """The row's `--kv-transfer-config` (None: vLLM alone)."""
    if row == "vllm":
        return None
    if row == "noop":
        return {"kv_connector": "NoopConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "bench.vllm.noop_connector"}
    if row == "kvheat-host":
        return {"kv_connector": "KVHeatConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "kvheat.integrations.vllm_connector",
                "kv_connector_extra_config": {"host_tier_size": tier_bytes,
                                              "tier_secret": SECRET}}
    raise ValueError(f"unknown row {row!r}; known: {', '.join(ROWS)}")


@dataclass
class Server:
    name: str  # row@bind
    row: str
    bind: str
    proc: subprocess.Popen[bytes]
    base: str
    log: Path

    def binding(self) -> str | None:
        """The cores vLLM bound its compute threads to, as it logged them."""
        m = re.search(r"local_rank=0, core ids=(\[[0-9, ]*\])",
                      self.log.read_text(errors="replace"))
        return m.group(1) if m else None


def start(python: str, model_dir: Path, tmp: Path, row: str, bind: str,
          a: argparse.Namespace) -> Server:
    """vLLM's OpenAI server (float32, prefix caching, one compute thread unless `bind` is
    `auto`) with the row's connector."""
    port = free_port()
    name = f"{row}@{bind}"
    log = tmp / f"{row}-{bind}.log"
    cmd = vllm_pool_command(python, model_dir, MODEL, port, BLOCK, a.pool_blocks,
                            max_seqs=max(a.seqs, 8),
                            kv_transfer=transfer_config(row, a.tier_mib << 20),
                            prompt_details=False, log_stats=False)
    env = dict(vllm_env(1, tmp / name), PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="INFO")
    if bind == "auto":  # vLLM's own default: it sizes and binds the threads itself
        env.pop("VLLM_CPU_OMP_THREADS_BIND")
        env.pop("OMP_NUM_THREADS")
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        env["OMP_NUM_THREADS"] = str(len(bind.split(",")))
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    return Server(name, row, bind, proc, f"http://127.0.0.1:{port}", log)


def prompts(rng: random.Random, n: int, tokens: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(tokens)] for _ in range(n)]


async def _requests(base: str, batch: list[list[int]], max_tokens: int, at_once: bool,
                    timeout_s: float) -> list[Reply]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as http:
        def one(p: list[int]) -> Any:
            body = {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0.0,
                    "stream_options": {"include_usage": True}}
            return stream_turn(http, base + "/v1/completions", body, timeout_s=timeout_s,
                               ttft_on_finish=True, require_done=True)
        if at_once:
            return list(await asyncio.gather(*(one(p) for p in batch)))
        return [await one(p) for p in batch]


def run_decode(srv: Server, batch: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    replies = asyncio.run(_requests(srv.base, batch, a.output_tokens, True, a.timeout))
    wall = time.perf_counter() - t0
    tp = [t for t in (r.tpot for r in replies if r.ok) if t is not None]
    return {"wall_s": wall, "errors": sum(not r.ok for r in replies),
            "tpot_s": statistics.median(tp) if tp else None,
            "tpots": [round(t, 6) for t in tp],
            "tokens": sum(r.completion_tokens for r in replies),
            "first_error": next((r.error for r in replies if not r.ok), None)}


def run_prefill(srv: Server, batch: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    replies = asyncio.run(_requests(srv.base, batch, 1, False, a.timeout))
    tt = [r.ttft for r in replies if r.ok and r.ttft is not None]
    return {"errors": sum(not r.ok for r in replies),
            "ttft_s": statistics.median(tt) if tt else None,
            "ttfts": [round(t, 5) for t in tt],
            "first_error": next((r.error for r in replies if not r.ok), None)}


def summarize(runs: list[dict[str, Any]], metric: str, base: list[dict[str, Any]] | None
              ) -> dict[str, Any]:
    vals = [r[metric] for r in runs if r[metric] is not None]
    out: dict[str, Any] = {metric: spread(vals) if vals else None,
                           "errors": sum(r["errors"] for r in runs)}
    if base is not None:
        ratios = [r[metric] / b[metric] for r, b in zip(runs, base, strict=True)
                  if r[metric] and b[metric]]
        if ratios:
            out["ratio"] = {**spread(ratios), "ratios": [round(x, 4) for x in ratios]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"some of {', '.join(ROWS)}")
    ap.add_argument("--bind", default="0",
                    help="the compute threads' binding: a core list (`0`, `0,1`) or `auto` "
                         "(vLLM's default); several separated by `/` (`0/auto`): a server "
                         "per row and binding")
    ap.add_argument("--phases", default="decode,prefill")
    ap.add_argument("--repeats", type=int, default=6, help="draws, each sent to every server")
    ap.add_argument("--pool-blocks", type=int, default=48)
    ap.add_argument("--seqs", type=int, default=8, help="decode: requests at once")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=120)
    ap.add_argument("--prefill-prompts", type=int, default=12)
    ap.add_argument("--prefill-tokens", type=int, default=500)
    ap.add_argument("--tier-mib", type=int, default=256, help="KVHeatConnector's host tier")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", default=str(RESULTS / "vllm" / "decode.json"))
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = a.rows.split(",")
    binds = a.bind.split("/")
    phases = [p for p in a.phases.split(",") if p]
    if set(rows) - set(ROWS) or set(phases) - {"decode", "prefill"} or not phases:
        ap.error(f"--rows: some of {', '.join(ROWS)}; --phases: decode, prefill")
    if (a.prompt_tokens + a.output_tokens + BLOCK - 1) // BLOCK * a.seqs > a.pool_blocks:
        ap.error("the decode batch must fit vLLM's pool (no preemption)")
    python = find_vllm_python(a.vllm_python)
    if python is None:
        print(f"{NO_VLLM}: nothing to run", file=sys.stderr)
        return 0
    report: dict[str, Any] = {"command": " ".join(["python bench/vllm/decode.py", *sys.argv[1:]]),
                              "config": {k: v for k, v in vars(a).items() if k != "json"},
                              "machine": {"cpus": os.cpu_count()}}
    check_quiet(report, "start")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {} for p in phases}
    with tempfile.TemporaryDirectory(prefix="kvheat-vdecode-") as td:
        tmp = Path(td)
        model_dir = save_tiny_model(tmp / "tiny-llama")
        servers: list[Server] = []
        try:
            for bind in binds:
                for row in rows:
                    srv = start(python, model_dir, tmp, row, bind, a)
                    servers.append(srv)
                    wait_ready(srv.base, srv.proc, 900, srv.log)
                    warm = prompts(random.Random(1), a.seqs, a.prompt_tokens)
                    asyncio.run(_requests(srv.base, warm, 16, True, a.timeout))
                    print(f"{srv.name} up, compute bound to {srv.binding()}", flush=True)
            report["bindings"] = {s.name: s.binding() for s in servers}
            for n in range(a.repeats):
                order = servers if n % 2 == 0 else servers[::-1]
                for phase in phases:
                    rng = random.Random(1000 + n)
                    batch = prompts(rng, a.seqs, a.prompt_tokens) if phase == "decode" \
                        else prompts(rng, a.prefill_prompts, a.prefill_tokens)
                    for srv in order:
                        f = (run_decode if phase == "decode" else run_prefill)(srv, batch, a)
                        runs[phase].setdefault(srv.name, []).append(f)
                        m = f.get("tpot_s") if phase == "decode" else f.get("ttft_s")
                        print(f"  draw {n} {phase:7s} {srv.name:18s} "
                              f"{'TPOT' if phase == 'decode' else 'TTFT'} "
                              f"{1000 * (m or 0):7.2f} ms  errors {f['errors']}"
                              + (f" ({f['first_error']})" if f["first_error"] else ""),
                              flush=True)
        finally:
            for srv in servers:
                stop(srv.proc)
    check_quiet(report, "end", after_own_run=True)
    summary: dict[str, Any] = {}
    for phase, by in runs.items():
        metric = "tpot_s" if phase == "decode" else "ttft_s"
        summary[phase] = {}
        for name, rs in by.items():
            bind = name.split("@", 1)[1]
            base = by.get(f"vllm@{bind}") if not name.startswith("vllm@") else None
            summary[phase][name] = summarize(rs, metric, base)
    report["summary"] = summary
    report["runs"] = runs
    for phase, cells in summary.items():
        metric = "tpot_s" if phase == "decode" else "ttft_s"
        print(f"\n{phase}: {metric} median (range) over {a.repeats} draws; ratio to vLLM "
              "alone of the same binding, per draw")
        for name, c in cells.items():
            m, r = c[metric], c.get("ratio")
            if m is None:
                print(f"  {name:18s} no answers")
                continue
            print(f"  {name:18s} {1000 * m['median']:7.2f} ms ({1000 * m['min']:.2f}-"
                  f"{1000 * m['max']:.2f})" + (f"  x{r['median']:.3f} ({r['min']:.3f}-"
                                               f"{r['max']:.3f})" if r else ""))
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
