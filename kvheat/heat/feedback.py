"""What KVHeat adapts to while it runs: the half-life follows the measured reuse gap (times
a multiple that itself follows the victims that come back, and optionally the online
tuner), the entropy regime switches the admission penalty and root pinning, and the
optional drift detector reports stale heat. docs/heat.md ("Online tuning and drift") has
the measurements.
"""

from __future__ import annotations

import math

from ..cache.node import Node
from .counts import HeatClock
from .drift import DriftDetector
from .entropy import LN2, EntropyTracker
from .heap import BlockHeap
from .penalties import Penalties
from .regime import MID, Regime
from .reuse import ReuseGapEstimator
from .tuning import OnlineTuner

# log2 bounds of the multiple under `adapt_mult`: a quarter to eight reuse gaps.
MULT_LO, MULT_HI = -2.0, 3.0


class Feedback:
    """KVHeat's adaptation of its half-life, penalties and regime to the traffic.

    It sets the clock's half-life, the penalties' scale and regime flags, and re-keys the
    heap when the keys' order changes."""

    def __init__(self, clock: HeatClock, penalties: Penalties, heap: BlockHeap,
                 gaps: ReuseGapEstimator, half_life: float | None, reuse_mult: float,
                 regime: bool, tune: bool, drift: bool, entropy_half_life: float,
                 entropy_sample: int, drift_window: int, drift_threshold: float,
                 adapt_mult: bool, regime_warmup: bool = False) -> None:
        self.clock, self.penalties, self.heap, self.gaps = clock, penalties, heap, gaps
        self.capacity = 0
        self.fixed_half_life = half_life
        self.reuse_mult = reuse_mult
        self.base_reuse_mult = reuse_mult
        # With `adapt_mult` the multiple follows the victims that come back
        # (`victim_returned`); its step is set at `bind`, when the capacity is known.
        self.adapt_mult = adapt_mult
        self.mult_log = math.log2(reuse_mult)
        self.keyed_log = self.mult_log  # log2 of the multiple the heap is keyed with
        self.mult_step = 0.0  # set at bind: (MULT_HI − MULT_LO) / capacity
        # The median victim's log2 heat at its last access, and the spread its step
        # follows, over about `horizon` evictions (the ghost history's length, at bind).
        self.victim_median = 0.0
        self.victim_spread = 0.0
        self.horizon = 1
        self.rekey_at = 0  # eviction count before which the multiple is not re-keyed
        self.entropy_sample = entropy_sample
        self.entropy_n = entropy_sample - 1  # the first access is recorded
        self.use_regime = regime
        self.regime = Regime()
        self.mode = MID
        # The entropy window counts depth-1 accesses (about one per request), not seconds.
        self.tracker = EntropyTracker(entropy_half_life) if (regime or drift) else None
        # The entropy of all the traffic a router spreads over this cache and others
        # (`set_cluster_entropy`): the regime reads it, not this cache's own share of the
        # keys, for one entropy window of depth-1 accesses after each report.
        self.cluster_bits: float | None = None
        self.cluster_left = 0
        self.cluster_window = max(1, round(entropy_half_life))
        self.tuner = OnlineTuner(reuse_mult, reuse_mult / 8, reuse_mult * 8) if tune else None
        self.detector = (DriftDetector(drift_window, drift_threshold, drift_window // 4)
                         if drift else None)
        self.watch_keys = regime or drift  # the entropy regime / drift watch depth-1 keys
        self.regime_rekeys = 0
        # Read the entropy against its sample count (`Regime.classify`): a warm-up whose
        # keys are nearly all distinct is already high.
        self.regime_warmup = regime_warmup
        self._set_mode(MID)

    def bind(self, capacity_blocks: int, horizon: int) -> None:
        """Size the feedback for a cache of `capacity_blocks`; medians over `horizon` victims."""
        self.capacity = capacity_blocks
        self.horizon = max(1, horizon)
        self.mult_step = (MULT_HI - MULT_LO) / max(capacity_blocks, 1)

    # -- the half-life and its multiple ----------------------------------------------
    def reuse_gap_moved(self) -> None:
        """Follow a moved reuse-gap estimate, if the half-life it implies moved enough.

        That is more than a quarter octave away; each change re-keys the heap once."""
        est = self.gaps.estimate
        if est is None:
            return
        mult = self.tuner.value if self.tuner is not None else self.reuse_mult
        # Floor: keys are sums of 2^(v/half-life); ages beyond ~1000 half-lives underflow
        # to 0 and lose their order, so the half-life stays above 1/64 of the cache's size
        # (evicted blocks are younger than ~16 cache sizes of traffic).
        hl = max(1.0, self.capacity / 64, mult * est)
        if abs(math.log2(hl / self.clock.half_life)) > 0.25:
            self.clock.set_half_life(hl)

    def victim_heat(self, m: float, gen: int, last: float, n_ev: int) -> None:
        """Take the `n_ev`-th victim's count `m` into the median victim's heat.

        The count is of generation `gen`, last access `last`. The median is followed by
        stochastic approximation over about `horizon` evictions, so that returns of a random
        sample of victims step up and down equally often, whatever the spread's skew."""
        # (`HeatClock.log2_at_last`, written out: this runs per eviction)
        base, lam = self.clock.gens[gen]
        x = math.log2(m) - lam * (last - base) / LN2
        if n_ev <= 1:
            self.victim_median = x
            return
        d = x - self.victim_median
        h = self.horizon
        spread = self.victim_spread
        spread += ((d if d > 0 else -d) - spread) / (n_ev if n_ev < h else h)
        self.victim_spread = spread
        self.victim_median += spread / 32 if d > 0 else -spread / 32

    def victim_returned(self, m: float, gen: int, v: float, evictions: int) -> None:
        """Move the multiple on a victim that came back: hotter asks for longer, colder for shorter.

        One hotter than the median victim (both by heat at the last access) asks for more
        frequency (a longer multiple), a colder one for more recency. At a balanced
        multiple, returns come from both halves equally often."""
        if m <= 0:
            return
        base, lam = self.clock.gens[gen]  # (`HeatClock.log2_at_last`, written out)
        d = (math.log2(m) - lam * (v - base) / LN2) - self.victim_median
        x = self.mult_log + (self.mult_step if d > 0 else -self.mult_step)
        self.mult_log = x = MULT_HI if x > MULT_HI else MULT_LO if x < MULT_LO else x
        # Re-keying costs O(cached blocks): at most once per cache turnover (capacity
        # evictions) keeps it O(1) per eviction however the multiple wanders.
        if abs(x - self.keyed_log) > 0.25 and evictions >= self.rekey_at:
            self.rekey_at = evictions + self.capacity
            self.set_mult(2.0 ** x)

    def set_mult(self, mult: float) -> None:
        """Set a new multiple of the reuse gap, and re-key the heap once.

        The penalties, stated in half-lives at the starting multiple, keep their length in
        reuse gaps."""
        self.reuse_mult = mult
        self.keyed_log = math.log2(mult)
        self.penalties.scale = self.base_reuse_mult / mult
        self.penalties.factors()
        hl = self.clock.half_life
        self.reuse_gap_moved()
        if self.clock.half_life == hl:
            self.heap.rekey()

    # -- the tuner, the entropy regime and drift -------------------------------------
    def observe(self, b: Node, hit: bool) -> bool:
        """Feed one access to the optional tuner, entropy regime and drift detector.

        True when the detector saw drift."""
        if self.tuner is not None and self.tuner.record(hit):
            if self.fixed_half_life is None:
                self.reuse_gap_moved()
            else:
                self.clock.set_half_life(self.tuner.value / self.reuse_mult * self.fixed_half_life)
        if b.depth == 1:  # the key right under a root names a conversation or document
            if self.tracker is not None:
                self.tracker.update(b.key)
                # The regime is a coarse, slow signal: re-read it every
                # `entropy_sample`-th update only (sampling the updates themselves
                # would see fewer distinct keys and bias the entropy down).
                self.entropy_n += 1
                if self.entropy_n >= self.entropy_sample or self.cluster_left > 0:
                    self.entropy_n = 0
                    bits = self.tracker.bits()
                    if self.cluster_left > 0:
                        # a shard's keys carry at most the whole traffic's entropy: the
                        # cluster's reading raises this cache's, never lowers it
                        self.cluster_left -= 1
                        bits = max(bits, self.cluster_bits or 0.0)
                    mode = self.regime.classify(
                        bits, self.tracker.samples() if self.regime_warmup else math.inf)
                    if mode != self.mode:
                        self._set_mode(mode)
            if self.detector is not None and self.detector.observe(b.key):
                return True
        return False

    def set_cluster_entropy(self, bits: float) -> None:
        """Take the entropy (bits) of the keys under the roots over all the cluster's traffic.

        That is all the traffic a router spreads across this cache and its peers, as one
        cache of all of it would measure.

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
        self.cluster_left = self.cluster_window
        mode = self.regime.classify(max(self.tracker.bits(), self.cluster_bits))
        if mode != self.mode:
            self._set_mode(mode)

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        if self.penalties.follow_regime(mode if self.use_regime else MID):
            self.regime_rekeys += 1
            self.heap.rekey()
