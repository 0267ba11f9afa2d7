"""`lecar`: LeCaR (Vietri et al., HotStorage'18), adapted to a prefix tree of blocks.

Two experts rank the cached blocks: LRU and LFU (LRU among equal frequencies). At each
eviction one expert is drawn, LRU with probability `w_lru`, and its victim goes; when
both name the same block there is nothing to learn. An evicted block's key joins the
history of the expert that chose it (each history holds up to one cache's worth of keys,
oldest dropped first), with the time of its eviction and its frequency. When a key in a
history is inserted again, that expert was wrong: its weight is multiplied by
`exp(-learning_rate * discount ** t)`, t the accesses since its eviction, and the weights
normalised; the block's frequency resumes from the history's, plus one.

As in the paper and the authors' code: learning rate 0.45, discount `0.005 ** (1 / N)`
(N the cache's blocks: a key that comes back after N accesses counts 0.5%), both weights
start at 0.5 and are kept within [0.01, 0.99] (the authors' clamp, which keeps an expert
that lost for a long stretch from being shut out for good). Time counts block accesses
(each insert and each hit). The draws come from `random.Random(seed)`, seed 0: a replay
is deterministic.

The prefix adaptation: each expert's victim is its coldest *evictable* block (refcount 0,
no cached child); blocks met before it that are not are parked, each expert on its own,
and rejoin both experts' cold ends once evictable. A held block is in neither order (a
request's prefix leaves both on acquire and rejoins at release, tail-first, as `LRU`).
The LRU expert is the block's own queue links; the LFU expert's frequency buckets link a
per-block record, so one block sits in both. Every hook is O(1) per block, but for the
LFU expert's heap of distinct frequencies (O(log F) when a frequency's bucket is made).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from typing import Any

from .eviction import EvictionPolicy, register_policy
from .links import Link, LinkList
from .node import Node, NodeQueue

BY_LRU, BY_LFU, BY_BOTH = 0, 1, 2


class LeCaRRecord(Link):
    """A block's place in the LFU expert's bucket of its frequency (`Node.rec`)."""

    __slots__ = ("node", "parked")

    def __init__(self, node: Node) -> None:
        super().__init__()
        self.node = node
        self.parked = False  # met unevictable at the head of its bucket, out of it


@register_policy("lecar")
class LeCaR(EvictionPolicy):
    """LeCaR: regret-minimising choice between an LRU and an LFU expert."""

    name = "lecar"

    def __init__(self, learning_rate: float = 0.45, history: float = 1.0, seed: int = 0,
                 w_lru: float = 0.5) -> None:
        super().__init__()
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
        if history < 0:
            raise ValueError(f"history must be >= 0 (a multiple of the capacity), got {history}")
        if not 0.0 <= w_lru <= 1.0:
            raise ValueError(f"w_lru must be in [0, 1], got {w_lru}")
        self.learning_rate = learning_rate
        self.history_mult = history
        self.rng = random.Random(seed)
        self.w_lru = w_lru
        self.w_lfu = 1.0 - w_lru
        self.discount = 0.005
        self.history_limit = 0
        self.time = 0
        self.lru = NodeQueue("lecar-lru")
        self.buckets: dict[int, LinkList] = {}  # frequency -> records, oldest first
        self.freqs: list[int] = []  # heap of the frequencies in `buckets`, each once
        # Keys evicted by each expert: (time of eviction, frequency).
        self.hist_lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.hist_lfu: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._chooser = BY_BOTH  # which expert chose the last victim
        self.choices = [0, 0, 0]  # victims by LRU, by LFU, by both
        self.regrets = [0, 0]  # history hits of LRU's victims, of LFU's

    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        self.discount = 0.005 ** (1.0 / max(capacity_blocks, 1))
        self.history_limit = int(self.history_mult * capacity_blocks)

    # ---- the LFU expert -----------------------------------------------------------------
    def _bucket(self, freq: int) -> LinkList:
        lst = self.buckets.get(freq)
        if lst is None:
            lst = self.buckets[freq] = LinkList()
            heapq.heappush(self.freqs, freq)
        return lst

    def _lfu_candidate(self) -> Node | None:
        """The LFU expert's coldest evictable block, left in place; unevictable ones met
        first are parked, emptied buckets dropped."""
        freqs, buckets = self.freqs, self.buckets
        while freqs:
            f = freqs[0]
            lst = buckets[f]
            end = lst.end
            e: Any = end.next  # a LeCaRRecord
            while e is not end:
                b = e.node
                if b.ref_cnt == 0 and b.num_children == 0:
                    return b
                nxt = e.next
                lst.remove(e)
                e.parked = True
                e = nxt
            heapq.heappop(freqs)
            del buckets[f]
        return None

    def _lru_candidate(self) -> Node | None:
        q = self.lru
        end = q.end
        b = end.next
        while b is not end:
            if b.ref_cnt == 0 and b.num_children == 0:
                return b
            nxt = b.next
            q.remove(b)
            b.parked = q
            b = nxt
        return None

    def _detach(self, b: Node) -> None:
        """Take `b` out of both experts' orders and parkings."""
        q = b.queue
        if q is not None:
            q.remove(b)
        b.parked = None
        r: LeCaRRecord = b.rec
        lst = r.owner
        if lst is not None:
            lst.remove(r)
        r.parked = False

    # ---- hooks --------------------------------------------------------------------------
    def on_insert(self, b: Node, now: float) -> None:
        self.time += 1
        key = b.key
        assert key is not None
        freq = 1
        past = self.hist_lru.pop(key, None)
        if past is not None:
            self._regret(BY_LRU, past[0])
            freq = past[1] + 1
        else:
            past = self.hist_lfu.pop(key, None)
            if past is not None:
                self._regret(BY_LFU, past[0])
                freq = past[1] + 1
        b.freq = freq
        r = b.rec
        if type(r) is LeCaRRecord and r.owner is None:
            r.node = b
            r.parked = False
        else:
            b.rec = LeCaRRecord(b)

    def _regret(self, expert: int, evicted_at: int) -> None:
        """The expert that evicted a key now wanted again loses weight."""
        self.regrets[expert] += 1
        loss = math.exp(-self.learning_rate * self.discount ** (self.time - evicted_at))
        w_lru, w_lfu = self.w_lru, self.w_lfu
        if expert == BY_LRU:
            w_lru *= loss
        else:
            w_lfu *= loss
        total = w_lru + w_lfu
        w_lru /= total
        self.w_lru = min(max(w_lru, 0.01), 0.99)
        self.w_lfu = 1.0 - self.w_lru

    def on_hit(self, b: Node, now: float) -> None:
        self.time += 1
        b.freq += 1
        r: LeCaRRecord = b.rec
        if r.owner is not None:  # touched while unreferenced: to its new bucket
            r.owner.remove(r)
            self._bucket(b.freq).append(r)

    def on_acquire(self, b: Node) -> None:
        self._detach(b)

    def on_release(self, b: Node, now: float) -> None:
        b.parked = None
        self.lru.append(b)
        r: LeCaRRecord = b.rec
        r.parked = False
        self._bucket(b.freq).append(r)

    def on_leaf(self, b: Node) -> None:
        if b.ref_cnt:
            return
        q = b.parked
        if q is not None:
            b.parked = None
            q.appendleft(b)
        r: LeCaRRecord = b.rec
        if r.parked:
            r.parked = False
            self._bucket(b.freq).appendleft(r)

    def victim(self) -> Node | None:
        by_lru = self._lru_candidate()
        by_lfu = self._lfu_candidate()
        pick_lru = self.rng.random() < self.w_lru
        if by_lru is None or by_lfu is None:  # the same blocks are evictable in both
            b = by_lru if by_lru is not None else by_lfu
            chooser = BY_BOTH
        elif by_lru is by_lfu:
            b, chooser = by_lru, BY_BOTH
        elif pick_lru:
            b, chooser = by_lru, BY_LRU
        else:
            b, chooser = by_lfu, BY_LFU
        if b is None:
            return None
        self._detach(b)
        self._chooser = chooser
        self.choices[chooser] += 1
        return b

    def on_evict(self, b: Node) -> None:
        chooser = self._chooser
        self._chooser = BY_BOTH
        if chooser == BY_BOTH:
            return
        assert b.key is not None
        hist = self.hist_lru if chooser == BY_LRU else self.hist_lfu
        hist[b.key] = (self.time, b.freq)
        if len(hist) > self.history_limit:
            hist.popitem(last=False)

    def forget(self, b: Node) -> None:
        if type(b.rec) is LeCaRRecord:
            self._detach(b)
        else:
            super().forget(b)

    def stats(self) -> dict[str, float]:
        return {"w_lru": self.w_lru, "w_lfu": self.w_lfu,
                "by_lru": self.choices[BY_LRU], "by_lfu": self.choices[BY_LFU],
                "by_both": self.choices[BY_BOTH],
                "regret_lru": self.regrets[BY_LRU], "regret_lfu": self.regrets[BY_LFU],
                "hist_lru": len(self.hist_lru), "hist_lfu": len(self.hist_lfu)}
