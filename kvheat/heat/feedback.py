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


class HeatFeedback(HeatPenalties):
    def _init_feedback(self, reuse_mult: float, regime: bool, tune: bool, drift: bool,
                       entropy_half_life: float, entropy_sample: int, drift_window: int,
                       drift_threshold: float) -> None:
        self.reuse_mult = reuse_mult
        self.entropy_sample = entropy_sample
        self._entropy_n = entropy_sample - 1  # the first access is recorded
        self.use_regime = regime
        self.regime = Regime()
        self.mode = "mid"
        # The entropy window counts depth-1 accesses (about one per request), not seconds.
        self.tracker = EntropyTracker(entropy_half_life) if (regime or drift) else None
        self.tuner = OnlineTuner(reuse_mult, reuse_mult / 8, reuse_mult * 8) if tune else None
        self.detector = DriftDetector(drift_window, drift_threshold, drift_window // 4) if drift else None
        self._feedback = regime or drift  # entropy regime / drift watch depth-1 keys
        self._set_mode("mid")

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
                if self._entropy_n >= self.entropy_sample:
                    self._entropy_n = 0
                    U = self.tracker.U.s  # entropy() inlined: H = ln U − V/U
                    bits = max(0.0, math.log(U) - self.tracker.V.s / U) / LN2 if U > 0 else 0.0
                    mode = self.regime.classify(bits)
                    if mode != self.mode:
                        self._set_mode(mode)
            if self.detector is not None and self.detector.observe(b.key):
                self._on_drift()

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
