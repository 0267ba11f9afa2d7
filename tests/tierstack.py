"""kvheat's device cache with lower tiers attached, wired as the engine wires them, for
tests that drive the cache and its tiers without a model."""

from __future__ import annotations

from kvheat.cache import KVCacheManager, Request
from kvheat.tiers import DeviceBlocks, KVStore, TierManager, TierSpec
from kvheat.tiers.cost import PrefillSpeed
from kvheat.tiers.device import allocate, attach, prefetch, purge, tiers_for


class Stack:
    """A `KVCacheManager`, its device pool and the `TierManager` under them."""

    def __init__(self, mgr: KVCacheManager, pool: DeviceBlocks, stores: list[KVStore],
                 spec: TierSpec | None = None,
                 prefill_tokens_per_s: PrefillSpeed = None) -> None:
        self.mgr, self.pool = mgr, pool
        self.tiers: TierManager = tiers_for(mgr, pool, spec or TierSpec(), "",
                                            prefill_tokens_per_s, stores=stores)
        self._detach = attach(self.tiers, mgr, pool)

    def allocate(self, req: Request) -> list[int]:
        """Allocate `req` with the tiers' hits loaded (`kvheat.tiers.device.allocate`)."""
        return allocate(self.tiers, self.mgr, self.pool, req)

    def prefetch(self, req: Request) -> int:
        """Plan and start `req`'s loads as the scheduler does when it arrives."""
        return prefetch(self.tiers, self.mgr, req)

    def purge(self, tenant: str | None) -> dict[str, int]:
        """Delete what the tiers hold of `tenant`, as the engine's flush does."""
        return purge(self.tiers, self.mgr, tenant)

    def close(self) -> None:
        self.tiers.close()
        self._detach()
