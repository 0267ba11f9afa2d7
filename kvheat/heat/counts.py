"""KVHeat's decayed access counts on a virtual clock: the per-block record and the
generation arithmetic that keeps the counts comparable without ever refreshing them.

Time is virtual: the number of block accesses before the current timestamp (the cache's
`now` only tells which accesses happen together), so the same requests at any traffic
rate give the same counts. A block's count is Σ_i e^{λ(v_i − base)}: its decayed access
count scaled by the common growing factor e^{λ(v − base)} (LRFU with a growing base), so a
hit is one addition of the per-timestamp weight `_w`, idle blocks never need refreshing and
counts of different blocks compare directly. When the exponent nears overflow the base
moves, and a new half-life changes λ: each (base, λ) is a generation, and a count converts
lazily to the current one on its block's next touch, through its value at last access.
Evicted keys keep their count for a while (the ghost history), so a prefix that comes back
resumes its heat. docs/heat.md ("How `kvheat` decides") has the derivation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cache.block import Block
from .entropy import LN2
from .heap import HeapPolicy
from .reuse import ReuseGapEstimator

# What the ghost history keeps of an evicted block: its record's fields, as a tuple
# (count, generation, last access, flags).
Remembered = tuple[float, int, float, int]


@dataclass(slots=True)
class HeatRecord:
    """KVHeat's per-block record (`Block.rec`)."""

    count: float = 0.0  # Σ_i e^{λ(v_i − base)}, relative to generation `gen`
    last: float = 0.0  # virtual time of the last access
    gen: int = 0  # index of the (base, λ) `count` is relative to, in `HeatCounts.gens`
    flags: int = 0  # PINNED | ONE_OFF | EXTENSION | FRESH (kvheat/heat/penalties.py)


class HeatCounts(HeapPolicy):
    """The clock, the generations and the history of the counts (the key is
    HeatPenalties', the cache's hooks are KVHeat's)."""

    REBASE_AT = 600.0  # λ·(v − base) beyond which the base moves (e^709 overflows)

    def _init_counts(self, half_life: float | None, reuse_quantile: float, ghost: float,
                     max_count: float) -> None:
        self.fixed_half_life = half_life
        # The workload's reuse gap, measured on a sample of keys unless `half_life` fixes
        # the half-life (then nothing is sampled and the estimate stays None).
        self.gaps = ReuseGapEstimator(quantile=reuse_quantile)
        self._sample_below = self.gaps.threshold if half_life is None else 0
        self.half_life = half_life if half_life is not None else 1024.0  # until bound/measured
        self.lam = LN2 / self.half_life
        self.base = 0.0
        self.gen = 0  # index of the current (base, λ) in `gens`
        self.gens: list[tuple[float, float]] = [(0.0, self.lam)]
        self._t = math.nan  # timestamp `_w` belongs to
        self._v = 0.0  # virtual time of `_t`: block accesses before it
        self._acc = 0  # block accesses so far
        self._w = 1.0  # e^{λ(_v − base)}: the weight of an access now
        self._cap = math.inf
        # Saturating the count lets a burst that ended cool down in a few half-lives.
        self.max_count = max_count
        self.retunes = 0
        self.ghost_mult = ghost
        # History in two generations of plain dicts (O(1), no per-entry links): new
        # entries go to `ghost`; when it holds `ghost_limit` keys (2/3 of `ghost` ×
        # capacity) it becomes `ghost_old` and the older one is dropped, so the last
        # 2/3..4/3 × `ghost` × capacity evictions are kept, `ghost` × capacity on average.
        self.ghost: dict[bytes, Remembered] = {}
        self.ghost_old: dict[bytes, Remembered] = {}
        self.ghost_limit = 0

    def _advance(self, now: float) -> None:
        """A new timestamp: virtual time moves to the accesses so far, and the weight of an
        access now follows (moving the base if needed)."""
        v = float(self._acc)
        x = self.lam * (v - self.base)
        if x > self.REBASE_AT:
            self._new_gen(v)
            x = 0.0
        self._t = now
        self._v = v
        self._w = w = math.exp(x)
        self._cap = self.max_count * w  # the saturated count, as a sum now

    def _new_gen(self, base: float) -> None:
        self.base = base
        self.gen += 1
        self.gens.append((base, self.lam))
        self._rekey()  # live heap keys convert at the next victim, other blocks on next touch

    def _convert(self, m: float, gen: int, v: float) -> float:
        """A sum relative to generation `gen`, last access `v`, in the current one: the
        count at `v` is kept (in the old λ), then weighted as of `v` in the new one."""
        base, lam = self.gens[gen]
        return m * math.exp(lam * (base - v) + self.lam * (v - self.base))

    def _rescale(self, r: HeatRecord) -> None:
        r.count = self._convert(r.count, r.gen, r.last)
        r.gen = self.gen

    def _set_half_life(self, half_life: float) -> None:
        self.half_life = half_life
        self.lam = LN2 / half_life
        self._new_gen(self._v)  # the base moves to now: same timestamp, new λ
        self.retunes += 1
        self._w = 1.0
        self._cap = self.max_count

    def _cap_counts_at_one(self) -> None:
        """Every cached count drops to at most one access now, the history is forgotten."""
        lam, base = self.lam, self.base
        for b in self._live():
            r: HeatRecord = b.rec
            if r.gen != self.gen:
                self._rescale(r)
            one = math.exp(lam * (r.last - base))
            if r.count > one:
                r.count = one
        self.ghost.clear()
        self.ghost_old.clear()
        self._rebuild()

    def log_count(self, b: Block, vtime: float | None = None) -> float:
        """ln of `b`'s decayed access count at virtual time `vtime` (default: now)."""
        r: HeatRecord = b.rec
        base, lam = self.gens[r.gen]
        v = self._acc if vtime is None else vtime
        return math.log(r.count) - lam * (v - base)
