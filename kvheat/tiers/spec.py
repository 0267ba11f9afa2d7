"""One definition of the lower KV tiers' settings (`TierSpec`) and the one place that
builds them under a device pool (`build_tiers`). The engine embeds a spec
(`EngineConfig.tiers`); the server fills one from its config file's and `serve` options'
tier keys, per arm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..checks import check_fields
from .store import DeviceBlocks, KVStore

if TYPE_CHECKING:
    from ..cache.manager import KVCacheManager
    from .cost import PrefillSpeed
    from .hierarchy import TieredCache

MODES = ("exclusive", "write_through")


@dataclass(slots=True)
class TierSpec:
    # Which tiers, in this order under the device: host memory, local disk (survives a
    # restart), Redis (shared by replicas).
    host_blocks: int = 0  # >0: a host-memory tier of this many blocks
    disk_dir: str | None = None
    disk_bytes: int = 0
    redis_url: str | None = None
    redis_bytes: int = 0
    redis_cluster: bool = False  # the URL is a Redis Cluster node
    # Replicas on one Redis tier tell each other (pub/sub) which blocks they put there, so
    # any replica loads what another demoted (kvheat.tiers.shared; the server wires it).
    redis_shared: bool = True
    # Keys the MAC of every KV value read back from disk or Redis, and their key names
    # (codec.tier_key); None: the KVHEAT_TIER_SECRET environment variable, else a disk
    # folder's own key file and a per-process Redis key. Servers sharing a Redis (or a disk
    # folder) need the same one.
    secret: str | None = None
    # Separates engines that must not share lower-tier KV of one model (the server's arms).
    namespace: str = ""
    # How blocks move between them.
    mode: str = "exclusive"  # a block in one tier at a time; or "write_through"
    policy: str | None = None  # the lower tiers' eviction policy; None: the device's
    # Background demotion and prefetch loaders, and timing each tier once at start (with a
    # prefill speed); None: when a tier is slow (disk, Redis). Host only: synchronous
    # copies, always loaded (a memory copy beats recomputing, bench/tiers/bandwidth.py).
    async_io: bool | None = None
    calibrate: bool | None = None
    queue_size: int = 256  # pending demotions (each holds one block's bytes)
    load_workers: int = 2
    # A tier judged slower than recomputing gets no reads, so its estimate would never
    # change: after this long without a read, one block is loaded anyway to measure again.
    remeasure_s: float = 10.0

    def __post_init__(self) -> None:
        check_fields(self)
        if self.host_blocks < 0:
            raise ValueError("host_tier_blocks must be >= 0")
        if bool(self.disk_dir) != (self.disk_bytes > 0):
            raise ValueError("a disk tier needs both a folder (disk_tier_dir) and a size "
                             "(disk_tier_bytes > 0)")
        if bool(self.redis_url) != (self.redis_bytes > 0):
            raise ValueError("a Redis tier needs both a URL (redis_tier_url) and a size "
                             "(redis_tier_bytes > 0)")
        if self.mode not in MODES:
            raise ValueError(f"tier_mode must be exclusive or write_through, not {self.mode!r}")
        if self.secret is not None and len(self.secret.encode()) < 16:
            raise ValueError("tier_secret must have at least 16 bytes")
        if self.queue_size <= 0 or self.load_workers <= 0:
            raise ValueError("queue_size and load_workers must be positive")
        if self.disk_bytes < 0 or self.redis_bytes < 0:
            raise ValueError("tier sizes must be >= 0")
        if self.remeasure_s <= 0:
            raise ValueError("remeasure_s must be positive")

    @property
    def enabled(self) -> bool:
        """Is any lower tier configured?"""
        return self.host_blocks > 0 or bool(self.disk_dir) or bool(self.redis_url)

    def stores(self, device: DeviceBlocks, model_id: str) -> list[KVStore]:
        """The configured stores, top first, for blocks of `device` and KV of `model_id`
        (names the KV on disk and in Redis, so KV of other weights is never served)."""
        return self.stores_for(device.bytes_per_block, model_id, store_layout(device))

    def stores_for(self, block_bytes: int, model_id: str, layout: str) -> list[KVStore]:
        """The configured stores, top first, for blocks of `block_bytes` bytes in the
        stored format `layout` (`store_layout`) of the weights `model_id`."""
        from .disk import DiskStore
        from .host import HostStore

        out: list[KVStore] = []
        if self.host_blocks > 0:
            out.append(HostStore(self.host_blocks * block_bytes, block_bytes))
        if self.namespace:
            model_id += "/" + self.namespace
        if self.disk_dir:
            out.append(DiskStore(self.disk_dir, self.disk_bytes, model=model_id,
                                 layout=layout, secret=self.secret))
        if self.redis_url:
            from .redis_store import RedisStore, connect

            out.append(RedisStore(connect(self.redis_url, cluster=self.redis_cluster),
                                  self.redis_bytes, model=model_id, layout=layout,
                                  secret=self.secret))
        return out


def store_layout(device: DeviceBlocks) -> str:
    """The name of the format `device`'s blocks are stored in ("gqa-b16-bfloat16"): part
    of every namespace, so KV of another layout, block size or dtype is never read."""
    dtype = str(device.dtype).removeprefix("torch.")
    return f"{device.layout}-b{device.block_size}-{dtype}"


def build_tiers(spec: TierSpec, mgr: KVCacheManager, device: DeviceBlocks, model_id: str,
                prefill_tokens_per_s: PrefillSpeed = None) -> TieredCache | None:
    """The tiers `spec` names under `mgr` and its `device` pool (None when it names none).
    With a slow tier, loads are made only where they beat the engine's measured
    `prefill_tokens_per_s`; host-only tiers always load."""
    from .hierarchy import TieredCache

    if not spec.enabled:
        return None
    stores = spec.stores(device, model_id)
    slow = any(not st.inline for st in stores)
    return TieredCache(mgr, device, stores, spec,
                       prefill_tokens_per_s=prefill_tokens_per_s if slow else None)
