"""Load or recompute: per tier, seconds = latency + bytes / bandwidth fitted from measured
transfers (`store.TransferModel`); recompute seconds = tokens / the engine's measured
prefill speed. The longest prefix with the largest saving is loaded; a tier slower than
recompute is never used, except now and then to measure it again (one block; a memory
tier's whole leading run)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..cache.hashing import Namespace, probe_key
from .counters import TierCounters
from .loads import LoadPlan
from .store import KVStore

# Engine prefill speed in tokens/s: a number or a callable reading the live figure (None
# before the first measurement: every block is loaded then).
PrefillSpeed = float | Callable[[], float | None] | None

# The namespace probe blocks are written in: no tenant's (a tenant salt is "tenant:" or
# "group:" and a name), so no lookup ever meets one.
PROBE_NS = Namespace.of("kvheat-probe")


class LoadCost:
    """The load-or-recompute cost model of a set of lower tiers, and its calibration."""

    def __init__(self, stores: list[KVStore], block_bytes: int,
                 prefill_tokens_per_s: PrefillSpeed, remeasure_s: float,
                 counters: TierCounters) -> None:
        self.stores = stores
        self.block_bytes = block_bytes
        self.prefill_tokens_per_s = prefill_tokens_per_s  # None: always load
        # A tier judged slower than recomputing gets no reads, so its estimate would never
        # change: after this long without a read, one block is loaded anyway to measure again.
        self.remeasure_s = remeasure_s
        self.counters = counters

    def prefill_speed(self) -> float | None:
        """The engine's prefill speed in tokens/s now (None: unknown, always load)."""
        s = self.prefill_tokens_per_s
        v = s() if callable(s) else s
        return float(v) if v else None

    def estimate_load_s(self, tier: int, n_blocks: int) -> float | None:
        """Estimated seconds to load `n_blocks` from `tier` (None: not measured yet)."""
        st = self.stores[tier]
        return st.read_model.estimate(n_blocks * self.block_bytes,
                                      ops=1 if st.batched_reads else n_blocks)

    def calibrate(self, rounds: int = 3) -> dict[str, dict[str, float | None]]:
        """Time real puts and gets of probe blocks on every tier (deleted after)."""
        return {st.name: self._time(st, rounds) for st in self.stores}

    def recalibrate(self, tier: int, rounds: int = 3) -> dict[str, float | None]:
        """Forget what was measured of `tier` and time it again now.

        It changed speed since: a slow spell that ended, a fast one that did not last."""
        st = self.stores[tier]
        st.read_model.reset()
        st.write_model.reset()
        return self._time(st, rounds)

    def probe(self, tier: int) -> float | None:
        """Seconds to read back one probe block just written to `tier` (deleted after).

        None when the tier would not store it or gave back something else. The store
        records the read in its transfer model like any other."""
        st = self.stores[tier]
        key = probe_key("kvheat-probe-health")
        block = self._probe_block()
        if not st.put(key, block, PROBE_NS):
            return None
        try:
            t0 = time.perf_counter()
            got = st.get(key, PROBE_NS)
            seconds = time.perf_counter() - t0
        finally:
            st.delete(key, PROBE_NS)
        # Compared as bytes: random bits read as floats hold NaNs, which never equal.
        same = got is not None and torch.equal(_raw(got), _raw(block))
        return seconds if same else None

    def _probe_block(self) -> torch.Tensor:
        """A block's worth of random bytes (the stores time bytes; the layout is moot)."""
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 255, (self.block_bytes,), dtype=torch.uint8, generator=g)

    def _time(self, st: KVStore, rounds: int) -> dict[str, float | None]:
        probe = self._probe_block()
        # One round first whose timings are dropped: a store's first calls pay one-time
        # costs (buffers allocated, kernels dispatched for the first time) that no later
        # load does, and with a handful of samples they would decide the first loads.
        kept = [(m, list(m.samples)) for m in (st.read_model, st.write_model)]
        self._round(st, probe, "warm")
        for model, samples in kept:
            model.replace(samples)
        for r in range(rounds):
            self._round(st, probe, str(r))
        fit = st.read_model.fit()
        return {"latency_s": fit[0] if fit else None, "bandwidth_Bps": fit[1] if fit else None}

    @staticmethod
    def _round(st: KVStore, probe: torch.Tensor, tag: str) -> None:
        """Write, read back and delete one probe block, then four."""
        for n in (1, 4):
            keys = [probe_key(f"kvheat-probe-{tag}-{n}-{j}") for j in range(n)]
            stored = [k for k in keys if st.put(k, probe, PROBE_NS)]
            if stored:  # read as a load reads it (the fit prices loads)
                if st.batched_reads:
                    st.get_many(stored, PROBE_NS,
                                outs=[torch.empty_like(probe) for _ in stored])
                else:
                    for k in stored:
                        st.get(k, PROBE_NS)
            for k in stored:
                st.delete(k, PROBE_NS)

    def decide(self, plan: LoadPlan, wait: float) -> int:
        """How many of the plan's blocks to load.

        The prefix with the largest estimated saving over recomputing it (0 when no prefix saves time). `wait`: seconds a slow
        read waits behind the loaders' backlog, worth it only if it still beats
        recomputing. Sets the plan's estimates."""
        speed = self.prefill_speed()
        if speed is None:
            return len(plan.steps)
        per_tier = [0] * len(self.stores)
        tokens = 0
        best_k, best_gain, best = 0, 0.0, (0.0, 0.0)
        points: list[tuple[float, float]] = []  # (load, recompute) of each prefix
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
            points.append((load, recompute))
            if recompute - load > best_gain:
                best_k, best_gain, best = k, recompute - load, (load, recompute)
        if wait and best_k < len(plan.steps) and self._decide_no_wait(plan, speed) > best_k:
            self.counters.backlog_recomputes += 1
        if best_k == 0 and plan.steps:
            tier = plan.steps[0].tier
            st = self.stores[tier]
            if not wait and time.monotonic() - st.read_model.last_at > self.remeasure_s:
                # One block, or a memory tier's whole leading run: a read of memory is
                # never far slower than its estimate, and a batched tier's fit needs
                # samples of the sizes loads read (one block alone only measures the
                # latency, so a fit spoilt by a slow spell could never recover).
                n = 1
                if st.inline:
                    while n < len(plan.steps) and plan.steps[n].tier == tier:
                        n += 1
                best_k, best = n, points[n - 1]
                self.counters.remeasure_loads += 1
        plan.est_load_s, plan.est_recompute_s = best
        return best_k

    def _decide_no_wait(self, plan: LoadPlan, speed: float) -> int:
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


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
