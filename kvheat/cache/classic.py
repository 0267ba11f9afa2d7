"""Baseline eviction policies: one small class each, adapted to a prefix tree of blocks.

All of them evict only refcount-0 leaves (see `eviction.py`). Ghost lists hold keys only.
"""

from __future__ import annotations

import heapq

from .eviction import PARKED, EvictionPolicy, register_policy
from .ghost import Ghost
from .node import DETACHED, Node, NodeQueue


@register_policy("lru")
class LRU(EvictionPolicy):
    """Least recently used, in vLLM's order.

    A block joins the hot end when released; a request is released tail-first, so its
    first block ends most recent and parents outlive children."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.q = NodeQueue("lru")

    def on_acquire(self, b: Node) -> None:
        if b.queue is not None:
            b.queue.remove(b)
        b.parked = None

    def on_release(self, b: Node, now: float) -> None:
        b.parked = None
        self.q.append(b)

    # A request's prefix leaves and rejoins the queue in one loop each, the list links
    # written out: the per-block method calls were most of an allocate's cost.
    def on_acquire_all(self, blocks: list[Node]) -> None:
        detached = DETACHED
        for b in blocks:
            q = b.queue
            if q is not None:
                prev, nxt = b.prev, b.next
                prev.next = nxt
                nxt.prev = prev
                b.prev = b.next = detached
                b.queue = None
                q.size -= 1
            b.parked = None

    def on_release_all(self, blocks: list[Node], now: float) -> None:
        q = self.q
        end = q.end
        last = end.prev
        for b in blocks:
            b.parked = None
            last.next = b
            b.prev = last
            b.queue = q
            last = b
        last.next = end
        end.prev = last
        q.size += len(blocks)

    def victim(self) -> Node | None:
        return self._pop_evictable(self.q)


@register_policy("fifo")
class FIFO(EvictionPolicy):
    """Insertion order, whatever the block's use since."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self.q = NodeQueue("fifo")

    def on_insert(self, b: Node, now: float) -> None:
        self.q.append(b)

    def victim(self) -> Node | None:
        return self._pop_evictable(self.q)


@register_policy("lfu")
class LFU(EvictionPolicy):
    """Least frequently used, LRU among equals: one LRU queue per frequency (O(1) LFU)."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.buckets: dict[int, NodeQueue] = {}

    def on_insert(self, b: Node, now: float) -> None:
        b.freq = 1

    def on_hit(self, b: Node, now: float) -> None:
        b.freq += 1

    def on_acquire(self, b: Node) -> None:
        q = b.queue
        if q is not None:
            q.remove(b)
            if not q.size:
                del self.buckets[b.freq]
        b.parked = None

    def _bucket(self, freq: int) -> NodeQueue:
        q = self.buckets.get(freq)
        if q is None:
            q = self.buckets[freq] = NodeQueue(f"f{freq}")
        return q

    def on_leaf(self, b: Node) -> None:
        if b.parked is not None and b.ref_cnt == 0:
            b.parked = None
            self._bucket(b.freq).appendleft(b)

    def on_release(self, b: Node, now: float) -> None:
        b.parked = None
        self._bucket(b.freq).append(b)

    def forget(self, b: Node) -> None:
        self.on_acquire(b)

    def victim(self) -> Node | None:
        # Distinct frequencies are few; scanning them is cheaper than keeping them sorted.
        for f in sorted(self.buckets):
            q = self.buckets[f]
            b = self._pop_evictable(q)
            if not q.size:
                del self.buckets[f]
            if b is not None:
                return b
        return None


T1, T2 = 1, 2


@register_policy("arc")
class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha).

    A recency list T1 and a frequency list T2; the ghosts B1/B2 steer the target size p
    of T1."""

    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        self.t = {T1: NodeQueue("t1"), T2: NodeQueue("t2")}
        self.size = {T1: 0, T2: 0}  # logical sizes, referenced blocks included
        self.b1: Ghost[bool] = Ghost()
        self.b2: Ghost[bool] = Ghost()
        self.p = 0.0

    def on_insert(self, b: Node, now: float) -> None:
        key = b.key
        assert key is not None
        if self.b1.take(key):
            self.p = min(self.capacity, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            b.state = T2
        elif self.b2.take(key):
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            b.state = T2
        else:
            b.state = T1
        self.size[b.state] += 1

    def on_hit(self, b: Node, now: float) -> None:
        if b.state == T1:
            self.size[T1] -= 1
            self.size[T2] += 1
            if b.queue is not None:
                b.queue.remove(b)
            if b.parked is not None:
                b.parked = self.t[T2]
            b.state = T2

    def on_acquire(self, b: Node) -> None:
        if b.queue is not None:
            b.queue.remove(b)
        b.parked = None

    def on_release(self, b: Node, now: float) -> None:
        b.parked = None
        self.t[b.state].append(b)

    def victim(self) -> Node | None:
        first = T1 if self.size[T1] > max(self.p, 0) or self.size[T2] == 0 else T2
        for lst in (first, T2 if first == T1 else T1):
            b = self._pop_evictable(self.t[lst])
            if b is not None:
                return b
        return None

    def on_evict(self, b: Node) -> None:
        self.size[b.state] -= 1
        # Each ghost list remembers up to one cache's worth of keys. (Classic ARC trims B1
        # to c - |T1| before admitting the missed key; here eviction runs before the
        # newcomer is known, and that trim would drop the very key about to hit.)
        assert b.key is not None
        (self.b1 if b.state == T1 else self.b2).add(b.key, True, self.capacity)

    def stats(self) -> dict[str, float]:
        return {"p": self.p, "t1": self.size[T1], "t2": self.size[T2]}

    def forget(self, b: Node) -> None:
        super().forget(b)
        self.size[b.state] -= 1


A1IN, AM = 1, 2


@register_policy("twoq")
class TwoQ(EvictionPolicy):
    """2Q (Johnson & Shasha): a probation FIFO, its ghost, a protected LRU.

    New blocks wait on probation (FIFO A1in, 25% of the cache); evicted probationers leave
    a ghost (A1out, 50%); a block seen again joins the protected LRU Am."""

    name = "twoq"

    def __init__(self, kin: float = 0.25, kout: float = 0.5) -> None:
        super().__init__()
        self.kin, self.kout = kin, kout
        self.a1in = NodeQueue("a1in")
        self.am = NodeQueue("am")
        self.n_a1in = 0
        self.a1out: Ghost[bool] = Ghost()

    def on_insert(self, b: Node, now: float) -> None:
        assert b.key is not None
        if self.a1out.take(b.key):
            b.state = AM
        else:
            b.state = A1IN
            self.n_a1in += 1
            self.a1in.append(b)

    def on_hit(self, b: Node, now: float) -> None:
        if b.state == A1IN:  # seen again while on probation: protect it
            self.n_a1in -= 1
            if b.queue is not None:
                b.queue.remove(b)
            b.parked = None
            b.state = AM

    def on_acquire(self, b: Node) -> None:
        if b.state == AM:
            if b.queue is not None:
                b.queue.remove(b)
            b.parked = None

    def on_release(self, b: Node, now: float) -> None:
        if b.state == AM:
            b.parked = None
            self.am.append(b)
        else:
            self._unpark(b)

    def victim(self) -> Node | None:
        order = (self.a1in, self.am) if self.n_a1in > self.kin * self.capacity else (self.am, self.a1in)
        for q in order:
            b = self._pop_evictable(q)
            if b is not None:
                return b
        return None

    def on_evict(self, b: Node) -> None:
        if b.state == A1IN:
            self.n_a1in -= 1
            assert b.key is not None
            self.a1out.add(b.key, True, int(self.kout * self.capacity))

    def forget(self, b: Node) -> None:
        super().forget(b)
        if b.state == A1IN:
            self.n_a1in -= 1


SMALL, MAIN = 1, 2


@register_policy("s3fifo")
class S3FIFO(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): small, main and ghost FIFOs.

    A small FIFO (10%) filters one-hit blocks, a main FIFO with 2-bit frequency
    reinsertion keeps the rest, a ghost FIFO remembers evictions from the small queue."""

    name = "s3fifo"

    def __init__(self, small: float = 0.1) -> None:
        super().__init__()
        self.small_frac = small
        self.s = NodeQueue("small")
        self.m = NodeQueue("main")
        self.n = {SMALL: 0, MAIN: 0}
        self.ghost: Ghost[bool] = Ghost()

    def on_insert(self, b: Node, now: float) -> None:
        b.freq = 0
        assert b.key is not None
        b.state = MAIN if self.ghost.take(b.key) else SMALL
        self.n[b.state] += 1
        (self.m if b.state == MAIN else self.s).append(b)

    def on_hit(self, b: Node, now: float) -> None:
        if b.freq < 3:
            b.freq += 1

    def _move_to_main(self, b: Node) -> None:
        self.n[SMALL] -= 1
        self.n[MAIN] += 1
        b.state = MAIN
        b.freq = 0
        self.m.append(b)

    def victim(self) -> Node | None:
        # Each loop step either evicts, parks, promotes, or lowers a frequency, so it ends.
        while self.s.size or self.m.size:
            from_small = self.s.size and (self.n[SMALL] >= self.small_frac * self.capacity or not self.m.size)
            q = self.s if from_small else self.m
            b = q.popleft()
            assert b is not None
            if from_small and b.freq > 1:
                self._move_to_main(b)
            elif not from_small and b.freq > 0:
                b.freq -= 1
                self.m.append(b)
            elif b.ref_cnt or b.num_children:
                b.parked = q
            else:
                return b
        return None

    def on_evict(self, b: Node) -> None:
        self.n[b.state] -= 1
        if b.state == SMALL:
            assert b.key is not None
            self.ghost.add(b.key, True, int((1 - self.small_frac) * self.capacity))

    def forget(self, b: Node) -> None:
        super().forget(b)
        self.n[b.state] -= 1


@register_policy("belady")
class Belady(EvictionPolicy):
    """Offline optimum: evict the block whose next use is furthest away (never first).

    The replayer sets `next_use[key]` before each request. A parent's next use is never
    later than its children's, and ties go to the deeper block, so the maximum is a leaf;
    blocks met that are not evictable are parked and pushed back when they become so.
    """

    name = "belady"
    needs_future = True

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple[float, int, int, int, Node]] = []
        self.next_use: dict[bytes, float] = {}
        self._seq = 0

    def _push(self, b: Node) -> None:
        b.heap_version += 1
        self._seq += 1
        assert b.key is not None
        nu = self.next_use.get(b.key, float("inf"))
        heap = self.heap
        heapq.heappush(heap, (-nu, -b.depth, self._seq, b.heap_version, b))
        # Superseded entries pile up with every release (a cache that rarely evicts pops
        # few): past twice the live ones' bound, keep the live ones only. The order stays
        # the tuples' own, so no decision changes.
        if len(heap) > 2 * max(getattr(self, "capacity", 0), 4096):
            self.heap = [e for e in heap if e[3] == e[4].heap_version and e[4].key is not None]
            heapq.heapify(self.heap)

    def on_acquire(self, b: Node) -> None:
        b.heap_version += 1  # invalidates its heap entry
        b.parked = None

    def on_release(self, b: Node, now: float) -> None:
        b.parked = None
        self._push(b)

    def on_leaf(self, b: Node) -> None:
        if b.parked is not None:
            b.parked = None
            self._push(b)

    def forget(self, b: Node) -> None:
        b.heap_version += 1
        b.parked = None

    def victim(self) -> Node | None:
        heap = self.heap
        while heap:
            _, _, _, ver, b = heapq.heappop(heap)
            if ver != b.heap_version or b.key is None:
                continue
            if b.ref_cnt or b.num_children:
                b.parked = PARKED
                continue
            b.heap_version += 1
            return b
        return None

