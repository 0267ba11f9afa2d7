"""Shannon entropy of a key distribution under exponential time decay, O(1) per access.

docs/heat.md ("Decayed entropy") has the measurements. Entropy does not change when every weight is scaled by the same factor, so
instead of decaying all keys on each access (O(n)) a new access gets the *growing* weight
e^{λ(t - base)}. With u_k the summed weights of key k, U = Σu_k and V = Σu_k·ln u_k,

    H = ln U - V / U   (nats; divided by ln 2 for bits).

An access to k changes u_k by x, U by x and V by (u+x)ln(u+x) - u ln u, computed as
u·log1p(x/u) + x·ln(u+x) to avoid cancellation; U and V are Kahan-compensated sums. When
the exponent grows large the base moves (U and V rescale exactly, keys lazily through an
epoch stamp), so weights never overflow. Per-key state lives in flat typed arrays indexed by
a dict slot: no Python object per key beyond the dict entry.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Hashable

import numpy as np

LN2 = math.log(2.0)
_REBASE_AT = 600.0  # exponent beyond which the base moves (e^600 is far below overflow)


class _Kahan:
    __slots__ = ("s", "c")

    def __init__(self) -> None:
        self.s = 0.0
        self.c = 0.0

    def add(self, x: float) -> None:
        y = x - self.c
        t = self.s + y
        self.c = (t - self.s) - y
        self.s = t

    def set(self, x: float) -> None:
        self.s, self.c = x, 0.0


class EntropyTracker:
    """Decayed access entropy over arbitrary hashable keys.

    `half_life`: decay half-life in the units of the `now` passed to `update` (seconds),
    or in accesses when `now` is omitted. `sample_low`/`low_bits`: entropy-adaptive
    sampling (docs/heat.md, "Decayed entropy"): while H < `low_bits`, only a `sample_low` fraction
    of accesses is recorded, each with weight 1/`sample_low` (unbiased counts).
    """

    def __init__(self, half_life: float = 1000.0, sample_low: float = 1.0, low_bits: float = 4.2,
                 seed: int = 0) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        if not 0 < sample_low <= 1:
            raise ValueError("sample_low must be in (0, 1]")
        self.lam = LN2 / half_life
        self.slot: dict[Hashable, int] = {}
        # Flat typed arrays (8 + 4 bytes per key), read as plain Python numbers: no numpy
        # scalar arithmetic on the per-access path.
        self.u = array("d")
        self.epoch = array("i")
        self.shifts: list[float] = [0.0]  # cumulative base shift (in exponent) per epoch
        self.base = 0.0  # time whose weight is e^0
        self.U = _Kahan()
        self.V = _Kahan()
        self.clock = 0.0
        self.sample_low = sample_low
        self.low_bits = low_bits
        self._rng = random.Random(seed)
        self.updates = 0
        self.recorded = 0

    def __len__(self) -> int:
        return len(self.slot)

    def _weight(self, i: int) -> float:
        """Current stored weight of slot i, brought to the current epoch."""
        e = self.epoch[i]
        cur = len(self.shifts) - 1
        u = self.u[i]
        if e != cur:
            u *= math.exp(-(self.shifts[cur] - self.shifts[e]))
            self.u[i] = u
            self.epoch[i] = cur
        return u

    def _rebase(self, expo: float) -> None:
        # Scale every weight by e^{-expo}: U' = U e^{-c}, V' = e^{-c}(V - c U), exactly.
        f = math.exp(-expo)
        U, V = self.U.s, self.V.s
        self.U.set(U * f)
        self.V.set((V - expo * U) * f)
        self.shifts.append(self.shifts[-1] + expo)
        self.base += expo / self.lam

    def update(self, key: Hashable, now: float | None = None, weight: float = 1.0) -> None:
        """Record one access to `key` at time `now` (default: one tick per access)."""
        self.updates += 1
        if now is None:
            self.clock += 1.0
            now = self.clock
        if self.sample_low < 1.0 and self.bits() < self.low_bits:
            if self._rng.random() >= self.sample_low:
                return
            weight /= self.sample_low
        self.recorded += 1
        expo = self.lam * (now - self.base)
        if expo > _REBASE_AT:
            self._rebase(expo)
            expo = 0.0
        x = weight * math.exp(expo)
        i = self.slot.get(key)
        if i is None:
            i = len(self.slot)
            self.slot[key] = i
            self.u.append(0.0)
            self.epoch.append(len(self.shifts) - 1)
            u = 0.0
        elif self.epoch[i] == len(self.shifts) - 1:
            u = self.u[i]  # same epoch: no rescaling
        else:
            u = self._weight(i)
        new = u + x
        dv = (u * math.log1p(x / u) if u > 0 else 0.0) + x * math.log(new)
        self.u[i] = new
        # Kahan additions inlined (this runs once per tracked access).
        K = self.U
        y = x - K.c
        t = K.s + y
        K.c = (t - K.s) - y
        K.s = t
        K = self.V
        y = dv - K.c
        t = K.s + y
        K.c = (t - K.s) - y
        K.s = t

    def entropy(self) -> float:
        """Current entropy in nats (0 for no accesses)."""
        U = self.U.s
        if U <= 0:
            return 0.0
        return max(0.0, math.log(U) - self.V.s / U)

    def bits(self) -> float:
        """Current entropy in bits (0 for no accesses)."""
        return self.entropy() / LN2

    def samples(self) -> float:
        """The decayed number of accesses recorded (each weighs 1 now).

        About their count early on, the window's length (half-life / ln 2) in steady state."""
        return self.U.s / math.exp(self.lam * (self.clock - self.base))

    def entropy_from_scratch(self) -> float:
        """The same quantity from all stored weights (O(n), exact sums): the reference."""
        n = len(self.slot)
        for i in range(n):
            self._weight(i)
        u = np.frombuffer(self.u, dtype=np.float64)[:n]
        u = u[u > 0]
        U = math.fsum(u.tolist())
        if U <= 0:
            return 0.0
        return max(0.0, math.log(U) - math.fsum((u * np.log(u)).tolist()) / U)

    def probability(self, key: Hashable) -> float:
        """The decayed share of the accesses that went to `key` (0 for a key not seen)."""
        i = self.slot.get(key)
        return self._weight(i) / self.U.s if i is not None and self.U.s > 0 else 0.0

    def array_bytes(self) -> int:
        """Bytes of the per-key weight and epoch arrays."""
        return len(self.u) * self.u.itemsize + len(self.epoch) * self.epoch.itemsize


def shannon_bits(counts: np.ndarray) -> float:
    """Plain Shannon entropy (bits) of a count vector."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    if c.size == 0:
        return 0.0
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())
