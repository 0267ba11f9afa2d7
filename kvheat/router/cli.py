"""`kvheat route`: the cache-aware router in front of kvheat (or vLLM) replicas."""

from __future__ import annotations

import gc
import logging
from typing import Any

import click

from ..server.config import EVENTS_SECRET_ENV, ConfigError, load_config, secret_from_env
from .config import ReplicaSpec, RouterConfig, RouterConfigError
from .routing import ROUTING_POLICIES


@click.command("route")
@click.option("--replica", "replicas", multiple=True,
              help="A replica: URL[,kind=kvheat|vllm|openai][,events=tcp://H:P]"
                   "[,replay=tcp://H:P][,block_size=N]; repeat for each.")
@click.option("--discover", default=None,
              help="host:port: every address this name resolves to is a kvheat replica "
                   "(a Kubernetes headless service), polled with the health checks.")
@click.option("--policy", type=click.Choice(ROUTING_POLICIES), default="kvheat", show_default=True)
@click.option("--model", type=click.Path(file_okay=False), default=None,
              help="The replicas' model directory (its tokenizer keys prompts); default: "
                   "the built-in tiny model's.")
@click.option("--family", default="llama", show_default=True,
              help="Built-in model family, when --model is not given.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              default=None, help="The replicas' server config: its tenants' API keys and "
                                 "share groups (prompts are keyed as the replicas key them).")
@click.option("--block-size", type=int, default=16, show_default=True,
              help="Tokens per block of replicas that do not say.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9000, show_default=True, type=int)
@click.option("--health-interval", "health_interval_s", type=float, default=1.0,
              show_default=True, help="Seconds between health checks.")
@click.option("--read-timeout", "read_timeout_s", type=float, default=60.0, show_default=True,
              help="Seconds of silence from a replica before it counts as dead.")
@click.option("--max-attempts", type=int, default=3, show_default=True,
              help="Replicas tried for one request.")
@click.option("--no-prewarm", is_flag=True, help="Do not send hot prefixes to replicas.")
@click.option("--overload-guard", is_flag=True,
              help="kvheat policy: leave a cached replica whose queue makes the wait there "
                   "1/(1-utilisation)^2 times the wait elsewhere (lower P99, fewer hits).")
@click.option("--shard-choices", type=click.IntRange(min=1), default=2, show_default=True,
              help="kvheat policy: a new prefix goes to the least queued of the first N "
                   "replicas its key hashes to (1: the hash alone).")
@click.option("--ghosts", "ghost_factor", type=click.FloatRange(0, 64), default=12.0,
              show_default=True,
              help="Evictions the prefix index remembers, as a multiple of the blocks the "
                   "replicas hold: a prefix evicted everywhere goes back to where it lived "
                   "(kvheat replicas remember up to 10.7x; about 150 bytes each; 0: never).")
@click.option("--admin-token", envvar="KVHEAT_ROUTER_ADMIN_TOKEN", default=None,
              help="Bearer token of the admin API (replicas join and leave); off when unset.")
@click.option("--replica-admin-token", envvar="KVHEAT_REPLICA_ADMIN_TOKEN", default=None,
              help="The replicas' admin token: report the whole traffic's entropy to their "
                   "eviction regime every health check (off when unset).")
@click.option("--otlp-endpoint", envvar="OTEL_EXPORTER_OTLP_ENDPOINT", default=None,
              help="OTLP/HTTP endpoint for a span per routing decision.")
@click.option("--events-secret", default=None,
              help="The replicas' KV events secret (at least 16 bytes); default: the "
                   "--config file's kv_events_secret, else $KVHEAT_EVENTS_SECRET.")
@click.option("--session-secret", envvar="KVHEAT_ROUTER_SESSION_SECRET", default=None,
              help="Keys the session digests vLLM replicas get in kv_transfer_params (at "
                   "least 16 bytes; routers in front of the same replicas: one); default: "
                   "a key drawn at start.")
@click.option("--events-grace", "events_grace_s", type=click.FloatRange(0, 3600, min_open=True),
              default=30.0, show_default=True,
              help="Seconds after a replica's first request by which its KV events must "
                   "arrive; past that the router warns that it routes blind to its cache.")
@click.option("--require-events", is_flag=True,
              help="Route by cache only once every replica's KV events arrive (until then "
                   "by load alone).")
@click.option("--no-net-signals", is_flag=True,
              help="No per-replica kernel TCP signals (retransmits, RTT, socket states) in "
                   "/metrics.")
@click.option("--max-in-flight", type=int, default=None,
              help="Proxied requests held at once; more get 503 (default 8192).")
@click.option("--max-in-flight-bytes", type=int, default=None,
              help="Their body bytes held at once; more get 503 (default 1 GiB).")
@click.option("--max-concurrent-requests", type=int, default=None,
              help="HTTP requests of any kind open at once (but /health and /metrics); "
                   "more get 503 before their body is read (default: --max-in-flight "
                   "+ 1024).")
@click.option("--index-max-blocks", type=int, default=None,
              help="Blocks the prefix index keeps per replica (arm or rank); past it the "
                   "oldest are forgotten or the replica resynced (default 2097152).")
@click.option("--event-queue-messages", type=int, default=None,
              help="KV event batches received and not yet applied, per replica; more are "
                   "dropped, then replayed or resynced (default 4096).")
@click.option("--event-queue-bytes", type=int, default=None,
              help="Their bytes, per replica (default 64 MiB).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def route_command(replicas: tuple[str, ...], discover: str | None, policy: str,
                  model: str | None, family: str, config_path: str | None, block_size: int,
                  host: str, port: int, health_interval_s: float, read_timeout_s: float,
                  max_attempts: int, no_prewarm: bool, overload_guard: bool,
                  shard_choices: int, ghost_factor: float,
                  admin_token: str | None, replica_admin_token: str | None,
                  otlp_endpoint: str | None, events_secret: str | None,
                  session_secret: str | None, events_grace_s: float, require_events: bool,
                  no_net_signals: bool, max_in_flight: int | None,
                  max_in_flight_bytes: int | None, max_concurrent_requests: int | None,
                  index_max_blocks: int | None, event_queue_messages: int | None,
                  event_queue_bytes: int | None, log_level: str) -> None:
    """Route OpenAI requests to replicas by a global prefix index fed by their KV events."""
    import uvicorn

    from ..server.listen import bind_port
    from .app import KVHeatRouter

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        tenants: dict[str, str] = {}
        share_groups: dict[str, str] = {}
        if config_path:
            try:
                # The replicas' config, checked as they check it (a bare string of api
                # keys is refused, not read as one key per character), but not against
                # this host's CPUs.
                scfg = load_config(config_path, this_host=False)
            except ConfigError as e:
                raise RouterConfigError(str(e)) from None
            tenants = {k: t.name for t in scfg.tenants for k in t.api_keys}
            share_groups = scfg.share_groups
            if events_secret is None:
                events_secret = scfg.kv_events_secret
        if events_secret is None:
            events_secret = secret_from_env(EVENTS_SECRET_ENV, RouterConfigError)
        limits: dict[str, Any] = {k: v for k, v in dict(  # unset: RouterConfig's defaults
            max_in_flight=max_in_flight, max_in_flight_bytes=max_in_flight_bytes,
            max_concurrent_requests=max_concurrent_requests, index_max_blocks=index_max_blocks,
            event_queue_messages=event_queue_messages,
            event_queue_bytes=event_queue_bytes).items() if v is not None}
        cfg = RouterConfig(replicas=[ReplicaSpec.parse(r) for r in replicas], policy=policy,
                           model=model, family=family, block_size=block_size, tenants=tenants,
                           share_groups=share_groups,
                           discover=discover, health_interval_s=health_interval_s,
                           read_timeout_s=read_timeout_s, max_attempts=max_attempts,
                           prewarm=not no_prewarm, overload_guard=overload_guard,
                           shard_choices=shard_choices, ghost_factor=ghost_factor,
                           admin_token=admin_token, replica_admin_token=replica_admin_token,
                           otlp_endpoint=otlp_endpoint, events_secret=events_secret,
                           session_secret=session_secret,
                           events_grace_s=events_grace_s, require_events=require_events,
                           net_signals=not no_net_signals, **limits)
    except RouterConfigError as e:
        raise click.ClickException(str(e)) from None
    # A port in use: one error line, before any start-up line. Released at once:
    # uvicorn.run binds its own (should another process take it in between, uvicorn
    # fails with its own error, as before).
    bind_port(host, port).close()
    router = KVHeatRouter(cfg)
    _ = router.keys.tokenizer  # load it now, not on the first request
    # Start-up's heap (imports, the tokenizer) lives as long as the router: frozen, no full
    # collection scans it again on the event loop (as `kvheat serve` does).
    gc.collect()
    gc.freeze()
    click.echo(f"kvheat route: {policy} over {len(cfg.replicas)} replica(s)"
               f"{' + ' + discover if discover else ''} on http://{host}:{port}", err=True)
    uvicorn.run(router.app, host=host, port=port, log_level=log_level, access_log=False)
