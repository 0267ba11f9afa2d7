"""KV tiers: the device pool, and host, disk and Redis stores below it under one policy.

`device.py` holds the engine's paged KV pool; `host.py`, `disk.py` and `redis_store.py`
hold real KV bytes per block key behind `store.KVStore`; `hierarchy.TieredCache` wraps a
`KVCacheManager` and moves blocks between them (demotion, promotion, prefetch,
load-or-recompute). Redis support needs redis-py (`pip install kvheat[tiers]`).
"""

from .codec import CorruptValue, namespace_digest
from .disk import DiskStore
from .hierarchy import TierConfig, TierCounters, TieredCache, TierIndex
from .host import HostStore
from .store import KVStore, StoreStats, TransferModel

__all__ = [
    "CorruptValue", "DiskStore", "HostStore", "KVStore", "StoreStats", "TierConfig",
    "TierCounters", "TierIndex", "TieredCache", "TransferModel", "namespace_digest",
]
