"""kvheat's tiers as vLLM's KV store: `KVHeatConnector`, a vLLM v1 KV connector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVHeatConnector",
      "kv_connector_module_path": "kvheat.integrations.vllm_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"host_tier_size": "8GiB"}}'

vLLM runs the scheduler and the model runner in two processes (its CPU build always uses
the multiprocessing executor), so the connector is two halves that talk only through
vLLM's per-step metadata:

- The worker half owns the tiers (`TierClient`: host memory, disk, Redis under kvheat's
  heat policy) and vLLM's KV tensors (`VLLMDeviceBlocks`). Each step it loads what the
  scheduler planned into the planned device blocks (host memory: before the forward; disk
  or Redis: on a loader thread while the request waits in WAITING_FOR_REMOTE_KVS), copies
  out each block that became full during the step, and reports back which keys its tiers
  took or lost.
- The scheduler half keeps a mirror of those keys (`TierMirror`) and answers vLLM's one
  question (how many tokens past the device's prefix can the tiers supply) from it, with
  no I/O. The mirror is exact for everything the worker did in earlier steps; a key lost
  since (a background eviction, Redis gone, a value failing its MAC) fails its load, and
  vLLM recomputes from that block (`get_block_ids_with_load_errors`; the connector sets
  `kv_load_failure_policy` to "recompute"). Never wrong KV.

Keys are vLLM's block hashes (whole blocks only), chained under the tenant's salt
(`cache/hashing.tenant_salt` of `kv_transfer_params["tenant"]`): another tenant's keys
never match, and every value read back carries the salt in its MAC. The tenant is the
client's claim unless a trusted front vouches for it (`cache/tenancy.py`: `kvheat route`
adds a MAC under the `tenant_secret` both share); an unvouched tenant is refused (its KV
neither loaded nor saved), counted and logged. (vLLM 0.32 drops the OpenAI `user` field
before the engine, so it cannot key anything; a request's `cache_salt` is already part of
vLLM's block hashes, which is how `kvheat route` salts a vLLM replica's requests, with a
keyed salt nobody else can name.) Blocks the tiers take or lose go out as KV events through
vLLM's own publisher (`--kv-events-config`), with their medium and locality, so a router
sees them; tier hits, bytes, faults and loads against recomputes are on vLLM's /metrics.

Request hints (kvheat/cache/hints.py) reach the tiers' eviction policy as they reach the
offload adapter's (`vllm_chunk.request_hints`): the session is
`kv_transfer_params["kvheat_session"]` (what `kvheat route` sets for a vLLM replica), the
outcome and finish reason come from vLLM's `Request` at `request_finished`. The scheduler
keys the session into a digest (never the client's string past it), and the hints travel
to the worker in the step's metadata: a request's session before its first loads and
saves (`TierClient.begin`), its end with its keys (`TierClient.finish`). A request with no
session that was not cancelled sends nothing, so without hints every decision is as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import typing
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..cache.eviction import policy_names
from ..cache.hashing import chain_key, root_key, tenant_salt
from ..cache.hints import Outcome, session_digest
from ..cache.tenancy import TENANT_PARAM, TENANT_SECRET_ENV, VOUCH_PARAM, TenantVouch
from ..checks import check_value, parse_size
from ..kvevents.schema import tier_place
from ..tiers.client import TierClient
from ..tiers.shared import SharedTierFeed, decode_announcements
from ..tiers.spec import MODES, TierSpec
from .vllm_blocks import VLLMDeviceBlocks
from .vllm_chunk import record_outcome, request_end, request_hints

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger, so these lines come out in its format and at its level.
log = logging.getLogger("vllm.kvheat_connector")

# With a Redis tier shared by replicas, the worker learns of blocks the others put there
# between steps; a scheduler that heard nothing from it for this long (an idle server)
# has vLLM run one empty step before answering a lookup.
SHARED_SYNC_S = 0.25
# Event details kept for keys no tier holds: just saved (not yet taken) or just left
# (moving down): more than the demotion queue holds in flight.
LEFT_KEYS = 8192
# How often the worker reads its tiers' counters for the metrics.
STATS_EVERY_S = 1.0
# At most one log line per this many seconds about refused tenants (a client can send
# any number of them); the count is always on the metrics.
REFUSED_LOG_EVERY_S = 60.0
# Tiers in the order a load prefers them (a key may sit in two with write_through).
TIER_ORDER = ("host", "disk", "redis")
_ANNOUNCED_PUT = 1  # tiers/shared.py's record op for a key put (2: deleted)
HIT_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


# ---- configuration ---------------------------------------------------------------------------
@dataclass(slots=True)
class ConnectorConfig:
    """`kv_connector_extra_config`: the tier keys of `kvheat serve` (sizes in bytes or as
    "64GiB", "500MB"; the host tier is sized in bytes here, as vLLM operators size
    offload buffers), each key exactly its type."""

    host_tier_size: int | str = 0
    disk_tier_dir: str | None = None
    disk_tier_size: int | str = 0
    redis_tier_url: str | None = None
    redis_tier_size: int | str = 0
    redis_cluster: bool = False
    redis_tier_shared: bool = True  # load blocks other replicas put in the Redis tier
    tier_secret: str | None = None  # keys every value's MAC; replicas sharing a tier: one
    tier_mode: str = "exclusive"  # or "write_through"
    policy: str = "kvheat"  # the tiers' eviction policy
    # Tenants of one group share KV, as in `kvheat serve`'s tenants: {tenant: group}.
    share_groups: dict[str, str] = field(default_factory=dict)
    # None: loads from disk or Redis run on loader threads while the request waits
    # (WAITING_FOR_REMOTE_KVS), loads from host memory before the step's forward;
    # true / false: every load one way.
    async_load: bool | None = None
    # Pass requests' hints (session, cancelled or finished, finish reason) to the tiers'
    # policy; false: never (every decision as without hints).
    request_hints: bool = True
    # Keys the MAC with which a trusted front (`kvheat route`, its `tenant_secret`) vouches
    # for `kv_transfer_params["tenant"]` (at least 16 bytes; None: $KVHEAT_TENANT_SECRET).
    # A tenant without a valid MAC is refused, so without a secret none is accepted.
    tenant_secret: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        hints = typing.get_type_hints(cls)
        known = [f.name for f in fields(cls)]
        for k, v in extra.items():
            if k not in hints:
                raise ValueError(f"kv_connector_extra_config: unknown key {k!r} "
                                 f"(known: {', '.join(known)})")
            check_value(v, hints[k], k, "kv_connector_extra_config")
        cfg = cls(**extra)
        for k in ("host_tier_size", "disk_tier_size", "redis_tier_size"):
            setattr(cfg, k, parse_size(getattr(cfg, k), k))
        if cfg.tier_mode not in MODES:
            raise ValueError(f"kv_connector_extra_config: tier_mode must be one of {MODES}, "
                             f"not {cfg.tier_mode!r}")
        if cfg.policy not in policy_names():
            raise ValueError(f"kv_connector_extra_config: policy {cfg.policy!r} is not one "
                             f"of {', '.join(policy_names())}")
        try:
            cfg.tenant_vouch()
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: tenant_secret (or "
                             f"${TENANT_SECRET_ENV}): {e}") from None
        return cfg

    def tenant_vouch(self) -> TenantVouch | None:
        """The secret that checks vouched tenants (this key, else the environment)."""
        return TenantVouch.from_config(self.tenant_secret)

    def tier_spec(self, block_bytes: int) -> TierSpec:
        """The tiers, with the host tier's bytes in whole blocks of `block_bytes`."""
        assert isinstance(self.host_tier_size, int)
        assert isinstance(self.disk_tier_size, int)
        assert isinstance(self.redis_tier_size, int)
        host_blocks = self.host_tier_size // block_bytes
        if self.host_tier_size and not host_blocks:
            raise ValueError(f"host_tier_size {self.host_tier_size} is less than one block "
                             f"({block_bytes} bytes)")
        spec = TierSpec(host_blocks=host_blocks, disk_dir=self.disk_tier_dir,
                        disk_bytes=self.disk_tier_size, redis_url=self.redis_tier_url,
                        redis_bytes=self.redis_tier_size, redis_cluster=self.redis_cluster,
                        redis_shared=self.redis_tier_shared, secret=self.tier_secret,
                        mode=self.tier_mode, policy=self.policy)
        if not spec.enabled:
            raise ValueError("kv_connector_extra_config names no tier: give host_tier_size, "
                             "disk_tier_dir and disk_tier_size, or redis_tier_url and "
                             "redis_tier_size")
        return spec


# ---- what the two halves tell each other -------------------------------------------------------
@dataclass(slots=True)
class LoadJob:
    req_id: str
    salt: str | None
    first: int  # the request's block index of keys[0]
    keys: list[bytes]
    slots: list[int]  # vLLM's device blocks to fill, one per key
    background: bool  # on a loader thread (the request waits), else before the forward


@dataclass(slots=True)
class SaveJob:
    salt: str | None
    keys: list[bytes]
    parents: list[bytes | None]
    slots: list[int]


@dataclass(slots=True)
class FinishHint:
    """A request's end, for the tiers' policy (`TierClient.finish`)."""

    keys: list[bytes]  # its blocks' keys, prefix order
    session: str | None  # the scheduler's digest of its session
    outcome: str  # an `Outcome` value
    reason: str | None  # vLLM's finish reason


@dataclass
class KVHeatConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Hints, applied before the step's loads and saves: sessions of requests new since
    # the last step (in order), then the ends of requests finished since.
    sessions: list[str] = field(default_factory=list)
    finished: list[FinishHint] = field(default_factory=list)


@dataclass
class KVHeatWorkerMetadata(KVConnectorWorkerMetadata):
    # (tier, key, stored): the worker's tiers took (True) or lost (False) a key, in order.
    changes: list[tuple[str, bytes, bool]] = field(default_factory=list)
    # (request id, block index): a load failed from this block on (vLLM recomputes it).
    failed: list[tuple[str, int]] = field(default_factory=list)
    # Tiers down now (Redis gone): the scheduler plans no loads from them meanwhile.
    down: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVHeatWorkerMetadata)
        return KVHeatWorkerMetadata(self.changes + other.changes, self.failed + other.failed,
                                    sorted({*self.down, *other.down}))


# ---- the scheduler's view of the tiers -----------------------------------------------------------
class TierMirror:
    """Which keys the worker's tiers hold, as it reported them: key -> bit mask of tiers,
    bit i for `names[i]` (kept in load preference order)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.where: dict[bytes, int] = {}

    def _add_tier(self, tier: str) -> None:
        old = list(self.names)
        self.names = sorted([*old, tier], key=lambda n: (
            TIER_ORDER.index(n) if n in TIER_ORDER else len(TIER_ORDER), n))
        pos = [self.names.index(n) for n in old]
        if pos != list(range(len(old))):  # a tier sorted before others: move their bits
            self.where = {k: sum(1 << p for i, p in enumerate(pos) if m >> i & 1)
                          for k, m in self.where.items()}

    def apply(self, tier: str, key: bytes, stored: bool) -> None:
        if tier not in self.names:
            self._add_tier(tier)
        bit = 1 << self.names.index(tier)
        mask = self.where.get(key, 0)
        mask = mask | bit if stored else mask & ~bit
        if mask:
            self.where[key] = mask
        else:
            self.where.pop(key, None)

    def tier_of(self, key: bytes, down: Iterable[str] = ()) -> str | None:
        """The fastest tier holding `key`, of those not `down`."""
        mask = self.where.get(key, 0) & ~self._mask(down)
        return self.names[(mask & -mask).bit_length() - 1] if mask else None

    def _mask(self, tiers: Iterable[str]) -> int:
        return sum(1 << self.names.index(t) for t in tiers if t in self.names)

    def run(self, keys: Sequence[bytes], start: int, down: Iterable[str] = ()) -> list[str]:
        """Tiers of the keys held contiguously from `keys[start]` (in tiers not `down`)."""
        up = ~self._mask(down)
        names = self.names
        out: list[str] = []
        for k in keys[start:]:
            mask = self.where.get(k, 0) & up
            if not mask:
                break
            out.append(names[(mask & -mask).bit_length() - 1])
        return out

    def __contains__(self, key: bytes) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)


@dataclass(slots=True)
class _Tracked:
    """A live request as the scheduler half sees it."""

    request: Request
    salt: str | None
    usable: bool  # False: a malformed tenant; the tiers neither serve nor keep its blocks
    root: bytes
    keys: list[bytes] = field(default_factory=list)
    saved: int = 0  # its blocks below this are in the tiers, on their way, or were offered
    device_blocks: int = 0  # the device's prefix at its last lookup
    plan: list[str] = field(default_factory=list)  # tiers of the blocks found after it
    background: bool = False
    # A load of it failed: its next loads run before the forward. (vLLM 0.32 keeps a
    # request whose background load failed on its list of in-flight prefills, whose
    # reservations a background load must fit beside, its own included: waiting for one
    # again could wait forever.)
    sync_only: bool = False
    hints: ReqContext | None = None  # its hints' context (None: hints are off)
    session: str | None = None  # the digest of its session

    def keys_upto(self, n: int) -> list[bytes]:
        hashes = self.request.block_hashes
        keys = self.keys
        while len(keys) < n:
            keys.append(chain_key(self.root, hashes[len(keys)]))
        return keys


@dataclass(slots=True)
class _BlockInfo:
    """What a KV event about one key says (kept only while events are on)."""

    block_hash: Any
    parent_hash: Any
    token_ids: list[int]
    extra_keys: list[tuple[Any, ...] | None] | None
    tiers: set[str] = field(default_factory=set)


class _PeerFeed(SharedTierFeed):
    """The shared Redis tier's feed (other replicas' keys, loadable here), which also
    passes each of their announcements on as a tier change, for the scheduler's mirror."""

    def __init__(self, client: TierClient,
                 on_change: typing.Callable[[str, bytes, bytes | None, int, bool], None]
                 ) -> None:
        self._on_change = on_change
        super().__init__(client)

    def _apply(self, data: bytes) -> None:
        super()._apply(data)
        try:
            writer, items = decode_announcements(data)
        except ValueError:
            return
        if writer != self.writer:
            for op, key, tokens in items:
                self._on_change(self.store.name, key, None, tokens, op == _ANNOUNCED_PUT)


# ---- metrics ---------------------------------------------------------------------------------------
class KVHeatConnectorStats(KVConnectorStats):
    """Counter increments since the last report, flat: "loaded", "hits.host", ...;
    "used_bytes.<tier>" is a level (the latest wins)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = v if k.startswith("used_bytes.") else out.get(k, 0) + v
        return KVHeatConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class _Counts:
    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self._lock = threading.Lock()  # loader threads count too

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.data[name] = self.data.get(name, 0) + n

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self.data = self.data, {}
        return out


# (stats key prefix, metric name, help, kind)
_TIER_METRICS = (
    ("hits", "kvheat_connector_tier_hits_total",
     "Blocks read back from a kvheat tier and verified (MAC, checksum)", "counter"),
    ("hit_bytes", "kvheat_connector_tier_hit_bytes_total",
     "Bytes read back from a kvheat tier and verified", "counter"),
    ("faults", "kvheat_connector_tier_faults_total",
     "Reads from a kvheat tier that failed (bad MAC or checksum, torn, I/O error, down)",
     "counter"),
    ("used_bytes", "kvheat_connector_tier_used_bytes", "Bytes a kvheat tier holds", "gauge"),
    ("puts", "kvheat_connector_tier_puts_total",
     "Blocks written into a kvheat tier (vLLM's saves, and demotions from the tier above)",
     "counter"),
)
# Stats of the hints the worker passed to its tiers' policy: request ends by outcome,
# "ended_session.<outcome>" those naming a session and "ended.<outcome>" the others (the
# metric's session label), and "hinted_entries", the tier entries they reached.
_ENDED = {"ended": "false", "ended_session": "true"}
# (our stats name, the TierClient's per-tier figure)
_TIER_STATS = (("hits", "hits"), ("hit_bytes", "get_bytes"), ("faults", "faults"),
               ("puts", "puts"))


class KVHeatPromMetrics(KVConnectorPromMetrics):
    """The connector's metrics on vLLM's own /metrics (needs vLLM's stats: no
    --disable-log-stats)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tier_labels = [*labelnames, "tier"]
        self._tier: dict[str, Any] = {}
        gauge: Any = self._gauge_cls  # vLLM's metric classes (typed as their union)
        for prefix, name, doc, kind in _TIER_METRICS:
            if kind == "gauge":
                self._tier[prefix] = gauge(name=name, documentation=doc,
                                           labelnames=tier_labels,
                                           multiprocess_mode="mostrecent")
            else:
                self._tier[prefix] = self._counter_cls(name=name, documentation=doc,
                                                       labelnames=tier_labels)
        self._loaded: Any = self._counter_cls(
            name="kvheat_connector_blocks_loaded_total",
            documentation="Blocks loaded from kvheat's tiers into vLLM's KV pool, by tier",
            labelnames=tier_labels)
        self._recomputed: Any = self._counter_cls(
            name="kvheat_connector_blocks_recomputed_total",
            documentation="Prompt blocks past the device's prefix that vLLM computed: not in "
                          "the tiers (miss) or failing their load (load_failed)",
            labelnames=[*labelnames, "reason"])
        self._ended: Any = self._counter_cls(
            name="kvheat_connector_hinted_ends_total",
            documentation="Request ends passed to kvheat's tier policy as hints, by outcome "
                          "and whether the request named a session (the session itself is "
                          "never shown)",
            labelnames=[*labelnames, "outcome", "session"])
        self._hinted: Any = self._counter_cls(
            name="kvheat_connector_hinted_entries_total",
            documentation="Tier entries of ended requests that kvheat's tier policy was told of",
            labelnames=labelnames)
        self._refused: Any = self._counter_cls(
            name="kvheat_connector_refused_tenants_total",
            documentation="Requests whose kv_transfer_params named a tenant the connector "
                          "refused (no tier loads or saves): unvouched (no valid MAC of a "
                          "trusted front) or malformed",
            labelnames=[*labelnames, "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx)
        if values is None:
            return
        for key, v in transfer_stats_data.items():
            name, _, tier = key.partition(".")
            if name in self._tier and tier:
                m = self._tier[name].labels(*values, tier)
                if name == "used_bytes":
                    m.set(v)
                elif v > 0:
                    m.inc(v)
            elif name == "loaded" and tier and v > 0:
                self._loaded.labels(*values, tier).inc(v)
            elif name in ("miss", "load_failed") and v > 0:
                self._recomputed.labels(*values, name).inc(v)
            elif name in _ENDED and tier and v > 0:
                self._ended.labels(*values, tier, _ENDED[name]).inc(v)
            elif name == "hinted_entries" and v > 0:
                self._hinted.labels(*values).inc(v)
            elif name == "refused_tenant" and tier and v > 0:
                self._refused.labels(*values, tier).inc(v)


# ---- the connector --------------------------------------------------------------------------------
class KVHeatConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
            raise ValueError("KVHeatConnector runs with one worker (tensor and pipeline "
                             "parallel size 1)")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"KVHeatConnector needs one KV cache group, this model has "
                             f"{len(groups)} (hybrid attention is not supported)")
        kv_spec = groups[0].kv_cache_spec
        self.layout = "mla" if isinstance(kv_spec, MLAAttentionSpec) else "gqa"
        self.block_size = vllm_config.cache_config.block_size
        # What a layer's block takes times the layers: the tiers' block size (the worker
        # measures it from the tensors; here it sizes the host tier for the check).
        self.spec = self.config.tier_spec(kv_spec.page_size_bytes * len(groups[0].layer_names))
        if not vllm_config.cache_config.enable_prefix_caching:
            log.warning("KVHeatConnector keys blocks by vLLM's block hashes, which vLLM "
                        "computes only with prefix caching on (--enable-prefix-caching): "
                        "without them nothing is saved or loaded")
        # The tiers are a cache: a block that fails to load is recomputed, never an error.
        if ktc.kv_load_failure_policy != "recompute":
            ktc.kv_load_failure_policy = "recompute"
        model = vllm_config.model_config
        self.model_id = f"vllm:{model.model}@{model.revision or ''}"
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, nothing more

    # ==== scheduler half =========================================================================
    def _init_scheduler(self, vllm_config: VllmConfig) -> None:
        self.mirror = TierMirror()
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []
        self._counts = _Counts()
        self._shared = bool(self.config.redis_tier_url) and self.config.redis_tier_shared
        self._synced_at = -float("inf")
        self._down: list[str] = []
        ev = vllm_config.kv_events_config
        self._events_on = ev is not None and ev.enable_kv_cache_events
        self._events: list[Any] = []
        self._info: dict[bytes, _BlockInfo] = {}  # keys a tier holds (events on)
        # Keys that left every tier lately: a block moving down (host to disk) leaves
        # one tier before the next takes it, and its next event needs what it says.
        self._left: OrderedDict[bytes, _BlockInfo] = OrderedDict()
        self._held: dict[tuple[Any, str], int] = {}  # (vLLM hash, tier) -> keys holding it
        # Hints for the worker's next step (`KVHeatConnectorMetadata`), and the key of the
        # session digests (this process's: the digests live no longer than the tiers'
        # policy state does).
        self._started: list[str] = []
        self._finished: list[FinishHint] = []
        self._session_key = os.urandom(32)
        # Checks the MAC of a tenant named in kv_transfer_params (None: none is accepted).
        self._vouch = self.config.tenant_vouch()
        self._refused_logged_at = -float("inf")
        self._refused_unlogged = 0

    def _track(self, request: Request) -> _Tracked:
        t = self._tracked.get(request.request_id)
        if t is None:
            salt, usable = self._salt(request)
            t = self._tracked[request.request_id] = _Tracked(request, salt, usable,
                                                              root_key(salt))
            if usable and self.config.request_hints:
                # The offload adapter's reading of the request's hints (vllm_chunk.py).
                t.hints = ReqContext(request.request_id, request.kv_transfer_params,
                                     request.kv_hints)
                session = request_hints(t.hints).session
                if session is not None:
                    t.session = self._session_digest(t, session)
                    self._started.append(t.session)
        return t

    def _session_digest(self, t: _Tracked, session: str) -> str:
        """`session` keyed by this scheduler's secret, the tenant's salt and vLLM's cache
        salt (as kvheat's server keys its sessions: tenants naming the same session get
        different ones), so the client's string goes no further than here."""
        return session_digest(self._session_key, "vllm", t.salt or "",
                              t.request.cache_salt or "", session)

    def _salt(self, request: Request) -> tuple[str | None, bool]:
        """(salt, usable): the salt of the request's tenant, if a trusted front vouched
        for it (`cache/tenancy.py`); a tenant the client named itself is refused."""
        params = request.kv_transfer_params
        tenant = params.get(TENANT_PARAM) if isinstance(params, dict) else None
        if tenant is None:
            return None, True
        if not isinstance(tenant, str) or not tenant:
            self._refuse(request, "malformed", "kv_transfer_params.tenant must be a "
                         "non-empty string")
            return None, False
        assert isinstance(params, dict)
        if self._vouch is None or not self._vouch.vouched(tenant, request.cache_salt,
                                                          params.get(VOUCH_PARAM)):
            self._refuse(request, "unvouched", "its tenant carries no valid MAC of a "
                         "trusted front (kvheat route with this connector's tenant_secret)"
                         if self._vouch is not None else "a tenant is accepted only when "
                         "vouched for, and this connector has no tenant_secret")
            return None, False
        return tenant_salt(tenant, self.config.share_groups), True

    def _refuse(self, request: Request, reason: str, why: str) -> None:
        """Count a refused tenant; log it, at most once per REFUSED_LOG_EVERY_S."""
        self._counts.add("refused_tenant." + reason)
        now = time.monotonic()
        if now - self._refused_logged_at < REFUSED_LOG_EVERY_S:
            self._refused_unlogged += 1
            return
        log.warning("request %s: %s; its KV is neither loaded from nor saved to kvheat's "
                    "tiers (%d more refused since the last such line)", request.request_id,
                    why, self._refused_unlogged)
        self._refused_logged_at, self._refused_unlogged = now, 0

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._track(request)
        t.plan = []
        bs = self.block_size
        start = num_computed_tokens // bs
        t.device_blocks = start
        # Whole blocks, and never the whole prompt: vLLM computes at least its last token.
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if not t.usable or stop <= start:
            return 0, False
        if self._shared and time.monotonic() - self._synced_at > SHARED_SYNC_S:
            return None, False  # one empty step brings the worker's news first
        t.plan = self.mirror.run(t.keys_upto(stop), start, self._down)
        if not t.plan:
            return 0, False
        auto = any(x != "host" for x in t.plan)
        t.background = not t.sync_only and (auto if self.config.async_load is None
                                            else self.config.async_load)
        return len(t.plan) * bs, t.background

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        t = self._track(request)
        n = min(num_external_tokens // self.block_size, len(t.plan))
        start = t.device_blocks
        if n > 0:
            slots = blocks.get_block_ids()[0][start:start + n]
            self._loads.append(LoadJob(request.request_id, t.salt, start,
                                       t.keys[start:start + n], list(slots), t.background))
        if t.plan or num_external_tokens:
            stop = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
            self._counts.add("miss", max(0, stop - start - n))
        t.saved = max(t.saved, start + n)
        t.plan = []

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        job = next((j for j in reversed(self._loads) if j.req_id == request.request_id), None)
        if job is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        out: dict[CacheHitSource, int] = {}
        for key in job.keys:
            src = HIT_SOURCES.get(self.mirror.tier_of(key) or "",
                                  CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + self.block_size
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVHeatConnectorMetadata(loads=self._loads, sessions=self._started,
                                       finished=self._finished)
        self._loads, self._started, self._finished = [], [], []
        bs = self.block_size
        state = scheduler_output.kv_connector_block_state
        spec = scheduler_output.scheduled_spec_decode_tokens
        saving: set[bytes] = set()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is None or not t.usable:
                continue
            r = t.request
            # Blocks full once this step has run (its KV is written in the forward).
            done = r.num_computed_tokens + n - len(spec.get(req_id, ()))
            full = min(done // bs, len(r.block_hashes))
            if full <= t.saved:
                continue
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is None:
                assert self._kv_cache_manager is not None
                ids = self._kv_cache_manager.get_block_ids(req_id)
            keys = t.keys_upto(full)
            job = SaveJob(t.salt, [], [], [])
            for i in range(t.saved, full):
                k = keys[i]
                if k in self.mirror or k in saving:
                    continue
                saving.add(k)
                job.keys.append(k)
                job.parents.append(keys[i - 1] if i else None)
                job.slots.append(ids[0][i])
                if self._events_on and k not in self._info:
                    # Waits with the keys that left (bounded) until a tier takes it.
                    self._left[k] = self._block_info(r, i)
                    if len(self._left) > LEFT_KEYS:
                        self._left.popitem(last=False)
            t.saved = full
            if job.keys:
                meta.saves.append(job)
        return meta

    def _block_info(self, r: Request, i: int) -> _BlockInfo:
        bs = self.block_size
        extra, _ = generate_block_hash_extra_keys(r, i * bs, (i + 1) * bs, 0)
        return _BlockInfo(maybe_convert_block_hash(r.block_hashes[i]),
                          maybe_convert_block_hash(r.block_hashes[i - 1]) if i else None,
                          list(r.all_token_ids[i * bs:(i + 1) * bs]),
                          to_event_extra_keys([extra]))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVHeatWorkerMetadata):
            return
        self._synced_at = time.monotonic()
        self._down = meta.down
        for tier, key, stored in meta.changes:
            self.mirror.apply(tier, key, stored)
            if self._events_on:
                self._event(tier, key, stored)
        for req_id, block in meta.failed:
            t = self._tracked.get(req_id)
            if t is not None:  # its recomputed blocks are saved again
                t.saved = min(t.saved, block)
                t.sync_only = True

    def _event(self, tier: str, key: bytes, stored: bool) -> None:
        """A vLLM KV event when the first key of a vLLM block hash enters a tier, or the
        last leaves it (tenants' keys of one hash count once). Keys another replica put
        in a shared tier carry no tokens here: that replica publishes them."""
        info = self._info.get(key)
        if info is None:
            info = self._left.pop(key, None) if stored else None
            if info is None:
                return
            self._info[key] = info
        medium, locality, ownership = tier_place(tier)
        ref = (info.block_hash, tier)
        if stored and tier not in info.tiers:
            info.tiers.add(tier)
            n = self._held.get(ref, 0)
            self._held[ref] = n + 1
            if n == 0:
                self._events.append(BlockStored(
                    block_hashes=[info.block_hash], parent_block_hash=info.parent_hash,
                    token_ids=info.token_ids, block_size=self.block_size, lora_id=None,
                    medium=medium, lora_name=None, extra_keys=info.extra_keys,
                    locality=locality, ownership=ownership))
        elif not stored and tier in info.tiers:
            info.tiers.discard(tier)
            n = self._held.pop(ref, 1) - 1
            if n:
                self._held[ref] = n
            else:
                self._events.append(BlockRemoved(block_hashes=[info.block_hash],
                                                 medium=medium, locality=locality,
                                                 ownership=ownership))
            if not info.tiers:
                del self._info[key]
                self._left[key] = info
                if len(self._left) > LEFT_KEYS:
                    self._left.popitem(last=False)

    def take_events(self) -> Iterable[Any]:
        out, self._events = self._events, []
        return out

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        t = self._tracked.pop(request.request_id, None)
        if t is not None and t.hints is not None:
            record_outcome(t.hints, *request_end(request))
            h = request_hints(t.hints)
            # A session or a cancel is a hint; a plain finish tells the policy nothing new.
            if t.session is not None or h.outcome is Outcome.CANCELLED:
                self._finished.append(FinishHint(t.keys, t.session, h.outcome.value, h.reason))
        return False, None  # every save was copied out in its step: free the blocks now

    # ==== worker half =============================================================================
    def _init_worker(self) -> None:
        self.device: VLLMDeviceBlocks | None = None
        self.client: TierClient | None = None
        self._changes: deque[tuple[str, bytes, bool]] = deque()
        self._failed: deque[tuple[str, int]] = deque()
        self._invalid: set[int] = set()
        self._lock = threading.Lock()
        self._done_loading: set[str] = set()
        self._done_invalid: dict[str, list[int]] = {}
        self._loaders: ThreadPoolExecutor | None = None
        self._feed: _PeerFeed | None = None
        self._counts = _Counts()
        self._stats_at = time.monotonic()
        self._last_tier_stats: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_cache_config = self._kv_cache_config
        self.device = dev = VLLMDeviceBlocks(kv_caches, kv_cache_config.num_blocks,
                                             self.block_size, self.layout)
        spec = self.config.tier_spec(dev.bytes_per_block)
        self.client = TierClient.from_spec(spec, block_bytes=dev.bytes_per_block,
                                           block_tokens=self.block_size, model=self.model_id,
                                           layout=dev.describe())
        self.client.index_listeners.append(self._on_tier_change)
        self._feed = _PeerFeed(self.client, self._on_tier_change) \
            if spec.redis_url and spec.redis_shared else None
        self._loaders = ThreadPoolExecutor(max(1, spec.load_workers),
                                           thread_name_prefix="kvheat-vllm-load")
        log.info("KVHeatConnector: %d layers, %d-token blocks of %d bytes (%s), tiers %s",
                 dev.num_layers, self.block_size, dev.bytes_per_block, dev.describe(),
                 ", ".join(n for n, on in (("host", spec.host_blocks), ("disk", spec.disk_dir),
                                           ("redis", spec.redis_url)) if on))

    def _on_tier_change(self, tier: str, key: bytes, parent: bytes | None, tokens: int,
                        stored: bool) -> None:
        self._changes.append((tier, key, stored))  # any thread; sent with the next step

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHeatConnectorMetadata)
        if meta.sessions or meta.finished:
            self._apply_hints(meta)  # before this step's loads and saves
        for job in meta.loads:
            if job.background:
                assert self._loaders is not None
                self._loaders.submit(self._load_background, job)
            else:
                self._invalid.update(self._load(job))

    def _apply_hints(self, meta: KVHeatConnectorMetadata) -> None:
        client = self.client
        if client is None:
            return
        try:
            for session in meta.sessions:
                client.begin(session)
            for f in meta.finished:
                told = client.finish(f.keys, f.session, f.outcome, f.reason)
                self._counts.add(("ended_session." if f.session is not None else "ended.")
                                 + f.outcome)
                self._counts.add("hinted_entries", told)
        except Exception:  # a hint is never worth the engine
            log.exception("KVHeatConnector: passing request hints to the tiers failed")

    def _load(self, job: LoadJob) -> list[int]:
        """Load `job`; the device blocks that did not load (vLLM recomputes from there)."""
        client, device = self.client, self.device
        loaded = 0
        try:
            assert client is not None and device is not None
            plan = client.lookup(job.salt, job.keys, 0)
            if plan.keys:
                with device.writing_back():
                    loaded = client.load(plan, job.slots[:len(plan.keys)], device)
            for tier in plan.tiers[:loaded]:
                self._counts.add("loaded." + tier)
        except Exception:  # a tier's bug must cost a recompute, never the engine
            log.exception("KVHeatConnector: loading %d blocks for %s failed", len(job.keys),
                          job.req_id)
        failed = job.slots[loaded:]
        if failed:
            self._counts.add("load_failed", len(failed))
            self._failed.append((job.req_id, job.first + loaded))
        return failed

    def _load_background(self, job: LoadJob) -> None:
        failed = self._load(job)
        with self._lock:
            self._done_loading.add(job.req_id)
            if failed:
                self._done_invalid[job.req_id] = failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the forward (or the request waits for them)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHeatConnectorMetadata)
        client, device = self.client, self.device
        for job in meta.saves:
            try:
                assert client is not None and device is not None
                self._counts.add("offered", len(job.keys))
                client.save(job.salt, job.keys, job.parents, job.slots, device)
            except Exception:
                log.exception("KVHeatConnector: saving %d blocks failed", len(job.keys))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                   set[str] | None]:
        with self._lock:
            done, self._done_loading = self._done_loading, set()
            # Failed blocks are reported in the same step as their request's finish.
            for req_id in done:
                self._invalid.update(self._done_invalid.pop(req_id, ()))
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        # Sent every step, even empty: it is also the scheduler's news that the worker
        # has been heard from (see SHARED_SYNC_S).
        changes = [self._changes.popleft() for _ in range(len(self._changes))]
        failed = [self._failed.popleft() for _ in range(len(self._failed))]
        down = [st.name for st in self.client.stores if not st.available()] \
            if self.client is not None else []
        return KVHeatWorkerMetadata(changes, failed, down)

    # ==== metrics (both halves) ===================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, int | float] = dict(self._counts.take())
        if self._role == KVConnectorRole.WORKER and self.client is not None and \
                time.monotonic() - self._stats_at >= STATS_EVERY_S:
            self._stats_at = time.monotonic()
            data.update(self._tier_stats())
        return KVHeatConnectorStats(data=data) if data else None

    def _tier_stats(self) -> dict[str, int]:
        """Increments of the tiers' counters since the last read, and their used bytes."""
        assert self.client is not None
        out: dict[str, int] = {}
        now: dict[str, int] = {}
        tiers = self.client.stats().get("tiers")
        for name, st in (tiers.items() if isinstance(tiers, Mapping) else ()):
            tier = name.partition(":")[2] or name
            if not isinstance(st, Mapping):
                continue
            for ours, theirs in _TIER_STATS:
                v = st.get(theirs)
                if isinstance(v, int):
                    now[f"{ours}.{tier}"] = v
            used = st.get("used_bytes")
            if isinstance(used, int):
                out[f"used_bytes.{tier}"] = used
        for k, v in now.items():
            d = v - self._last_tier_stats.get(k, 0)
            if d > 0:
                out[k] = d
        self._last_tier_stats = now
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVHeatConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVHeatPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._role != KVConnectorRole.WORKER:
            return
        if self._loaders is not None:
            self._loaders.shutdown(wait=True)
        if self._feed is not None:
            self._feed.close()
        if self.client is not None:
            try:
                self.client.flush(timeout_s=5.0)
            finally:
                self.client.close()
