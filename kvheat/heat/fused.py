"""`fused`: sampled eviction by the fused sigmoid-gated score of entropy and recency
(docs/heat.md, "Fused score")."""

from __future__ import annotations

import math
import random

import numpy as np
from numpy.typing import NDArray

from ..cache.eviction import EvictionPolicy, register_policy
from ..cache.node import Node


def fused_score(entropy: float | NDArray[np.float64], ts_norm: float | NDArray[np.float64],
                alpha: float = 2.0, beta: float = 0.5) -> float | NDArray[np.float64]:
    """gate = σ(-α(H - β)); score = gate·ts + (1 - gate)(1 - H).

    `entropy` and `ts_norm` are both normalised to [0, 1]; the result is in [0, 1]. High
    entropy shuts the recency term and favours low-entropy (predictable) keys."""
    h = np.asarray(entropy, dtype=np.float64)
    ts = np.asarray(ts_norm, dtype=np.float64)
    if np.any((h < 0) | (h > 1)) or np.any((ts < 0) | (ts > 1)):
        raise ValueError("entropy and ts_norm must lie in [0, 1]")
    gate = 1.0 / (1.0 + np.exp(alpha * (h - beta)))
    out = gate * ts + (1.0 - gate) * (1.0 - h)
    return float(out) if out.ndim == 0 else out


def _fused_scalar(h: float, ts: float, alpha: float, beta: float) -> float:
    """`fused_score` for one pair of floats (no numpy on the eviction path)."""
    gate = 1.0 / (1.0 + math.exp(alpha * (h - beta)))
    return gate * ts + (1.0 - gate) * (1.0 - h)


@register_policy("fused")
class Fused(EvictionPolicy):
    """Sampled eviction by the fused score of entropy and recency.

    Among `sample` random evictable leaves evict the lowest fused_score(H_b, ts_b), where
    H_b is the block's self-information -log2 p(b) normalised by log2(#blocks) (a rarely
    used block has high entropy) and ts_b its recency normalised over the sample. `slot`
    maps a candidate to its index in `cands`; `freq` counts a block's accesses."""

    name = "fused"

    def __init__(self, sample: int = 8, alpha: float = 2.0, beta: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        self.sample = sample
        self.alpha, self.beta = alpha, beta
        self.cands: list[Node] = []
        self.slot: dict[Node, int] = {}
        self.total = 0
        self.rng = random.Random(seed)

    def _add(self, b: Node) -> None:
        if b not in self.slot and b.ref_cnt == 0 and b.num_children == 0:
            self.slot[b] = len(self.cands)
            self.cands.append(b)

    def _drop(self, b: Node) -> None:
        i = self.slot.pop(b, None)
        if i is None:
            return
        last = self.cands.pop()
        if last is not b:
            self.cands[i] = last
            self.slot[last] = i

    def on_insert(self, b: Node, now: float) -> None:
        b.freq = 1
        self.slot.pop(b, None)
        self.total += 1

    def on_hit(self, b: Node, now: float) -> None:
        b.freq += 1
        self.total += 1

    def on_acquire(self, b: Node) -> None:
        self._drop(b)

    def on_release(self, b: Node, now: float) -> None:
        self._add(b)

    def on_leaf(self, b: Node) -> None:
        self._add(b)

    def victim(self) -> Node | None:
        c = self.cands
        if not c:
            return None
        picks = [c[self.rng.randrange(len(c))] for _ in range(min(self.sample, len(c)))]
        log_n = math.log2(max(self.total, 2))
        oldest = min(p.last_access for p in picks)
        span = max(max(p.last_access for p in picks) - oldest, 1e-9)
        best, best_score = picks[0], math.inf
        for p in picks:
            h = min(1.0, max(0.0, -math.log2(p.freq / max(self.total, 1)) / log_n))
            s = _fused_scalar(h, (p.last_access - oldest) / span, self.alpha, self.beta)
            if s < best_score:
                best, best_score = p, s
        self._drop(best)
        return best

    def on_evict(self, b: Node) -> None:
        self.slot.pop(b, None)
