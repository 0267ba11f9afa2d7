"""The `kvheat` command: replay traces, serve, route."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click


@click.group()
def main() -> None:
    """kvheat: a KV-cache manager for LLM inference."""


@main.command()
@click.argument("trace", default="builtin")
@click.option("--capacity", default="1M,3M,10M", show_default=True,
              help="Cache sizes in tokens, comma-separated (1M = 1,000,000).")
@click.option("--policy", "policies", default=None,
              help="Eviction policies, comma-separated [default: lru,arc,s3fifo,twoq,belady; "
                   "with --replicas: kvheat].")
@click.option("--block-tokens", default=512, show_default=True, help="Tokens per block.")
@click.option("--hold", is_flag=True, help="Hold each request's blocks for its modelled duration.")
@click.option("--limit", type=int, default=None, help="Replay only the first N requests.")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Multiply every timestamp by K: what if the traffic were 1/K times as fast.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the results as one JSON object here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of hit rate against capacity here.")
@click.option("--misses/--no-misses", default=True, help="Print the miss breakdown.")
@click.option("--format", "fmt", type=click.Choice(["auto", "mooncake", "vllm-events", "vllm-log"]),
              default="auto", show_default=True,
              help="TRACE's format: Mooncake JSONL, vLLM KV events (JSON lines) or a vLLM request log.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Simulate a cluster: N caches of CAPACITY each behind each --router.")
@click.option("--router", "routers", default="rr,least-load,prefix-hash,sglang-like,kvheat",
              show_default=True, help="With --replicas: routing policies, comma-separated.")
@click.option("--shared-capacity", default=None,
              help="With --replicas: a shared (Redis) tier of this many tokens for all replicas.")
@click.option("--prefill-tps", type=click.FloatRange(min=0, min_open=True), default=20_000.0,
              show_default=True, help="With --replicas: modelled prefill tokens/s per replica.")
@click.option("--decode-tps", type=click.FloatRange(min=0, min_open=True), default=50.0,
              show_default=True, help="With --replicas: modelled decode tokens/s per sequence.")
@click.option("--overload-guard", is_flag=True,
              help="With --replicas: the kvheat router leaves overloaded affinity replicas.")
def replay(trace: str, capacity: str, policies: str, block_tokens: int, hold: bool,
           limit: int | None, time_scale: float, json_path: str | None, plot_path: str | None,
           misses: bool, fmt: str, replicas: int | None, routers: str,
           shared_capacity: str | None, prefill_tps: float, decode_tps: float,
           overload_guard: bool) -> None:
    """Replay TRACE (a Mooncake JSONL file, vLLM's KV events or request log, or 'builtin'
    for the generator) through the cache, or with --replicas through a cluster of caches
    behind each routing policy."""
    from rich.progress import Progress

    from .cache import policy_names
    from .replay import PreparedTrace, TraceError, generate_workload, load_trace, parse_tokens
    from .replay import replay as run_replay
    from .replay.report import plot, print_misses, print_table, summarize, write_json

    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("plots need matplotlib: pip install 'kvheat[plot]'",
                                 param_hint="--plot")
    try:
        caps = [parse_tokens(c) for c in capacity.split(",") if c.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--capacity") from None
    if policies is None:
        policies = "kvheat" if replicas is not None else "lru,arc,s3fifo,twoq,belady"
    pols = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in pols if p not in policy_names()]
    if unknown:
        raise click.BadParameter(f"unknown policy {', '.join(unknown)}; known: "
                                 f"{', '.join(policy_names())}", param_hint="--policy")
    if trace == "builtin":
        reqs = generate_workload(block_tokens=block_tokens)
        name = "built-in multi-turn workload"
    else:
        from .replay.vllm_trace import detect_format, load_kv_events, load_vllm_log

        try:
            fmt = detect_format(trace) if fmt == "auto" else fmt
            if fmt == "vllm-events":
                reqs = load_kv_events(trace, block_tokens)
            elif fmt == "vllm-log":
                reqs = load_vllm_log(trace, block_tokens)
            else:
                reqs = load_trace(trace, block_tokens, limit)
        except (OSError, TraceError) as e:
            raise click.ClickException(str(e)) from None
        name = Path(trace).name
    if time_scale != 1:
        name += f" (timestamps x{time_scale:g})"
    if limit is not None:
        reqs = reqs[:limit]
    pt = PreparedTrace(reqs, block_tokens)
    if replicas is not None:
        _replay_cluster(pt, name, caps, pols, routers, replicas, shared_capacity, prefill_tps,
                        decode_tps, time_scale, json_path, plot_path, overload_guard)
        return
    results = []
    with Progress(transient=True, disable=not sys.stderr.isatty()) as prog:
        task = prog.add_task("replaying", total=len(caps) * len(pols) * len(reqs))
        for c in caps:
            for p in pols:
                prog.update(task, description=f"{p} @ {c:,} tokens")
                results.append(run_replay(pt, p, c, block_tokens, hold=hold, time_scale=time_scale))
                prog.advance(task, len(reqs))
    summary = summarize(name, block_tokens, pt.infinite_hit_rate(), results)
    print_table(summary)
    if misses:
        print_misses(summary)
    if json_path:
        write_json(summary, json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        plot(summary, plot_path)
        click.echo(f"wrote {plot_path}")


def _replay_cluster(pt, name: str, caps: list[int], pols: list[str], routers: str,
                    replicas: int, shared_capacity: str | None, prefill_tps: float,
                    decode_tps: float, time_scale: float, json_path: str | None,
                    plot_path: str | None, overload_guard: bool = False) -> None:
    from .replay import parse_tokens
    from .router.policy import POLICIES
    from .router.policy import make_policy as make_router
    from .router.report import plot, print_table, summarize, write_json
    from .router.simulate import ClusterConfig, simulate

    names = [r.strip() for r in routers.split(",") if r.strip()]
    unknown = [r for r in names if r not in POLICIES]
    if unknown or not names:
        raise click.BadParameter(f"unknown router {', '.join(unknown) or '(none)'}; known: "
                                 f"{', '.join(POLICIES)}", param_hint="--router")
    if len(pols) != 1:
        raise click.BadParameter("with --replicas give one eviction --policy (default here: "
                                 "kvheat)", param_hint="--policy")
    try:
        shared = parse_tokens(shared_capacity) if shared_capacity else 0
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shared-capacity") from None
    results = []
    for c in caps:
        for r in names:
            cfg = ClusterConfig(replicas=replicas, capacity_tokens=c, cache_policy=pols[0],
                                shared_tokens=shared, prefill_tps=prefill_tps,
                                decode_tps=decode_tps, time_scale=time_scale)
            spec = (lambda ix: make_router("kvheat", ix, overload_guard=True)) \
                if r == "kvheat" and overload_guard else r
            results.append(simulate(pt, spec, cfg))
    summary = summarize(name, results, block_tokens=pt.block_tokens, cache_policy=pols[0],
                        prefill_tps=prefill_tps, decode_tps=decode_tps, time_scale=time_scale)
    print_table(summary)
    if json_path:
        write_json(summary, json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        plot([summary], plot_path)
        click.echo(f"wrote {plot_path}")


def _register_optional_commands() -> None:
    # The engine and server pull in torch and FastAPI: only when those extras are installed.
    try:
        from .server.cli import arms_command, serve_command
    except ImportError:
        pass
    else:
        main.add_command(serve_command, "serve")
        main.add_command(arms_command, "arms")
    try:
        from .router.cli import route_command
    except ImportError:
        pass
    else:
        main.add_command(route_command, "route")


_register_optional_commands()

if __name__ == "__main__":
    main()
