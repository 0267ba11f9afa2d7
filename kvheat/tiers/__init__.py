"""KV tiers: host, disk and Redis stores below the device pool, under one policy.

`client.TierClient` is the narrow interface every engine uses (lookup a `LoadPlan`, load
it into device slots, save device blocks; kvheat's engine and the vLLM connector alike).
`host.py`, `disk.py` and `redis_store.py` hold real KV bytes per block key behind
`store.KVStore`; `hierarchy.TieredCache` wraps a `KVCacheManager` and the device pool
(typed by `store.DeviceBlocks`; the engine's is `kvheat.engine.kv_pool`) and moves blocks
on top of a `TierClient`: `demotion`, `promotion` (prefetch, loads), `cost` (load or
recompute), `lower` and `index` (what lies below: one `KeyIndex` of each key's tiers,
parent and tenant salt). `spec.TierSpec` declares the
tiers and `spec.build_tiers` builds them.
Redis support needs redis-py (`pip install kvheat[tiers]`).
"""

from .client import LoadPlan, TierClient
from .codec import CorruptValue, namespace_digest
from .counters import TierCounters
from .disk import DiskStore
from .hierarchy import TieredCache
from .host import HostStore
from .index import TierIndex
from .spec import TierSpec, build_tiers, store_layout
from .store import DeviceBlocks, KVStore, StoreStats, TransferModel

__all__ = [
    "CorruptValue", "DeviceBlocks", "DiskStore", "HostStore", "KVStore", "LoadPlan",
    "StoreStats", "TierClient", "TierCounters", "TierIndex", "TierSpec", "TieredCache",
    "TransferModel", "build_tiers", "namespace_digest", "store_layout",
]
