"""Load or recompute: per tier, seconds = latency + bytes / bandwidth fitted from measured
transfers (`store.TransferModel`); recompute seconds = tokens / the engine's measured
prefill speed. The longest prefix with the largest saving is loaded; a tier slower than
recompute is never used, except for one block now and then to measure it again."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .counters import TierCounters
from .loads import Plan
from .store import KVStore

# Engine prefill speed in tokens/s: a number or a callable reading the live figure (None
# before the first measurement: every block is loaded then).
PrefillSpeed = float | Callable[[], float | None] | None


class LoadCost:
    """The load-or-recompute cost model of a set of lower tiers, and its calibration."""

    def __init__(self, stores: list[KVStore], block_bytes: int, block_shape: tuple[int, ...],
                 block_dtype: torch.dtype, prefill_tokens_per_s: PrefillSpeed,
                 remeasure_s: float, counters: TierCounters) -> None:
        self.stores = stores
        self.block_bytes = block_bytes
        self.block_shape = block_shape
        self.block_dtype = block_dtype
        self.prefill_tokens_per_s = prefill_tokens_per_s  # None: always load
        # A tier judged slower than recomputing gets no reads, so its estimate would never
        # change: after this long without a read, one block is loaded anyway to measure again.
        self.remeasure_s = remeasure_s
        self.counters = counters

    def prefill_speed(self) -> float | None:
        s = self.prefill_tokens_per_s
        v = s() if callable(s) else s
        return float(v) if v else None

    def estimate_load_s(self, tier: int, n_blocks: int) -> float | None:
        st = self.stores[tier]
        return st.read_model.estimate(n_blocks * self.block_bytes,
                                      ops=1 if st.pipelined else n_blocks)

    def calibrate(self, rounds: int = 3) -> dict[str, dict[str, float | None]]:
        """Time real puts and gets of probe blocks on every tier (deleted after)."""
        g = torch.Generator().manual_seed(0)
        probe = torch.randint(0, 255, (self.block_bytes,), dtype=torch.uint8, generator=g)
        probe = probe.view(self.block_dtype).view(self.block_shape)
        out: dict[str, dict[str, float | None]] = {}
        for st in self.stores:
            for r in range(rounds):
                for n in (1, 4):
                    keys = [f"kvheat-probe-{r}-{n}-{j}".encode() for j in range(n)]
                    stored = [k for k in keys if st.put(k, probe, "kvheat-probe")]
                    if stored:
                        if st.pipelined:
                            st.get_many(stored, "kvheat-probe")
                        else:
                            for k in stored:
                                st.get(k, "kvheat-probe")
                    for k in stored:
                        st.delete(k, "kvheat-probe")
            fit = st.read_model.fit()
            out[st.name] = {"latency_s": fit[0] if fit else None,
                            "bandwidth_Bps": fit[1] if fit else None}
        return out

    def decide(self, plan: Plan, wait: float) -> int:
        """How many of the plan's blocks to load: the prefix with the largest estimated
        saving over recomputing it (0 when no prefix saves time). `wait`: seconds a slow
        read waits behind the loaders' backlog, worth it only if it still beats
        recomputing. Sets the plan's estimates."""
        speed = self.prefill_speed()
        if speed is None:
            return len(plan.steps)
        per_tier = [0] * len(self.stores)
        tokens = 0
        best_k, best_gain, best = 0, 0.0, (0.0, 0.0)
        first = best
        slow = False
        for k, s in enumerate(plan.steps, 1):
            per_tier[s.tier] += 1
            tokens += s.tokens
            slow = slow or not self.stores[s.tier].inline
            load = wait if slow else 0.0
            for t, n in enumerate(per_tier):
                if n:
                    est = self.estimate_load_s(t, n)
                    load += est if est is not None else 0.0
            recompute = tokens / speed
            if k == 1:
                first = (load, recompute)
            if recompute - load > best_gain:
                best_k, best_gain, best = k, recompute - load, (load, recompute)
        if wait and best_k < len(plan.steps) and self._decide_no_wait(plan, speed) > best_k:
            self.counters.backlog_recomputes += 1
        if best_k == 0 and plan.steps:
            model = self.stores[plan.steps[0].tier].read_model
            if not wait and time.monotonic() - model.last_at > self.remeasure_s:
                best_k, best = 1, first
                self.counters.remeasure_loads += 1
        plan.est_load_s, plan.est_recompute_s = best
        return best_k

    def _decide_no_wait(self, plan: Plan, speed: float) -> int:
        """How many blocks `decide` would load with no backlog (to count the difference)."""
        per_tier = [0] * len(self.stores)
        tokens, best_k, best_gain = 0, 0, 0.0
        for k, s in enumerate(plan.steps, 1):
            per_tier[s.tier] += 1
            tokens += s.tokens
            load = sum(self.estimate_load_s(t, n) or 0.0 for t, n in enumerate(per_tier) if n)
            if tokens / speed - load > best_gain:
                best_k, best_gain = k, tokens / speed - load
        return best_k
