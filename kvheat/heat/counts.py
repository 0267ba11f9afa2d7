"""KVHeat's decayed access counts on a virtual clock: the per-block record and the clock
whose generation arithmetic keeps the counts comparable without ever refreshing them.

Time is virtual: the number of block accesses before the current timestamp (the cache's
`now` only tells which accesses happen together), so the same requests at any traffic
rate give the same counts. A block's count is Σ_i e^{λ(v_i − base)}: its decayed access
count scaled by the common growing factor e^{λ(v − base)} (LRFU with a growing base), so a
hit is one addition of the per-timestamp `weight`, idle blocks never need refreshing and
counts of different blocks compare directly. When the exponent nears overflow the base
moves, and a new half-life changes λ: each (base, λ) is a generation, and a count converts
lazily to the current one on its block's next touch, through its value at last access.
docs/heat.md ("How `kvheat` decides") has the derivation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..cache.node import PolicyRecord
from .entropy import LN2


class HeatFields(Protocol):
    """What KVHeat reads and writes of a node's record.

    A `HeatRecord`, or a node that is its own record with these fields (vLLM's offload
    `Chunk`)."""

    count: float
    last: float
    gen: int
    flags: int
    gap: float


@dataclass(slots=True)
class HeatRecord(PolicyRecord):
    """KVHeat's per-block record (`Node.rec`)."""

    count: float = 0.0  # Σ_i e^{λ(v_i − base)}, relative to generation `gen`
    last: float = 0.0  # virtual time of the last access
    gen: int = 0  # index of the (base, λ) `count` is relative to, in `HeatClock.gens`
    flags: int = 0  # PINNED | ONE_OFF | EXTENSION | FRESH (kvheat/heat/penalties.py)
    # Accesses between its last two uses (0: used once), kept while protection is on
    # (kvheat/heat/protect.py: a protected block is stale after a few of its own gaps).
    gap: float = 0.0
    # The session's own pace, a factor on the key while the class bits (flags >= 16) are
    # set: only blocks a request hint released carry it (kvheat/heat/sessions.py).
    own: float = 1.0
    # The session whose requests alone used the block (`SHARED` once two did): only a
    # block of one session is charged for that session's end.
    owner: object = None


SHARED = object()  # `HeatRecord.owner` of a block two sessions used


class HeatClock:
    """Virtual time, the weight of an access now, and the generations counts are relative to.

    `on_new_gen` is called at each new generation (every count's scale changed: the policy
    re-keys its heap)."""

    __slots__ = ("half_life", "lam", "base", "gen", "gens", "t", "v", "accesses", "weight",
                 "cap", "max_count", "retunes", "on_new_gen", "rebase_at")

    def __init__(self, half_life: float, max_count: float,
                 on_new_gen: Callable[[], None]) -> None:
        self.half_life = half_life
        self.lam = LN2 / half_life
        self.base = 0.0
        self.gen = 0  # index of the current (base, λ) in `gens`
        self.gens: list[tuple[float, float]] = [(0.0, self.lam)]
        self.t = math.nan  # the timestamp `weight` belongs to
        self.v = 0.0  # virtual time of `t`: block accesses before it
        self.accesses = 0  # block accesses so far
        self.weight = 1.0  # e^{λ(v − base)}: the weight of an access now
        self.cap = math.inf  # the saturated count, as a sum now
        # Saturating the count lets a burst that ended cool down in a few half-lives.
        self.max_count = max_count
        self.retunes = 0
        self.on_new_gen = on_new_gen
        self.rebase_at = 600.0  # λ·(v − base) beyond which the base moves (e^709 overflows)

    def start(self, half_life: float) -> None:
        """The half-life before any access (the policy's first guess, at bind)."""
        self.half_life = half_life
        self.lam = LN2 / half_life
        self.gens[self.gen] = (self.base, self.lam)

    def advance(self, now: float) -> None:
        """Move to a new timestamp: virtual time to the accesses so far.

        The weight of an access now follows (moving the base if needed)."""
        v = float(self.accesses)
        x = self.lam * (v - self.base)
        if x > self.rebase_at:
            self._new_gen(v)
            x = 0.0
        self.t = now
        self.v = v
        self.weight = w = math.exp(x)
        self.cap = self.max_count * w

    def set_half_life(self, half_life: float) -> None:
        """A new λ from now on: the base moves to now (same timestamp, new generation)."""
        self.half_life = half_life
        self.lam = LN2 / half_life
        self._new_gen(self.v)
        self.retunes += 1
        self.weight = 1.0
        self.cap = self.max_count

    def _new_gen(self, base: float) -> None:
        self.base = base
        self.gen += 1
        self.gens.append((base, self.lam))
        self.on_new_gen()  # heap keys convert at the next victim, other counts on next touch

    def convert(self, m: float, gen: int, v: float) -> float:
        """A sum relative to generation `gen`, last access `v`, in the current generation.

        The count at `v` is kept (in the old λ), then weighted as of `v` in the new one."""
        base, lam = self.gens[gen]
        return m * math.exp(lam * (base - v) + self.lam * (v - self.base))

    def rescale(self, r: HeatFields) -> None:
        """Bring `r`'s count to the current generation.

        `convert`, written out: this runs per block touched after each new generation."""
        base, lam = self.gens[r.gen]
        v = r.last
        r.count = r.count * math.exp(lam * (base - v) + self.lam * (v - self.base))
        r.gen = self.gen

    def log2_at_last(self, m: float, gen: int, last: float) -> float:
        """log2 of a count `m` (generation `gen`) as of its last access `last`."""
        base, lam = self.gens[gen]
        return math.log2(m) - lam * (last - base) / LN2

    def log_count(self, r: HeatFields, vtime: float | None = None) -> float:
        """ln of `r`'s decayed access count at virtual time `vtime` (default: now)."""
        base, lam = self.gens[r.gen]
        v = self.accesses if vtime is None else vtime
        return math.log(r.count) - lam * (v - base)
