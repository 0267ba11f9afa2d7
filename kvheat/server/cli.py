"""`kvheat serve` (start the server) and `kvheat arms` (the per-arm A/B report).

`python -m kvheat.server.cli serve ...` runs the same command without the main CLI.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace

import click

from .config import EVENTS_SECRET_ENV, ConfigError, load_config, secret_from_env


@click.command("serve")
@click.option("--model", type=click.Path(file_okay=False), default=None,
              help="A local Hugging Face model directory (default: the built-in tiny model, "
                   "random weights: it answers gibberish; for trying the API and the cache).")
@click.option("--family", default=None, help="Built-in model family: llama, qwen3 or deepseek.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              default=None, help="Server config (TOML or YAML): tenants, arms, limits.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--served-model-name", default=None, help="The model id clients use.")
@click.option("--num-blocks", type=int, default=None, help="Device KV blocks per arm (512).")
@click.option("--block-size", type=int, default=None, help="Tokens per block (16).")
@click.option("--host-tier-blocks", type=int, default=None,
              help="Blocks of a host-memory KV tier under each arm's device pool (0: none).")
@click.option("--disk-tier-dir", default=None,
              help="A KV tier on local disk under this folder (kept across restarts).")
@click.option("--disk-tier-size", "disk_tier_bytes", default=None,
              help="Its size cap, e.g. 64GiB.")
@click.option("--redis-tier-url", default=None, help="A KV tier in Redis, e.g. redis://host:6379/0.")
@click.option("--redis-tier-size", "redis_tier_bytes", default=None,
              help="How much of Redis it may use, e.g. 100GiB.")
@click.option("--redis-cluster", is_flag=True, default=None, help="The Redis URL is a Cluster node.")
@click.option("--redis-tier-share/--no-redis-tier-share", "redis_tier_shared", default=None,
              help="Load blocks other replicas put in the Redis tier (default: on).")
@click.option("--tier-mode", type=click.Choice(["exclusive", "write_through"]), default=None,
              help="A block in one tier at a time (exclusive) or kept below when promoted.")
@click.option("--policy", default=None, help="Eviction policy when no arms are configured (kvheat; lru for the baseline).")
@click.option("--max-num-seqs", type=int, default=None, help="Running sequences per arm (16).")
@click.option("--max-num-batched-tokens", type=int, default=None, help="Tokens per step (256).")
@click.option("--max-tokens-limit", type=int, default=None, help="Refuse larger max_tokens.")
@click.option("--threads", type=int, default=None, help="torch threads for the engine.")
@click.option("--engine-cores", default=None,
              help="CPUs the engine thread runs on, e.g. 0 or 0-3 (default: any).")
@click.option("--max-body-size", "max_body_bytes", default=None,
              help="Refuse larger request bodies with 413 (8MiB).")
@click.option("--drain-timeout", "drain_timeout_s", type=float, default=None,
              help="Seconds requests in flight get to finish on shutdown (25).")
@click.option("--admin-token", envvar="KVHEAT_ADMIN_TOKEN", default=None,
              help="Bearer token of the admin API (or $KVHEAT_ADMIN_TOKEN); off when unset.")
@click.option("--otlp-endpoint", envvar="OTEL_EXPORTER_OTLP_ENDPOINT", default=None,
              help="OTLP/HTTP endpoint for traces (or $OTEL_EXPORTER_OTLP_ENDPOINT); off when unset.")
@click.option("--kv-events-endpoint", default=None,
              help="Publish KV events (vLLM's schema) on a ZMQ PUB socket bound here, "
                   "e.g. tcp://*:5557.")
@click.option("--kv-events-replay-endpoint", default=None,
              help="ZMQ ROUTER socket for event replay and snapshots, e.g. tcp://*:5558.")
@click.option("--kv-events-token-ids", is_flag=True, default=None,
              help="Operator mode: events carry token ids (off: keys only).")
@click.option("--kv-events-secret", default=None,
              help=f"Keys the KV events' hashes and authenticates their sockets (at least "
                   f"16 bytes; routers need the same); default: the config's, else "
                   f"${EVENTS_SECRET_ENV}.")
@click.option("--metrics-token", envvar="KVHEAT_METRICS_TOKEN", default=None,
              help="/metrics needs this bearer token (or $KVHEAT_METRICS_TOKEN) and labels "
                   "tenants by name; unset: /metrics is open and tenants are labelled "
                   "tenant-<i> or by their metrics_label.")
@click.option("--net-signals/--no-net-signals", default=None,
              help="Per-peer kernel TCP signals (retransmits, RTT, socket states) in /metrics "
                   "(default: on).")
@click.option("--self-heal", "self_heal", is_flag=False, flag_value="on", default=None,
              type=click.Choice(["off", "on", "dry-run"]),
              help="Act on the doctor's findings about this server: bypass a failing tier, "
                   "shed the lowest priority, recalibrate, raise the autoscaler's signal "
                   "(--self-heal); or only report them (--self-heal=dry-run). Default: off.")
@click.option("--self-heal-interval", "self_heal_interval_s", type=float, default=None,
              help="Seconds between the self-healer's looks at the metrics (2).")
@click.option("--seed", type=int, default=None, help="Seed of the built-in model's weights.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve_command(model: str | None, family: str | None, config_path: str | None, host: str,
                  port: int, served_model_name: str | None, num_blocks: int | None,
                  block_size: int | None, host_tier_blocks: int | None,
                  disk_tier_dir: str | None, disk_tier_bytes: str | None,
                  redis_tier_url: str | None, redis_tier_bytes: str | None,
                  redis_cluster: bool | None, redis_tier_shared: bool | None,
                  tier_mode: str | None, policy: str | None,
                  max_num_seqs: int | None, max_num_batched_tokens: int | None,
                  max_tokens_limit: int | None,
                  threads: int | None, engine_cores: str | None, max_body_bytes: str | None,
                  drain_timeout_s: float | None,
                  admin_token: str | None, otlp_endpoint: str | None,
                  kv_events_endpoint: str | None, kv_events_replay_endpoint: str | None,
                  kv_events_token_ids: bool | None, kv_events_secret: str | None,
                  metrics_token: str | None, net_signals: bool | None,
                  self_heal: str | None, self_heal_interval_s: float | None, seed: int | None,
                  log_level: str) -> None:
    """Serve an OpenAI-compatible API on the kvheat cache.

    Without --model it serves the built-in tiny model, whose weights are random: its
    answers are gibberish (it is there to try the API, the cache and the tools)."""
    from .app import KVHeatServer
    from .listen import bind_port, bound_port, serve_on

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = load_config(config_path, model=model, family=family,
                          served_model_name=served_model_name, num_blocks=num_blocks,
                          block_size=block_size, host_tier_blocks=host_tier_blocks,
                          disk_tier_dir=disk_tier_dir, disk_tier_bytes=disk_tier_bytes,
                          redis_tier_url=redis_tier_url, redis_tier_bytes=redis_tier_bytes,
                          redis_cluster=redis_cluster, redis_tier_shared=redis_tier_shared,
                          tier_mode=tier_mode,
                          policy=policy, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_tokens_limit=max_tokens_limit, threads=threads,
                          engine_cores=engine_cores,
                          max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout_s,
                          admin_token=admin_token, otlp_endpoint=otlp_endpoint,
                          kv_events_endpoint=kv_events_endpoint,
                          kv_events_replay_endpoint=kv_events_replay_endpoint,
                          kv_events_token_ids=kv_events_token_ids,
                          kv_events_secret=kv_events_secret, metrics_token=metrics_token,
                          net_signals=net_signals, self_heal=self_heal,
                          self_heal_interval_s=self_heal_interval_s, seed=seed)
        if cfg.kv_events_secret is None:  # neither the option nor the file: the env's
            env_secret = secret_from_env(error=ConfigError)
            if env_secret is not None:
                cfg = replace(cfg, kv_events_secret=env_secret)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    sock = bind_port(host, port)  # before the model loads and before "serving ... on"
    try:
        server = KVHeatServer(cfg)
    except ConfigError as e:
        sock.close()
        raise click.ClickException(str(e)) from None
    except BaseException:
        sock.close()
        raise
    port = bound_port(sock)
    if cfg.model is None:
        logging.getLogger("kvheat.serve").warning(
            "the built-in %s model has random weights: its answers are gibberish (give "
            "--model DIR for a real one)", cfg.family)
    arms = ", ".join(f"{a.name} ({a.share}%, {a.policy})" for a in cfg.arm_list)
    click.echo(f"kvheat: serving {cfg.model_name} on http://{host}:{port}  arms: {arms}  "
               f"tenants: {len(cfg.tenants) or 'none (open API)'}  admin API: "
               f"{'on' if cfg.admin_token else 'off'}  /metrics: "
               f"{'token' if cfg.metrics_token else 'open'}  self-heal: {cfg.self_heal}",
               err=True)
    server.freeze_startup_heap()
    serve_on(server.uvicorn(host, port, log_level), sock)


@click.command("arms")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The server's base URL.")
@click.option("--admin-token", envvar="KVHEAT_ADMIN_TOKEN", required=True,
              help="The admin API token (or $KVHEAT_ADMIN_TOKEN).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--timeout", "timeout_s", type=float, default=10.0, show_default=True,
              help="Seconds for the whole answer, body included.")
def arms_command(url: str, admin_token: str, as_json: bool, timeout_s: float) -> None:
    """Print P99 TTFT and prefix hit rate per A/B arm of a running server."""
    # The doctor's fetch: one deadline over the whole answer (a server that drips bytes
    # cannot hold it), a size cap, and JSON without NaN or Infinity.
    from ..doctor.scrape import DoctorError, fetch, loads_json

    where = url.rstrip("/") + "/admin/arms"
    try:
        data = loads_json(fetch(where, admin_token, timeout_s=timeout_s,
                                accept="application/json", expect="a kvheat server's base URL"),
                          where)
        if not isinstance(data, dict) or not isinstance(data.get("arms"), list):
            raise DoctorError(f"{where}: not a kvheat /admin/arms answer")
    except DoctorError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(format_arms(data["arms"]))


def format_arms(rows: list[dict]) -> str:
    """The per-arm table `kvheat serve` prints: requests, prewarms, hit rate, TTFT."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f}"

    width = max([16, *(len(str(r["arm"])) for r in rows)])  # a long arm name is never cut
    lines = [f"{'arm':<{width}} {'requests':>9} {'prewarms':>9} {'hit rate':>9} "
             f"{'TTFT P50 ms':>12} {'TTFT P99 ms':>12}"]
    for r in rows:
        lines.append(f"{r['arm']:<{width}} {r['requests']:>9} {r.get('prewarm_requests', 0):>9} "
                     f"{r['hit_rate']:>9.1%} {ms(r['ttft_p50_s']):>12} {ms(r['ttft_p99_s']):>12}")
    return "\n".join(lines)


@click.group()
def _main() -> None:
    """kvheat server commands."""


_main.add_command(serve_command)
_main.add_command(arms_command)

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(_main())
