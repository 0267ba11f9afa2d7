"""Tenant quotas: a tenant with a block quota gets an eviction policy of its own over the
blocks it owns (a partition of the pool), so at its quota it evicts only its own blocks.

`TenantPartitions` is that split as one `EvictionPolicy` (the pool sees one policy and no
tenants); `TenantQuotas` sets quotas, moving blocks between partitions, and runs the
partitions on the pool only while some tenant has a quota: without quotas the pool runs
the shared policy itself, with no routing on its path.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block import Block
from .eviction import EvictionPolicy, make_policy, policy_names
from .hints import Outcome
from .node import Node
from .pool import BlockPool
from .request import OutOfBlocks


class TenantPartitions(EvictionPolicy):
    """The shared policy plus one partition policy per tenant with a quota.

    Each hook goes to the policy of the block's owner (`Block.tenant`), and victims are chosen by
    who needs the block and how far each tenant is over its quota."""

    name = "tenants"

    def __init__(self, shared: EvictionPolicy, usage: dict[str | None, int]) -> None:
        super().__init__()
        self.shared = shared
        self.partitions: dict[str | None, EvictionPolicy] = {}
        self.quotas: dict[str | None, int] = {}
        self.usage = usage  # the pool's: blocks held or cached, by owner

    def of(self, b: Node) -> EvictionPolicy:
        """The policy that orders `b`: its owner's partition, or the shared one."""
        return self.partitions.get(b.tenant, self.shared) if isinstance(b, Block) else self.shared

    def on_insert(self, b: Node, now: float) -> None:
        self.of(b).on_insert(b, now)

    def on_hit(self, b: Node, now: float) -> None:
        self.of(b).on_hit(b, now)

    def on_acquire(self, b: Node) -> None:
        self.of(b).on_acquire(b)

    def on_release(self, b: Node, now: float) -> None:
        self.of(b).on_release(b, now)

    def on_leaf(self, b: Node) -> None:
        self.of(b).on_leaf(b)

    def on_evict(self, b: Node) -> None:
        self.of(b).on_evict(b)

    def forget(self, b: Node) -> None:
        self.of(b).forget(b)

    # Hints: a session or a queue entry concerns whichever partitions its blocks fall in,
    # so every policy hears it; a request's end goes to each partition with its own blocks.
    def on_session(self, session: str, now: float) -> None:
        for pol in self._all():
            pol.on_session(session, now)

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        by_policy: dict[EvictionPolicy, list[Node]] = {}
        for b in blocks:
            by_policy.setdefault(self.of(b), []).append(b)
        for pol, own in by_policy.items():
            pol.on_finish(own, session, outcome, reason, now)

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        for pol in self._all():
            pol.on_queue(request_id, keys, session)

    def on_dequeue(self, request_id: str) -> None:
        for pol in self._all():
            pol.on_dequeue(request_id)

    def _all(self) -> list[EvictionPolicy]:
        return [self.shared, *self.partitions.values()]

    def victim(self) -> Node | None:
        return self._pick(None)

    def victim_for(self, owner: str | None) -> Node | None:
        b = self._pick(owner)
        if b is None and owner in self.quotas:
            raise OutOfBlocks(f"tenant {owner!r} is at its quota of {self.quotas[owner]} "
                              "blocks and none of its own blocks can be evicted")
        return b

    def _pick(self, owner: str | None) -> Node | None:
        for pol in self._sources(owner):
            b = pol.victim()
            if b is not None:
                assert b.ref_cnt == 0 and b.num_children == 0, f"policy chose an unevictable {b}"
                return b
        return None

    def _sources(self, owner: str | None) -> list[EvictionPolicy]:
        """Which policies to ask for a victim, in order, when `owner` needs a block."""
        quota, usage = self.quotas, self.usage
        if owner in quota and usage.get(owner, 0) >= quota[owner]:
            return [self.partitions[owner]]  # at its quota: only its own blocks go
        by_pressure = sorted(quota, key=lambda t: usage.get(t, 0) / quota[t], reverse=True)
        over = [self.partitions[t] for t in by_pressure if usage.get(t, 0) > quota[t]]
        rest = [self.partitions[t] for t in by_pressure if usage.get(t, 0) <= quota[t]]
        return over + [self.shared] + rest

    def set_cluster_entropy(self, bits: float) -> None:
        """Give the cluster's entropy to every policy here that reads an entropy regime.

        The shared one and each partition's; others ignore it."""
        for pol in self._all():
            fn = getattr(pol, "set_cluster_entropy", None)
            if fn is not None:
                fn(bits)

    def stats(self) -> dict[str, float]:
        return self.shared.stats()


class TenantQuotas:
    """The quota operations over a pool.

    Its partitions run on the pool while any tenant has a quota."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.policy = TenantPartitions(pool.policy, pool.usage)

    @property
    def quotas(self) -> dict[str | None, int]:
        """Each tenant's block quota, for the tenants that have one."""
        return self.policy.quotas

    @property
    def partitions(self) -> dict[str | None, EvictionPolicy]:
        """The policy of each tenant with a quota."""
        return self.policy.partitions

    def set_quota(self, tenant: str | None, blocks: int | None) -> int:
        """Cap a tenant's blocks when the pool is contended (None lifts the cap).

        Free blocks are used by anyone; once the pool is full, a tenant at its quota can
        only evict its own blocks, and others evict from tenants over their quota first.
        A tenant over its new quota loses its coldest unreferenced blocks at once, deleted,
        not demoted (demoting them would push other tenants out of the lower tiers).
        Returns how many were deleted.
        """
        pool, parts = self.pool, self.policy
        if blocks is not None and blocks <= 0:
            raise ValueError("a quota is a positive number of blocks")
        old = parts.partitions.get(tenant, parts.shared)
        if blocks is None:
            parts.quotas.pop(tenant, None)
            new = parts.shared
            parts.partitions.pop(tenant, None)
        else:
            parts.quotas[tenant] = blocks
            if tenant in parts.partitions:
                parts.partitions[tenant].bind(blocks)
                return self.trim(tenant)
            new = self._new_policy()
            new.bind(blocks)
            parts.partitions[tenant] = new
        pool.set_policy(parts if parts.partitions else parts.shared)
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
        quota = self.policy.quotas.get(tenant)
        pol = self.policy.partitions.get(tenant)
        n = 0
        while quota is not None and pol is not None and pool.usage.get(tenant, 0) > quota:
            b = pol.victim()
            if b is None:
                break
            assert isinstance(b, Block)
            pol.on_evict(b)
            pool.uncache(b, drop=True)
            n += 1
        return n

    def _new_policy(self) -> EvictionPolicy:
        """A fresh policy like the shared one (by name when it is registered)."""
        policy = self.policy.shared
        return make_policy(policy.name) if policy.name in policy_names() else type(policy)()

    def flush(self, tenant: str | None) -> int:
        """Delete every unreferenced cached block the tenant owns; returns how many.

        They are not demoted: the drop listeners delete the keys from the lower tiers too."""
        pool = self.pool
        mine = sorted((b for b in pool.cached.values() if b.tenant == tenant and b.ref_cnt == 0),
                      key=lambda b: -b.depth)
        n = 0
        for b in mine:  # deepest first, so each is a leaf by the time it is reached
            if b.key is not None and b.ref_cnt == 0 and b.num_children == 0:
                pool.policy.forget(b)
                pool.uncache(b, drop=True)
                n += 1
        return n
