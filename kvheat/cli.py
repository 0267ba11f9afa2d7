"""The `kvheat` command: replay traces, run the engine benchmark, serve."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def main() -> None:
    """kvheat: a KV-cache manager for LLM inference."""


def _load_heat() -> None:
    # Registers the heat policies (kvheat, ...) beside the baselines, when present.
    try:
        import kvheat.heat  # noqa: F401
    except ImportError as e:  # pragma: no cover - the heat package ships with kvheat
        click.echo(f"warning: heat policies unavailable: {e}", err=True)


@main.command()
@click.argument("trace", default="builtin")
@click.option("--capacity", default="1M,3M,10M", show_default=True,
              help="Cache sizes in tokens, comma-separated (1M = 1,000,000).")
@click.option("--policy", "policies", default="lru,arc,s3fifo,twoq,belady", show_default=True,
              help="Eviction policies, comma-separated.")
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
def replay(trace: str, capacity: str, policies: str, block_tokens: int, hold: bool,
           limit: int | None, time_scale: float, json_path: str | None, plot_path: str | None,
           misses: bool, fmt: str) -> None:
    """Replay TRACE (a Mooncake JSONL file, vLLM's KV events or request log, or 'builtin'
    for the generator) through the cache."""
    from rich.progress import Progress

    from .cache import policy_names
    from .replay import PreparedTrace, TraceError, generate_workload, load_trace, parse_tokens
    from .replay import replay as run_replay
    from .replay.report import plot, print_misses, print_table, summarize, write_json

    _load_heat()
    try:
        caps = [parse_tokens(c) for c in capacity.split(",") if c.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--capacity") from None
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


def _register_optional_commands() -> None:
    # The engine and server pull in torch and FastAPI: only when those extras are installed.
    try:
        from .bench import bench_command
    except ImportError:
        pass
    else:
        main.add_command(bench_command, "bench")
    try:
        from .server.cli import arms_command, serve_command
    except ImportError:
        pass
    else:
        main.add_command(serve_command, "serve")
        main.add_command(arms_command, "arms")


_register_optional_commands()

if __name__ == "__main__":
    main()
