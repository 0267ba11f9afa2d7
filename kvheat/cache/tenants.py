"""Tenant quotas: a tenant with a block quota gets an eviction policy of its own over the
blocks it owns (a partition of the pool), so at its quota it evicts only its own blocks."""

from __future__ import annotations

from .policy import EvictionPolicy, make_policy, policy_names
from .pool import BlockPool


class TenantQuotas:
    """The quota operations over a pool's partitions (`pool.partitions`, `pool.quotas`,
    `pool.usage`, which the pool's eviction reads)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def set_quota(self, tenant: str | None, blocks: int | None) -> int:
        """Cap a tenant's blocks when the pool is contended (None lifts the cap).

        Free blocks are used by anyone; once the pool is full, a tenant at its quota can
        only evict its own blocks, and others evict from tenants over their quota first.
        A tenant over its new quota loses its coldest unreferenced blocks at once, deleted,
        not demoted (demoting them would push other tenants out of the lower tiers).
        Returns how many were deleted.
        """
        pool = self.pool
        if blocks is not None and blocks <= 0:
            raise ValueError("a quota is a positive number of blocks")
        old = pool.partitions.get(tenant, pool.policy)
        if blocks is None:
            pool.quotas.pop(tenant, None)
            new = pool.policy
            pool.partitions.pop(tenant, None)
        else:
            pool.quotas[tenant] = blocks
            if tenant in pool.partitions:
                pool.partitions[tenant].bind(blocks)
                return self.trim(tenant)
            new = self._new_policy()
            new.bind(blocks)
            pool.partitions[tenant] = new
        if new is not old:
            # Move the tenant's cached blocks over, oldest first and children before
            # parents, so the new policy sees them in the order they were used.
            mine = sorted((b for b in pool.cached.values() if b.tenant == tenant),
                          key=lambda b: (b.last_access, -b.depth))
            for b in mine:
                old.forget(b)
            for b in mine:
                new.on_insert(b, b.last_access)
                if b.ref_cnt == 0:
                    new.on_release(b, b.last_access)
        return self.trim(tenant)

    def trim(self, tenant: str | None) -> int:
        """Delete a tenant's coldest unreferenced blocks while it is over its quota."""
        pool = self.pool
        quota = pool.quotas.get(tenant)
        pol = pool.partitions.get(tenant)
        n = 0
        while quota is not None and pol is not None and pool.usage.get(tenant, 0) > quota:
            b = pol.victim()
            if b is None:
                break
            pol.on_evict(b)
            pool._unlink(b, drop=True)
            n += 1
        return n

    def _new_policy(self) -> EvictionPolicy:
        """A fresh policy like the pool's (by name when it is registered)."""
        policy = self.pool.policy
        return make_policy(policy.name) if policy.name in policy_names() else type(policy)()

    def flush(self, tenant: str | None) -> int:
        """Delete every unreferenced cached block the tenant owns (not demoted: the drop
        listeners delete the keys from the lower tiers too); returns how many."""
        pool = self.pool
        mine = sorted((b for b in pool.cached.values() if b.tenant == tenant and b.ref_cnt == 0),
                      key=lambda b: -b.depth)
        n = 0
        for b in mine:  # deepest first, so each is a leaf by the time it is reached
            if b.key is not None and b.ref_cnt == 0 and b.num_children == 0:
                pool._pol(b).forget(b)
                pool._unlink(b, drop=True)
                n += 1
        return n

