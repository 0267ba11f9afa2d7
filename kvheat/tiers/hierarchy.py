"""Tier placement under one policy: the device pool of a real `KVCacheManager` on top,
then host, disk and Redis stores below it.

- Demotion: the manager calls `mgr.evict_listeners` with each block about to lose its KV;
  its bytes go to the first lower tier that is up (inline for the host tier: a memory copy,
  so the device block can be reused at once). A tier that must make room evicts its own
  coldest entry, in the order of the same policy family as the device, down to the next
  tier through a background thread with a bounded queue (a full queue drops the demotion,
  counted, never blocks serving). Exclusive by default: a block lives in one tier; with
  `write_through` a demoted block goes to every lower tier and keeps its copies when
  promoted.
- Promotion: on a device miss, `allocate` keeps matching the request's next keys on the
  lower tiers, decides how many of them to load (load-or-recompute, below), allocates the
  device blocks and fills them, so loaded tokens count as cached (`req.num_cached_tokens`).
  `prefetch` plans and starts the slow loads (disk, Redis) when a request arrives, before
  the scheduler allocates it.
- Load or recompute: per tier, seconds = latency + bytes / bandwidth fitted from measured
  transfers; recompute seconds = tokens / the engine's measured prefill speed. The longest
  prefix with the largest saving is loaded; a tier slower than recompute is never used.
- Integrity: stores verify every read; a failed or missing load ends the loaded prefix
  there (the engine recomputes the rest), counted. Down tiers are skipped.

- Prefix links below: every lower-tier entry keeps its parent key (taken from the device
  block's parent at demotion, carried through the queue and between tiers; None for a first
  block, and for entries found in a store at start-up, whose parent is unknown: they count
  as roots). A key that leaves the hierarchy for good (dropped at the bottom, a failed load,
  a refused or dropped demotion) while neither the device nor any tier holds it takes
  every lower-tier descendant with it (`orphans_dropped`): a prefix match ends at the first
  missing key, so they could never be served. The bottom tier evicts leaves first (entries
  with no child held below), parking the others as the device does, so the policy still
  orders the leaves; it evicts a parent, with its descendants, only when it holds no leaf.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..cache.block import Block
from ..cache.manager import KVCacheManager, Request
from ..cache.policy import EvictionPolicy, make_policy
from .store import KVStore

log = logging.getLogger("kvheat.tiers")

PrefillSpeed = float | Callable[[], float] | None


class TierIndex:
    """The keys one lower tier holds, ordered for eviction by an `EvictionPolicy`.

    Entries are `Block` objects that never hold KV themselves; a pinned entry (being
    loaded) has ref_cnt > 0, so the policy never picks it. With `leaf_first`, an entry's
    `num_children` counts its children held on lower tiers: the policy parks such an entry
    as it parks a device parent, and `inner` keeps them for when no leaf is left."""

    def __init__(self, policy: EvictionPolicy, capacity_entries: int,
                 leaf_first: bool = False) -> None:
        self.policy = policy
        policy.bind(max(1, capacity_entries))
        self.leaf_first = leaf_first
        self.entries: dict[bytes, Block] = {}
        self.sizes: dict[bytes, int] = {}
        # key -> the tenant whose request filled it (`_UNKNOWN` for entries found at
        # start-up): a flush deletes a tenant's own entries, not its share group's.
        self.owners: dict[bytes, object] = {}
        # Entries with children below, in the order they got their first (leaf_first only).
        self.inner: dict[bytes, Block] = {}
        self._ids = 0
        # Called with (entry, parent key, True) when a key is added and (entry, None,
        # False) when it goes: KV events (TieredCache.index_listeners).
        self.listener: Callable[[Block, bytes | None, bool], None] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> Block | None:
        return self.entries.get(key)

    def insert(self, key: bytes, salt: str | None, tokens: int, size: int, now: float,
               children: int = 0, owner: object = None, parent: bytes | None = None) -> bool:
        """Add `key` (True) or refresh it (False). `children`: its children held below."""
        b = self.entries.get(key)
        if b is not None:
            self.sizes[key] = size
            self.touch(b, now)
            return False
        self._ids += 1
        b = Block(self._ids)
        b.key = key
        b.tenant = salt
        b.num_tokens = tokens
        b.last_access = b.inserted_at = now
        if self.leaf_first and children:
            b.num_children = children
            self.inner[key] = b
        b.ref_cnt = 1  # as the manager does: inserted while held, then released
        self.policy.on_insert(b, now)
        b.ref_cnt = 0
        self.policy.on_release(b, now)
        self.entries[key] = b
        self.sizes[key] = size
        self.owners[key] = owner
        if self.listener is not None:
            self.listener(b, parent, True)
        return True

    def set_children(self, key: bytes, n: int) -> None:
        """`key` now has `n` children held below; at 0 it may be evicted again."""
        b = self.entries.get(key)
        if b is None or not self.leaf_first or b.num_children == n:
            return
        was = b.num_children
        b.num_children = n
        if n and not was:
            self.inner[key] = b
        elif was and not n:
            del self.inner[key]
            if b.ref_cnt == 0:
                self.policy.on_leaf(b)

    def touch(self, b: Block, now: float) -> None:
        b.last_access = now
        if b.ref_cnt == 0:
            self.policy.on_acquire(b)
            self.policy.on_hit(b, now)
            self.policy.on_release(b, now)
        else:
            self.policy.on_hit(b, now)

    def pin(self, b: Block, now: float) -> None:
        """Hold `b` while it is being loaded; a request found it, so it counts as a hit."""
        b.ref_cnt += 1
        if b.ref_cnt == 1:
            self.policy.on_acquire(b)
        b.last_access = now
        self.policy.on_hit(b, now)

    def unpin(self, b: Block, now: float) -> None:
        b.ref_cnt -= 1
        if b.ref_cnt == 0 and self.entries.get(b.key) is b:  # type: ignore[arg-type]
            self.policy.on_release(b, now)

    def remove(self, key: bytes) -> Block | None:
        """Forget `key`; its Block stays referenced so the policy never returns it."""
        b = self.entries.pop(key, None)
        if b is None:
            return None
        self.sizes.pop(key, None)
        self.owners.pop(key, None)
        self.inner.pop(key, None)
        if b.ref_cnt == 0:
            self.policy.on_acquire(b)
        b.ref_cnt += 1
        self.policy.on_evict(b)
        if self.listener is not None:
            self.listener(b, None, False)
        return b

    def victim(self) -> Block | None:
        """The policy's choice among evictable entries (leaves, with `leaf_first`); when
        only parents are left, the one that became a parent first."""
        while True:
            b = self.policy.victim()
            if b is None:
                break
            if self.entries.get(b.key) is b:  # type: ignore[arg-type]
                return b
        # Rare (a full tier of parents whose children sit on other tiers): the caller's
        # removal then drops the descendants too. Pinned ones are skipped, never many.
        return next((b for b in self.inner.values() if b.ref_cnt == 0), None)


@dataclass(slots=True)
class TierConfig:
    mode: str = "exclusive"  # or "write_through"
    policy: str | None = None  # lower tiers' policy; None: the device manager's
    async_io: bool = True  # background demotion thread and prefetch loaders
    queue_size: int = 256  # pending demotions (each holds one block's bytes)
    load_workers: int = 2
    # Engine prefill speed in tokens/s (a number or a callable reading the live figure);
    # None: always load.
    prefill_tokens_per_s: PrefillSpeed = None
    calibrate: bool = True  # measure each tier once at start (needs a prefill speed)
    # A tier judged slower than recomputing gets no reads, so its estimate would never
    # change: after this long without a read, one block is loaded anyway to measure again.
    remeasure_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in ("exclusive", "write_through"):
            raise ValueError(f"mode must be 'exclusive' or 'write_through', not {self.mode!r}")
        if self.queue_size <= 0 or self.load_workers <= 0:
            raise ValueError("queue_size and load_workers must be positive")


@dataclass(slots=True)
class _Step:
    index: int  # block index in the request
    key: bytes
    tier: int
    entry: Block
    tokens: int
    result: _Slot | None = None  # set when a loader thread fetches it
    done: bool = False  # written into its device block
    peer: bool = False  # another replica's entry in a shared tier (not in our index)


@dataclass(slots=True)
class _Move:
    """One block on its way to a lower tier (demoted, or handed down by a full tier)."""

    tier: int
    key: bytes
    salt: str | None
    tokens: int
    kv: torch.Tensor
    parent: bytes | None
    owner: object  # the tenant that filled it (`_UNKNOWN`: found at start-up)
    gen: int  # the owner's flush count when it left the device

    def to(self, tier: int, kv: torch.Tensor) -> _Move:
        return _Move(tier, self.key, self.salt, self.tokens, kv, self.parent, self.owner,
                     self.gen)


@dataclass(slots=True)
class _Plan:
    start: int  # first block index the plan covers (the device hit length when made)
    salt: str | None
    owner: str | None = None  # the request's tenant
    steps: list[_Step] = field(default_factory=list)
    found_blocks: int = 0  # continuation blocks found on lower tiers before deciding
    found_tokens: int = 0
    est_load_s: float = 0.0
    est_recompute_s: float = 0.0


@dataclass(slots=True)
class TierCounters:
    # Of the requests that went through `allocate` (the engine's scheduler sends only
    # those with a lower-tier plan, so its whole-prompt hit rates live in the cache's
    # own stats); the per-tier hit counts are absolute.
    requests: int = 0
    query_tokens: int = 0
    device_hit_tokens: int = 0
    lower_hit_tokens: int = 0
    found_tokens: int = 0  # on lower tiers, contiguous after the device hit
    loaded_blocks: int = 0
    recompute_chosen_blocks: int = 0  # found below but recomputing was faster
    recompute_chosen_tokens: int = 0
    decisions_load: int = 0  # requests that loaded from a lower tier
    decisions_recompute: int = 0  # requests that found blocks below and recomputed them all
    decisions_partial: int = 0  # loaded a prefix of what was found, recomputed the rest
    load_failed: int = 0  # planned loads that came back missing or unverified
    shape_mismatch: int = 0
    orphans_dropped: int = 0  # lower-tier entries deleted because an ancestor left for good
    remeasure_loads: int = 0  # blocks loaded only to measure a tier judged too slow again
    est_load_s: float = 0.0  # estimated seconds of the loads done
    est_recompute_saved_s: float = 0.0  # estimated prefill seconds they replaced
    demotions: int = 0
    demote_refused: int = 0  # no tier took the block
    demote_dropped: int = 0  # the background queue was full
    dropped_bottom: int = 0  # evicted from the lowest tier
    prefetch_plans: int = 0
    prefetch_used: int = 0
    prefetch_replanned: int = 0
    worker_errors: int = 0
    # Bytes read from lower tiers to promote blocks, bytes written into device blocks from
    # them, and bytes read for plans dropped before use (request ended, flushed, device hit
    # grew meanwhile): read_bytes <= promoted_bytes + unused_read_bytes, each block read
    # at most once per promotion.
    read_bytes: int = 0
    promoted_bytes: int = 0
    unused_read_bytes: int = 0
    backlog_recomputes: int = 0  # plans cut short because the loaders' backlog made loading slower


class TieredCache:
    """A device `KVCacheManager` + `DeviceKVPool` with lower tiers below it."""

    def __init__(self, mgr: KVCacheManager, device: object, tiers: list[KVStore],
                 config: TierConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.mgr = mgr
        self.device = device  # DeviceKVPool: block_view, read_block, write_block
        self.tiers = tiers
        self.config = cfg = config or TierConfig()
        self.clock = clock or mgr.clock
        self.block_bytes: int = device.bytes_per_block  # type: ignore[attr-defined]
        probe = device.block_view(0)  # type: ignore[attr-defined]
        self.block_shape = tuple(probe.shape)
        self.block_dtype = probe.dtype
        name = cfg.policy or mgr.config.policy
        self.counters = TierCounters()
        self.tier_hit_tokens = [0] * len(tiers)
        self.tier_hit_blocks = [0] * len(tiers)
        self.tier_demotions = [0] * len(tiers)
        self.tier_evictions = [0] * len(tiers)
        self.tier_deleted = [0] * len(tiers)  # entries deleted by flushes and quota cuts
        # (tier name, tokens) of each block the latest `allocate` loaded, in block order:
        # read right after it, on the same thread, to credit a request's hits to tiers.
        self.last_loaded: list[tuple[str, int]] = []
        self.indexes: list[TierIndex] = []
        # Called with (tier name, key, parent key, tokens, True) when a tier takes a key and
        # (tier name, key, None, 0, False) when it loses it, under this cache's lock, from
        # the thread doing it: keep them quick (KV events queue and return).
        self.index_listeners: list[Callable[[str, bytes, bytes | None, int, bool], None]] = []
        # Keys other replicas put in a shared tier (tiers.shared.SharedTierFeed): found
        # after our own indexes, loaded like ours, never deleted or evicted by us.
        self.peers: Any = None
        # Prefix links of the keys held below, all tiers together. A key is held while an
        # index has it or a demotion of it is queued or moving between tiers (`_held`
        # counts those); `_kids[k]` are the held keys whose parent is k.
        self._held: dict[bytes, int] = {}
        self._parent: dict[bytes, bytes | None] = {}
        self._kids: dict[bytes, set[bytes]] = {}
        for i, st in enumerate(tiers):
            slot = getattr(st, "slot_bytes", None)
            if slot is not None and slot < self.block_bytes:
                raise ValueError(f"{st.name} tier slots hold {slot} bytes; a device block "
                                 f"has {self.block_bytes}")
            pol = make_policy(name)
            if pol.needs_future:  # an offline oracle cannot order a live tier
                pol = make_policy("lru")
            cap = st.capacity_bytes // max(1, self.block_bytes)
            # Only the bottom tier's victims leave the hierarchy (in write-through mode the
            # upper tiers' copies are on the bottom one too): there, leaves go first.
            idx = TierIndex(pol, cap, leaf_first=i == len(tiers) - 1)
            idx.listener = self._index_listener(st.name)
            now = self.clock()
            for key, ns in st.stored():  # entries that survived a restart
                # Known tenants by salt; others by namespace digest (still evictable).
                salt = self._salt_of_ns(st, ns)
                if idx.insert(key, ns if salt is _UNKNOWN else salt,  # type: ignore[arg-type]
                              mgr.block_size, self.block_bytes, now, owner=_UNKNOWN):
                    # A store keeps no parent: a root here, never dropped with an ancestor.
                    self._hold(key, None)
            self.indexes.append(idx)
        self._lock = threading.RLock()
        self._prefetched: dict[str, _Plan] = {}
        # key -> the read of it in flight or done for plans not finished yet (shared).
        self._inflight: dict[bytes, _Slot] = {}
        self._backlog_s = 0.0  # estimated seconds of submitted reads not finished yet
        self._queue: queue.Queue[_Move | None] = queue.Queue(cfg.queue_size)
        # tenant -> flushes so far: a demotion queued before a flush of its tenant is
        # dropped when its turn comes (one entry per tenant ever flushed).
        self._flushes: dict[object, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._worker: threading.Thread | None = None
        if cfg.async_io:
            self._pool = ThreadPoolExecutor(cfg.load_workers, thread_name_prefix="kvheat-load")
            self._worker = threading.Thread(target=self._work, name="kvheat-demote", daemon=True)
            self._worker.start()
        mgr.evict_listeners.append(self._on_device_evict)
        mgr.drop_listeners.append(self._on_device_drop)
        if cfg.calibrate and cfg.prefill_tokens_per_s is not None:
            self.calibrate()

    def _index_listener(self, name: str) -> Callable[[Block, bytes | None, bool], None]:
        def changed(e: Block, parent: bytes | None, stored: bool) -> None:
            for listener in self.index_listeners:
                listener(name, e.key, parent, e.num_tokens, stored)  # type: ignore[arg-type]
        return changed

    def tier_of(self, name: str) -> int | None:
        return next((i for i, st in enumerate(self.tiers) if st.name == name), None)

    # ---- namespaces -------------------------------------------------------------------
    def _salt_of_ns(self, store: KVStore, ns: bytes) -> str | None | object:
        """The salt whose namespace digest is `ns`, among tenants the manager knows."""
        if ns == store.ns(None):
            return None
        for tenant in self.mgr.known_tenants():
            salt = self.mgr.salt_of(tenant)
            if store.ns(salt) == ns:
                return salt
        return _UNKNOWN

    # ---- prefix links below -----------------------------------------------------------
    # All called with `self._lock` held; store deletes they ask for run after, unlocked.
    def _hold(self, key: bytes, parent: bytes | None) -> None:
        """One more holding of `key` below (an index entry, a queued or moving demotion)."""
        self._held[key] = self._held.get(key, 0) + 1
        if parent is None:
            if key not in self._parent:
                self._parent[key] = None
            return
        # Also when already held: a restored root learns its parent, and a key whose parent
        # left and came back while it was queued is linked to the parent's new life.
        self._parent[key] = parent
        kids = self._kids.get(parent)
        if kids is None:
            kids = self._kids[parent] = set()
        if key not in kids:
            kids.add(key)
            self._mark(parent)

    def _mark(self, key: bytes) -> None:
        """Tell the leaf-first tiers holding `key` how many children it has below."""
        n = len(self._kids.get(key, ()))
        for idx in self.indexes:
            if idx.leaf_first:
                idx.set_children(key, n)

    def _release(self, key: bytes, leaving_device: bool = False
                 ) -> list[tuple[int, bytes, str | None]]:
        """Drop one holding of `key`; when it was the last and the device does not hold the
        key either (`leaving_device`: it is being evicted from there now), the key is gone
        and its descendants below go too. Returns the (tier, key, salt) to delete."""
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
            return []
        if n == 0:
            del self._held[key]
            parent = self._parent.pop(key, None)
            if parent is not None:
                kids = self._kids.get(parent)
                if kids is not None and key in kids:
                    kids.discard(key)
                    if not kids:
                        del self._kids[parent]
                    self._mark(parent)
        return self._settle(key, leaving_device)

    def _settle(self, key: bytes, leaving_device: bool = False
                ) -> list[tuple[int, bytes, str | None]]:
        """If `key` is held nowhere (no tier, no queued demotion, not the device), delete
        its descendants from every tier: O(descendants)."""
        if key in self._held or (not leaving_device and key in self.mgr.cached):
            return []
        out: list[tuple[int, bytes, str | None]] = []
        stack = [key]
        while stack:
            for c in self._kids.pop(stack.pop(), ()):
                for t, idx in enumerate(self.indexes):
                    e = idx.remove(c)
                    if e is not None:
                        out.append((t, c, e.tenant))
                        self.counters.orphans_dropped += 1
                        self._held[c] -= 1
                if self._held.get(c, 1) == 0:
                    del self._held[c]
                    self._parent.pop(c, None)
                # A copy still queued is dropped when placed (its parent is gone then);
                # a key the device holds keeps its children reachable.
                if c not in self._held and c not in self.mgr.cached:
                    stack.append(c)
        return out

    def _orphan(self, parent: bytes | None) -> bool:
        """Would an entry under `parent` be unreachable (the parent is held nowhere)?"""
        return parent is not None and parent not in self._held and parent not in self.mgr.cached

    def _delete(self, dels: list[tuple[int, bytes, str | None]]) -> None:
        for t, key, salt in dels:
            self.tiers[t].delete(key, salt)

    # ---- demotion ---------------------------------------------------------------------
    def _on_device_evict(self, b: Block) -> None:
        if not self.tiers or b.key is None:
            return
        salt = self.mgr.salt_of(b.tenant)
        view = self.device.block_view(b.block_id)  # type: ignore[attr-defined]
        # The device evicts leaves first, so the parent is still cached there now.
        parent = b.parent.key if b.parent is not None else None
        gen = self._flushes.get(b.tenant, 0)
        if self.config.mode == "write_through":
            copy: torch.Tensor | None = None
            for i, st in enumerate(self.tiers):
                if b.key in self.indexes[i].entries:
                    with self._lock:
                        e = self.indexes[i].get(b.key)
                        if e is not None:
                            self.indexes[i].touch(e, self.clock())
                    continue
                if st.inline:
                    self._place(_Move(i, b.key, salt, b.num_tokens, view, parent, b.tenant, gen),
                                cascade=False)
                else:
                    if copy is None:
                        copy = _private(view)
                    self._enqueue(_Move(i, b.key, salt, b.num_tokens, copy, parent, b.tenant,
                                        gen))
        else:
            first = next((i for i, st in enumerate(self.tiers) if st.available()), None)
            if first is None:
                self.counters.demote_refused += 1
            elif self.tiers[first].inline:
                self._place(_Move(first, b.key, salt, b.num_tokens, view, parent, b.tenant, gen),
                            cascade=True)
            else:
                self._enqueue(_Move(first, b.key, salt, b.num_tokens, _private(view), parent,
                                    b.tenant, gen))
        # Refused or dropped: the key leaves with the device block, and its children below.
        with self._lock:
            dels = self._settle(b.key, leaving_device=True)
        self._delete(dels)

    def _on_device_drop(self, b: Block) -> None:
        """A device block deleted on purpose (flush, quota cut): its key goes from every
        tier (write-through copies included), and so do its descendants below."""
        if not self.tiers or b.key is None:
            return
        salt = self.mgr.salt_of(b.tenant)
        dels: list[tuple[int, bytes, str | None]] = []
        with self._lock:
            for t, idx in enumerate(self.indexes):
                e = idx.get(b.key)
                st = self.tiers[t]
                if e is not None and st.ns(e.tenant) == st.ns(salt):
                    idx.remove(b.key)
                    dels.append((t, b.key, e.tenant))
                    dels += self._release(b.key, leaving_device=True)
            dels += self._settle(b.key, leaving_device=True)
        self._delete(dels)
        self._count_deleted(dels)

    def _count_deleted(self, dels: list[tuple[int, bytes, str | None]]) -> None:
        for t, _key, _salt in dels:
            self.tier_deleted[t] += 1

    def purge_tenant(self, tenant: str | None) -> dict[str, int]:
        """Delete what the tiers hold of `tenant` (a flush): its entries on every tier,
        durable ones included, its queued demotions and its requests' load plans. Only its
        own: in a share group, the entries other members filled stay (entries found at
        start-up, whose filler is unknown, go with any member's flush). Returns the
        entries deleted per tier name."""
        salt = self.mgr.salt_of(tenant)
        shared = tenant is not None and tenant in self.mgr.config.share_groups
        out = {st.name: 0 for st in self.tiers}
        dels: list[tuple[int, bytes, str | None]] = []
        plans: list[_Plan] = []
        with self._lock:
            self._flushes[tenant] = self._flushes.get(tenant, 0) + 1
            for rid, plan in list(self._prefetched.items()):
                if plan.owner == tenant:  # its loads would bring the KV back
                    plans.append(self._prefetched.pop(rid))
            for t, idx in enumerate(self.indexes):
                st = self.tiers[t]
                ns = st.ns(salt)
                mine = [k for k, e in idx.entries.items() if st.ns(e.tenant) == ns
                        and (not shared or idx.owners.get(k) in (tenant, _UNKNOWN))]
                for k in mine:
                    e = idx.remove(k)
                    if e is not None:
                        dels.append((t, k, e.tenant))
                        dels += self._release(k)
        for plan in plans:
            self._unpin(plan.steps)
        self._delete(dels)
        self._count_deleted(dels)
        for t, _k, _s in dels:
            out[self.tiers[t].name] += 1
        if not shared:  # entries other processes put there (replicas on one Redis)
            for t, st in enumerate(self.tiers):
                n = st.purge(salt)
                out[st.name] += n
                self.tier_deleted[t] += n
        return out

    def _enqueue(self, m: _Move) -> None:
        """Hand a demotion to the background thread. The item holds `key` below from now
        until it is placed, so a key moving between tiers is never taken for gone."""
        with self._lock:
            self._hold(m.key, m.parent)
        if self._worker is None:
            try:
                self._place(m, cascade=self.config.mode == "exclusive", owned=True)
            finally:
                with self._lock:
                    dels = self._release(m.key)
                self._delete(dels)
            return
        try:
            self._queue.put_nowait(m)
        except queue.Full:
            self.counters.demote_dropped += 1
            with self._lock:
                dels = self._release(m.key)
            self._delete(dels)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._place(item, cascade=self.config.mode == "exclusive", owned=True)
            except Exception:  # the demotion thread must outlive any one bad block
                self.counters.worker_errors += 1
                log.exception("tier demotion failed")
            finally:
                if item is not None:
                    try:
                        with self._lock:
                            dels = self._release(item.key)
                        self._delete(dels)
                    except Exception:
                        self.counters.worker_errors += 1
                        log.exception("tier cleanup failed")
                self._queue.task_done()

    def _place(self, m: _Move, cascade: bool, owned: bool = False) -> None:
        """Put one block into `m.tier`, making room by evicting that tier's coldest entries
        (down to the next tier when `cascade`); a refused block itself goes down too.
        `owned`: `m.kv` is a private copy; otherwise it may view a device block that is
        reused as soon as this returns, so anything queued is copied first. The caller
        holds the key meanwhile and settles it after (a refused key may be gone)."""
        tier, key, salt, tokens, kv, parent = m.tier, m.key, m.salt, m.tokens, m.kv, m.parent
        st, idx = self.tiers[tier], self.indexes[tier]
        nxt = tier + 1 if cascade and tier + 1 < len(self.tiers) else None
        with self._lock:
            if self._flushes.get(m.owner, 0) != m.gen:  # its tenant was flushed meanwhile
                return
            if self._orphan(parent):  # its parent left while it waited in the queue
                self.counters.orphans_dropped += 1
                return
            e = idx.get(key)
            if e is not None:
                # Already there (a key names its KV): refresh it. Rewriting would hide the
                # entry from readers while the store replaces it (a load then misses).
                idx.touch(e, self.clock())
                return
        if not st.available():
            if nxt is not None:
                self._enqueue(m.to(nxt, kv if owned else _private(kv)))
            else:
                self.counters.demote_refused += 1
            return
        need = st.entry_bytes(kv, key)
        victims: list[tuple[Block, bytes | None, object]] = []
        with self._lock:
            freed = 0
            held = idx.sizes.get(key, 0)
            while st.used_bytes() - held - freed + need > st.capacity_bytes:
                v = idx.victim()
                if v is None:
                    break
                freed += idx.sizes.get(v.key, 0)  # type: ignore[arg-type]
                owner = idx.owners.get(v.key, _UNKNOWN)  # type: ignore[arg-type]
                idx.remove(v.key)  # type: ignore[arg-type]
                # Its holding stays until it is handed down or dropped (released below).
                victims.append((v, self._parent.get(v.key), owner))  # type: ignore[arg-type]
        for v, vparent, vowner in victims:
            vkey: bytes = v.key  # type: ignore[assignment]
            try:
                if nxt is not None and self.tiers[nxt].available():
                    t = st.get(vkey, v.tenant)
                    if t is not None:
                        self._enqueue(_Move(nxt, vkey, v.tenant, v.num_tokens, t, vparent,
                                            vowner, self._flushes.get(vowner, 0)))
                elif tier == len(self.tiers) - 1:
                    self.counters.dropped_bottom += 1
                st.delete(vkey, v.tenant)
                self.tier_evictions[tier] += 1
            finally:
                with self._lock:
                    dels = self._release(vkey)
                self._delete(dels)
        if st.put(key, kv, salt):
            with self._lock:
                # Checked again: making room above may have dropped the parent meanwhile,
                # and a flush of its tenant may have run while it was written.
                orphan = self._orphan(parent) or self._flushes.get(m.owner, 0) != m.gen
                if not orphan and idx.insert(key, salt, tokens, need, self.clock(),
                                             len(self._kids.get(key, ())), m.owner, parent):
                    self._hold(key, parent)
            if orphan:
                self.counters.orphans_dropped += 1
                st.delete(key, salt)
                return
            self.tier_demotions[tier] += 1
            self.counters.demotions += 1
        elif nxt is not None:
            self._enqueue(m.to(nxt, kv if owned else _private(kv)))
        else:
            self.counters.demote_refused += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued demotions are written (tests, benchmarks, shutdown)."""
        if self._worker is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def close(self) -> None:
        if self._worker is not None:
            self.flush()
            self._queue.put(None)
            self._worker.join(timeout=5)
            self._worker = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._on_device_evict in self.mgr.evict_listeners:
            self.mgr.evict_listeners.remove(self._on_device_evict)
        if self._on_device_drop in self.mgr.drop_listeners:
            self.mgr.drop_listeners.remove(self._on_device_drop)

    # ---- load or recompute ------------------------------------------------------------
    def prefill_speed(self) -> float | None:
        s = self.config.prefill_tokens_per_s
        v = s() if callable(s) else s
        return float(v) if v else None

    def estimate_load_s(self, tier: int, n_blocks: int) -> float | None:
        st = self.tiers[tier]
        return st.read_model.estimate(n_blocks * self.block_bytes,
                                      ops=1 if st.pipelined else n_blocks)

    def calibrate(self, rounds: int = 3) -> dict[str, dict[str, float | None]]:
        """Time real puts and gets of probe blocks on every tier (deleted after)."""
        g = torch.Generator().manual_seed(0)
        probe = torch.randint(0, 255, (self.block_bytes,), dtype=torch.uint8, generator=g)
        probe = probe.view(self.block_dtype).view(self.block_shape)
        out: dict[str, dict[str, float | None]] = {}
        for st in self.tiers:
            for r in range(rounds):
                for n in (1, 4):
                    keys = [f"kvheat-probe-{r}-{n}-{j}".encode() for j in range(n)]
                    stored = [k for k in keys if st.put(k, probe, "kvheat-probe")]
                    if stored:
                        if st.pipelined:
                            st.get_many(stored, "kvheat-probe")
                        else:
                            for k in stored:
                                st.get(k, "kvheat-probe")
                    for k in stored:
                        st.delete(k, "kvheat-probe")
            fit = st.read_model.fit()
            out[st.name] = {"latency_s": fit[0] if fit else None,
                            "bandwidth_Bps": fit[1] if fit else None}
        return out

    def _decide(self, plan: _Plan) -> int:
        """How many of the plan's blocks to load: the prefix with the largest estimated
        saving over recomputing it (0 when no prefix saves time)."""
        speed = self.prefill_speed()
        if speed is None:
            return len(plan.steps)
        per_tier = [0] * len(self.tiers)
        tokens = 0
        best_k, best_gain, best = 0, 0.0, (0.0, 0.0)
        first = best
        # Reads go to the loader threads behind those already queued: a load that would
        # wait behind a backlog is worth it only if it still beats recomputing.
        wait = self.backlog_s() if self._pool is not None else 0.0
        slow = False
        for k, s in enumerate(plan.steps, 1):
            per_tier[s.tier] += 1
            tokens += s.tokens
            slow = slow or not self.tiers[s.tier].inline
            load = wait if slow else 0.0
            for t, n in enumerate(per_tier):
                if n:
                    est = self.estimate_load_s(t, n)
                    load += est if est is not None else 0.0
            recompute = tokens / speed
            if k == 1:
                first = (load, recompute)
            if recompute - load > best_gain:
                best_k, best_gain, best = k, recompute - load, (load, recompute)
        if wait and best_k < len(plan.steps):
            no_wait = self._decide_no_wait(plan, speed)
            if no_wait > best_k:
                self.counters.backlog_recomputes += 1
        if best_k == 0 and plan.steps:
            model = self.tiers[plan.steps[0].tier].read_model
            if not wait and time.monotonic() - model.last_at > self.config.remeasure_s:
                best_k, best = 1, first
                self.counters.remeasure_loads += 1
        plan.est_load_s, plan.est_recompute_s = best
        return best_k

    def _decide_no_wait(self, plan: _Plan, speed: float) -> int:
        """How many blocks `_decide` would load with no backlog (to count the difference)."""
        per_tier = [0] * len(self.tiers)
        tokens, best_k, best_gain = 0, 0, 0.0
        for k, s in enumerate(plan.steps, 1):
            per_tier[s.tier] += 1
            tokens += s.tokens
            load = sum(self.estimate_load_s(t, n) or 0.0 for t, n in enumerate(per_tier) if n)
            if tokens / speed - load > best_gain:
                best_k, best_gain = k, tokens / speed - load
        return best_k

    # ---- promotion --------------------------------------------------------------------
    def _make_plan(self, req: Request, start: int) -> _Plan:
        """Pin the request's blocks found on lower tiers after the first `start`, then keep
        the prefix worth loading. Called with the lock held."""
        salt = self.mgr.salt_of(req.tenant)
        plan = _Plan(start, salt, req.tenant)
        plan.steps = self._find(req, start, len(req.keys), salt)
        plan.found_blocks = len(plan.steps)
        plan.found_tokens = sum(s.tokens for s in plan.steps)
        k = self._decide(plan)
        self._unpin(plan.steps[k:])
        plan.steps = plan.steps[:k]
        return plan

    def _find(self, req: Request, start: int, stop: int, salt: str | None) -> list[_Step]:
        """Pin the request's blocks `start` .. `stop` - 1 held below, up to the first one
        missing. Called with the lock held."""
        steps: list[_Step] = []
        now = self.clock()
        for i in range(start, stop):
            key = req.keys[i]
            found = None
            for t, idx in enumerate(self.indexes):
                e = idx.get(key)
                st = self.tiers[t]
                if e is not None and st.ns(e.tenant) == st.ns(salt) and st.available():
                    found = (t, e)
                    break
            if found is None and self.peers is not None:
                peer = self.peers.lookup(key)
                if peer is not None and self.tiers[peer[0]].available():
                    steps.append(_Step(i, key, peer[0], peer[1], req.block_tokens[i], peer=True))
                    continue
            if found is None:
                break
            self.indexes[found[0]].pin(found[1], now)
            steps.append(_Step(i, key, found[0], found[1], req.block_tokens[i]))
        return steps

    def _refit(self, req: Request, plan: _Plan, hit: int) -> list[_Step] | None:
        """Fit a kept plan to the device prefix now `hit` blocks long: blocks the device
        gained meanwhile need no load; blocks it lost (a gap before the plan) are added
        in front when the tiers hold them, so the planned reads are never done again.
        Returns the added steps (not submitted yet), or None when the plan no longer fits
        (it is unpinned then). Called with the lock held."""
        self._unpin([s for s in plan.steps if s.index < hit])
        plan.steps = [s for s in plan.steps if s.index >= hit]
        if not plan.steps or plan.steps[0].index == hit:
            plan.start = hit
            return [] if plan.steps else None
        front = self._find(req, hit, plan.steps[0].index, plan.salt)
        if hit + len(front) != plan.steps[0].index:
            self._unpin(front + plan.steps)
            return None
        plan.steps = front + plan.steps
        plan.start = hit
        plan.found_blocks += len(front)
        plan.found_tokens += sum(s.tokens for s in front)
        return front

    def _unpin(self, steps: list[_Step]) -> None:
        now = self.clock()
        with self._lock:
            for s in steps:
                if not s.peer:
                    self.indexes[s.tier].unpin(s.entry, now)
                slot = s.result
                if slot is None:
                    continue
                slot.used = slot.used or s.done
                slot.refs -= 1
                if slot.refs == 0:
                    if self._inflight.get(s.key) is slot:
                        del self._inflight[s.key]
                    if not slot.used:  # read (or being read), never written to the device
                        self.counters.unused_read_bytes += self.block_bytes

    def _fetch(self, steps: list[_Step], salt: str | None) -> list[torch.Tensor | None]:
        """Load steps from their tiers (runs of a pipelined tier in one round trip)."""
        out: list[torch.Tensor | None] = []
        i = 0
        while i < len(steps):
            st = self.tiers[steps[i].tier]
            if st.pipelined:
                j = i
                while j < len(steps) and steps[j].tier == steps[i].tier:
                    j += 1
                # Only copied into device blocks: views of the received bytes will do.
                got = st.get_many([s.key for s in steps[i:j]], salt, readonly_ok=True)
                self.counters.read_bytes += sum(g.nbytes for g in got if g is not None)
                out.extend(got)
                if any(g is None for g in got):
                    break
                i = j
            else:
                t = st.get(steps[i].key, salt)
                if t is not None:
                    self.counters.read_bytes += t.nbytes
                out.append(t)
                if t is None:
                    break
                i += 1
        return out

    def _start_loads(self, plan: _Plan, steps: list[_Step] | None = None) -> None:
        """Submit the plan's slow loads (not inline tiers; of `steps` when given) to the
        loader threads."""
        if self._pool is None:
            return
        slow = [s for s in (plan.steps if steps is None else steps)
                if not self.tiers[s.tier].inline and s.result is None]
        with self._lock:
            # A block another waiting request's plan is reading already is read once:
            # both plans take the same result (a burst of requests on one prefix).
            for s in slow:
                shared = self._inflight.get(s.key)
                if shared is not None and shared.tier == s.tier:
                    shared.refs += 1
                    s.result = shared
            slow = [s for s in slow if s.result is None]
        if not slow:
            return
        est = sum(self.estimate_load_s(s.tier, 1) or 0.0 for s in slow)
        with self._lock:
            self._backlog_s += est
        fut = self._pool.submit(self._fetch, slow, plan.salt)
        fut.add_done_callback(lambda _f: self._job_done(est))
        with self._lock:
            for pos, s in enumerate(slow):
                s.result = self._inflight[s.key] = _Slot(fut, pos, s.tier)

    def _job_done(self, est: float) -> None:
        with self._lock:
            self._backlog_s = max(0.0, self._backlog_s - est)

    def backlog_s(self) -> float:
        """Estimated seconds until the loader threads are through the reads queued now."""
        return self._backlog_s / self.config.load_workers

    def prefetch(self, req: Request) -> int:
        """Plan a waiting request's lower-tier loads and start the slow ones now; returns
        the tokens planned. `allocate` picks the plan up; `cancel_prefetch` drops it."""
        with self._lock:
            hit = len(self.mgr.match_prefix(req))
            old = self._prefetched.pop(req.request_id, None)
            front = self._refit(req, old, hit) if old is not None else None
            if old is not None and front is not None:
                # Planned earlier (on arrival, or an admission that found no blocks): keep
                # it, and its reads in flight or done.
                self._prefetched[req.request_id] = old
                plan = old
            else:
                plan = None
        if plan is not None:
            self._start_loads(plan, front)
            return sum(s.tokens for s in plan.steps)
        with self._lock:
            plan = self._make_plan(req, hit)
            if not plan.steps:
                return 0
            self._prefetched[req.request_id] = plan
            self.counters.prefetch_plans += 1
        self._start_loads(plan)
        return sum(s.tokens for s in plan.steps)

    def cancel_prefetch(self, request_id: str) -> None:
        with self._lock:
            plan = self._prefetched.pop(request_id, None)
        if plan is not None:
            self._unpin(plan.steps)

    def allocate(self, req: Request, count_stats: bool = True) -> list[int]:
        """`mgr.allocate` plus lower-tier hits loaded into the new device blocks
        (`count_stats`: as for `mgr.allocate`)."""
        self.last_loaded = []
        with self._lock:
            hit = self.mgr.match_prefix(req)
            plan = self._prefetched.pop(req.request_id, None)
            if plan is not None:
                # Blocks the device gained meanwhile need no load; a gap it cannot fill
                # means replanning. Added front steps are read below, in this thread.
                if self._refit(req, plan, len(hit)) is None:
                    self.counters.prefetch_replanned += 1
                    plan = None
                else:
                    self.counters.prefetch_used += 1
            if plan is None:
                plan = self._make_plan(req, len(hit))
        try:
            table = self.mgr.allocate(req, matched=hit, count_stats=count_stats)
        except Exception:
            # No blocks now: the plan, its pins and its reads (in flight or done) wait for
            # the next try, so a block is read once however long its request waits.
            if plan.steps:
                with self._lock:
                    self._prefetched[req.request_id] = plan
            raise
        # A chunked prefill allocates a head of the prefetched request: load what fits.
        beyond = [s for s in plan.steps if s.index >= len(req.keys)]
        if beyond:
            self._unpin(beyond)
            plan.steps = plan.steps[:len(plan.steps) - len(beyond)]
        loaded_tokens = self._load(req, plan)
        c = self.counters
        c.requests += 1
        c.query_tokens += req.num_tokens
        c.device_hit_tokens += req.num_cached_tokens
        req.num_cached_tokens += loaded_tokens
        c.lower_hit_tokens += loaded_tokens
        c.found_tokens += plan.found_tokens
        if plan.found_blocks:
            n_load = len(plan.steps)
            if n_load == 0:
                c.decisions_recompute += 1
            elif n_load < plan.found_blocks:
                c.decisions_partial += 1
            else:
                c.decisions_load += 1
            c.recompute_chosen_blocks += plan.found_blocks - n_load
            c.recompute_chosen_tokens += plan.found_tokens - sum(s.tokens for s in plan.steps)
        return table

    def _load(self, req: Request, plan: _Plan) -> int:
        """Fill the request's new device blocks from the plan, in order, stopping at the
        first block that is missing or fails its check. Returns the tokens loaded."""
        steps = plan.steps
        if not steps:
            return 0
        # Slow loads not prefetched run here, in this thread.
        sync_needed = [s for s in steps if s.result is None and not self.tiers[s.tier].inline]
        sync_results = dict(zip((id(s) for s in sync_needed),
                                self._fetch(sync_needed, plan.salt), strict=False)) if sync_needed else {}
        # Inline (host) loads: one batched call per tier, straight into the device blocks.
        inline_results: dict[int, torch.Tensor | None] = {}
        for tier, st in enumerate(self.tiers):
            run = [s for s in steps if s.tier == tier] if st.inline else []
            if not run:
                continue
            views = [self.device.block_view(req.blocks[s.index].block_id)  # type: ignore[attr-defined]
                     for s in run]
            try:
                got = st.get_many([s.key for s in run], plan.salt, outs=views)
            except ValueError:  # a stored layout that is not this pool's
                self.counters.shape_mismatch += 1
                got = [None] * len(run)
            self.counters.read_bytes += sum(g.nbytes for g in got if g is not None)
            inline_results.update(zip((id(s) for s in run), got, strict=True))
        loaded = 0
        done: list[_Step] = []
        failed = False
        for s in steps:
            st = self.tiers[s.tier]
            dst = req.blocks[s.index]
            if st.inline:
                t = inline_results.get(id(s))
            else:
                t = s.result.get() if s.result is not None else sync_results.get(id(s))
                if t is not None:
                    if tuple(t.shape) != self.block_shape or t.dtype != self.block_dtype:
                        self.counters.shape_mismatch += 1
                        t = None
                    else:
                        self.device.write_block(dst.block_id, t)  # type: ignore[attr-defined]
            if t is None:
                failed = True
                self.counters.load_failed += 1
                if s.peer:  # the other replica evicted it meanwhile
                    self.peers.forget(s.key)
                    break
                with self._lock:  # stale or corrupt: forget it
                    dels = self._release(s.key) if self.indexes[s.tier].remove(s.key) else []
                self._delete(dels)  # descendants, if nothing else holds the key
                break
            loaded += s.tokens
            s.done = True
            done.append(s)
            self.tier_hit_tokens[s.tier] += s.tokens
            self.tier_hit_blocks[s.tier] += 1
        self.last_loaded = [(self.tiers[s.tier].name, s.tokens) for s in done]
        c = self.counters
        c.loaded_blocks += len(done)
        c.promoted_bytes += len(done) * self.block_bytes
        if not failed:
            c.est_load_s += plan.est_load_s
            c.est_recompute_saved_s += plan.est_recompute_s
        self._unpin(steps)
        if self.config.mode == "exclusive":
            for s in done:  # the block now lives on the device only
                if s.peer:  # another replica's: it stays there for everyone
                    continue
                with self._lock:
                    # On the device now, so its children below stay reachable (no cascade
                    # unless the manager kept the block private).
                    dels = self._release(s.key) if self.indexes[s.tier].remove(s.key) else []
                self.tiers[s.tier].delete(s.key, plan.salt)
                self._delete(dels)
        return loaded

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """Plain counters and measured figures (the server turns them into metrics)."""
        c = self.counters
        q = max(1, c.query_tokens)
        tiers: dict[str, object] = {}
        for i, st in enumerate(self.tiers):
            d = st.describe()
            d.update(entries=len(self.indexes[i]), hit_tokens=self.tier_hit_tokens[i],
                     hit_blocks=self.tier_hit_blocks[i], demotions=self.tier_demotions[i],
                     evictions=self.tier_evictions[i],
                     deleted=self.tier_deleted[i], hit_rate=self.tier_hit_tokens[i] / q)
            tiers[f"{i}:{st.name}"] = d
        return {
            **asdict(c),
            "device_hit_rate": c.device_hit_tokens / q,
            "total_hit_rate": (c.device_hit_tokens + c.lower_hit_tokens) / q,
            "prefill_tokens_per_s": self.prefill_speed(),
            "queue_depth": self._queue.qsize(),
            "tiers": tiers,
        }


class _Slot:
    """One step's tensor out of a batch future, shared by the plans that need that block
    (`refs` of them; `used`: one wrote it into a device block)."""

    __slots__ = ("fut", "pos", "tier", "refs", "used")

    def __init__(self, fut: Future[list[torch.Tensor | None]], pos: int, tier: int) -> None:
        self.fut = fut
        self.pos = pos
        self.tier = tier
        self.refs = 1
        self.used = False

    def get(self) -> torch.Tensor | None:
        try:
            res = self.fut.result()
        except Exception:  # a loader failure is a miss, never an error to the caller
            log.exception("tier load failed")
            return None
        return res[self.pos] if self.pos < len(res) else None


_UNKNOWN = object()


def _private(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares no memory with `kv` (a device block view)."""
    return kv.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
