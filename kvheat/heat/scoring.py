"""Heat scores: the fused sigmoid-gated score (§2.3), decayed counts, LRU-K history,
the chunk/session hotness counter (§2.5) and the entropy regime (§2.1)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .decay import log_add_exp


def fused_score(entropy: float | NDArray[np.float64], ts_norm: float | NDArray[np.float64],
                alpha: float = 2.0, beta: float = 0.5) -> float | NDArray[np.float64]:
    """SPEC §2.3 as written: gate = σ(-α(H - β)); score = gate·ts + (1 - gate)(1 - H).

    `entropy` and `ts_norm` are both normalised to [0, 1]; the result is in [0, 1]. High
    entropy shuts the recency term and favours low-entropy (predictable) keys."""
    h = np.asarray(entropy, dtype=np.float64)
    ts = np.asarray(ts_norm, dtype=np.float64)
    if np.any((h < 0) | (h > 1)) or np.any((ts < 0) | (ts > 1)):
        raise ValueError("entropy and ts_norm must lie in [0, 1]")
    gate = 1.0 / (1.0 + np.exp(alpha * (h - beta)))
    out = gate * ts + (1.0 - gate) * (1.0 - h)
    return float(out) if out.ndim == 0 else out


def decayed_log_count(prev_log: float | None, now: float, lam: float) -> float:
    """Exponentially decayed access count kept in log space with a growing base:
    key = ln Σ e^{λ t_i}. Comparing keys at any common time compares decayed counts, so the
    key never needs refreshing while the block is idle (LRFU, Lee et al. 2001)."""
    x = lam * now
    return x if prev_log is None else log_add_exp(prev_log, x)


class LRUKHistory:
    """The last K access times of a key (LRU-K, O'Neil et al.): backward K-distance."""

    __slots__ = ("k", "times")

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError("K must be >= 1")
        self.k = k
        self.times: list[float] = []

    def record(self, now: float) -> None:
        self.times.append(now)
        if len(self.times) > self.k:
            del self.times[0]

    def kth_time(self) -> float:
        """Time of the K-th most recent access; -inf when fewer than K (evicted first)."""
        return self.times[0] if len(self.times) == self.k else -math.inf


class HotnessCounter:
    """Per-chunk or per-session heat with a per-second decay factor (§2.5).

    heat(t) = Σ decay^(t - t_i). The seed's 0.995/s halves in ln2/ln(1/0.995) ≈ 138 s (it
    says 128 s). Accesses less than `dedup_s` apart count once (the seed's window dedup).
    """

    def __init__(self, decay_per_s: float = 0.995, dedup_s: float = 0.0) -> None:
        if not 0 < decay_per_s < 1:
            raise ValueError("decay_per_s must be in (0, 1)")
        self.ln_decay = math.log(decay_per_s)
        self.dedup_s = dedup_s
        self.heat_at: dict[Hashable, tuple[float, float]] = {}  # key -> (heat, time)

    def half_life(self) -> float:
        return math.log(0.5) / self.ln_decay

    def hit(self, key: Hashable, now: float, weight: float = 1.0) -> float:
        h, t = self.heat_at.get(key, (0.0, now))
        if now < t:
            raise ValueError("time went backwards")
        h *= math.exp(self.ln_decay * (now - t))
        if not (key in self.heat_at and now - t < self.dedup_s):
            h += weight
        self.heat_at[key] = (h, now)
        return h

    def heat(self, key: Hashable, now: float) -> float:
        h, t = self.heat_at.get(key, (0.0, now))
        return h * math.exp(self.ln_decay * max(0.0, now - t))

    def hottest(self, now: float, n: int) -> list[tuple[Hashable, float]]:
        items = [(k, self.heat(k, now)) for k in self.heat_at]
        items.sort(key=lambda kv: kv[1], reverse=True)
        return items[:n]

    def forget_below(self, now: float, threshold: float) -> int:
        """Drop keys whose heat fell under `threshold`; returns how many (bounds memory)."""
        cold = [k for k in self.heat_at if self.heat(k, now) < threshold]
        for k in cold:
            del self.heat_at[k]
        return len(cold)


LOW, MID, HIGH = "low", "mid", "high"


@dataclass(slots=True, frozen=True)
class Regime:
    """Entropy tiers of §2.1 (bits): below `low` pin and prewarm the hottest prefixes;
    between: LRU-K with entropy-aware eviction; from `high` on: do not admit one-off
    suffixes."""

    low: float = 1.0
    high: float = 8.0

    def classify(self, bits: float) -> str:
        if bits < self.low:
            return LOW
        return MID if bits < self.high else HIGH
