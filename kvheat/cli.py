"""The `kvheat` command: replay traces, serve, route."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import click

if TYPE_CHECKING:
    from .replay import PreparedTrace
    from .replay.spool import Spool


class _Lazy(NamedTuple):
    """A command imported only when it runs: `serve`, `arms` and `route` pull in torch and
    FastAPI (seconds), which `kvheat --help`, `--version`, `replay` and `doctor` never need."""

    module: str
    attr: str
    needs: tuple[str, ...]  # its extra's packages: listed only when they are installed
    extra: str
    short_help: str  # for `kvheat --help`, which must not import the module


_LAZY = {
    "arms": _Lazy("kvheat.server.cli", "arms_command", ("torch", "fastapi"), "server",
                  "Print P99 TTFT and prefix hit rate per A/B arm of a running server."),
    "doctor": _Lazy("kvheat.doctor.cli", "doctor_command", ("prometheus_client",), "server",
                    "Rank the likely causes of an SLO breach or a hit-rate drop."),
    "route": _Lazy("kvheat.router.cli", "route_command", ("torch", "fastapi"), "server",
                   "Route OpenAI requests to replicas by a global prefix index."),
    "serve": _Lazy("kvheat.server.cli", "serve_command", ("torch", "fastapi"), "server",
                   "Serve an OpenAI-compatible API on the kvheat cache."),
}


def _installed(packages: tuple[str, ...]) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in packages)  # imports none


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [n for n, c in _LAZY.items() if _installed(c.needs)]
        return sorted({*super().list_commands(ctx), *lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        lazy = _LAZY.get(cmd_name)
        if lazy is None or cmd_name in self.commands:
            return super().get_command(ctx, cmd_name)
        try:
            cmd = getattr(importlib.import_module(lazy.module), lazy.attr)
        except ImportError as e:
            raise click.UsageError(f"`kvheat {cmd_name}` needs the {lazy.extra} extra "
                                   f"(pip install 'kvheat[{lazy.extra}]'): {e}") from None
        self.add_command(cmd, cmd_name)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.commands.get(name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(formatter.width - 6 - len(name))))
            elif cmd is None:
                rows.append((name, _LAZY[name].short_help))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _version() -> str:
    try:
        return importlib.metadata.version("kvheat")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


@click.group(cls=_Group)
@click.version_option(_version(), "--version", prog_name="kvheat",
                      message="%(prog)s %(version)s")
def main() -> None:
    """kvheat: a KV-cache manager for LLM inference."""


class _PositiveNumber(click.ParamType):
    """A finite number > 0 (click's FloatRange lets nan and inf through)."""

    name = "number"

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        try:
            v = float(value) if isinstance(value, (int, float, str)) else math.nan
        except (ValueError, OverflowError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v) or v <= 0:
            self.fail(f"{value!r} is not a finite number > 0", param, ctx)
        return v


POSITIVE = _PositiveNumber()


def _names(text: str, option: str, what: str) -> list[str]:
    """A comma-separated list of names: none empty, none twice, at least one."""
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise click.BadParameter(f"an empty {what} name in {text!r}", param_hint=option)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise click.BadParameter(f"{what} {', '.join(dup)} given twice", param_hint=option)
    return names


def _token_list(text: str, option: str, block_tokens: int) -> list[int]:
    """Comma-separated token counts (`parse_tokens`), each at least one block."""
    from .replay import parse_tokens

    out = []
    for item in text.split(","):
        try:
            v = parse_tokens(item)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=option) from None
        if v < block_tokens:
            raise click.BadParameter(f"{item.strip()} tokens hold no {block_tokens}-token block "
                                     f"(--block-tokens)", param_hint=option)
        out.append(v)
    return out


def _check_memory(pt: PreparedTrace | Spool, caps: list[int], hold: bool, replicas: int | None, shared: int) -> None:
    """Refuse a run whose caches would not fit in the memory left (after clamping each to
    the blocks the trace can fill, `pool_blocks`), before allocating any of it."""
    from .replay.replayer import BLOCK_BYTES, available_memory, pool_blocks

    avail = available_memory()
    if avail is None:
        return
    for c in caps:
        if replicas is None:
            blocks, where = pool_blocks(pt, c, hold), f"a cache of {c:,} tokens"
        else:  # N caches, then one of N x C (+ shared) for the bound
            blocks = replicas * pool_blocks(pt, c) + pool_blocks(pt, replicas * c + shared)
            where = f"{replicas:,} caches of {c:,} tokens (and the bound's cache)"
        need = blocks * BLOCK_BYTES + (replicas or 0) * _REPLICA_BYTES
        if need > avail:
            raise click.BadParameter(
                f"{where}: {blocks:,} blocks of {pt.block_tokens} tokens, about "
                f"{need / 2**30:.1f} GiB, but only {avail / 2**30:.1f} GiB of memory is "
                f"free", param_hint="--replicas" if replicas else "--capacity")


_REPLICA_BYTES = 256 * 1024  # a replica's cache, policy and router state, less its blocks


# Every policy worth comparing, kvheat (the default of the engine and server) and LRU-K
# included; Belady last, the offline bound the "gap" column measures against.
DEFAULT_POLICIES = "lru,arc,s3fifo,twoq,lruk,lirs,kvheat,belady"


def _given(ctx: click.Context, name: str) -> bool:
    src = ctx.get_parameter_source(name)
    return src is not None and src is not click.core.ParameterSource.DEFAULT


@main.command()
@click.argument("trace", default="builtin")
@click.option("--capacity", default="1M,3M,10M", show_default=True,
              help="Cache sizes in tokens, comma-separated: whole numbers, K/M/G = 10^3/6/9 "
                   "(1M, 2.5M, 1e9), each at least one block. A size beyond what the trace "
                   "can ever fill gives the same results as an unbounded cache: only the "
                   "blocks the trace can fill are allocated, the size is reported as given. "
                   "Sizes whose blocks would not fit in this machine's free memory are "
                   "refused.")
@click.option("--policy", "policies", default=None,
              help=f"Eviction policies, comma-separated [default: {DEFAULT_POLICIES}; "
                   "with --replicas: kvheat].")
@click.option("--block-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens per block.")
@click.option("--hold", is_flag=True, help="Hold each request's blocks for its modelled duration.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests.")
@click.option("--time-scale", type=POSITIVE, default=1.0, show_default=True,
              help="Multiply every timestamp by K (finite, > 0): what if the traffic were 1/K "
                   "times as fast.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the results as one JSON object here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of hit rate against capacity here.")
@click.option("--misses/--no-misses", default=True, help="Print the miss breakdown.")
@click.option("--format", "fmt", type=click.Choice(["auto", "mooncake", "vllm-events", "vllm-log",
                                                    "kv-cache-tester"]),
              default="auto", show_default=True,
              help="TRACE's format: Mooncake JSONL, vLLM KV events (JSON lines), a vLLM request "
                   "log, or kv-cache-tester's agentic session files (TRACE a folder of "
                   "trace_*.json, or its parent with raw/, or one file).")
@click.option("--group", type=click.IntRange(min=1), default=None,
              help="kv-cache-tester: 64-token blocks per block, full groups only [default: "
                   "--block-tokens / 64, i.e. 8]; sets --block-tokens to 64 x N.")
@click.option("--session-offset-s", type=click.FloatRange(min=0, max=1e9), default=0.0,
              show_default=True,
              help="kv-cache-tester: start each session at a random offset in [0, S) seconds "
                   "(seeded by --seed; 0: all at once).")
@click.option("--session-span-s", type=POSITIVE, default=None,
              help="kv-cache-tester: drop requests more than S seconds into their session.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="The seed of --copies' offsets (and kv-cache-tester's session offsets and "
                   "--max-sessions), and of --curve's key sample.")
@click.option("--sessions", "session_names", default=None,
              help="kv-cache-tester: the session files to read, by stem (trace_0004,...).")
@click.option("--max-sessions", type=click.IntRange(min=1), default=None,
              help="kv-cache-tester: draw this many session files at random (seeded).")
@click.option("--copies", type=click.IntRange(min=1, max=100_000), default=1, show_default=True,
              help="Play the trace N times at once, each copy its own sessions and blocks "
                   "(kv-cache-tester: each session file, at its own offset; a Mooncake trace: "
                   "the whole file, at a seeded offset within its span), read as a stream: a "
                   "day of traffic from an hour's trace.")
@click.option("--subagents/--no-subagents", default=True, show_default=True,
              help="kv-cache-tester: replay nested sub-agent sessions.")
@click.option("--hints/--no-hints", default=True, show_default=True,
              help="Pass each request's session and finish reason to the cache (when the "
                   "trace has them); --no-hints replays the prompts alone.")
@click.option("--lookahead", type=click.IntRange(min=0, max=1_000_000), default=0,
              show_default=True,
              help="Queue the next N requests while each is served (the queued-blocks hint, "
                   "as a server's waiting queue); 0 queues none.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Simulate a cluster: N caches of CAPACITY each behind each --router.")
@click.option("--router", "routers", default="rr,least-load,prefix-hash,sglang-like,kvheat",
              show_default=True, help="With --replicas: routing policies, comma-separated.")
@click.option("--shared-capacity", default=None,
              help="With --replicas: a shared (Redis) tier of this many tokens for all replicas.")
@click.option("--prefill-tps", type=POSITIVE, default=20_000.0,
              show_default=True, help="With --replicas: modelled prefill tokens/s per replica.")
@click.option("--decode-tps", type=POSITIVE, default=50.0,
              show_default=True, help="With --replicas: modelled decode tokens/s per sequence.")
@click.option("--overload-guard", is_flag=True,
              help="With --replicas: the kvheat router leaves overloaded affinity replicas.")
@click.option("--jobs", type=click.IntRange(min=1, max=256), default=1, show_default=True,
              help="Run the policies and capacities (and curve points) in N processes.")
@click.option("--curve", is_flag=True,
              help="Also print (and with --json/--plot write) each policy's hit rate against "
                   "capacity: LRU exact by stack distance, the others replayed, on a sampled "
                   "miniature when the trace is large (its error against the table's full "
                   "replays shown), with the capacity reaching 90% of an unbounded cache.")
@click.option("--curve-points", type=click.IntRange(min=2, max=64), default=12, show_default=True,
              help="With --curve: capacities on the curve, log-spaced up to the trace's "
                   "footprint.")
@click.option("--explain", is_flag=True,
              help="Print what each adaptive policy learned over the trace: kvheat's "
                   "half-life multiple, each move its miniature simulations made and the "
                   "lead (in standard errors) that made it (also in --json).")
@click.pass_context
def replay(ctx: click.Context, trace: str, capacity: str, policies: str | None,
           block_tokens: int, hold: bool, limit: int | None, time_scale: float,
           json_path: str | None, plot_path: str | None, misses: bool, fmt: str,
           replicas: int | None, routers: str, shared_capacity: str | None,
           prefill_tps: float, decode_tps: float, overload_guard: bool, group: int | None,
           session_offset_s: float, session_span_s: float | None, seed: int,
           session_names: str | None, max_sessions: int | None, copies: int,
           subagents: bool, hints: bool, lookahead: int, jobs: int, curve: bool,
           curve_points: int, explain: bool) -> None:
    """Replay TRACE through the cache, or with --replicas through a cluster of caches.

    TRACE is a Mooncake JSONL file, vLLM's KV events or request log, or 'builtin' for the
    generator; with --replicas the cluster runs behind each routing policy.

    Every line of TRACE is checked (a Mooncake line: hash_ids a non-empty list of integer
    block ids in [0, 2**64), input_length an integer that fits them, output_length an
    integer >= 0, timestamp a finite number of ms >= 0, session_id, tenant and stop
    strings); a bad line, like an empty trace, is an error naming the file and line. A
    kv-cache-tester session file is checked the same way, field by field."""
    from itertools import islice

    from rich.progress import Progress

    from .cache import policy_names
    from .replay import PreparedTrace, TraceError, generate_workload
    from .replay.curves import KNEE
    from .replay.parallel import ReplayTask, run_replays
    from .replay.report import plot, print_misses, print_table, summarize, write_json
    from .replay.spool import Spool
    from .replay.traces import TraceRequest, iter_copies, iter_trace

    if fmt == "auto" and trace != "builtin" and Path(trace).is_dir():
        fmt = "kv-cache-tester"  # a folder: of session files (a file's format is detected below)
    tester = [o for o, n in (("--group", "group"), ("--session-offset-s", "session_offset_s"),
                             ("--session-span-s", "session_span_s"),
                             ("--sessions", "session_names"), ("--max-sessions", "max_sessions"),
                             ("--subagents", "subagents"))
              if _given(ctx, n)]
    if tester and fmt != "kv-cache-tester":
        raise click.UsageError(f"{', '.join(tester)}: only with --format kv-cache-tester")
    if _given(ctx, "seed") and fmt != "kv-cache-tester" and copies == 1 and not curve:
        raise click.UsageError("--seed: only with --format kv-cache-tester, --copies or --curve "
                               "(nothing else is drawn at random)")
    if fmt == "kv-cache-tester":
        if group is None:
            if block_tokens % 64:
                raise click.BadParameter("kv-cache-tester blocks are groups of 64 tokens: "
                                         "give --group or a multiple of 64", param_hint="--block-tokens")
            group = block_tokens // 64
        elif _given(ctx, "block_tokens") and block_tokens != 64 * group:
            raise click.BadParameter(f"--group {group} makes {64 * group}-token blocks, not "
                                     f"{block_tokens}", param_hint="--block-tokens")
        block_tokens = 64 * group
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("plots need matplotlib: pip install 'kvheat[plot]'",
                                 param_hint="--plot")
    caps = _token_list(capacity, "--capacity", block_tokens)
    _check_writable(json_path, "--json")
    _check_writable(plot_path, "--plot")
    if replicas is None:
        extra = [o for o, n in (("--router", "routers"), ("--shared-capacity", "shared_capacity"),
                                ("--prefill-tps", "prefill_tps"), ("--decode-tps", "decode_tps"),
                                ("--overload-guard", "overload_guard")) if _given(ctx, n)]
        if extra:
            raise click.UsageError(f"{', '.join(extra)}: only with --replicas (a cluster)")
    elif hold or lookahead:
        raise click.UsageError(f"{'--hold' if hold else '--lookahead'} is not modelled with "
                               "--replicas")
    elif curve or _given(ctx, "jobs"):
        raise click.UsageError(f"{'--curve' if curve else '--jobs'}: not with --replicas")
    if trace == "builtin" and fmt != "auto":
        raise click.BadParameter("the built-in workload has no file format", param_hint="--format")
    if policies is None:
        policies = "kvheat" if replicas is not None else DEFAULT_POLICIES
    pols = _names(policies, "--policy", "policy")
    unknown = [p for p in pols if p not in policy_names()]
    if unknown:
        raise click.BadParameter(f"unknown policy {', '.join(unknown)}; known: "
                                 f"{', '.join(policy_names())}", param_hint="--policy")
    cluster: tuple[list[str], int] | None = None
    if replicas is not None:
        cluster = _cluster_options(pols, routers, shared_capacity, block_tokens)
    detected = False
    reqs: Iterable[TraceRequest]
    if trace == "builtin":
        reqs = generate_workload(block_tokens=block_tokens)[:limit]
        name = "built-in multi-turn workload"
    else:
        from .replay.vllm_trace import detect_format, iter_vllm_log, load_kv_events

        detected = fmt == "auto"
        try:
            fmt = detect_format(trace) if detected else fmt
            if fmt == "kv-cache-tester":
                from .replay.traces import SessionDraw, load_kv_cache_tester

                names = (tuple(_names(session_names, "--sessions", "session"))
                         if session_names is not None else None)
                reqs = load_kv_cache_tester(trace, SessionDraw(
                    group=block_tokens // 64, offset_s=float(session_offset_s), seed=seed,
                    span_s=session_span_s, sessions=names, max_sessions=max_sessions,
                    subagents=subagents, copies=copies))[:limit]
            elif copies > 1 and fmt != "mooncake":
                raise click.UsageError(f"--copies: Mooncake traces and kv-cache-tester "
                                       f"sessions only, not {fmt}")
            elif fmt == "vllm-events":
                reqs = load_kv_events(trace, block_tokens)[:limit]
            elif fmt == "vllm-log":
                reqs = islice(iter_vllm_log(trace, block_tokens), limit)
            elif copies > 1:
                reqs = iter_copies(trace, block_tokens, copies, seed, limit)
            else:
                reqs = iter_trace(trace, block_tokens, limit)
        except (OSError, TraceError) as e:
            raise click.ClickException(str(e)) from None
        name = Path(trace).name + (f" ({copies} copies)" if copies > 1 else "")
    how = f"read as {fmt}" + (", detected from its first line (--format picks another)"
                              if detected else "")
    if replicas is not None and cluster is not None:
        listed = list(reqs)
        if not listed:
            raise click.ClickException(f"{trace}: no requests in the trace ({how})")
        _check_time_scale(max(r.timestamp_ms for r in listed), time_scale)
        if time_scale != 1:
            name += f" (timestamps x{time_scale:g})"
        pt = PreparedTrace(listed, block_tokens)
        _check_memory(pt, caps, hold, replicas, cluster[1])
        _replay_cluster(pt, name, caps, pols, cluster[0], replicas, cluster[1], prefill_tps,
                        decode_tps, time_scale, json_path, plot_path, overload_guard)
        return
    try:
        with Progress(transient=True, disable=not sys.stderr.isatty()) as prog:
            prog.add_task("reading the trace", total=None)
            sp = Spool.build(reqs, block_tokens)
    except (OSError, TraceError) as e:
        raise click.ClickException(str(e)) from None
    if not sp.summary.requests:
        raise click.ClickException(f"{trace}: no requests in the trace ({how})")
    _check_time_scale(sp.summary.max_ms, time_scale)
    if time_scale != 1:
        name += f" (timestamps x{time_scale:g})"
    _check_memory(sp, caps, hold, None, 0)
    options = {"hold": hold, "time_scale": time_scale, "hints": hints, "lookahead": lookahead}
    tasks = [ReplayTask(0, p, c, options) for c in caps for p in pols]
    with Progress(transient=True, disable=not sys.stderr.isatty()) as prog:
        task = prog.add_task("replaying", total=len(tasks) * sp.summary.refs)

        def done(t: ReplayTask) -> None:
            prog.update(task, description=f"{t.policy} @ {t.capacity_tokens:,} tokens")
            prog.advance(task, sp.summary.refs)

        results = run_replays([sp], tasks, jobs, done)
    summary = summarize(name, block_tokens, sp.infinite_hit_rate(), results)
    summary["trace_stats"] = {"requests": sp.summary.requests, "block_references": sp.summary.refs,
                              "distinct_blocks": sp.summary.distinct}
    print_table(summary)
    if misses:
        print_misses(summary)
    if explain:
        from .replay.report import print_explain

        print_explain(summary)
    if curve:
        from .replay.curves import capacity_grid, policy_curves
        from .replay.report import print_curves

        grid = capacity_grid(sp, curve_points)
        with Progress(transient=True, disable=not sys.stderr.isatty()) as prog:
            prog.add_task("curves", total=None)
            curves = policy_curves(sp, pols, grid, results, jobs, seed, options=options)
        summary["curves"] = {"capacities": grid, "unbounded": sp.infinite_hit_rate(),
                             "knee_share": KNEE, "policies": [c.as_dict() for c in curves]}
        print_curves(summary)
    _write(write_json, summary, json_path, "--json")
    _write(plot, summary, plot_path, "--plot")


def _check_time_scale(last_ms: float, time_scale: float) -> None:
    if not math.isfinite(last_ms * time_scale):
        raise click.BadParameter(f"timestamps up to {last_ms:g} ms times {time_scale:g} overflow",
                                 param_hint="--time-scale")


def _check_writable(path: str | None, option: str) -> None:
    """Fail before a long replay, not after it, where its output cannot be written."""
    if not path:
        return
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(f"cannot create {parent}: {e.strerror or e}",
                                 param_hint=option) from None
    if not os.access(parent, os.W_OK):
        raise click.BadParameter(f"{parent} is not writable", param_hint=option)


def _write(fn: Callable[[dict, str], None], what: dict, path: str | None, option: str) -> None:
    if not path:
        return
    try:
        fn(what, path)
    except OSError as e:
        raise click.ClickException(f"{option} {path}: {e.strerror or e}") from None
    click.echo(f"wrote {path}")


def _cluster_options(pols: list[str], routers: str, shared_capacity: str | None,
                     block_tokens: int) -> tuple[list[str], int]:
    """The routers and the shared tier's tokens of a --replicas run, checked."""
    from .router.routing import ROUTING_POLICIES

    names = _names(routers, "--router", "router")
    unknown = [r for r in names if r not in ROUTING_POLICIES]
    if unknown:
        raise click.BadParameter(f"unknown router {', '.join(unknown)}; known: "
                                 f"{', '.join(ROUTING_POLICIES)}", param_hint="--router")
    if len(pols) != 1:
        raise click.BadParameter("with --replicas give one eviction --policy (default here: "
                                 "kvheat)", param_hint="--policy")
    if shared_capacity is None:
        return names, 0
    if "," in shared_capacity:
        raise click.BadParameter("one size, not a list", param_hint="--shared-capacity")
    return names, _token_list(shared_capacity, "--shared-capacity", block_tokens)[0]


def _replay_cluster(pt, name: str, caps: list[int], pols: list[str], names: list[str],
                    replicas: int, shared: int, prefill_tps: float,
                    decode_tps: float, time_scale: float, json_path: str | None,
                    plot_path: str | None, overload_guard: bool = False) -> None:
    from .replay.replayer import pool_blocks
    from .router.report import plot, print_table, summarize, write_json
    from .router.routing import make_routing_policy
    from .router.simulate import ClusterConfig, simulate

    results = []
    for c in caps:
        # A replica never holds more blocks than the trace can fill: a larger capacity is
        # simulated at that size (no eviction either way, the same results) and reported
        # as given.
        fill = pool_blocks(pt, c)
        run_c = c if fill == c // pt.block_tokens else fill * pt.block_tokens
        for r in names:
            cfg = ClusterConfig(replicas=replicas, capacity_tokens=run_c, cache_policy=pols[0],
                                shared_tokens=shared, prefill_tps=prefill_tps,
                                decode_tps=decode_tps, time_scale=time_scale)
            spec = (lambda ix: make_routing_policy("kvheat", ix, overload_guard=True)) \
                if r == "kvheat" and overload_guard else r
            res = simulate(pt, spec, cfg)
            res.capacity_tokens = c
            results.append(res)
    summary = summarize(name, results, block_tokens=pt.block_tokens, cache_policy=pols[0],
                        prefill_tps=prefill_tps, decode_tps=decode_tps, time_scale=time_scale)
    print_table(summary)
    _write(write_json, summary, json_path, "--json")
    _write(lambda s, p: plot([s], p), summary, plot_path, "--plot")


if __name__ == "__main__":
    main()
