"""`lruk`: LRU-K (O'Neil et al.), K = 2 by default, with retained history."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cache.eviction import EvictionPolicy, register_policy
from ..cache.ghost import Ghost
from ..cache.node import Node, PolicyRecord
from .heap import BlockHeap


@dataclass(slots=True)
class LRUKHistory(PolicyRecord):
    """LRU-K's per-block record (`Node.rec`): the block's last K access times, oldest first.

    LRUK's per-block record (`Node.rec`): the block's last K access times, oldest
    first."""

    times: list[float]


@register_policy("lruk")
class LRUK(EvictionPolicy):
    """LRU-K: evict the block whose K-th most recent access is oldest.

    Fewer than K accesses counts as infinitely old, LRU among those. History survives
    eviction in a ghost map (a key's last access), as LRU-K's retained-information period."""

    name = "lruk"

    def __init__(self, k: int = 2, ghost: float = 8.0) -> None:
        super().__init__()
        if k < 1:
            raise ValueError("K must be >= 1")
        self.k = k
        self.ghost_mult = ghost
        self.ghost: Ghost[float] = Ghost()
        self.heap = BlockHeap(self.key, self.keys)

    def key(self, b: Node) -> float:
        """The block's eviction key: its K-th most recent access time."""
        return self.keys((b,))[0]

    def keys(self, blocks: Sequence[Node]) -> list[float]:
        """Each block's key, in one call (the heap's push of a request's blocks)."""
        k = self.k
        out = []
        for b in blocks:
            h: LRUKHistory = b.rec
            times = h.times
            # Blocks with < K accesses sort before all others (offset), LRU among themselves.
            out.append(times[0] if len(times) == k else times[-1] - 1e12)
        return out

    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        self.heap.bind(capacity_blocks)

    def on_insert(self, b: Node, now: float) -> None:
        assert b.key is not None
        last = self.ghost.take(b.key)
        times = [last] if last is not None and self.k > 1 else []
        times.append(now)
        h: LRUKHistory | None = b.rec
        if h is None:  # the block's first insert: its record is reused from then on
            b.rec = LRUKHistory(times[-self.k:])
        else:
            h.times = times[-self.k:]

    def on_hit(self, b: Node, now: float) -> None:
        h: LRUKHistory = b.rec
        times = h.times
        times.append(now)
        if len(times) > self.k:
            del times[0]

    # The heap's hooks: no acquire (a referenced block's entry is parked when met).
    def on_release(self, b: Node, now: float) -> None:
        self.heap.push((b,))

    def on_release_all(self, blocks: list[Node], now: float) -> None:
        # The cache's batched release (a request's blocks, tail-first): one push call.
        self.heap.push(blocks)

    def on_leaf(self, b: Node) -> None:
        if b.parked is not None:  # met while it had children: back in
            self.heap.push((b,))

    def victim(self) -> Node | None:
        return self.heap.pop()

    def forget(self, b: Node) -> None:
        self.heap.forget(b)

    def on_evict(self, b: Node) -> None:
        assert b.key is not None
        h: LRUKHistory = b.rec
        self.ghost.add(b.key, h.times[-1], int(self.ghost_mult * self.capacity))
