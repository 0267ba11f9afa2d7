"""Serving signals end to end (issue 40, item 6): the engine with sessions on, at equal
memory, kvheat with its hints against kvheat without them, LRU, LRU-K and vLLM's `sae`.

The workload is agentic: the sessions of `../shared/traces/agentic/agentic_dev.jsonl`
(Claude Code, top-level requests, in time order), made into real prompts at CPU size (`--group`
consecutive 512-token trace blocks become one engine block of `--block-size` tokens; a block
id names its whole prefix, so the last id of a group names the group's prefix), answers
scaled from the trace's output lengths. Each session's requests run one after another, as
an agent's do (the next starts once the previous answered); up to `--concurrency` run at
once and up to as many again wait in the engine's queue, so queued-block hints exist.

What each arm's cache policy is told (`SchedulerConfig.cache_hints`):
- hints on: the request's session, the blocks of the requests waiting in the queue, and at
  the end FINISHED with the trace's finish reason (`tool_use`, `end_turn`), as a server
  that knows the model's stop reason passes it (where the trace has none, the engine's
  own: `length`);
- hints off: none of it (the policy sees what it saw before hints existed).

All arms run in lockstep (one engine step each in turn) on their own busy-time clocks, and
the whole run is repeated with the arms' order rotated (A B C, B C A, ...): prefix hit
rate and TTFT are reported as median and range over the repeats, beside Belady's and the
one-at-a-time replay of the same prompts at the same memory.

    python bench/engine/sessions.py [--json docs/results/engine/sessions.json]
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

if not __package__:  # run as `python bench/engine/sessions.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.workload import EngineRequest, materialize
from bench.engine.table import BusyClock, prompt_trace
from kvheat.cache import policy_names
from kvheat.cache.hints import Outcome
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.replay import PreparedTrace, load_trace, replay
from kvheat.replay.traces import TraceRequest

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "agentic" / "agentic_dev.jsonl"


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    policy: str
    hints: bool


ARMS = {
    "kvheat+hints": Arm("kvheat+hints", "kvheat", True),
    "kvheat": Arm("kvheat", "kvheat", False),
    "lru": Arm("lru", "lru", False),
    "lruk": Arm("lruk", "lruk", False),
    "sae": Arm("sae", "sae", True),  # vLLM PR #50422's session-aware policy: sessions on
}
DEFAULT_ARMS = ["kvheat+hints", "kvheat", "lru", "lruk", "sae"]


@dataclass(slots=True)
class SessionRequest:
    prompt: list[int]
    max_tokens: int  # answer tokens, as the trace's (scaled)
    session: str
    stop: str | None  # the trace's finish reason (None where it has none)


@dataclass(slots=True)
class BenchConfig:
    trace: str = str(TRACE)
    limit: int = 800  # trace requests, in time order
    group: int = 16  # trace blocks per engine block
    block_size: int = 16
    output_scale: float = 1 / 64  # answer tokens per trace answer token
    max_output: int = 16
    num_blocks: int = 256
    concurrency: int = 4
    max_batched_tokens: int = 512
    repeats: int = 3
    seed: int = 0
    threads: int = 1
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))


def grouped(trace: list[TraceRequest], group: int, block_size: int, output_scale: float,
            max_output: int, max_input: int) -> list[tuple[int, TraceRequest]]:
    """Each `group` consecutive trace blocks as one block of `block_size` tokens (named by
    the group's last id: an id names its whole prefix); a partial last group is a partial
    block. Requests over `max_input` tokens after it are dropped; (index, request) kept."""
    out = []
    for i, r in enumerate(trace):
        ids = r.hash_ids
        full, rem = divmod(len(ids), group)
        new = [ids[(k + 1) * group - 1] for k in range(full)] + ([ids[-1]] if rem else [])
        n = full * block_size + (max(1, rem * block_size // group) if rem else 0)
        if n > max_input:
            continue
        out_tokens = max(1, min(max_output, round(r.output_length * output_scale)))
        out.append((i, TraceRequest(r.timestamp_ms, n, out_tokens, new, r.session, r.tenant)))
    return out


def load_workload(cfg: BenchConfig, vocab_size: int, max_input: int
                  ) -> tuple[list[TraceRequest], list[SessionRequest]]:
    trace = load_trace(cfg.trace, 512, limit=cfg.limit)
    kept = grouped(trace, cfg.group, cfg.block_size, cfg.output_scale, cfg.max_output,
                   max_input)
    keep = [r for _, r in kept]
    toks: list[EngineRequest] = materialize(keep, cfg.block_size, vocab_size, cfg.seed)
    return keep, [SessionRequest(e.prompt, e.max_tokens, e.session or f"r{i}",
                                 trace[i].finish_reason)
                  for (i, _), e in zip(kept, toks, strict=True)]


class ArmRun:
    """One arm's engine over the whole workload: each session's requests in order, one
    at a time; up to `concurrency` running and as many again queued in the engine."""

    def __init__(self, model: torch.nn.Module, reqs: list[SessionRequest], arm: Arm,
                 cfg: BenchConfig) -> None:
        ecfg = EngineConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            policy=arm.policy, seed=cfg.seed,
                            scheduler=SchedulerConfig(
                                max_num_batched_tokens=cfg.max_batched_tokens,
                                max_num_seqs=cfg.concurrency, cache_hints=arm.hints))
        self.clock = BusyClock()
        self.engine = LLMEngine(model, None, ecfg, clock=self.clock)
        self.arm = arm
        self.in_engine_max = 2 * cfg.concurrency
        self.pending = deque(enumerate(reqs))
        self.reqs = reqs
        self.busy_sessions: set[str] = set()
        self.live: dict[str, int] = {}  # request id -> index into reqs
        self.ttft: list[float] = []
        self.preemptions = 0

    @property
    def done(self) -> bool:
        return not self.pending and not self.live

    def _top_up(self) -> None:
        """Start requests in trace order, skipping (for now) those whose session has one
        running: the next request of an agent comes after its previous answer."""
        lookahead = 64
        i = 0
        while self.pending and len(self.live) < self.in_engine_max and i < len(self.pending) \
                and i < lookahead:
            idx, r = self.pending[i]
            if r.session in self.busy_sessions:
                i += 1
                continue
            del self.pending[i]
            # One token more than the answer when the serving layer ends it (below).
            extra = 1 if r.stop is not None else 0
            rid = self.engine.add_request(
                r.prompt, SamplingParams(max_tokens=r.max_tokens + extra, ignore_eos=True),
                session=r.session if self.arm.hints else None)
            self.live[rid] = idx
            self.busy_sessions.add(r.session)

    def step(self) -> int:
        self._top_up()
        engine = self.engine
        self.clock.start()
        try:
            outs = engine.step()
            ended = []
            for tok in outs:
                idx = self.live.get(tok.request_id)
                if idx is None:
                    continue
                r = self.reqs[idx]
                if tok.finished:
                    ended.append(tok.request_id)
                elif r.stop is not None and tok.index + 1 >= r.max_tokens:
                    # The answer is complete: the serving layer knows why it stopped (the
                    # trace's reason) and ends it so, as the server does on a stop string.
                    engine.abort(tok.request_id, r.stop, Outcome.FINISHED)
                    ended.append(tok.request_id)
        finally:
            self.clock.stop()
        for rid in ended:
            out = engine.release(rid)
            assert out.metrics.ttft is not None
            self.ttft.append(out.metrics.ttft)
            self.busy_sessions.discard(self.reqs[self.live.pop(rid)].session)
        return len(ended)

    def result(self) -> dict[str, Any]:
        ms = np.array(self.ttft) * 1000.0
        st = self.engine.stats
        return {"arm": self.arm.name, "policy": self.arm.policy, "hints": self.arm.hints,
                "requests": len(self.ttft), "hit_rate": self.engine.cache.stats.hit_rate,
                "mean_ttft_ms": float(ms.mean()), "p50_ttft_ms": float(np.percentile(ms, 50)),
                "p99_ttft_ms": float(np.percentile(ms, 99)),
                "prefill_tokens": st.prefill_tokens, "preemptions": st.preemptions,
                "engine_s": self.clock.busy}


def run_once(model: torch.nn.Module, reqs: list[SessionRequest], arms: list[Arm],
             cfg: BenchConfig) -> list[dict[str, Any]]:
    runs = [ArmRun(model, reqs, a, cfg) for a in arms]
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.step()
    return [r.result() for r in runs]


def bounds(reqs: list[SessionRequest], cfg: BenchConfig) -> dict[str, float]:
    """The same prompts replayed one at a time at the same memory (no running requests
    holding blocks, no answers cached): Belady's bound, and the policies without the
    engine, with the replayer's hints (the session and the trace's finish reason) where the
    arm has them."""
    prompts = prompt_trace([EngineRequest(r.prompt, r.max_tokens, r.session) for r in reqs],
                           cfg.block_size)
    pt = PreparedTrace([replace(t, finish_reason=r.stop) for t, r in zip(prompts, reqs,
                                                                          strict=True)],
                       cfg.block_size)
    cap = cfg.num_blocks * cfg.block_size
    out = {"infinite": pt.infinite_hit_rate()}
    known = policy_names()
    for name, pol, hints in (("belady", "belady", False), ("lru", "lru", False),
                             ("lruk", "lruk", False), ("kvheat", "kvheat", False),
                             ("kvheat+hints", "kvheat", True), ("sae", "sae", True)):
        if pol in known:
            out[name] = replay(pt, pol, cap, cfg.block_size, hints=hints).hit_rate
    return out


def summarize(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for name in [r["arm"] for r in rounds[0]]:
        rs = [r for rnd in rounds for r in rnd if r["arm"] == name]

        def agg(k: str, rs: list[dict[str, Any]] = rs) -> dict[str, float]:
            xs = [float(r[k]) for r in rs]
            return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

        out.append({"arm": name, "policy": rs[0]["policy"], "hints": rs[0]["hints"],
                    "requests": rs[0]["requests"],
                    **{k: agg(k) for k in ("hit_rate", "mean_ttft_ms", "p50_ttft_ms",
                                           "p99_ttft_ms", "prefill_tokens", "engine_s")}})
    return out


def run_bench(cfg: BenchConfig, echo: Any = print) -> dict[str, Any]:
    from kvheat.engine.loader import load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, _, mcfg = load_model(None, "llama", seed=cfg.seed)
    # room for the longest prompt and its answer beside the others' blocks
    max_input = min(mcfg.max_position_embeddings - cfg.max_output - 1,
                    (cfg.num_blocks // 2) * cfg.block_size)
    _, reqs = load_workload(cfg, mcfg.vocab_size, max_input)
    known = policy_names()
    notes = []
    arms = []
    for key in cfg.arms:
        a = ARMS[key]
        if a.policy in known:
            arms.append(a)
        else:
            notes.append(f"{a.name}: policy {a.policy!r} is not registered; arm skipped")
    warm = LLMEngine(model, None, EngineConfig(num_blocks=cfg.num_blocks,
                                               block_size=cfg.block_size))
    warm.generate([r.prompt for r in reqs[:cfg.concurrency]], SamplingParams(max_tokens=4))
    rounds = []
    for k in range(cfg.repeats):
        order = arms[k % len(arms):] + arms[:k % len(arms)]  # rotate: no arm always first
        t0 = time.perf_counter()
        res = run_once(model, reqs, order, cfg)
        echo(f"repeat {k + 1}/{cfg.repeats}: {time.perf_counter() - t0:.0f} s; " + ", ".join(
            f"{r['arm']} {100 * r['hit_rate']:.1f}% {r['p50_ttft_ms']:.1f} ms" for r in res))
        rounds.append(sorted(res, key=lambda r: [a.name for a in arms].index(r["arm"])))
    return {
        "config": asdict(cfg),
        "workload": {"source": Path(cfg.trace).name, "requests": len(reqs),
                     "sessions": len({r.session for r in reqs}),
                     "dropped_over_max_input": cfg.limit - len(reqs), "max_input": max_input,
                     "prompt_tokens": sum(len(r.prompt) for r in reqs),
                     "finish_reasons": {str(s): sum(1 for r in reqs if r.stop == s)
                                        for s in sorted({r.stop for r in reqs}, key=str)}},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "rounds": rounds,
        "summary": summarize(rounds),
        "bound": bounds(reqs, cfg),
        "notes": notes,
    }


def _fmt(a: dict[str, float], scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    return (f"{scale * a['median']:.{digits}f}{unit} "
            f"({scale * a['min']:.{digits}f}-{scale * a['max']:.{digits}f})")


def print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvheat.replay.report import print_uncut

    w, c, b = report["workload"], report["config"], report["bound"]
    t = Table(title=f"engine, sessions on: {w['requests']} requests of {w['sessions']} "
                    f"agentic sessions, {c['num_blocks']} blocks of {c['block_size']} "
                    f"(Belady {100 * b['belady']:.1f}%, one at a time), "
                    f"{c['repeats']} repeats: median (range)")
    for col in ("arm", "prefix hit rate", "mean TTFT", "P50 TTFT", "P99 TTFT",
                "tokens computed"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for r in report["summary"]:
        t.add_row(r["arm"], _fmt(r["hit_rate"], 100, "%", 2),
                  _fmt(r["mean_ttft_ms"], unit=" ms"), _fmt(r["p50_ttft_ms"], unit=" ms"),
                  _fmt(r["p99_ttft_ms"], unit=" ms"), _fmt(r["prefill_tokens"], digits=0))
    print_uncut(t)
    click.echo("one at a time (replay, same prompts and memory): " + ", ".join(
        f"{k} {100 * v:.2f}%" for k, v in b.items()))
    for n in report["notes"]:
        click.echo(f"note: {n}")


@click.command()
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=str(TRACE),
              show_default=True, help="An agentic trace (Mooncake JSONL with session_id, stop).")
@click.option("--limit", default=800, show_default=True, help="Trace requests, in time order.")
@click.option("--group", default=16, show_default=True,
              help="Consecutive 512-token trace blocks per engine block.")
@click.option("--num-blocks", default=256, show_default=True, help="Device KV blocks (every arm).")
@click.option("--block-size", default=16, show_default=True)
@click.option("--concurrency", default=4, show_default=True, help="Running requests at most.")
@click.option("--repeats", default=3, show_default=True, help="Whole runs, arm order rotated.")
@click.option("--arms", default=",".join(DEFAULT_ARMS), show_default=True,
              help=f"From {', '.join(ARMS)}.")
@click.option("--threads", default=1, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(trace: str, limit: int, group: int, num_blocks: int, block_size: int,
         concurrency: int, repeats: int, arms: str, threads: int, seed: int,
         json_path: str | None) -> None:
    """kvheat with hints vs without, LRU, LRU-K and sae, through the engine, sessions on."""
    keys = [a.strip() for a in arms.split(",") if a.strip()]
    bad = [k for k in keys if k not in ARMS]
    if bad or not keys:
        raise click.BadParameter(f"unknown arm {', '.join(bad)}; known: {', '.join(ARMS)}",
                                 param_hint="--arms")
    for name, v in (("--limit", limit), ("--group", group), ("--num-blocks", num_blocks),
                    ("--block-size", block_size), ("--concurrency", concurrency),
                    ("--repeats", repeats)):
        if v <= 0:
            raise click.BadParameter("must be positive", param_hint=name)
    cfg = BenchConfig(trace=trace, limit=limit, group=group, block_size=block_size,
                      num_blocks=num_blocks, concurrency=concurrency, repeats=repeats,
                      seed=seed, threads=threads, arms=keys)
    report = run_bench(cfg, click.echo)
    print_table(report)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
        click.echo(f"wrote {json_path}")


if __name__ == "__main__":
    main()
