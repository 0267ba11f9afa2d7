"""One definition of the lower KV tiers' settings (`TierSpec`) and the stores it names
(`TierSpec.stores_for`; `manager.TierManager` builds its tiers from a spec). The engine
embeds a spec (`EngineConfig.tiers`); the server fills one from its config file's and
`serve` options' tier keys, per arm."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_fields
from .store import DeviceBlocks, KVStore

MODES = ("exclusive", "write_through")


@dataclass(slots=True)
class TierSpec:
    """The lower tiers' settings: which tiers, their sizes, and how blocks move between them."""

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
    def slow(self) -> bool:
        """True when it names a tier read off the engine's thread (disk, Redis)."""
        return bool(self.disk_dir) or bool(self.redis_url)

    @property
    def enabled(self) -> bool:
        """True when any lower tier is configured."""
        return self.host_blocks > 0 or bool(self.disk_dir) or bool(self.redis_url)

    def stores_for(self, block_bytes: int, model_id: str, layout: str) -> list[KVStore]:
        """Build the configured stores, top first, for blocks of `block_bytes` bytes.

        The blocks are in the stored format `layout` (`store_layout`) of the weights
        `model_id`."""
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
    """The name of the format `device`'s blocks are stored in, e.g. "gqa-b16-bfloat16".

    Part of every namespace, so KV of another layout, block size or dtype is never read."""
    dtype = str(device.dtype).removeprefix("torch.")
    return f"{device.layout}-b{device.block_size}-{dtype}"
