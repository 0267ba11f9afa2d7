"""Protection of a stable subset: what keeps a cache smaller than its traffic's cycle from
keeping nothing (LIRS, Jiang & Zhang, SIGMETRICS'02, over the heat order).

In a cycle of conversations longer than the cache every block has the same history, so an
order by decayed count ranks by recency, as LRU does, and each block leaves before its
reuse: 0 hits. LIRS keeps a subset instead, and so does KVHeat while `Protection` is on
(the miniatures switch it on where it serves more, miniature.py):

- **Protected** blocks stay: the heat heap orders them, and gives the victim only when no
  probation block can go. A list of them by last access gives the oldest one's age.
- **Probation** blocks are the victims, oldest first: every new block, unless it enters
  protected at once (below).
- A block becomes protected when it is hit on probation; when it comes back from the ghost
  history with a reuse gap below the oldest protected block's age (LIRS's test: its
  inter-reference recency is below the bottom LIR block's recency); while the cache has not
  evicted yet; or when a stale block left a credit (below).
- Protected blocks fill all but `HIR_SHARE` of the cache (LIRS's 1%); past it the one used
  longest ago goes to probation.
- **Stale**: a protected block unused for `STALE` times its own last reuse gap (the
  measured reuse gap when it has none) goes to probation first and leaves a credit, taken
  by the next new block. Without it a set of conversations that ended holds the cache until
  reuses of new ones push it out, LIRS's slow turnover (docs/heat.md, "A cycle of
  conversations longer than the cache").

Both constants are dimensionless (a share of the cache, a multiple of a block's own gap).
A block's state is `Node.state`; the two lists use its queue links, which KVHeat's heap
does not. Every hook is O(1) per block (amortised: a block goes stale once per use); a
switch on sorts the cached blocks once.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable

from ..cache.eviction import PARKED, EvictionPolicy
from ..cache.node import Node, NodeQueue
from .heap import BlockHeap

PROTECTED, PROBATION = 1, 2  # Node.state; 0: not classed (cached before protection began)
HIR_SHARE = 0.01  # the cache's share that protected blocks leave to probation (LIRS's)
# A protected block unused for this many of its own reuse gaps is stale. On the cycles
# bench (docs/heat.md): at 1 a live block's next turn, a little later than its last gap
# (the cycle grows each turn), finds it gone and nothing is kept at 64-128 blocks; at 2
# or 3 a set of conversations that ended holds on longer (192 blocks: 31% against 37.5%);
# 1.25 and 1.5 are alike.
STALE = 1.5


class Protection:
    """The protected and probation sets of one KVHeat, around its heat heap."""

    def __init__(self, heap: BlockHeap, capacity_blocks: int) -> None:
        self.heap = heap
        self.recent = NodeQueue("protected")  # protected blocks, least recently used first
        self.probation = NodeQueue("probation")  # evictable probation blocks, oldest first
        self.target = 1
        self.resize(capacity_blocks)
        self.warm = True  # no eviction yet: new blocks fill the protected set
        self.credit = 0  # stale blocks' places, for new blocks to take
        self.promotions = 0
        self.demotions = 0
        self.stales = 0

    # -- setup -----------------------------------------------------------------------
    def resize(self, capacity_blocks: int) -> None:
        """The cache's size changed: the protected set's target follows."""
        self.target = max(1, capacity_blocks - max(1, round(HIR_SHARE * capacity_blocks)))

    def adopt(self, blocks: Iterable[Node]) -> None:
        """Class cached blocks as protected, in order of last access (the switch on)."""
        recent = self.recent
        for b in sorted(blocks, key=lambda b: b.rec.last):
            b.state = PROTECTED
            recent.append(b)
        self.warm = False

    def disband(self) -> list[Node]:
        """Unclass every block (the switch off): those on probation, evictable, returned."""
        out = []
        for q in (self.recent, self.probation):
            b = q.first()
            while b is not None:
                q.remove(b)
                b.state = 0
                if q is self.probation:
                    out.append(b)
                b = q.first()
        return out

    def age_of_oldest(self, now_v: float) -> float:
        """Accesses since the least recently used protected block's last use (inf: none)."""
        b = self.recent.first()
        return math.inf if b is None else now_v - b.rec.last

    # -- accesses --------------------------------------------------------------------
    def inserted(self, b: Node, gap: float, now_v: float) -> None:
        """`b` was just cached (held by its request): protect it or put it on probation.

        `gap` > 0: it came back from the ghost history after that many accesses."""
        if self.warm or 0 < gap < self.age_of_oldest(now_v):
            if not self.warm:
                self.promotions += 1
            self._protect(b)
        elif self.credit > 0 and self.recent.size < self.target:
            self.credit -= 1
            self._protect(b)
        else:
            b.state = PROBATION  # its release queues it

    def hit(self, b: Node) -> None:
        """`b` was used again (its record's last access is now)."""
        if b.state == PROTECTED:
            q = self.recent
            q.remove(b)
            q.append(b)
            return
        if b.state == PROBATION:
            self.promotions += 1
            if b.queue is not None:
                b.queue.remove(b)
            b.parked = None
        self._protect(b)

    def _protect(self, b: Node) -> None:
        b.state = PROTECTED
        self.recent.append(b)
        if self.recent.size > self.target:
            self._demote(self.recent.first())
            self.demotions += 1

    def _demote(self, b: Node | None, cold: bool = False) -> None:
        """Move protected `b` to probation: at the cold end with `cold`, else the hot end."""
        if b is None:
            return
        self.recent.remove(b)
        self.heap.forget(b)  # its heap entry, if any, reads as stale
        b.state = PROBATION
        if b.ref_cnt:
            return  # its release queues it
        if b.num_children:
            b.parked = self.probation  # back at the cold end once a leaf (`leaf`)
        elif cold:
            self.probation.appendleft(b)
        else:
            self.probation.append(b)

    # -- the heap and the queue ------------------------------------------------------
    def route(self, blocks: Iterable[Node]) -> None:
        """Released blocks back where they wait: the heap or the probation queue.

        Protected ones into the heap at their key, probation ones queued (those already
        queued keep their place)."""
        push = []
        for b in blocks:
            st = b.state
            if st == PROBATION:
                if b.queue is None:
                    b.parked = None
                    self.probation.append(b)
                continue
            if st != PROTECTED:  # cached before protection began, held until now
                b.state = PROTECTED
                self.recent.append(b)
            push.append(b)
        if push:
            self.heap.push(push)

    def leaf(self, b: Node) -> None:
        """Parked `b` became evictable: back in its queue's cold end or in the heap."""
        p = b.parked
        if p is None:
            return
        if b.state == PROBATION and p is not PARKED:
            if b.ref_cnt == 0 and b.num_children == 0:
                b.parked = None
                self.probation.appendleft(b)
            return
        self.route((b,))

    def victim(self, now_v: float, gap_estimate: float) -> Node | None:
        """The next victim: the oldest evictable probation block, else the coldest protected.

        Stale protected blocks join probation first."""
        self.warm = False
        self._unstale(now_v, gap_estimate)
        b = EvictionPolicy._pop_evictable(self.probation)
        return b if b is not None else self.heap.pop()

    def take(self, n: int, protected: Container[object], now_v: float, gap_estimate: float
             ) -> tuple[list[Node], list[Node]]:
        """Up to `n` probation victims, oldest first, for `KVHeat.take_lazy`.

        Stale protected blocks join probation first; those whose key is in `protected` are
        taken and returned apart."""
        self.warm = False
        self._unstale(now_v, gap_estimate)
        picked: list[Node] = []
        skipped: list[Node] = []
        q = self.probation
        end = q.end
        b = end.next
        while b is not end and len(picked) < n:
            nxt = b.next
            q.remove(b)
            if b.ref_cnt or b.num_children:
                b.parked = q
            elif b.key in protected:
                skipped.append(b)
            else:
                picked.append(b)
            b = nxt
        return picked, skipped

    def _unstale(self, now_v: float, gap_estimate: float) -> None:
        q = self.recent
        while True:
            b = q.first()
            if b is None:
                return
            r = b.rec
            gap = r.gap if r.gap > 0 else gap_estimate
            if now_v - r.last <= STALE * gap:
                return
            self._demote(b, cold=True)
            self.stales += 1
            if self.credit < self.target:
                self.credit += 1

    def forget(self, b: Node) -> None:
        """`b` leaves the cache (evicted or dropped)."""
        if b.queue is not None:
            b.queue.remove(b)
        b.state = 0

    def stats(self) -> dict[str, float]:
        """Sizes and counters, for reports."""
        return {"protected_blocks": float(self.recent.size),
                "probation_blocks": float(self.probation.size),
                "protect_promotions": float(self.promotions),
                "protect_demotions": float(self.demotions),
                "protect_stale": float(self.stales)}
