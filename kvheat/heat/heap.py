"""The bucketed min-heap the heat policies evict from (KVHeat, LRU-K).

A policy defines `_key(block)`; the coldest evictable leaf goes first. Blocks that are
referenced or still have cached children when met are parked and pushed again when they
become evictable (see kvheat/cache/policy.py).
"""

from __future__ import annotations

import heapq
import math

from ..cache.block import Block
from ..cache.policy import PARKED, EvictionPolicy


class HeapPolicy(EvictionPolicy):
    """Evict the evictable leaf with the smallest key; subclasses define `_key`.

    The heap holds bare floats (C-speed comparisons, no tuples); `owner` maps each to
    a bucket: the blocks pushed with that key, in push order. Consecutive pushes of an
    equal key (a request's blocks, inserted at one time) share one bucket and one heap
    entry; other equal keys step to the next float up. Ties thus go to the earlier push
    (the cache releases a request tail-first, so a chain's tail leaves before its head).
    An entry is live while it equals `block.heap_ver` (lazy invalidation: a newer push
    supersedes it; NaN: none)."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[float] = []
        self.owner: dict[float, list[Block]] = {}
        self._last_key = math.nan
        self._last_slot = math.nan
        self._cur: list[Block] = []  # the bucket `victim` is draining (left of heap)
        # Keys changed (new generation or half-life) but the heap is not re-keyed yet: it
        # is, once, when a victim is next taken (`_rekey`), however many changes came first.
        self._stale = False
        self._cur_i = 0
        self._cur_u = math.nan
        self._entries = 0  # pushes since the last compaction, plus what it kept
        self._compact_at = 1024

    def _key(self, b: Block) -> float:
        raise NotImplementedError

    def _push(self, b: Block) -> None:
        self._push_key(b, self._key(b))

    def _push_key(self, b: Block, k: float) -> None:
        owner = self.owner
        if k == self._last_key:
            bucket = owner.get(self._last_slot)
            if bucket is not None:
                bucket.append(b)
                b.heap_ver = self._last_slot
                self._entries += 1
                return
        u = k
        while u in owner:
            u = math.nextafter(u, math.inf)
        self._last_key = k
        self._last_slot = u
        owner[u] = [b]
        b.heap_ver = u
        heapq.heappush(self.heap, u)
        self._entries += 1
        if self._entries > self._compact_at:
            self._compact()

    def _park_bucket(self) -> None:
        """Return the rest of the bucket being drained to the heap (before later pushes
        of the same key)."""
        rest = self._cur[self._cur_i:]
        self._cur, self._cur_i = [], 0
        if rest:
            u = self._cur_u
            later = self.owner.get(u)
            if later is None:
                self.owner[u] = rest
                heapq.heappush(self.heap, u)
            else:
                self.owner[u] = rest + later

    def _live(self) -> list[Block]:
        self._park_bucket()
        # A block is live in one bucket at most (the one its `heap_ver` names), perhaps
        # twice there: keep its first entry, in bucket order.
        live: list[Block] = []
        for u, bucket in self.owner.items():
            start = len(live)
            for b in bucket:
                if u == b.heap_ver and b.key is not None:
                    b.heap_ver = math.inf  # taken: a later entry of it reads as stale
                    live.append(b)
            for i in range(start, len(live)):
                live[i].heap_ver = u
        return live

    def _rebuild(self) -> None:
        self._stale = False
        live = self._live()
        self.heap = []
        self.owner = {}
        self._last_key = math.nan
        self._entries = 0
        for b in live:
            self._push(b)

    def _rekey(self) -> None:
        """Every key changed: re-key the heap before the next victim, not now."""
        self._stale = True

    def _compact(self) -> None:
        """Drop superseded entries (keys unchanged, so one heapify): keeps the heap, and
        the log n of every push, near the number of evictable blocks."""
        if self._stale:  # a rebuild compacts too
            self._rebuild()
            return
        self._park_bucket()
        owner: dict[float, list[Block]] = {}
        kept = 0
        for u, bucket in self.owner.items():
            for b in bucket:
                if u != b.heap_ver or b.key is None:
                    break
            else:  # all live (most buckets): the same list, nothing allocated
                owner[u] = bucket
                kept += len(bucket)
                continue
            live = [b for b in bucket if u == b.heap_ver and b.key is not None]
            if live:
                owner[u] = live
                kept += len(live)
        self.owner = owner
        self.heap = heap = list(owner)
        heapq.heapify(heap)
        self._last_key = math.nan
        self._entries = kept
        self._compact_at = kept + max(kept // 2, self.capacity // 2) + 256

    # No on_acquire: a referenced block's entry is skipped (parked) by `victim`, and its
    # release pushes a fresh entry that supersedes the old one (the cache skips the call).

    def on_release(self, b: Block, now: float) -> None:
        b.parked = None
        self._push(b)

    def on_leaf(self, b: Block) -> None:
        if b.parked is not None:
            b.parked = None
            self._push(b)

    def victim(self) -> Block | None:
        if self._stale:
            self._rebuild()
        heap = self.heap
        while True:
            cur, i = self._cur, self._cur_i
            if i >= len(cur):
                if not heap:
                    self._cur, self._cur_i = [], 0
                    return None
                u = heapq.heappop(heap)
                cur = self._cur = self.owner.pop(u)
                i = 0
                self._cur_u = u
            elif heap and heap[0] < self._cur_u:  # a smaller key arrived meanwhile
                self._park_bucket()
                continue
            u = self._cur_u
            n = len(cur)
            while i < n:
                b = cur[i]
                i += 1
                if u != b.heap_ver or b.key is None:
                    continue
                if b.ref_cnt or b.num_children:
                    b.parked = PARKED
                    continue
                self._cur_i = i
                b.heap_ver = math.nan
                return b
            self._cur_i = i

    def forget(self, b: Block) -> None:
        b.heap_ver = math.nan
        b.parked = None
