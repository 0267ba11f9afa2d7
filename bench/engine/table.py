"""The engine benchmark (`make bench` runs it): the design's results table, from real forward passes on this machine.

One multi-turn workload (the built-in generator, or a Mooncake trace shrunk to CPU size)
runs through the engine once per strategy, in the same order, at the same concurrency:

- no cache: every prompt computed in full;
- whole-prompt KV cache: a prompt reuses KV only when the very same prompt ran before;
- block-shared cache, LRU and kvheat's heat policy, on the device pool alone;
- the same two with a host tier under the device pool.

Policies are compared at equal memory only: each row names its memory (device, or device
+ host) and stands beside Belady's prefix hit rate for that same memory (the offline
optimum; a bound: requests one at a time, nothing held by running requests). The default
workload is sized so that the device budget matters (Belady well above LRU there).

TTFT is measured from the moment a request enters the engine to its first token.
"KV memory saved" is 1 - (distinct blocks the running requests hold) / (blocks they would
hold without sharing), summed over every engine step.

    python bench/engine/table.py [--json results/engine/table.json] [--trace PATH]
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

if not __package__:  # run as `python bench/engine/table.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.workload import EngineRequest, cpu_workload, materialize, scale_trace
from kvheat.cache import CacheConfig, KVCacheManager, policy_names
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.replay import PreparedTrace, load_trace, replay
from kvheat.replay.traces import TraceRequest
from kvheat.tiers.spec import TierSpec


@dataclass(slots=True)
class Strategy:
    name: str
    prefix_caching: str  # "off" | "exact" | "block"
    policy: str = "lru"
    host_tier: bool = False


STRATEGIES = {
    "none": Strategy("no cache", "off"),
    "whole": Strategy("whole-prompt KV cache", "exact"),
    "lru": Strategy("block-shared LRU, device", "block", "lru"),
    "kvheat": Strategy("block-shared kvheat, device", "block", "kvheat"),
    "lru-host": Strategy("block-shared LRU, device+host", "block", "lru", host_tier=True),
    "kvheat-host": Strategy("block-shared kvheat, device+host", "block", "kvheat", host_tier=True),
}
DEFAULT_STRATEGIES = ["none", "whole", "lru", "kvheat", "lru-host", "kvheat-host"]


@dataclass(slots=True)
class StrategyResult:
    strategy: str
    prefix_caching: str
    policy: str
    host_tier: bool
    requests: int
    mean_ttft_ms: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float
    hit_rate: float  # prompt tokens served from cache (any tier) / prompt tokens
    host_hit_tokens: int  # of which loaded from the host tier
    kv_memory_saved: float
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    engine_s: float  # time spent in this strategy's engine steps
    output_tokens_per_s: float


@dataclass(slots=True)
class BenchConfig:
    family: str = "llama"
    model_path: str | None = None
    num_blocks: int = 128
    host_blocks: int = 128  # host tier under the device, for strategies that have one
    block_size: int = 16
    concurrency: int = 4
    max_batched_tokens: int = 256
    conversations: int = 64  # enough that 128 device blocks hold well under the working set
    resubmit_frac: float = 0.15
    trace: str | None = None
    trace_limit: int = 300
    max_input: int = 1500
    seed: int = 0
    threads: int = 1  # one thread: steadier on a shared machine (0: torch's default)
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))


def build_workload(cfg: BenchConfig, vocab_size: int) -> list[EngineRequest]:
    if cfg.trace is None:
        _, reqs = cpu_workload(cfg.block_size, vocab_size, cfg.conversations,
                               cfg.resubmit_frac, cfg.seed, cfg.max_input)
        return reqs
    trace = load_trace(cfg.trace, 512, limit=cfg.trace_limit)
    scaled = scale_trace(trace, 512, cfg.block_size, cfg.max_input, max_output=64)
    if not scaled:
        raise click.ClickException(f"no request of {cfg.trace} fits {cfg.max_input} tokens after scaling")
    return materialize(scaled, cfg.block_size, vocab_size, cfg.seed)


class BusyClock:
    """Seconds this engine has spent inside its own steps. The strategies run in lockstep
    (one step each in turn), so a load spike on a shared machine hits them all alike; each
    engine's TTFT counts only its own work, as on a machine of its own (the closed loop
    keeps an engine busy whenever a request waits)."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.started: float | None = None

    def __call__(self) -> float:
        if self.started is None:
            return self.busy
        return self.busy + time.perf_counter() - self.started

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> None:
        assert self.started is not None
        self.busy += time.perf_counter() - self.started
        self.started = None


class StrategyRun:
    """One strategy's engine over the whole workload, at most `concurrency` in flight."""

    def __init__(self, model: torch.nn.Module, reqs: list[EngineRequest], strat: Strategy,
                 cfg: BenchConfig) -> None:
        ecfg = EngineConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            policy=strat.policy, seed=cfg.seed,
                            tiers=TierSpec(host_blocks=cfg.host_blocks if strat.host_tier else 0),
                            scheduler=SchedulerConfig(
                                prefix_caching=strat.prefix_caching,
                                max_num_batched_tokens=cfg.max_batched_tokens,
                                max_num_seqs=cfg.concurrency))
        self.clock = BusyClock()
        self.engine = LLMEngine(model, None, ecfg, clock=self.clock)
        self.strat = strat
        self.concurrency = cfg.concurrency
        self.pending = deque(reqs)
        self.in_flight = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.out_tokens = 0

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished

    def step(self) -> int:
        """One engine step (topping up the requests in flight first); returns how many
        requests finished."""
        engine = self.engine
        while self.pending and self.in_flight < self.concurrency:
            r = self.pending.popleft()
            engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                               tenant=r.tenant, session=r.session)
            self.in_flight += 1
        self.clock.start()
        try:
            outs = engine.step()
        finally:
            self.clock.stop()
        n = 0
        for tok in outs:
            if tok.finished:
                out = engine.release(tok.request_id)
                self.in_flight -= 1
                m = out.metrics
                assert m.ttft is not None
                self.ttft.append(m.ttft)
                self.itl.extend(m.inter_token_latencies)
                self.out_tokens += len(out.output_token_ids)
                n += 1
        return n

    def result(self) -> StrategyResult:
        ms = np.array(self.ttft) * 1000.0
        st, busy = self.engine.stats, self.clock.busy
        tiers = self.engine.tiers
        return StrategyResult(
            self.strat.name, self.strat.prefix_caching, self.strat.policy, self.strat.host_tier,
            len(self.ttft), float(ms.mean()), float(np.percentile(ms, 50)),
            float(np.percentile(ms, 99)), float(np.mean(self.itl) * 1000.0) if self.itl else 0.0,
            self.engine.cache.stats.hit_rate,
            tiers.counters.lower_hit_tokens if tiers is not None else 0,
            st.kv_memory_saved, st.prefill_tokens, st.decode_tokens, st.preemptions, busy,
            self.out_tokens / busy)


def run_strategies(model: torch.nn.Module, reqs: list[EngineRequest], strategies: list[Strategy],
                   cfg: BenchConfig, tick: Callable[[int], None] | None = None) -> list[StrategyResult]:
    runs = [StrategyRun(model, reqs, s, cfg) for s in strategies]
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                n = r.step()
                if n and tick is not None:
                    tick(n)
    return [r.result() for r in runs]


def prompt_trace(reqs: list[EngineRequest], block_size: int) -> list[TraceRequest]:
    """The prompts as a trace of block ids: a full block's id names its prefix, as the
    cache's chained keys do; a partial last block is never cached by the engine, so it
    gets an id of its own."""
    mgr = KVCacheManager(CacheConfig(num_blocks=1, block_size=block_size))
    ids: dict[bytes, int] = {}
    out = []
    for i, r in enumerate(reqs):
        req = mgr.make_request(str(i), r.prompt, r.tenant)
        hids = [ids.setdefault(k, len(ids)) for k in req.keys]
        if len(r.prompt) % block_size:
            hids.append(-(i + 1) & 0xFFFFFFFFFFFF | 1 << 60)
        out.append(TraceRequest(float(i), len(r.prompt), r.max_tokens, hids, r.session, r.tenant))
    return out


def belady_bound(reqs: list[EngineRequest], cfg: BenchConfig) -> dict[str, float]:
    pt = PreparedTrace(prompt_trace(reqs, cfg.block_size), cfg.block_size)
    cap = cfg.num_blocks * cfg.block_size
    cap_host = (cfg.num_blocks + cfg.host_blocks) * cfg.block_size
    return {"belady": replay(pt, "belady", cap, cfg.block_size).hit_rate,
            "belady_device_plus_host": replay(pt, "belady", cap_host, cfg.block_size).hit_rate,
            "lru_one_at_a_time": replay(pt, "lru", cap, cfg.block_size).hit_rate,
            "infinite": pt.infinite_hit_rate()}


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    from kvheat.engine.loader import load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, _, mcfg = load_model(cfg.model_path, cfg.family, seed=cfg.seed)
    reqs = build_workload(cfg, mcfg.vocab_size)
    strategies = []
    notes: list[str] = []
    for key in cfg.strategies:
        strat = STRATEGIES[key]
        if strat.policy not in policy_names():
            notes.append(f"{strat.name}: policy {strat.policy!r} is not registered; row skipped")
            continue
        strategies.append(strat)
    # Warm-up on a throwaway engine, so the first strategy pays no one-time costs.
    warm = LLMEngine(model, None, EngineConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size))
    warm.generate([r.prompt for r in reqs[:cfg.concurrency]], SamplingParams(max_tokens=4))
    with _progress(len(reqs) * len(strategies), progress) as tick:
        results = run_strategies(model, reqs, strategies, cfg, tick)
    bound = belady_bound(reqs, cfg)
    return {
        "config": {k: v for k, v in asdict(cfg).items()},
        "workload": {"requests": len(reqs), "prompt_tokens": sum(len(r.prompt) for r in reqs),
                     "output_tokens": sum(r.max_tokens for r in reqs),
                     "source": cfg.trace or "built-in multi-turn generator"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "results": [asdict(r) for r in results],
        "bound": bound,
        "notes": notes,
    }


class _progress:
    """A rich progress bar over all requests of all strategies (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self._p: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.progress import Progress

        self._p = Progress(transient=True)
        self._p.__enter__()
        task = self._p.add_task("kvheat bench", total=self.total)
        return lambda n: self._p.advance(task, n)

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)


def print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvheat.replay.report import print_uncut

    w = report["workload"]
    t = Table(title=f"kvheat bench: {w['requests']} requests, {w['prompt_tokens']} prompt tokens "
                    f"({w['source']}), {report['config']['num_blocks']} blocks of "
                    f"{report['config']['block_size']}")
    for col in ("strategy", "mean TTFT", "P99 TTFT", "KV memory saved", "prefix hit rate",
                "Belady, same memory", "tokens computed", "engine time"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    b = report["bound"]
    for r in report["results"]:
        bound = "-"
        if r["prefix_caching"] == "block":
            bound = f"{100 * b['belady_device_plus_host' if r['host_tier'] else 'belady']:.1f}%"
        t.add_row(r["strategy"], f"{r['mean_ttft_ms']:.1f} ms", f"{r['p99_ttft_ms']:.1f} ms",
                  f"{100 * r['kv_memory_saved']:.1f}%", f"{100 * r['hit_rate']:.1f}%", bound,
                  str(r["prefill_tokens"]), f"{r['engine_s']:.1f} s")
    print_uncut(t)
    for n in report["notes"]:
        click.echo(f"note: {n}")


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["strategy"].replace(" (", "\n(") for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = np.arange(len(rows))
    a1.bar(x - 0.2, [r["mean_ttft_ms"] for r in rows], 0.4, label="mean")
    a1.bar(x + 0.2, [r["p99_ttft_ms"] for r in rows], 0.4, label="P99")
    a1.set_xticks(x, names, fontsize=7)
    a1.set_ylabel("TTFT (ms)")
    a1.legend()
    a2.bar(x - 0.2, [100 * r["hit_rate"] for r in rows], 0.4, label="prefix hit rate")
    a2.bar(x + 0.2, [100 * r["kv_memory_saved"] for r in rows], 0.4, label="KV memory saved")
    a2.axhline(100 * report["bound"]["belady"], color="k", ls="--", lw=1, label="Belady hit rate")
    a2.set_xticks(x, names, fontsize=7)
    a2.set_ylabel("%")
    a2.legend(fontsize=7)
    fig.suptitle("kvheat bench (real forward passes, "
                 f"{report['workload']['requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@click.command("bench")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="A local Hugging Face model directory (default: the built-in tiny model).")
@click.option("--family", type=click.Choice(["llama", "qwen3", "deepseek"]), default="llama",
              show_default=True, help="Built-in tiny model family (without --model).")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Mooncake JSONL trace, scaled to CPU size (default: built-in generator).")
@click.option("--trace-limit", default=300, show_default=True, help="Requests read from --trace.")
@click.option("--conversations", default=64, show_default=True,
              help="Conversations of the built-in workload.")
@click.option("--resubmit", default=0.15, show_default=True,
              help="Fraction of requests resubmitted unchanged (regenerate/retry).")
@click.option("--num-blocks", default=128, show_default=True, help="Device KV blocks.")
@click.option("--block-size", default=16, show_default=True, help="Tokens per block.")
@click.option("--concurrency", default=4, show_default=True, help="Requests in flight at once.")
@click.option("--max-batched-tokens", default=256, show_default=True, help="Tokens per engine step.")
@click.option("--host-blocks", default=128, show_default=True,
              help="Host-tier blocks under the device, for rows with a host tier.")
@click.option("--strategies", default=",".join(DEFAULT_STRATEGIES), show_default=True,
              help=f"Rows to run, from {', '.join(STRATEGIES)}.")
@click.option("--threads", default=1, show_default=True,
              help="torch threads (0: torch's default); one is steadier on a shared machine.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the report here (and the plot beside it, unless --plot).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the table here.")
@click.option("--progress/--no-progress", default=True)
def bench_command(model_path: str | None, family: str, trace: str | None, trace_limit: int,
                  conversations: int, resubmit: float, num_blocks: int, host_blocks: int,
                  block_size: int,
                  concurrency: int, max_batched_tokens: int, strategies: str, threads: int,
                  seed: int, json_path: str | None, plot_path: str | None, progress: bool) -> None:
    """Replay a multi-turn workload through the engine once per cache strategy and print
    mean/P99 TTFT, KV memory saved and prefix hit rate, with Belady's hit rate as bound."""
    keys = [s.strip() for s in strategies.split(",") if s.strip()]
    bad = [k for k in keys if k not in STRATEGIES]
    if bad or not keys:
        raise click.BadParameter(f"unknown strategy {', '.join(bad)}; known: "
                                 f"{', '.join(STRATEGIES)}", param_hint="--strategies")
    for name, v in (("--num-blocks", num_blocks), ("--block-size", block_size),
                    ("--concurrency", concurrency), ("--max-batched-tokens", max_batched_tokens),
                    ("--conversations", conversations)):
        if v <= 0:
            raise click.BadParameter("must be positive", param_hint=name)
    cfg = BenchConfig(family=family, model_path=model_path, num_blocks=num_blocks,
                      host_blocks=host_blocks,
                      block_size=block_size, concurrency=concurrency,
                      max_batched_tokens=max_batched_tokens, conversations=conversations,
                      resubmit_frac=resubmit, trace=trace, trace_limit=trace_limit,
                      max_input=min(1500, (num_blocks // 2) * block_size), seed=seed,
                      threads=threads, strategies=keys)
    try:
        report = run_bench(cfg, progress)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    print_table(report)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
        click.echo(f"wrote {json_path}")
        if plot_path is None:
            plot_path = str(Path(json_path).with_suffix(".png"))
    if plot_path:
        plot(report, plot_path)
        click.echo(f"wrote {plot_path}")


if __name__ == "__main__":
    bench_command()
