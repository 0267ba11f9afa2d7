"""`lirs`: LIRS (Jiang & Zhang, SIGMETRICS'02), adapted to a prefix tree of blocks.

LIRS ranks a block by its inter-reference recency (IRR): the number of distinct blocks
used between its last two uses. Blocks of low IRR are LIR and stay; the rest are HIR, and
only resident HIR blocks are evicted. Two structures:

- the stack S, by recency: every LIR block, and the HIR blocks (resident or not: a
  non-resident entry is the key of an evicted block) used more recently than the oldest
  LIR block. Its bottom is always LIR ("pruning" drops the HIR entries below it). An HIR
  block used again while in S has an IRR below the bottom LIR's recency: it becomes LIR
  and the bottom LIR is demoted to HIR.
- the queue Q of resident HIR blocks, oldest first: the eviction order.

The LIR set holds up to `(1 - hir) * capacity` blocks; `hir` is the paper's 1% by default.

The prefix adaptation (the cache evicts only refcount-0 leaves, and a request's new blocks
are inserted together and held while it allocates):

- A block inserted by a request is HIR until its first reuse. Only a cold cache (no
  eviction yet) fills its LIR set with new blocks, as LIRS does; afterwards the LIR set
  may be short of its target (see the demotions below), and filling it with new blocks
  would make every block LIR, which is LRU on the stack. An inserted key that is a
  non-resident entry of S was evicted and is wanted again within the LIR set's recency:
  it enters LIR at once. With no LIR block at all, S is not pruned (it would empty).
- The victim is the oldest *evictable* resident HIR block of Q; those met first that are
  held or have cached children are parked (`EvictionPolicy._pop_evictable`) and rejoin
  Q's cold end when evictable.
- When Q has no evictable block (e.g. all its blocks are the held new blocks of the
  request being allocated), the LIR block at the bottom of S is demoted to HIR into Q and
  S is pruned, as LIRS does when an HIR block is promoted, and Q is tried again: LIR
  blocks are never evicted as LIR, and the LIR set shrinks below its target until reuses
  promote HIR blocks again (a promotion demotes only while the LIR set is full).
- A request's blocks are one access: in S they sit together, the root on top and each
  deeper block just below its parent (a block whose parent was the previous block placed
  goes below it), so S's bottom, and a demotion, reaches a request's deepest block first,
  the one that can be evicted, as LRU's tail-first release does.
- Non-resident entries are bounded by `ghost * capacity` (2x by default); past it the
  oldest evicted goes, counted in `stats()["ghost_overflow"]`.

Every hook is O(1) amortised per block: S and Q are intrusive lists, each entry is pruned
at most once per placement, each demotion follows a promotion or ends in an eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .eviction import EvictionPolicy, register_policy
from .links import Link, LinkList
from .node import Node, NodeQueue

LIR, HIR = 1, 2


class LIRSEntry(Link):
    """A block's place in LIRS's stack S (`Node.rec`).

    After its block is evicted it stays, non-resident (`node` None), under its key while it is in
    S."""

    __slots__ = ("key", "node", "lir")

    def __init__(self) -> None:
        super().__init__()
        self.key: bytes = b""
        self.node: Node | None = None
        self.lir = False


@register_policy("lirs")
class LIRS(EvictionPolicy):
    """LIRS: evict the oldest evictable resident HIR block; LIR blocks (low IRR) stay."""

    name = "lirs"

    def __init__(self, hir: float = 0.01, ghost: float = 2.0) -> None:
        super().__init__()
        if not 0.0 < hir < 1.0:
            raise ValueError(f"hir must be a share in (0, 1), got {hir}")
        if ghost < 0:
            raise ValueError(f"ghost must be >= 0 (a multiple of the capacity), got {ghost}")
        self.hir = hir
        self.ghost_mult = ghost
        self.s = LinkList()  # the LIRS stack: end.next is the bottom, end.prev the top
        self.q = NodeQueue("hir")  # resident HIR blocks, oldest first
        self.ghosts: OrderedDict[bytes, LIRSEntry] = OrderedDict()  # non-resident, in S
        self.lir_target = 1
        self.ghost_limit = 0
        self.n_lir = 0
        self.n_hir = 0  # resident HIR blocks (in Q or parked from it)
        self._anchor: Node | None = None  # the block placed last in S
        self._warming = True  # no eviction yet: new blocks fill the LIR set, as in LIRS
        self.promotions = 0
        self.ghost_hits = 0
        self.fallbacks = 0  # demotions because Q had no evictable block
        self.ghost_overflow = 0

    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        n_hir = max(1, round(self.hir * capacity_blocks))
        self.lir_target = max(1, capacity_blocks - n_hir)
        self.ghost_limit = int(self.ghost_mult * capacity_blocks)

    # ---- S ------------------------------------------------------------------------------
    def _place(self, e: LIRSEntry, b: Node) -> None:
        """Put `e` (of block `b`) on top of S, or just below the block placed before it
        when that is `b`'s parent (the same request's prefix, root on top)."""
        s = self.s
        if e.owner is not None:
            s.remove(e)
        a = self._anchor
        self._anchor = b
        if a is not None and b.parent is a:
            ae = a.rec
            if type(ae) is LIRSEntry and ae.owner is s and ae.node is a:
                s.insert_before(e, ae)
                return
        s.append(e)

    def _prune(self) -> None:
        """Drop the HIR entries at the bottom of S, so that its bottom is LIR."""
        s = self.s
        end = s.end
        e: Any = end.next  # a LIRSEntry (read untyped: this runs per placement)
        ghosts = self.ghosts
        if not self.n_lir:  # nothing to keep S's history against: keep it all
            return
        while e is not end:
            if e.lir:
                return
            nxt = e.next
            s.remove(e)
            if e.node is None:
                del ghosts[e.key]
            e = nxt

    def _demote(self) -> bool:
        """Demote the bottom LIR block of S to resident HIR at Q's hot end, then prune.
        False when S holds no LIR block."""
        e = self.s.end.next
        if e is self.s.end:
            return False
        assert isinstance(e, LIRSEntry) and e.lir and e.node is not None
        self.s.remove(e)
        e.lir = False
        b = e.node
        b.state = HIR
        self.n_lir -= 1
        self.n_hir += 1
        self.q.append(b)
        self._prune()
        return True

    def _promote(self, e: LIRSEntry, b: Node) -> None:
        e.lir = True
        b.state = LIR
        self.n_lir += 1
        self._place(e, b)
        self._prune()
        if self.n_lir > self.lir_target:
            self._demote()

    # ---- hooks --------------------------------------------------------------------------
    def on_insert(self, b: Node, now: float) -> None:
        key = b.key
        assert key is not None
        g = self.ghosts.pop(key, None)
        if g is not None:  # evicted, and wanted again within the LIR set's recency
            g.node = b
            b.rec = g
            self.ghost_hits += 1
            self._promote(g, b)
            return
        e = b.rec
        if type(e) is not LIRSEntry or e.owner is not None:
            e = b.rec = LIRSEntry()
        assert isinstance(e, LIRSEntry)
        e.key = key
        e.node = b
        if self._warming and self.n_lir < self.lir_target:  # a cold cache: LIR, as LIRS
            e.lir = True
            b.state = LIR
            self.n_lir += 1
            self._place(e, b)
            return
        e.lir = False
        b.state = HIR
        self.n_hir += 1
        self.q.append(b)
        self._place(e, b)
        self._prune()

    def on_hit(self, b: Node, now: float) -> None:
        e: LIRSEntry = b.rec
        if e.lir:
            self._place(e, b)
            self._prune()
            return
        # A resident HIR block: out of Q (or its parking) either way.
        q = b.queue
        if q is not None:
            q.remove(b)
        b.parked = None
        if e.owner is not None:  # still in S: its IRR is below the bottom LIR's recency
            self.n_hir -= 1
            self.promotions += 1
            self._promote(e, b)
        else:  # stays HIR, most recent in S and Q
            self.q.append(b)
            self._place(e, b)
            self._prune()

    def on_release_all(self, blocks: list[Node], now: float) -> None:
        # `on_release` (unpark) of a request's blocks in one call.
        for b in blocks:
            q = b.parked
            if q is not None and b.num_children == 0:
                b.parked = None
                q.appendleft(b)

    def victim(self) -> Node | None:
        self._warming = False
        while True:
            b = self._pop_evictable(self.q)
            if b is not None:
                return b
            if not self._demote():
                return None
            self.fallbacks += 1

    def on_evict(self, b: Node) -> None:
        e: LIRSEntry = b.rec
        b.state = 0
        self.n_hir -= 1
        if e.owner is None:  # not in S: nothing to remember; the record is reused
            e.node = None
            return
        # Non-resident HIR, kept in S under its key.
        e.node = None
        b.rec = None
        ghosts = self.ghosts
        ghosts[e.key] = e
        if len(ghosts) > self.ghost_limit:
            _, old = ghosts.popitem(last=False)
            self.s.remove(old)  # never the bottom: that is LIR
            self.ghost_overflow += 1

    def forget(self, b: Node) -> None:
        super().forget(b)
        e = b.rec
        if type(e) is LIRSEntry and e.node is b:
            if e.owner is not None:
                self.s.remove(e)
            if e.lir:
                self.n_lir -= 1
            elif b.state == HIR:
                self.n_hir -= 1
            e.lir = False
            e.node = None
            self._prune()
        if self._anchor is b:
            self._anchor = None
        b.state = 0

    def stats(self) -> dict[str, float]:
        return {"lir": self.n_lir, "hir": self.n_hir, "stack": len(self.s),
                "ghosts": len(self.ghosts), "promotions": self.promotions,
                "ghost_hits": self.ghost_hits, "fallbacks": self.fallbacks,
                "ghost_overflow": self.ghost_overflow}
