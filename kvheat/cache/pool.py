"""The block pool: KV blocks, the free stack, the prefix index and the eviction policy's
hooks; pure mechanism (as vLLM's block_pool). `KVCacheManager` holds one and builds
requests on it.

Blocks are never evicted while referenced, and only leaves go (a block whose child is
cached stays), in the order the policy picks. Every operation is O(1) per block: dict
lookups, intrusive lists, a free-block stack. The pool runs one policy and knows nothing
of tenants but the owner each block is counted against (`usage`): quotas are a policy
(`kvheat.cache.tenants.TenantPartitions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from .block import Block
from .eviction import EvictionPolicy, make_policy
from .hashing import BlockKey
from .node import Node
from .request import CacheConfig, CacheStats, OutOfBlocks, Request


class BlockPool:
    """The blocks, their prefix index and the eviction policy that frees them.

    The pool's mechanism: a free stack, the index of cached blocks by key, eviction through one
    policy's hooks, and the listeners told of every change; no tenant branches."""

    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = [Block(i) for i in range(config.num_blocks)]
        self.free_stack: list[Block] = self.blocks[::-1]  # uncached, unreferenced blocks
        self.cached: dict[bytes, Block] = {}
        policy = policy if policy is not None else make_policy(config.policy)
        policy.bind(config.num_blocks)
        self.set_policy(policy)
        self.usage: dict[str | None, int] = {}  # blocks held or cached, by owner (tenant)
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

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Run `policy` from now on.

        It is bound already and already holds the cached blocks: `TenantQuotas` swaps the shared
        policy and its partitions in and out."""
        self.policy = policy
        # Skip the per-block call where the policy does not use the hook.
        pol = type(policy)
        base = EvictionPolicy
        self._on_hit = None if pol.on_hit is base.on_hit else policy.on_hit
        self._on_insert = None if pol.on_insert is base.on_insert else policy.on_insert
        self._on_acquire = None if pol.on_acquire is base.on_acquire else policy.on_acquire
        self._acquire_all = (None if pol.on_acquire_all is base.on_acquire_all
                             else policy.on_acquire_all)
        self._release_all = (None if pol.on_release_all is base.on_release_all
                             else policy.on_release_all)
        self._victim_for = None if pol.victim_for is base.victim_for else policy.victim_for
        self._on_evict = None if pol.on_evict is base.on_evict else policy.on_evict
        self._on_leaf = policy.on_leaf

    # ---- references -------------------------------------------------------------------
    def acquire(self, hit: Sequence[Block], now: float) -> int:
        """Reference the blocks of a cached prefix; returns their token count."""
        if self._acquire_all is not None and self._on_hit is None:
            tokens = 0
            fresh: list[Node] = []
            for b in hit:
                if b.ref_cnt == 0:
                    fresh.append(b)
                b.ref_cnt += 1
                b.last_access = now
                tokens += b.num_tokens
            self.num_referenced += len(fresh)
            self._acquire_all(fresh)
            return tokens
        on_acquire, on_hit = self._on_acquire, self._on_hit
        tokens = 0
        for b in hit:
            if b.ref_cnt == 0:
                self.num_referenced += 1
                if on_acquire is not None:
                    on_acquire(b)
            b.ref_cnt += 1
            b.last_access = now
            if on_hit is not None:
                on_hit(b, now)
            tokens += b.num_tokens
        return tokens

    def allocate_blocks(self, blocks: list[Block], n_need: int, owner: str | None,
                        keys: Sequence[BlockKey], contents: Sequence[bytes],
                        block_tokens: Sequence[int], now: float) -> None:
        """Grow `blocks` (a cached prefix, acquired) to `n_need` blocks held once by `owner`.

        Block i holds `block_tokens[i]` tokens and is cached under `keys[i]` when there is one.
        Evicts when the free stack is empty. The new blocks count against `owner` from the start
        (a quota's choice of victims sees them). On OutOfBlocks everything is undone, the prefix
        released too, and the error raised."""
        n_hit = len(blocks)
        n_new = n_need - n_hit
        parent: Block | None = blocks[-1] if blocks else None
        n_keys = len(keys)
        free_stack = self.free_stack
        self.usage[owner] = self.usage.get(owner, 0) + n_new
        try:
            for i in range(n_hit, n_need):
                b = free_stack.pop() if free_stack else self._evict_for(owner)
                b.ref_cnt = 1
                b.num_tokens = block_tokens[i]
                b.tenant = owner
                b.last_access = b.inserted_at = now
                if i < n_keys:
                    self.register(b, keys[i], contents[i], parent, now, keys[i - 1] if i else None)
                blocks.append(b)
                parent = b
        except OutOfBlocks:  # only an owner held to its quota gets here
            self.num_referenced += len(blocks) - n_hit
            self.usage[owner] -= n_new - (len(blocks) - n_hit)
            self._undo(blocks, n_hit, now)
            raise
        self.num_referenced += n_new

    def take_free_blocks(self, n: int, owner: str | None) -> list[Block]:
        """Take `n` free blocks, evicting for `owner` as needed, not yet held (`hold`).

        On OutOfBlocks the ones taken go back to the free stack."""
        taken: list[Block] = []
        free_stack = self.free_stack
        try:
            for _ in range(n):
                taken.append(free_stack.pop() if free_stack else self._evict_for(owner))
        except OutOfBlocks:  # an owner held to its quota: give the fresh blocks back
            free_stack.extend(reversed(taken))
            raise
        return taken

    def hold(self, taken: Sequence[Block], owner: str | None, now: float) -> None:
        """Hold blocks from `take_free_blocks` once each, empty, counted against `owner`."""
        if taken:
            self.usage[owner] = self.usage.get(owner, 0) + len(taken)
        for b in taken:
            b.ref_cnt = 1
            self.num_referenced += 1
            b.num_tokens = 0
            b.tenant = owner
            b.last_access = b.inserted_at = now

    def _undo(self, blocks: list[Block], n_hit: int, now: float) -> None:
        """Roll back a failed allocate: new blocks leave the cache uncomputed, hits are released."""
        policy = self.policy
        for b in reversed(blocks[n_hit:]):
            b.ref_cnt = 0
            self.num_referenced -= 1
            if b.key is not None:
                policy.forget(b)
                self._unlink(b, evicted=False)
            else:
                self._reset(b)
                self.free_stack.append(b)
        for b in reversed(blocks[:n_hit]):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.num_referenced -= 1
                policy.on_release(b, now)

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference to each block, tail-first.

        So a request's first block ends most recent; uncached blocks left unreferenced go back to
        the free stack."""
        now = self.clock()
        if self._release_all is not None:
            done: list[Node] = []
            free_stack = self.free_stack
            for b in reversed(blocks):
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
            return
        on_release = self.policy.on_release
        released = 0
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                released += 1
                if b.key is None:
                    self._reset(b)
                    self.free_stack.append(b)
                else:
                    on_release(b, now)
        self.num_referenced -= released

    # ---- the prefix index -------------------------------------------------------------
    def register(self, b: Block, key: BlockKey, content: bytes, parent: Block | None,
                 now: float, parent_key: bytes | None = None) -> None:
        """Cache held block `b` under `key`, as a child of `parent`."""
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
        if self._on_insert is not None:
            self._on_insert(b, now)

    def unregister(self, b: Block) -> None:
        """Un-cache held leaf `b`, whose KV was never written (its forward pass failed).

        Its key goes without eviction listeners, and it stays held, private."""
        for listener in self.index_listeners:
            listener(b, False)
        self.policy.forget(b)
        assert b.key is not None
        del self.cached[b.key]
        parent = b.parent
        self._forget_key(b)
        if parent is not None:
            self._lost_child(parent)

    def uncache(self, b: Block, drop: bool = False) -> None:
        """Move refcount-0 leaf `b` out of the cache into the free stack.

        The policy has let go of it already (its victim, or forgotten). `drop`: its KV is deleted
        on purpose (a flush, a quota cut), not demoted."""
        self._unlink(b, drop=drop)

    def _unlink(self, b: Block, evicted: bool = True, drop: bool = False) -> None:
        """`uncache`; `evicted` is False only for blocks whose KV was never computed (a
        rolled-back allocate)."""
        self._clear(b, evicted, drop)
        self.free_stack.append(b)

    def _clear(self, b: Block, evicted: bool = True, drop: bool = False) -> None:
        """Take `b` out of the index and the tree, free but not yet in the free stack:
        listeners told, the parent told it may be a leaf now (this runs per eviction:
        `_lost_child` written out, empty listener lists skipped)."""
        if evicted:
            listeners = self.drop_listeners if drop else self.evict_listeners
            if listeners:
                for listener in listeners:
                    listener(b)
            self.stats.evicted_blocks += 1
        if self.index_listeners:
            for index_listener in self.index_listeners:
                index_listener(b, False)
        assert b.key is not None
        del self.cached[b.key]
        parent = b.parent
        self._reset(b)
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0 and parent.ref_cnt == 0:
                self._on_leaf(parent)

    def _lost_child(self, parent: Node) -> None:
        parent.num_children -= 1
        if parent.num_children == 0 and parent.ref_cnt == 0:
            self.policy.on_leaf(parent)

    def _forget_key(self, b: Block) -> None:
        """Clear what `b` had as a cached block (a new `heap_version`: its entries go stale)."""
        b.key = None
        b.content = None
        b.parent = None
        b.state = 0
        b.freq = 0
        b.parked = None
        b.heap_version += 1

    def _reset(self, b: Block) -> None:
        """Return `b` to the free state, uncounted against its owner (`_forget_key`, and
        more, written out: this runs per block freed)."""
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
        b.heap_version += 1

    # ---- eviction ---------------------------------------------------------------------
    def set_cluster_entropy(self, bits: float) -> None:
        """Give the policy the entropy of the traffic a router spreads over the cluster.

        That is the traffic of this cache and its peers, for a policy that reads an entropy
        regime; others ignore it."""
        fn = getattr(self.policy, "set_cluster_entropy", None)
        if fn is not None:
            fn(bits)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Mark blocks used now (tail-first), without changing who holds them."""
        now = self.clock()
        policy = self.policy
        for b in reversed(blocks):
            if b.key is None:
                continue
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
        while done < n and self._evict_one(self.policy.victim()):
            done += 1
        return done

    def _evict_for(self, owner: str | None) -> Block:
        """A block freed by evicting one, to make room for `owner` (it goes straight to the
        caller, not through the free stack)."""
        victim_for = self._victim_for
        b = self.policy.victim() if victim_for is None else victim_for(owner)
        if b is None:
            raise OutOfBlocks("no free or evictable block")  # excluded by the callers' checks
        assert type(b) is Block  # the pool's policy orders only the pool's blocks
        if self._on_evict is not None:
            self._on_evict(b)
        self._clear(b)
        return b

    def _evict_one(self, b: Node | None) -> bool:
        if b is None:
            return False
        assert type(b) is Block  # the pool's policy orders only the pool's blocks
        if self._on_evict is not None:
            self._on_evict(b)
        self._unlink(b)
        return True

    @property
    def num_free(self) -> int:
        """Blocks in the free stack: uncached and unreferenced."""
        return len(self.free_stack)

    @property
    def num_cached(self) -> int:
        """Blocks cached under a key."""
        return len(self.cached)


def check_invariants(pool: BlockPool, holders: Iterable[Request]) -> None:
    """Check the whole consistency of a pool and of the requests holding its blocks.

    O(pool); for tests."""
    n = len(pool.blocks)
    free_ids = {b.block_id for b in pool.free_stack}
    assert len(free_ids) == len(pool.free_stack), "a block is twice in the free pool"
    held: dict[int, int] = {}
    for r in holders:
        for b in r.blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    children: dict[Node, int] = {}
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == held.get(b.block_id, 0), f"refcount of {b} != holders"
        if b.block_id in free_ids:
            assert b.key is None and b.ref_cnt == 0
        if b.key is not None:
            assert pool.cached.get(b.key) is b
            if b.parent is not None:
                assert b.parent.key is not None, "a cached block's parent was evicted"
                children[b.parent] = children.get(b.parent, 0) + 1
        elif b.block_id not in free_ids:
            assert b.ref_cnt > 0, f"{b} is neither free, cached nor held"
    for b in pool.blocks:
        assert b.num_children == children.get(b, 0), f"child count of {b}"
    assert sum(1 for b in pool.blocks if b.ref_cnt) == pool.num_referenced
    assert len(pool.cached) + len(pool.free_stack) + sum(
        1 for b in pool.blocks if b.key is None and b.ref_cnt) == n
    owned: dict[str | None, int] = {}
    for b in pool.blocks:
        if b.block_id not in free_ids:
            owned[b.tenant] = owned.get(b.tenant, 0) + 1
    assert owned == {t: c for t, c in pool.usage.items() if c}, "tenant usage drifted"
