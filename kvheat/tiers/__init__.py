"""KV tiers: host, disk and Redis stores below the device pool, under one policy.

`manager.TierManager` is the one face every engine calls (kvheat's engine and the vLLM
connector alike), built from a `spec.TierSpec`: `lookup` a `LoadPlan`, `load` it into
device slots, `save` / `evict` device blocks down, `purge` a tenant, `health` and bypass
for operations. `host.py`, `disk.py` and `redis_store.py` hold real KV bytes per block key
(`cache.hashing.BlockKey`) in a tenant's `cache.hashing.Namespace` behind `store.KVStore`;
`lower.LowerTiers` is the stores with the one index of what they hold (`index.KeyIndex`:
each key's tiers, parent and namespace), `demotion` moves blocks down, `loads` reads them
up, `cost` decides load or recompute. `device` binds kvheat's own device cache on top (its
evictions go down). Redis support needs redis-py (`pip install kvheat[tiers]`).
"""

from .codec import CorruptValue, namespace_digest
from .counters import TierCounters
from .disk import DiskStore
from .host import HostStore
from .index import TierIndex
from .loads import LoadPlan
from .manager import TierHealth, TierManager
from .spec import TierSpec, store_layout
from .store import DeviceBlocks, KVStore, StoreStats, TransferModel

__all__ = [
    "CorruptValue", "DeviceBlocks", "DiskStore", "HostStore", "KVStore", "LoadPlan",
    "StoreStats", "TierCounters", "TierHealth", "TierIndex", "TierManager", "TierSpec",
    "TransferModel", "namespace_digest", "store_layout",
]
