"""What KVHeat adapts to while it runs: the half-life follows the measured reuse gap (and,
optionally, the online tuner), the entropy regime switches the admission penalty and root
pinning, and the optional drift detector drops stale heat. docs/heat.md ("Online tuning and
drift") has the measurements.
"""

from __future__ import annotations

import math

from ..cache.block import Block
from .drift import DriftDetector
from .entropy import LN2, EntropyTracker
from .penalties import ONE_OFF, HeatPenalties
from .regime import HIGH, LOW, Regime
from .tuning import OnlineTuner

# log2 bounds of the multiple under `adapt_mult`: a quarter to eight reuse gaps.
MULT_LO, MULT_HI = -2.0, 3.0


class HeatFeedback(HeatPenalties):
    def _init_feedback(self, reuse_mult: float, regime: bool, tune: bool, drift: bool,
                       entropy_half_life: float, entropy_sample: int, drift_window: int,
                       drift_threshold: float, adapt_mult: bool = False) -> None:
        self.reuse_mult = reuse_mult
        self.base_reuse_mult = reuse_mult
        # With `adapt_mult` the multiple follows the victims that come back (ghost hits,
        # `_ghost_feedback`); its step is set at `bind`, when the capacity is known.
        self.adapt_mult = adapt_mult
        self._mult_log = math.log2(reuse_mult)
        self._keyed_log = self._mult_log  # log2 of the multiple the heap is keyed with
        self._mult_step = 0.0  # set at bind: (MULT_HI − MULT_LO) / capacity
        self._victim_heat = 0.0
        self._victim_spread = 0.0
        self._rekey_at = 0  # eviction count before which the multiple is not re-keyed
        self.entropy_sample = entropy_sample
        self._entropy_n = entropy_sample - 1  # the first access is recorded
        self.use_regime = regime
        self.regime = Regime()
        self.mode = "mid"
        # The entropy window counts depth-1 accesses (about one per request), not seconds.
        self.tracker = EntropyTracker(entropy_half_life) if (regime or drift) else None
        # The entropy of all the traffic a router spreads over this cache and others
        # (`set_cluster_entropy`): the regime reads it, not this cache's own share of the
        # keys, for one entropy window of depth-1 accesses after each report.
        self.cluster_bits: float | None = None
        self._cluster_left = 0
        self._cluster_window = max(1, round(entropy_half_life))
        self.tuner = OnlineTuner(reuse_mult, reuse_mult / 8, reuse_mult * 8) if tune else None
        self.detector = DriftDetector(drift_window, drift_threshold, drift_window // 4) if drift else None
        self._feedback = regime or drift  # entropy regime / drift watch depth-1 keys
        self._set_mode("mid")

    def _ghost_feedback(self, m: float, gen: int, v: float) -> None:
        """A victim came back: one hotter than the median victim (both by heat at the last
        access) asks for more frequency (a longer multiple), a colder one for more
        recency. At a balanced multiple, returns come from both halves equally often."""
        if m <= 0:
            return
        base, lam = self.gens[gen]
        d = math.log2(m) - lam * (v - base) / LN2 - self._victim_heat
        x = self._mult_log + (self._mult_step if d > 0 else -self._mult_step)
        self._mult_log = x = MULT_HI if x > MULT_HI else MULT_LO if x < MULT_LO else x
        # Re-keying costs O(cached blocks): at most once per cache turnover (capacity
        # evictions) keeps it O(1) per eviction however the multiple wanders.
        if abs(x - self._keyed_log) > 0.25 and self.evictions >= self._rekey_at:
            self._rekey_at = self.evictions + self.capacity
            self._set_mult(2.0 ** x)

    def _set_mult(self, mult: float) -> None:
        """A new multiple: the penalties, stated in half-lives at the starting multiple,
        keep their length in reuse gaps, and the heap is re-keyed once."""
        self.reuse_mult = mult
        self._keyed_log = math.log2(mult)
        self.penalty_scale = self.base_reuse_mult / mult
        self._factors()
        hl = self.half_life
        self._measured_half_life()
        if self.half_life == hl:
            self._rekey()

    def _measured_half_life(self) -> None:
        """The reuse-gap estimate moved: follow it when the half-life it implies is more
        than a quarter octave away (each change re-keys the heap once)."""
        est = self.gaps.estimate
        if est is None:
            return
        mult = self.tuner.value if self.tuner is not None else self.reuse_mult
        # Floor: keys are sums of 2^(v/half-life); ages beyond ~1000 half-lives underflow
        # to 0 and lose their order, so the half-life stays above 1/64 of the cache's size
        # (evicted blocks are younger than ~16 cache sizes of traffic).
        hl = max(1.0, self.capacity / 64, mult * est)
        if abs(math.log2(hl / self.half_life)) > 0.25:
            self._set_half_life(hl)

    def _observe(self, b: Block, now: float, hit: bool) -> None:
        """Feedback for the optional tuner, entropy regime and drift detector."""
        if self.tuner is not None and self.tuner.record(hit):
            if self.fixed_half_life is None:
                self._measured_half_life()
            else:
                self._set_half_life(self.tuner.value / self.reuse_mult * self.fixed_half_life)
        if b.depth == 1:  # the key right under a root names a conversation or document
            if self.tracker is not None:
                self.tracker.update(b.key)
                # The regime is a coarse, slow signal: re-read it every
                # `entropy_sample`-th update only (sampling the updates themselves
                # would see fewer distinct keys and bias the entropy down).
                self._entropy_n += 1
                if self._entropy_n >= self.entropy_sample or self._cluster_left > 0:
                    self._entropy_n = 0
                    U = self.tracker.U.s  # entropy() inlined: H = ln U − V/U
                    bits = max(0.0, math.log(U) - self.tracker.V.s / U) / LN2 if U > 0 else 0.0
                    if self._cluster_left > 0:
                        # a shard's keys carry at most the whole traffic's entropy: the
                        # cluster's reading raises this cache's, never lowers it
                        self._cluster_left -= 1
                        bits = max(bits, self.cluster_bits or 0.0)
                    mode = self.regime.classify(bits)
                    if mode != self.mode:
                        self._set_mode(mode)
            if self.detector is not None and self.detector.observe(b.key):
                self._on_drift()

    def set_cluster_entropy(self, bits: float) -> None:
        """The entropy (bits) of the keys under the roots over all the traffic a router
        spreads across this cache and its peers, as one cache of all of it would measure.

        A router that keeps each prefix on one replica hands each cache a shard of the
        keys, log2(replicas) bits fewer than the whole: a replica of a high-entropy
        workload reads as middling and stops charging first-seen blocks, which one cache
        of all the traffic would charge (docs/cluster.md). For the next entropy window of
        this cache's depth-1 accesses the regime reads the larger of `bits` and its own
        entropy (a router that has just started, and read few keys, cannot lower it),
        then its own alone, so a router that stops reporting stops steering it.
        """
        if not math.isfinite(bits) or bits < 0:
            raise ValueError("cluster entropy must be a finite number of bits >= 0")
        if self.tracker is None or not self.use_regime:
            return
        self.cluster_bits = float(bits)
        self._cluster_left = self._cluster_window
        mode = self.regime.classify(max(self.tracker.bits(), self.cluster_bits))
        if mode != self.mode:
            self._set_mode(mode)

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        on = self.use_regime
        self._new_flags = ONE_OFF if on and mode == HIGH else 0
        self._pin_roots = on and mode == LOW

    def _on_drift(self) -> None:
        """A few new prefixes took over: the heat the old ones built up is stale and would
        hold them for ln(count) half-lives, so every count drops to at most one access
        and the ghost history is forgotten (O(cached blocks), once per drift)."""
        self._cap_counts_at_one()
