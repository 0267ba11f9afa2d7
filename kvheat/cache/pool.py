"""The block pool: KV blocks, the free stack, the prefix index and the eviction policy's
hooks; pure mechanism (as vLLM's block_pool). `KVCacheManager` builds requests on it.

Blocks are never evicted while referenced, and only leaves go (a block whose child is
cached stays), in the order the policy picks. Every operation is O(1) per block: dict
lookups, intrusive lists, a free-block stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from .block import Block
from .policy import EvictionPolicy, make_policy
from .request import CacheConfig, CacheStats, OutOfBlocks, Request


class BlockPool:
    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = [Block(i) for i in range(config.num_blocks)]
        self.free_stack: list[Block] = self.blocks[::-1]  # uncached, unreferenced blocks
        self.cached: dict[bytes, Block] = {}
        self.policy = policy if policy is not None else make_policy(config.policy)
        self.policy.bind(config.num_blocks)
        # Tenants with a block quota get a policy of their own (a partition, kept by
        # `TenantQuotas`); the rest share `self.policy`. Blocks belong to the tenant that
        # filled them.
        self.partitions: dict[str | None, EvictionPolicy] = {}
        self.quotas: dict[str | None, int] = {}
        self.usage: dict[str | None, int] = {}  # blocks held or cached, by owning tenant
        # Skip the per-block call where the policy does not use the hook.
        pol = type(self.policy)
        base = EvictionPolicy
        self._on_hit = None if pol.on_hit is base.on_hit else self.policy.on_hit
        self._on_insert = None if pol.on_insert is base.on_insert else self.policy.on_insert
        self._on_acquire = None if pol.on_acquire is base.on_acquire else self.policy.on_acquire
        self._acquire_all = (None if pol.on_acquire_all is base.on_acquire_all
                             else self.policy.on_acquire_all)
        self._release_all = (None if pol.on_release_all is base.on_release_all
                             else self.policy.on_release_all)
        self.clock = clock
        self.num_referenced = 0
        self.stats = CacheStats()
        # Called with each block about to lose its KV (tiers demote it here).
        self.evict_listeners: list[Callable[[Block], None]] = []
        # Called instead with each block whose KV is deleted on purpose (a flush, a quota
        # cut): tiers delete the key everywhere rather than demote it.
        self.drop_listeners: list[Callable[[Block], None]] = []
        # Called with (block, True) once a block is registered under its key, and with
        # (block, False) just before it leaves the index for any reason (evicted, dropped,
        # rolled back, discarded): KV events for routers (kvheat.kvevents).
        self.index_listeners: list[Callable[[Block, bool], None]] = []

    def _acquire(self, hit: list[Block], now: float) -> int:
        """Reference the blocks of a cached prefix; returns their token count."""
        if self._acquire_all is not None and self._on_hit is None and not self.partitions:
            tokens = 0
            fresh = []
            for b in hit:
                if b.ref_cnt == 0:
                    fresh.append(b)
                b.ref_cnt += 1
                b.last_access = now
                tokens += b.num_tokens
            self.num_referenced += len(fresh)
            self._acquire_all(fresh)
            return tokens
        parts = self.partitions
        policy = self.policy
        on_hit = self._on_hit
        tokens = 0
        for b in hit:
            pol = parts.get(b.tenant, policy) if parts else policy
            if b.ref_cnt == 0:
                self.num_referenced += 1
                if pol is not policy:
                    pol.on_acquire(b)
                elif self._on_acquire is not None:
                    self._on_acquire(b)
            b.ref_cnt += 1
            b.last_access = now
            if pol is not policy:
                pol.on_hit(b, now)
            elif on_hit is not None:
                on_hit(b, now)
            tokens += b.num_tokens
        return tokens

    def _undo(self, blocks: list[Block], n_hit: int, now: float) -> None:
        """Roll back a failed allocate: new blocks leave the cache uncomputed, hits are released."""
        for b in reversed(blocks[n_hit:]):
            b.ref_cnt = 0
            self.num_referenced -= 1
            if b.key is not None:
                self._pol(b).forget(b)
                self._unlink(b, evicted=False)
            else:
                self._reset(b)
                self.free_stack.append(b)
        for b in reversed(blocks[:n_hit]):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.num_referenced -= 1
                self._pol(b).on_release(b, now)

    def _pol(self, b: Block) -> EvictionPolicy:
        return self.partitions.get(b.tenant, self.policy) if self.partitions else self.policy

    def _register(self, b: Block, key: bytes, content: bytes, parent: Block | None,
                  now: float, parent_key: bytes | None = None) -> None:
        if key in self.cached:  # the same prefix was filled by another request meanwhile
            return  # this copy stays private and is freed uncached
        if parent is not None and parent.key is None:
            # The parent is a private copy of a cached block (e.g. a fully cached prompt whose
            # last block is recomputed). Hang this block off the cached original, which holds
            # the same KV; with no original it stays private, as a cached child of a block
            # freed uncached would break the tree.
            parent = self.cached.get(parent_key) if parent_key is not None else None
            if parent is None:
                return
        b.key = key
        b.content = content
        b.parent = parent
        b.depth = parent.depth + 1 if parent is not None else 0
        if parent is not None:
            parent.num_children += 1
        self.cached[key] = b
        self.stats.inserted_blocks += 1
        for listener in self.index_listeners:
            listener(b, True)
        if self.partitions:
            self._pol(b).on_insert(b, now)
        elif self._on_insert is not None:
            self._on_insert(b, now)

    def _release(self, r: Request) -> None:
        now = self.clock()
        parts, policy = self.partitions, self.policy
        if self._release_all is not None and not parts:
            done: list[Block] = []
            free_stack = self.free_stack
            for b in reversed(r.blocks):
                b.ref_cnt -= 1
                if b.ref_cnt == 0:
                    if b.key is None:
                        self._reset(b)
                        free_stack.append(b)
                    else:
                        done.append(b)
                    self.num_referenced -= 1
            if done:
                self._release_all(done, now)
            r.blocks = []
            return
        on_release = policy.on_release
        released = 0
        for b in reversed(r.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                released += 1
                if b.key is None:
                    self._reset(b)
                    self.free_stack.append(b)
                elif parts and b.tenant in parts:
                    parts[b.tenant].on_release(b, now)
                else:
                    on_release(b, now)
        self.num_referenced -= released
        r.blocks = []

    def set_cluster_entropy(self, bits: float) -> None:
        """The entropy of all the traffic a router spreads over this cache and its peers,
        for every policy here that reads an entropy regime (the shared one and each
        tenant partition's); others ignore it."""
        for pol in (self.policy, *self.partitions.values()):
            fn = getattr(pol, "set_cluster_entropy", None)
            if fn is not None:
                fn(bits)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Mark blocks used now (tail-first), without changing who holds them."""
        now = self.clock()
        for b in reversed(blocks):
            if b.key is None:
                continue
            policy = self._pol(b)
            b.last_access = now
            if b.ref_cnt == 0:
                policy.on_acquire(b)
                policy.on_hit(b, now)
                policy.on_release(b, now)
            else:
                policy.on_hit(b, now)

    def evict(self, n: int) -> int:
        """Evict up to `n` unreferenced cached blocks into the free pool; returns how many."""
        done = 0
        while done < n and self._evict_one(None):
            done += 1
        return done

    def _take_free_block(self, tenant: str | None = None) -> Block:
        return self.free_stack.pop() if self.free_stack else self._evict_for_new(tenant)

    def _evict_for_new(self, tenant: str | None) -> Block:
        if not self._evict_one(tenant):
            if tenant in self.quotas:
                raise OutOfBlocks(f"tenant {tenant!r} is at its quota of {self.quotas[tenant]} "
                                  "blocks and none of its own blocks can be evicted")
            raise OutOfBlocks("no free or evictable block")  # excluded by the callers' checks
        return self.free_stack.pop()

    def _victim_sources(self, tenant: str | None) -> list[EvictionPolicy]:
        """Which policies to ask for a victim, in order, when `tenant` needs a block."""
        if not self.partitions:
            return [self.policy]
        quota, usage = self.quotas, self.usage
        if tenant in quota and usage.get(tenant, 0) >= quota[tenant]:
            return [self.partitions[tenant]]  # at its quota: only its own blocks go
        by_pressure = sorted(quota, key=lambda t: usage.get(t, 0) / quota[t], reverse=True)
        over = [self.partitions[t] for t in by_pressure if usage.get(t, 0) > quota[t]]
        rest = [self.partitions[t] for t in by_pressure if usage.get(t, 0) <= quota[t]]
        return over + [self.policy] + rest

    def _evict_one(self, tenant: str | None) -> bool:
        if not self.partitions:  # the common case: one policy for everyone
            pol = self.policy
            b = pol.victim()
            if b is None:
                return False
            pol.on_evict(b)
            self._unlink(b)
            return True
        for pol in self._victim_sources(tenant):
            b = pol.victim()
            if b is not None:
                assert b.ref_cnt == 0 and b.num_children == 0, f"policy chose an unevictable {b}"
                pol.on_evict(b)
                self._unlink(b)
                return True
        return False

    def _unlink(self, b: Block, evicted: bool = True, drop: bool = False) -> None:
        """Take a refcount-0 leaf out of the cache and into the free pool. `evicted` is
        False only for blocks whose KV was never computed (a rolled-back allocate);
        `drop`: its KV is deleted on purpose (flush, quota cut), not demoted."""
        if evicted:
            for listener in (self.drop_listeners if drop else self.evict_listeners):
                listener(b)
        for index_listener in self.index_listeners:
            index_listener(b, False)
        del self.cached[b.key]  # type: ignore[arg-type]
        parent = b.parent
        self._reset(b)
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0 and parent.ref_cnt == 0:
                self._pol(parent).on_leaf(parent)
        self.free_stack.append(b)
        if evicted:
            self.stats.evicted_blocks += 1

    def _reset(self, b: Block) -> None:
        self.usage[b.tenant] -= 1
        b.key = None
        b.content = None
        b.parent = None
        b.num_children = 0
        b.num_tokens = 0
        b.state = 0
        b.freq = 0
        b.parked = None
        b.tenant = None
        b.heap_ver += 1

    @property
    def num_free(self) -> int:
        return len(self.free_stack)

    @property
    def num_cached(self) -> int:
        return len(self.cached)


def check_invariants(pool: BlockPool, holders: Iterable[Request]) -> None:
    """Full consistency check of a pool and the requests holding its blocks (O(pool));
    for tests."""
    n = len(pool.blocks)
    free_ids = {b.block_id for b in pool.free_stack}
    assert len(free_ids) == len(pool.free_stack), "a block is twice in the free pool"
    held: dict[int, int] = {}
    for r in holders:
        for b in r.blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    children: dict[int, int] = {}
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == held.get(b.block_id, 0), f"refcount of {b} != holders"
        if b.block_id in free_ids:
            assert b.key is None and b.ref_cnt == 0
        if b.key is not None:
            assert pool.cached.get(b.key) is b
            if b.parent is not None:
                assert b.parent.key is not None, "a cached block's parent was evicted"
                children[b.parent.block_id] = children.get(b.parent.block_id, 0) + 1
        elif b.block_id not in free_ids:
            assert b.ref_cnt > 0, f"{b} is neither free, cached nor held"
    for b in pool.blocks:
        assert b.num_children == children.get(b.block_id, 0), f"child count of {b}"
    assert sum(1 for b in pool.blocks if b.ref_cnt) == pool.num_referenced
    assert len(pool.cached) + len(pool.free_stack) + sum(
        1 for b in pool.blocks if b.key is None and b.ref_cnt) == n
    owned: dict[str | None, int] = {}
    for b in pool.blocks:
        if b.block_id not in free_ids:
            owned[b.tenant] = owned.get(b.tenant, 0) + 1
    assert owned == {t: c for t, c in pool.usage.items() if c}, "tenant usage drifted"
