"""`kvheat`: the default eviction policy, decayed-frequency heat on the cache's own clock.

A block's heat is its exponentially decayed access count on a virtual clock (counts.py),
times its penalty factors (penalties.py), adapted while it runs (feedback.py); the coldest
evictable leaf goes first (heap.py). The class below wires the cache's hooks to those
parts, with the per-access work inlined: it is the hot path of every replay and server.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

from ..cache.block import Block
from ..cache.policy import register_policy
from .counts import HeatRecord
from .entropy import LN2
from .feedback import MULT_HI, MULT_LO, HeatFeedback
from .penalties import EXTENSION, FRESH, PINNED


@register_policy("kvheat")
class KVHeat(HeatFeedback):
    """Decayed-frequency heat with history, suffix demotion and optional adaptation.

    The half-life is `reuse_mult` times the workload's typical reuse gap, measured online
    (`ReuseGapEstimator`), unless `half_life` fixes it (in block accesses); every penalty
    is a number of half-lives. Each block's `rec` is its `HeatRecord`.
    """

    name = "kvheat"

    # Every default is dimensionless (a multiple of the learned half-life, a count of
    # depth-1 accesses for the entropy window, bits for the regime): docs/heat.md has the
    # measurements behind each, at every time scale and capacity.
    def __init__(self, half_life: float | None = None, reuse_mult: float = 1.0,
                 reuse_quantile: float = 0.5, ghost: float = 8.0, tail_penalty: float = 6.67,
                 regime: bool = True, admit_penalty: float = 1.6, pin_bonus: float = 4.0,
                 tune: bool = False, drift: bool = False, entropy_half_life: float = 1024.0,
                 drift_window: int = 2048, drift_threshold: float = 1.0,
                 extension_penalty: float = 2.67, adapt_extension: bool = True,
                 max_count: float = math.inf, entropy_sample: int = 1,
                 penalty_fade: float = 2.0, adapt_mult: bool = True) -> None:
        super().__init__()
        if entropy_sample < 1:
            raise ValueError("entropy_sample must be >= 1")
        if half_life is not None and half_life <= 0:
            raise ValueError("half_life must be positive (block accesses)")
        if reuse_mult <= 0:
            raise ValueError("reuse_mult must be positive")
        self._init_counts(half_life, reuse_quantile, ghost, max_count)
        self._init_penalties(tail_penalty, admit_penalty, pin_bonus, extension_penalty,
                             adapt_extension, penalty_fade)
        self._init_feedback(reuse_mult, regime, tune, drift, entropy_half_life, entropy_sample,
                            drift_window, drift_threshold,
                            adapt_mult and half_life is None and not tune)
        self.ghost_hits = 0

    def on_insert(self, b: Block, now: float) -> None:
        # Runs once per block filled: flags precomputed, few attribute lookups.
        if now != self._t:
            self._advance(now)
        self._acc += 1
        w = self._w
        n = b.num_tokens
        bs = self.block_size
        if n > bs:
            self.block_size = bs = n
        key: bytes = b.key  # type: ignore[assignment]  # set: the block is cached
        if key[0] < self._sample_below and self.gaps.observe(key, self._v):
            self._measured_half_life()
            w = self._w
        r: HeatRecord | None = b.rec
        if r is None:  # the block's first insert: its record is reused from then on
            r = b.rec = HeatRecord()
        g = self.ghost.pop(key, None)
        if g is None and self.ghost_old:
            g = self.ghost_old.pop(key, None)
        if g is None:
            st = self._new_flags
            p = b.parent
            if p is not None and self._extensions:
                # A new block extending a prefix known before this request (hit now, or
                # back from the ghost: count > 1) below depth 0 is an appended suffix; a
                # new parent passes its flag on down the chain.
                pr: HeatRecord = p.rec
                if p.inserted_at != now or pr.count != w:
                    if p.depth >= 1:
                        st |= EXTENSION
                else:
                    st |= pr.flags & EXTENSION
            if n == bs:
                # Inserted counts are added to `reuse` in batches of 64 (exact: the
                # smoothing only applies at the batch end).
                if st & EXTENSION:
                    self._ext_seen += 1
                else:
                    st |= FRESH
                self._first_seen += 1
                if self._first_seen >= 64:
                    self._update_penalties()
            r.count = w
        else:
            self.ghost_hits += 1
            m, gen, v, st = g
            if self.adapt_mult:
                self._ghost_feedback(m, gen, v)
                w = self._w
            if gen != self.gen:
                m = self._convert(m, gen, v)
            r.count = m + w
            if st & (EXTENSION | FRESH):
                self.reuse[0 if st & EXTENSION else 2] += 1.0
            st = 0
        if self._pin_roots and b.depth == 0:
            st |= PINNED
        r.gen = self.gen
        r.last = self._v
        r.flags = st
        if (b.depth == 1 and self._feedback) or self.tuner is not None:
            self._observe(b, now, False)

    def on_hit(self, b: Block, now: float) -> None:
        if now != self._t:
            self._advance(now)
        self._acc += 1
        key: bytes = b.key  # type: ignore[assignment]  # set: the block is cached
        if key[0] < self._sample_below and self.gaps.observe(key, self._v):
            self._measured_half_life()
        r: HeatRecord = b.rec
        if r.gen != self.gen:
            self._rescale(r)
        m = r.count + self._w
        r.count = m if m < self._cap else self._cap
        r.last = self._v
        st = r.flags
        if st > PINNED:
            if st & (EXTENSION | FRESH):
                self.reuse[0 if st & EXTENSION else 2] += 1.0
            r.flags = st & PINNED  # seen again: no longer a one-off
        if (b.depth == 1 and self._feedback) or self.tuner is not None:
            self._observe(b, now, True)

    def on_hit_all(self, blocks: Iterable[Block], now: float) -> None:
        """`on_hit` of each block in order, at one timestamp, in one call (a request's
        reused blocks): the same counts, flags and feedback, lookups hoisted."""
        if now != self._t:
            self._advance(now)
        gaps, below = self.gaps, self._sample_below
        observe = self._observe if self._feedback or self.tuner is not None else None
        tuned = self.tuner is not None
        reuse = self.reuse
        for b in blocks:
            self._acc += 1
            key: bytes = b.key  # type: ignore[assignment]  # set: the block is cached
            if key[0] < below and gaps.observe(key, self._v):
                self._measured_half_life()  # may start a generation: read them per block
            r: HeatRecord = b.rec
            if r.gen != self.gen:
                self._rescale(r)
            m = r.count + self._w
            cap = self._cap
            r.count = m if m < cap else cap
            r.last = self._v
            st = r.flags
            if st > PINNED:
                if st & (EXTENSION | FRESH):
                    reuse[0 if st & EXTENSION else 2] += 1.0
                r.flags = st & PINNED  # seen again: no longer a one-off
            if observe is not None and (b.depth == 1 or tuned):
                observe(b, now, True)

    def on_release(self, b: Block, now: float) -> None:
        # _push with the key computed inline: this runs once per block access.
        b.parked = None
        r: HeatRecord = b.rec
        if r.gen != self.gen:
            self._rescale(r)
        k = r.count * self._flag[r.flags]
        if b.num_tokens < self.block_size:
            k *= self._tail
        if k == self._last_key:  # the same key as the previous push: same bucket
            bucket = self.owner.get(self._last_slot)
            if bucket is not None:
                bucket.append(b)
                b.heap_ver = self._last_slot
                self._entries += 1
                return
        self._push_key(b, k)

    def on_release_all(self, blocks: list[Block], now: float) -> None:
        # The cache's batched release (a request's blocks, tail-first, after their refcounts
        # changed): the same heap as `on_release` of each, without a call per block.
        self.release_all(blocks)

    def release_all(self, blocks: Iterable[Block]) -> None:
        """`on_release` of each block in order, in one call (for a caller releasing many
        at once: the loop's lookups hoisted, the push inlined; the same heap after)."""
        gen, flag, bs, tail = self.gen, self._flag, self.block_size, self._tail
        rescale, nextafter, inf, heappush = self._rescale, math.nextafter, math.inf, heapq.heappush
        owner, heap = self.owner, self.heap
        last_k, last_u = self._last_key, self._last_slot
        bucket = owner.get(last_u)  # the last push's bucket, unless victim took it since
        entries, compact_at = self._entries, self._compact_at
        for b in blocks:
            b.parked = None
            r: HeatRecord = b.rec
            if r.gen != gen:
                rescale(r)
            k = r.count * flag[r.flags]
            if b.num_tokens < bs:
                k *= tail
            if k == last_k and bucket is not None:
                bucket.append(b)
                b.heap_ver = last_u
                entries += 1
                continue
            u = k
            while u in owner:
                u = nextafter(u, inf)
            last_k = k
            last_u = u
            bucket = owner[u] = [b]
            b.heap_ver = u
            heappush(heap, u)
            entries += 1
            if entries > compact_at:
                self._last_key, self._last_slot, self._entries = last_k, last_u, entries
                self._compact()
                owner, heap, bucket = self.owner, self.heap, None
                last_k, last_u = self._last_key, self._last_slot
                entries, compact_at = self._entries, self._compact_at
        self._last_key, self._last_slot, self._entries = last_k, last_u, entries

    def on_evict(self, b: Block) -> None:
        self.on_evict_all((b,))

    def on_evict_all(self, blocks: Iterable[Block]) -> None:
        """`on_evict` of each block in order, in one call: the eviction age, the median
        victim's heat (for `_ghost_feedback`) and the ghost history, lookups hoisted."""
        acc, n_ev, age = self._acc, self.evictions, self.evict_age
        adapt = self.adapt_mult
        gens, log2, spread, med = self.gens, math.log2, self._victim_spread, self._victim_heat
        horizon = max(1, self.ghost_limit)
        ghost, limit = self.ghost, self.ghost_limit
        for b in blocks:
            r: HeatRecord = b.rec
            # EWMA over about the last 250 evictions, its start unbiased (a mean until then)
            n_ev += 1
            last = r.last
            age += (acc - last - age) / (n_ev if n_ev < 250 else 250)
            m = r.count
            if adapt and m > 0:
                # The median victim's log2 heat at its last access, by stochastic
                # approximation over about the ghost history's length: returns of a
                # random sample of victims then step up and down equally often,
                # whatever the spread's skew.
                base, lam = gens[r.gen]
                x = log2(m) - lam * (last - base) / LN2
                if n_ev <= 1:
                    med = x
                else:
                    d = x - med
                    spread += ((d if d > 0 else -d) - spread) / (n_ev if n_ev < horizon else horizon)
                    med += spread / 32 if d > 0 else -spread / 32
            ghost[b.key] = (m, r.gen, last, r.flags)  # type: ignore[index]  # set: cached
            if len(ghost) >= limit:
                self.ghost_old = ghost if limit else {}
                self.ghost = ghost = {}
        self.evictions, self.evict_age = n_ev, age
        self._victim_spread, self._victim_heat = spread, med

    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        self.ghost_limit = int(self.ghost_mult * capacity_blocks * 2 / 3)
        self._compact_at = 2 * capacity_blocks + 256
        if self.fixed_half_life is None and self.gaps.estimate is None:
            # Until the first reuse gaps are in: the cache's own size, in accesses.
            self.half_life = float(max(capacity_blocks, 1))
            self.lam = LN2 / self.half_life
            self.gens[self.gen] = (self.base, self.lam)
        self._mult_step = (MULT_HI - MULT_LO) / max(capacity_blocks, 1)

    def stats(self) -> dict[str, float]:
        out = {"half_life_accesses": self.half_life, "ghost_hits": self.ghost_hits,
               "admit_penalty": self.admit_penalty, "evict_age": self.evict_age,
               "extension_penalty": self.extension_penalty,
               "retunes": self.retunes, "reuse_mult": self.reuse_mult}
        if self.gaps.estimate is not None:
            out["reuse_gap_accesses"] = self.gaps.estimate
        if self.tracker is not None:
            out["entropy_bits"] = self.tracker.bits()
        if self._cluster_left > 0:
            out["cluster_entropy_bits"] = self.cluster_bits  # type: ignore[assignment]
        if self.detector is not None:
            out["drifts"] = self.detector.drifts
        return out
