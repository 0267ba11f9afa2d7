"""`kvheat route` configuration: the replicas, the policy, the tokenizer, tenants, timeouts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..cache.tenancy import TENANT_SECRET_ENV
from ..checks import check_fields
from ..kvevents.subscriber import MAX_QUEUE_BYTES, MAX_QUEUE_MESSAGES
from ..server.concurrency import MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES
from ..server.config import check_secret, secret_from_env
from .index import MAX_BLOCKS
from .routing import ROUTING_POLICIES

KINDS = ("kvheat", "vllm", "openai")
# HTTP requests of any kind held at once (kvheat/server/concurrency.py), unless given:
# the proxied ones above, plus this many for the admin API, /v1/models and the like.
CONCURRENT_HEADROOM = 1024


class RouterConfigError(ValueError):
    """A router configuration that cannot be used."""


@dataclass(slots=True)
class ReplicaSpec:
    """One replica: its URL, its kind, and where its KV events are.

    `kvheat` replicas say where their KV events are (GET /kv_events); `vllm` ones need
    `events` (and `replay`) given, and get the tenant's salt as `cache_salt`; `openai`: any
    other OpenAI-compatible server (no events: load only)."""

    url: str
    kind: str = "kvheat"
    events: str | None = None  # ZMQ PUB address of its KV events
    replay: str | None = None  # its replay (ROUTER) address
    block_size: int | None = None  # None: what its events or /kv_events say

    def __post_init__(self) -> None:
        check_fields(self, f"replica {self.url!r}" if isinstance(self.url, str) else "replica",
                     RouterConfigError)
        self.url = self.url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RouterConfigError(f"a replica needs an http(s) URL, not {self.url!r}")
        if self.kind not in KINDS:
            raise RouterConfigError(f"replica kind must be one of {', '.join(KINDS)}, "
                                    f"not {self.kind!r}")
        for name in ("events", "replay"):
            v = getattr(self, name)
            if v is not None and not re.fullmatch(r"(tcp://[^\s/]+:[0-9]+|ipc://\S+)", v):
                raise RouterConfigError(f"replica {self.url}: {name} must be a ZMQ address "
                                        f"such as tcp://host:5557, not {v!r}")
        if self.block_size is not None and self.block_size < 1:
            raise RouterConfigError("block_size must be positive")

    @property
    def host(self) -> str:
        """The host name of the replica's URL."""
        return urlsplit(self.url).hostname or ""

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """`URL[,kind=K][,events=ADDR][,replay=ADDR][,block_size=N]`."""
        url, *opts = [p.strip() for p in text.split(",")]
        kw: dict[str, Any] = {}
        for o in opts:
            k, sep, v = o.partition("=")
            if not sep or k not in ("kind", "events", "replay", "block_size"):
                raise RouterConfigError(f"replica option {o!r}: use kind=, events=, replay= "
                                        "or block_size=")
            if k == "block_size":
                try:
                    kw[k] = int(v)
                except ValueError:
                    raise RouterConfigError(f"block_size must be an integer, not {v!r}") \
                        from None
            else:
                kw[k] = v
        return cls(url, **kw)


@dataclass(slots=True)
class RouterConfig:
    """The router's configuration: its replicas, policy, tokenizer, tenants and limits."""

    replicas: list[ReplicaSpec] = field(default_factory=list)
    policy: str = "kvheat"
    # The tokenizer the replicas use (their model directory; None: the built-in tiny
    # model's of `family`), to key prompts as their caches do.
    model: str | None = None
    family: str = "llama"
    block_size: int = 16  # when a replica does not say
    # API key -> tenant name, as the replicas' config maps them (None: an open API), and
    # tenant -> share group, as it groups them: the router salts a tenant's keys as the
    # replicas' caches do (kvheat.cache.hashing.tenant_salt). `kvheat route --config`
    # reads both from the replicas' server config.
    tenants: dict[str, str] = field(default_factory=dict)
    share_groups: dict[str, str] = field(default_factory=dict)
    discover: str | None = None  # "host:port": every address the name resolves to
    health_interval_s: float = 1.0
    health_failures: int = 2  # consecutive failed checks before a replica is out
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0  # longest silence from a replica mid-response
    max_attempts: int = 3  # replicas tried for one request before it fails
    max_body_bytes: int = 8 << 20
    # Bounds on what outside data fills (issue 51): proxied requests and their body bytes
    # in flight (past either: 503, `kvheat_router_refused`), HTTP requests of any kind
    # open at once (past it: 503 before the body is read,
    # `kvheat_router_concurrency_refused`), the blocks (and vLLM hash aliases) the index
    # keeps per replica unit (past it: the oldest forgotten, or a resync;
    # `kvheat_router_index_overflows`), and each replica's received-but-unapplied KV
    # event batches and their bytes (past either: dropped, then replayed or resynced;
    # `kvheat_router_event_errors{kind="overflows"}`).
    max_in_flight: int = MAX_IN_FLIGHT
    max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES
    max_concurrent_requests: int | None = None  # None: max_in_flight + CONCURRENT_HEADROOM
    index_max_blocks: int = MAX_BLOCKS
    event_queue_messages: int = MAX_QUEUE_MESSAGES
    event_queue_bytes: int = MAX_QUEUE_BYTES
    prewarm: bool = True  # send hot prefixes to replicas that lack them
    overload_guard: bool = False  # kvheat policy: leave an overloaded affinity replica
    shard_choices: int = 2  # kvheat policy: a new prefix to the less queued of this many
    # Evictions the index remembers, as a multiple of the blocks the replicas hold (a
    # prefix evicted everywhere goes back to where it lived): kvheat replicas remember up
    # to 10.7x (PrefixIndex).
    ghost_factor: float = 12.0
    admin_token: str | None = None
    # The replicas' admin token: with it the router reports the whole traffic's entropy
    # to each kvheat replica (PUT /admin/cluster) every health check, for its eviction
    # regime (kvheat/router/regime.py); without it they keep their own.
    replica_admin_token: str | None = None
    otlp_endpoint: str | None = None
    # The replicas' kv_events_secret: keys their KV events' block hashes and authenticates
    # the event sockets (at least 16 bytes); None: none (`kvheat route` falls back to
    # $KVHEAT_EVENTS_SECRET).
    events_secret: str | None = None
    # A replica sent requests whose KV events have not arrived this long after the first
    # is routed blind: warned about, and shown (metric, /admin/replicas).
    events_grace_s: float = 30.0
    # Route by cache only once every replica's events arrive (until then by load alone).
    require_events: bool = False
    # Per-upstream kernel TCP signals in /metrics (kvheat/server/netsignals.py).
    net_signals: bool = True
    net_signals_ebpf: bool = True  # with net_signals: retransmits from eBPF too, where it runs
    # Keys the session digests vLLM replicas get in `kv_transfer_params` (hints.py; at
    # least 16 bytes): routers in front of the same replicas, one. None: a key drawn at
    # start (a router restart then starts every session afresh).
    session_secret: str | None = None
    # Keys the `cache_salt` vLLM replicas get for a tenant and the MAC that vouches for
    # the tenant to their KVHeatConnector (kvheat/cache/tenancy.py; at least 16 bytes; the
    # connectors' `tenant_secret`, one for all). None: $KVHEAT_TENANT_SECRET, else a key
    # drawn at start (salts still unguessable, but no connector accepts the tenant and a
    # restart starts every tenant's vLLM cache afresh).
    tenant_secret: str | None = None

    def __post_init__(self) -> None:
        check_fields(self, error=RouterConfigError)
        if self.policy not in ROUTING_POLICIES:
            raise RouterConfigError(f"unknown policy {self.policy!r}; known: "
                                    f"{', '.join(ROUTING_POLICIES)}")
        if self.block_size < 1 or self.health_failures < 1 or self.max_attempts < 1 or \
                self.shard_choices < 1:
            raise RouterConfigError("block_size, health_failures, max_attempts and "
                                    "shard_choices must be positive")
        self._check_bounds()
        if not 0 <= self.ghost_factor <= 64:  # also rejects NaN
            raise RouterConfigError("ghost_factor must be in [0, 64]")
        if not 0 < self.health_interval_s <= 60 or self.connect_timeout_s <= 0 or \
                self.read_timeout_s <= 0:
            raise RouterConfigError("health_interval_s must be in (0, 60] and timeouts "
                                    "positive")
        if self.discover is not None and not re.fullmatch(r"[^\s:]+:[0-9]+", self.discover):
            raise RouterConfigError(f"discover must be host:port, not {self.discover!r}")
        check_secret(self.events_secret, "events_secret", RouterConfigError)
        check_secret(self.session_secret, "session_secret", RouterConfigError)
        check_secret(self.tenant_secret, "tenant_secret", RouterConfigError)
        if self.tenant_secret is None:  # the environment's, checked here (a clear error)
            self.tenant_secret = secret_from_env(TENANT_SECRET_ENV, RouterConfigError)
        if not 0 < self.events_grace_s <= 3600:
            raise RouterConfigError("events_grace_s must be in (0, 3600]")
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise RouterConfigError("a replica is listed twice")
        if not self.replicas and not self.discover:
            raise RouterConfigError("give at least one replica (--replica) or --discover")

    def _check_bounds(self) -> None:
        if self.max_concurrent_requests is None:
            self.max_concurrent_requests = self.max_in_flight + CONCURRENT_HEADROOM
        for name in ("max_body_bytes", "max_in_flight", "max_in_flight_bytes",
                     "max_concurrent_requests", "index_max_blocks", "event_queue_messages",
                     "event_queue_bytes"):
            if getattr(self, name) < 1:
                raise RouterConfigError(f"{name} must be at least 1, not {getattr(self, name)}")
        # A body without a length is held as the largest allowed: a smaller budget would
        # refuse every such request.
        if self.max_in_flight_bytes < self.max_body_bytes:
            raise RouterConfigError(f"max_in_flight_bytes ({self.max_in_flight_bytes}) must "
                                    f"be at least max_body_bytes ({self.max_body_bytes})")
        if self.max_concurrent_requests < self.max_in_flight:
            raise RouterConfigError(f"max_concurrent_requests ({self.max_concurrent_requests})"
                                    f" must be at least max_in_flight ({self.max_in_flight}),"
                                    " or the in-flight bound never applies")
