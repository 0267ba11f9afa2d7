"""The bucketed min-heap the heat policies evict from (KVHeat, LRU-K).

A policy holds one `BlockHeap` and gives it its key function; the coldest evictable leaf
goes first. Blocks that are referenced or still have cached children when met are parked
and pushed again when they become evictable (see kvheat/cache/eviction.py).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Container, Iterable, Sequence

from ..cache.eviction import PARKED
from ..cache.node import Node


class BlockHeap:
    """Blocks by ascending key: `pop` returns the evictable leaf with the smallest one.

    The heap holds bare floats (C-speed comparisons, no tuples); `owner` maps each to a
    bucket: the blocks pushed with that key, in push order. Consecutive pushes of an equal
    key (a request's blocks, inserted at one time) share one bucket and one heap entry;
    other equal keys step to the next float up. Ties thus go to the earlier push (the cache
    releases a request tail-first, so a chain's tail leaves before its head). An entry is
    live while it equals `block.heap_slot` (lazy invalidation: a newer push supersedes it;
    NaN: none). `key(block)` is the policy's key, read at each push and at a re-key;
    `keys(blocks)`, where the policy gives it, is `key` of each block in one call (a push
    gets a request's keys without a call per block)."""

    def __init__(self, key: Callable[[Node], float],
                 keys: Callable[[Sequence[Node]], list[float]] | None = None) -> None:
        self.key = key
        self.keys = keys if keys is not None else (lambda blocks: [key(b) for b in blocks])
        self.heap: list[float] = []
        self.owner: dict[float, list[Node]] = {}
        self.last_key = math.nan  # the key of the last push, and the slot it went to
        self.last_slot = math.nan
        self.cur: list[Node] = []  # the bucket `pop` is draining (left of `heap`)
        self.cur_i = 0
        self.cur_u = math.nan
        # Keys changed (a new generation or half-life) but the heap is not re-keyed yet:
        # it is, once, when a block is next taken, however many changes came first.
        self.stale = False
        self.entries = 0  # pushes since the last compaction, plus what it kept
        self.compact_at: float = 1024  # entries beyond which a push compacts
        self.capacity = 0

    def bind(self, capacity_blocks: int, compact_at: int | None = None) -> None:
        """Size the heap for `capacity_blocks`, and set the entries past which a push compacts."""
        self.capacity = capacity_blocks
        if compact_at is not None:
            self.compact_at = compact_at

    def __len__(self) -> int:
        """Heap entries (stale ones included)."""
        return len(self.heap)

    def push(self, blocks: Iterable[Node]) -> None:
        """Enter each block at its key, in order, superseding any entry it had.

        A released block, a parked one that became evictable, or the whole heap re-keyed. A
        request's blocks come in one call; the loop is every access's hot path."""
        if not isinstance(blocks, (list, tuple)):
            blocks = list(blocks)
        owner, heap = self.owner, self.heap
        nextafter, inf, heappush = math.nextafter, math.inf, heapq.heappush
        last_k, last_u = self.last_key, self.last_slot
        bucket = owner.get(last_u)  # the last push's bucket, unless `pop` took it since
        entries, compact_at = self.entries, self.compact_at
        # (the keys first: nothing below changes one, a compaction included)
        for b, k in zip(blocks, self.keys(blocks)):
            b.parked = None
            if k == last_k and bucket is not None:  # as the previous push: its bucket
                bucket.append(b)
                b.heap_slot = last_u
                entries += 1
                continue
            u = k
            while u in owner:
                u = nextafter(u, inf)
            last_k = k
            last_u = u
            bucket = owner[u] = [b]
            b.heap_slot = u
            heappush(heap, u)
            entries += 1
            if entries > compact_at:
                self.last_key, self.last_slot, self.entries = last_k, last_u, entries
                self.compact()
                owner, heap, bucket = self.owner, self.heap, None
                last_k, last_u = self.last_key, self.last_slot
                entries, compact_at = self.entries, self.compact_at
        self.last_key, self.last_slot, self.entries = last_k, last_u, entries

    # No acquire: a referenced block's entry is skipped (parked) when met, and its release
    # (or, for a parked parent, its becoming a leaf) pushes a fresh entry that supersedes
    # the old one.
    def forget(self, b: Node) -> None:
        """`b` leaves: any entry it has reads as stale."""
        b.heap_slot = math.nan
        b.parked = None

    def rekey(self) -> None:
        """Every key changed: re-key the heap before the next block is taken, not now."""
        self.stale = True

    def pop(self) -> Node | None:
        """Remove and return the evictable leaf with the smallest key (None: none left)."""
        if self.stale:
            self.rebuild()
        heap = self.heap
        while True:
            cur, i = self.cur, self.cur_i
            if i >= len(cur):
                if not heap:
                    self.cur, self.cur_i = [], 0
                    return None
                u = heapq.heappop(heap)
                cur = self.cur = self.owner.pop(u)
                i = 0
                self.cur_u = u
            elif heap and heap[0] < self.cur_u:  # a smaller key arrived meanwhile
                self._park_bucket()
                continue
            u = self.cur_u
            n = len(cur)
            while i < n:
                b = cur[i]
                i += 1
                if u != b.heap_slot or b.key is None:
                    continue
                if b.ref_cnt or b.num_children:
                    b.parked = PARKED
                    continue
                self.cur_i = i
                b.heap_slot = math.nan
                return b
            self.cur_i = i

    def take_lazy(self, n: int, protected: Container[object]
                  ) -> tuple[list[Node], list[Node]]:
        """Take up to `n` coldest blocks for a caller that does not push a block when its key rises.

        Such a caller skips the push at a hit, a cleared flag or a raised head: between
        re-keys keys only rise, so a block's entry is a lower bound of its key, and a block
        met with a key above its entry is pushed back at its key instead of taken. The
        blocks are the coldest, as `pop` with a push at every access would give (ties
        aside). Blocks whose key (`Node.key`) is in `protected` are taken and returned
        apart, for the caller to push back; fewer than `n` when the heap runs dry."""
        if self.stale:
            self.rebuild()
        heap, owner, heappop, key = self.heap, self.owner, heapq.heappop, self.key
        picked: list[Node] = []
        skipped: list[Node] = []
        if n <= 0:
            return picked, skipped
        if self.cur_i < len(self.cur) and heap and heap[0] < self.cur_u:
            self._park_bucket()  # a smaller key arrived since the bucket was taken
        cur, i, u = self.cur, self.cur_i, self.cur_u
        # No compaction while `cur` is drained here: once, after.
        compact_at, self.compact_at = self.compact_at, math.inf
        while True:
            if i >= len(cur):
                if not heap:
                    cur, i = [], 0
                    break
                u = heappop(heap)
                cur = owner.pop(u)
                i = 0
            m = len(cur)
            while i < m:
                b = cur[i]
                i += 1
                if u != b.heap_slot or b.key is None:
                    continue
                if b.ref_cnt or b.num_children:
                    b.parked = PARKED
                    continue
                if key(b) > u:  # hotter since its entry: back in at its key (above this one)
                    self.push((b,))
                    continue
                b.heap_slot = math.nan
                if b.key in protected:
                    skipped.append(b)
                    continue
                picked.append(b)
                if len(picked) == n:
                    break
            else:
                continue
            break
        self.cur, self.cur_i, self.cur_u = cur, i, u
        self.compact_at = compact_at
        if self.entries > compact_at:
            self.compact()
        return picked, skipped

    def _park_bucket(self) -> None:
        """Return the rest of the bucket being drained to the heap (before later pushes
        of the same key)."""
        rest = self.cur[self.cur_i:]
        self.cur, self.cur_i = [], 0
        if rest:
            u = self.cur_u
            later = self.owner.get(u)
            if later is None:
                self.owner[u] = rest
                heapq.heappush(self.heap, u)
            else:
                self.owner[u] = rest + later

    def live(self) -> list[Node]:
        """The blocks with a live entry, in heap-entry order (not key order)."""
        self._park_bucket()
        # A block is live in one bucket at most (the one its `heap_slot` names), perhaps
        # twice there: keep its first entry, in bucket order.
        live: list[Node] = []
        for u, bucket in self.owner.items():
            start = len(live)
            for b in bucket:
                if u == b.heap_slot and b.key is not None:
                    b.heap_slot = math.inf  # taken: a later entry of it reads as stale
                    live.append(b)
            for i in range(start, len(live)):
                live[i].heap_slot = u
        return live

    def rebuild(self) -> None:
        """Re-key now: every live block pushed again at its current key.

        This runs over every evictable block: at most once per new generation or half-life."""
        self.stale = False
        live = self.live()
        self.heap = []
        self.owner = {}
        self.last_key = math.nan
        self.entries = 0
        self.push(live)

    def compact(self) -> None:
        """Drop superseded entries (keys unchanged, so one heapify).

        This keeps the heap, and the log n of every push, near the number of evictable
        blocks."""
        if self.stale:  # a rebuild compacts too
            self.rebuild()
            return
        self._park_bucket()
        owner: dict[float, list[Node]] = {}
        kept = 0
        for u, bucket in self.owner.items():
            for b in bucket:
                if u != b.heap_slot or b.key is None:
                    break
            else:  # all live (most buckets): the same list, nothing allocated
                owner[u] = bucket
                kept += len(bucket)
                continue
            live = [b for b in bucket if u == b.heap_slot and b.key is not None]
            if live:
                owner[u] = live
                kept += len(live)
        self.owner = owner
        self.heap = heap = list(owner)
        heapq.heapify(heap)
        self.last_key = math.nan
        self.entries = kept
        self.compact_at = kept + max(kept // 2, self.capacity // 2) + 256
