"""Heat-driven eviction policies the block cache runs (registered on import).

- `kvheat`: the default heat policy. A block's heat is its exponentially decayed access
  count (half-life `half_life_s`), kept against a growing base so that the eviction key
  Σe^{λ(t_i − base)} never needs refreshing while the block sits idle (LRFU); the
  coldest evictable leaf goes first (a min-heap of floats with equal-key buckets, lazy
  deletion, parking for blocks that are referenced or still have cached children). On
  top of that:
  * history: evicted blocks leave their heat in a ghost map, so a prefix that comes back
    resumes its count instead of starting cold (what makes frequency work at all when
    reuse distances exceed the cache, as in multi-turn chat);
  * one-hit suffix demotion: a partial last block (the end of a prompt, which the next
    turn extends and so re-keys) is charged `tail_penalty_s` of age;
  * the entropy regime of §2.1 (on by default): pin roots when the entropy of the keys
    under the roots is low, charge first-seen blocks an admission penalty when it is high;
  * extension demotion: a first-seen block appended to an already known prefix is
    charged a penalty learned online from how much less often such suffixes are reused
    than fresh prompts (zero where they are reused as often);
  * optional: the online tuner of §2.4 on the half-life and the drift detector of §4.2.
  docs/heat.md has the measurements behind every default.
- `lruk`: LRU-K (K=2) with retained history.
- `fused`: sampled eviction by the fused sigmoid-gated score of §2.3.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Iterable

from ..cache.block import Block, BlockQueue
from ..cache.policy import EvictionPolicy, register_policy
from .drift import DriftDetector
from .entropy import LN2, EntropyTracker
from .reuse import ReuseGapEstimator
from .scoring import HIGH, LOW, Regime
from .tuning import OnlineTuner

_PARKED = BlockQueue("parked")
# KVHeat block flags (Block.state bits); all but PINNED clear at the block's first reuse.
PINNED, ONE_OFF, EXTENSION, FRESH = 1, 2, 4, 8


class _HeapPolicy(EvictionPolicy):
    """Evict the evictable leaf with the smallest key; subclasses define `_key`.

    The heap holds bare floats (C-speed comparisons, no tuples); `owner` maps each to
    a bucket: the blocks pushed with that key, in push order. Consecutive pushes of an
    equal key (a request's blocks, inserted at one time) share one bucket and one heap
    entry; other equal keys step to the next float up. Ties thus go to the earlier push
    (the cache releases a request tail-first, so a chain's tail leaves before its head).
    An entry is live while it equals `block.heap_ver` (lazy invalidation: a newer push
    supersedes it; NaN: none)."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[float] = []
        self.owner: dict[float, list[Block]] = {}
        self._last_key = math.nan
        self._last_slot = math.nan
        self._cur: list[Block] = []  # the bucket `victim` is draining (left of heap)
        self._cur_i = 0
        self._cur_u = math.nan
        self._entries = 0  # pushes since the last compaction, plus what it kept
        self._compact_at = 1024

    def _key(self, b: Block) -> float:
        raise NotImplementedError

    def _push(self, b: Block) -> None:
        self._push_key(b, self._key(b))

    def _push_key(self, b: Block, k: float) -> None:
        owner = self.owner
        if k == self._last_key:
            bucket = owner.get(self._last_slot)
            if bucket is not None:
                bucket.append(b)
                b.heap_ver = self._last_slot
                self._entries += 1
                return
        u = k
        while u in owner:
            u = math.nextafter(u, math.inf)
        self._last_key = k
        self._last_slot = u
        owner[u] = [b]
        b.heap_ver = u
        heapq.heappush(self.heap, u)
        self._entries += 1
        if self._entries > self._compact_at:
            self._compact()

    def _park_bucket(self) -> None:
        """Return the rest of the bucket being drained to the heap (before later pushes
        of the same key)."""
        rest = self._cur[self._cur_i:]
        self._cur, self._cur_i = [], 0
        if rest:
            u = self._cur_u
            later = self.owner.get(u)
            if later is None:
                self.owner[u] = rest
                heapq.heappush(self.heap, u)
            else:
                self.owner[u] = rest + later

    def _live(self) -> list[Block]:
        self._park_bucket()
        seen: dict[int, Block] = {}
        for u, bucket in self.owner.items():
            for b in bucket:
                if u == b.heap_ver and b.key is not None:
                    seen[id(b)] = b
        return list(seen.values())

    def _rebuild(self) -> None:
        live = self._live()
        self.heap = []
        self.owner = {}
        self._last_key = math.nan
        self._entries = 0
        for b in live:
            self._push(b)

    def _compact(self) -> None:
        """Drop superseded entries (keys unchanged, so one heapify): keeps the heap, and
        the log n of every push, near the number of evictable blocks."""
        self._park_bucket()
        owner: dict[float, list[Block]] = {}
        kept = 0
        for u, bucket in self.owner.items():
            live = [b for b in bucket if u == b.heap_ver and b.key is not None]
            if live:
                owner[u] = live
                kept += len(live)
        self.owner = owner
        self.heap = heap = list(owner)
        heapq.heapify(heap)
        self._last_key = math.nan
        self._entries = kept
        self._compact_at = kept + max(kept // 2, self.capacity // 2) + 256

    # No on_acquire: a referenced block's entry is skipped (parked) by `victim`, and its
    # release pushes a fresh entry that supersedes the old one (the cache skips the call).

    def on_release(self, b: Block, now: float) -> None:
        b.parked = None
        self._push(b)

    def on_leaf(self, b: Block) -> None:
        if b.parked is not None:
            b.parked = None
            self._push(b)

    def victim(self) -> Block | None:
        heap = self.heap
        while True:
            cur, i = self._cur, self._cur_i
            if i >= len(cur):
                if not heap:
                    self._cur, self._cur_i = [], 0
                    return None
                u = heapq.heappop(heap)
                cur = self._cur = self.owner.pop(u)
                i = 0
                self._cur_u = u
            elif heap and heap[0] < self._cur_u:  # a smaller key arrived meanwhile
                self._park_bucket()
                continue
            u = self._cur_u
            n = len(cur)
            while i < n:
                b = cur[i]
                i += 1
                if u != b.heap_ver or b.key is None:
                    continue
                if b.ref_cnt or b.num_children:
                    b.parked = _PARKED
                    continue
                self._cur_i = i
                b.heap_ver = math.nan
                return b
            self._cur_i = i

    def forget(self, b: Block) -> None:
        b.heap_ver = math.nan
        b.parked = None


class _Ghost:
    """Heat of recently evicted keys, bounded (oldest dropped first)."""

    def __init__(self) -> None:
        self.d: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def put(self, key: bytes, value: tuple[float, float], limit: int) -> None:
        self.d[key] = value
        if len(self.d) > limit:
            self.d.popitem(last=False)

    def take(self, key: bytes) -> tuple[float, float] | None:
        return self.d.pop(key, None)

    def __len__(self) -> int:
        return len(self.d)


@register_policy("kvheat")
class KVHeat(_HeapPolicy):
    """Decayed-frequency heat with history, suffix demotion and optional adaptation, on the
    cache's own clock.

    Time is virtual: the number of block accesses before the current timestamp (the
    cache's `now` only tells which accesses happen together), so the same requests at any
    traffic rate make the same decisions. The half-life is `reuse_mult` times the
    workload's typical reuse gap, measured online (`ReuseGapEstimator`), unless
    `half_life` fixes it (in block accesses); every penalty is a number of half-lives.

    Per block: `meta` = Σ_i e^{λ(v_i − base)}, the decayed access count scaled by the
    common growing factor e^{λ(v − base)} (LRFU with a growing base), so a hit is one
    addition of the per-timestamp weight `_w`, idle blocks never need refreshing and keys
    of different blocks compare directly. Penalties are constant factors 2^{−penalty}.
    `next_use` = virtual time of the last access, `freq` = the generation (base, λ)
    `meta` is relative to: when the exponent nears overflow the base moves, and a new
    half-life changes λ; blocks convert lazily on their next touch, through their count at
    last access.
    """

    name = "kvheat"
    REBASE_AT = 600.0  # λ·(v − base) beyond which the base moves (e^709 overflows)

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
                 penalty_fade: float = 2.0) -> None:
        super().__init__()
        if entropy_sample < 1:
            raise ValueError("entropy_sample must be >= 1")
        if half_life is not None and half_life <= 0:
            raise ValueError("half_life must be positive (block accesses)")
        if reuse_mult <= 0:
            raise ValueError("reuse_mult must be positive")
        self.entropy_sample = entropy_sample
        self._entropy_n = entropy_sample - 1  # the first access is recorded
        self.fixed_half_life = half_life
        self.reuse_mult = reuse_mult
        self.gaps = ReuseGapEstimator(quantile=reuse_quantile) if half_life is None else None
        self._sample_below = self.gaps.threshold if self.gaps is not None else 0
        self.half_life = half_life if half_life is not None else 1024.0  # until bound/measured
        self.lam = LN2 / self.half_life
        self.base = 0.0
        self.gen = 0  # index of the current (base, λ) in `gens`
        self.gens: list[tuple[float, float]] = [(0.0, self.lam)]
        self._t = math.nan  # timestamp `_w` belongs to
        self._v = 0.0  # virtual time of `_t`: block accesses before it
        self._acc = 0  # block accesses so far
        self._w = 1.0  # e^{λ(_v − base)}: the weight of an access now
        self._cap = math.inf
        self.ghost_mult = ghost
        # History in two generations of plain dicts (O(1), no per-entry links): new
        # entries go to `ghost`; when it holds `ghost_limit` keys (2/3 of `ghost` ×
        # capacity) it becomes `ghost_old` and the older one is dropped, so the last
        # 2/3..4/3 × `ghost` × capacity evictions are kept, `ghost` × capacity on average.
        self.ghost: dict[bytes, tuple[float, int, float, int]] = {}
        self.ghost_old: dict[bytes, tuple[float, int, float, int]] = {}
        self.ghost_limit = 0
        self.tail_penalty = tail_penalty
        self.block_size = 0  # largest block seen: a smaller last block is a partial tail
        self.use_regime = regime
        self.regime = Regime()
        self.max_admit_penalty = admit_penalty
        self.admit_penalty = admit_penalty
        # The admission and extension penalties fade as the cache's eviction age (in
        # accesses) reaches `penalty_fade` typical reuse gaps: a cache that holds most
        # reuses anyway loses by being choosy about what it keeps.
        self.penalty_fade = penalty_fade
        self.evict_age = 0.0  # mean age at eviction since last access, accesses (EWMA)
        self.pin_bonus = pin_bonus
        # Extension demotion, learned (§2.4): the penalty scales with how much less often
        # appended suffixes are reused than fresh prompts, measured online (hits and ghost
        # hits of first-seen blocks), updated every 64 first-seen inserts, smoothing 0.95.
        self.max_extension_penalty = extension_penalty
        self.adapt_extension = adapt_extension
        self.extension_penalty = 0.0 if adapt_extension else extension_penalty
        self.reuse = [1.0, 4.0, 1.0, 4.0]  # extension reused, inserted; fresh reused, inserted
        self._first_seen = 0  # first-seen full blocks since the last update
        self._ext_seen = 0  # of which extensions
        # Saturating the count lets a burst that ended cool down in a few half-lives.
        self.max_count = max_count
        self.mode = "mid"
        # The entropy window counts depth-1 accesses (about one per request), not seconds.
        self.tracker = EntropyTracker(entropy_half_life) if (regime or drift) else None
        self.tuner = OnlineTuner(reuse_mult, reuse_mult / 8, reuse_mult * 8) if tune else None
        self.detector = DriftDetector(drift_window, drift_threshold, drift_window // 4) if drift else None
        self.ghost_hits = 0
        self.retunes = 0
        self._feedback = regime or drift  # entropy regime / drift watch depth-1 keys
        self._extensions = extension_penalty > 0
        self._factors()
        self._set_mode("mid")

    # -- heat ------------------------------------------------------------------------
    def _factors(self) -> None:
        """Key multipliers, precomputed: per flag combination and for a partial tail. A
        penalty of p half-lives is a factor 2^-p, whatever the half-life."""
        self._tail = 2.0 ** -self.tail_penalty
        f = []
        for st in range(16):
            s = 0.0
            if st & PINNED:
                s += self.pin_bonus
            if st & ONE_OFF:
                s -= self.admit_penalty
            if st & EXTENSION:
                s -= self.extension_penalty
            f.append(2.0 ** s)
        self._flag = f

    def _key(self, b: Block) -> float:
        if b.freq != self.gen:
            self._rescale(b)
        k = b.meta * self._flag[b.state]  # type: ignore[operator]
        return k * self._tail if b.num_tokens < self.block_size else k

    def _advance(self, now: float) -> None:
        """A new timestamp: virtual time moves to the accesses so far, and the weight of an
        access now follows (moving the base if needed)."""
        v = float(self._acc)
        x = self.lam * (v - self.base)
        if x > self.REBASE_AT:
            self._new_gen(v)
            x = 0.0
        self._t = now
        self._v = v
        self._w = w = math.exp(x)
        self._cap = self.max_count * w  # the saturated count, as a sum now

    def _rebuild(self) -> None:
        """`_HeapPolicy._rebuild` with the key, the rescale and the push inlined and one
        heapify at the end (the same buckets and slots, so the same order): this runs over
        every cached block at each new generation or half-life."""
        live = self._live()
        gen, gens, lam, base = self.gen, self.gens, self.lam, self.base
        flag, bs, tail = self._flag, self.block_size, self._tail
        exp, nextafter, inf = math.exp, math.nextafter, math.inf
        owner: dict[float, list[Block]] = {}
        last_k = last_u = math.nan
        bucket: list[Block] = []
        for b in live:
            if b.freq != gen:
                g_base, g_lam = gens[b.freq]  # type: ignore[index]
                v = b.next_use
                b.meta = b.meta * exp(g_lam * (g_base - v) + lam * (v - base))  # type: ignore[operator]
                b.freq = gen
            k = b.meta * flag[b.state]  # type: ignore[operator]
            if b.num_tokens < bs:
                k *= tail
            if k == last_k:
                bucket.append(b)
                b.heap_ver = last_u
                continue
            u = k
            while u in owner:
                u = nextafter(u, inf)
            last_k = k
            last_u = u
            bucket = owner[u] = [b]
            b.heap_ver = u
        self.owner = owner
        self.heap = heap = list(owner)
        heapq.heapify(heap)
        self._last_key = last_k
        self._last_slot = last_u
        self._entries = len(live)

    def _new_gen(self, base: float) -> None:
        self.base = base
        self.gen += 1
        self.gens.append((base, self.lam))
        self._rebuild()  # live heap keys convert now (via _key), other blocks on next touch

    def _convert(self, m: float, gen: int, v: float) -> float:
        """A sum relative to generation `gen`, last access `v`, in the current one: the
        count at `v` is kept (in the old λ), then weighted as of `v` in the new one."""
        base, lam = self.gens[gen]
        return m * math.exp(lam * (base - v) + self.lam * (v - self.base))

    def _rescale(self, b: Block) -> None:
        b.meta = self._convert(b.meta, b.freq, b.next_use)  # type: ignore[arg-type]
        b.freq = self.gen

    def log_count(self, b: Block, vtime: float | None = None) -> float:
        """ln of `b`'s decayed access count at virtual time `vtime` (default: now)."""
        base, lam = self.gens[b.freq]  # type: ignore[index]
        v = self._acc if vtime is None else vtime
        return math.log(b.meta) - lam * (v - base)  # type: ignore[arg-type]

    def _set_half_life(self, half_life: float) -> None:
        self.half_life = half_life
        self.lam = LN2 / half_life
        self._new_gen(self._v)  # the base moves to now: same timestamp, new λ
        self.retunes += 1
        self._w = 1.0
        self._cap = self.max_count

    def _measured_half_life(self) -> None:
        """The reuse-gap estimate moved: follow it when the half-life it implies is more
        than a quarter octave away (each change re-keys the heap once)."""
        est = self.gaps.estimate  # type: ignore[union-attr]
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
            if self.gaps is not None:
                self._measured_half_life()
            else:
                self._set_half_life(self.tuner.value / self.reuse_mult * self.fixed_half_life)  # type: ignore[operator]
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
        lam, base = self.lam, self.base
        for b in self._live():
            if b.freq != self.gen:
                self._rescale(b)
            one = math.exp(lam * (b.next_use - base))  # type: ignore[operator]
            if b.meta > one:  # type: ignore[operator]
                b.meta = one
        self.ghost.clear()
        self.ghost_old.clear()
        self._rebuild()

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
        key = b.key
        if key[0] < self._sample_below and self.gaps.observe(key, self._v):  # type: ignore[index,union-attr,arg-type]
            self._measured_half_life()
            w = self._w
        g = self.ghost.pop(key, None)  # type: ignore[arg-type]
        if g is None and self.ghost_old:
            g = self.ghost_old.pop(key, None)  # type: ignore[arg-type]
        if g is None:
            st = self._new_flags
            p = b.parent
            if p is not None and self._extensions:
                # A new block extending a prefix known before this request (hit now, or
                # back from the ghost: count > 1) below depth 0 is an appended suffix; a
                # new parent passes its flag on down the chain.
                if p.inserted_at != now or p.meta != w:
                    if p.depth >= 1:
                        st |= EXTENSION
                else:
                    st |= p.state & EXTENSION
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
            b.meta = w
        else:
            self.ghost_hits += 1
            m, gen, v, st = g
            if gen != self.gen:
                m = self._convert(m, gen, v)
            b.meta = m + w
            if st & (EXTENSION | FRESH):
                self.reuse[0 if st & EXTENSION else 2] += 1.0
            st = 0
        if self._pin_roots and b.depth == 0:
            st |= PINNED
        b.freq = self.gen
        b.next_use = self._v
        b.state = st
        if (b.depth == 1 and self._feedback) or self.tuner is not None:
            self._observe(b, now, False)

    def on_hit(self, b: Block, now: float) -> None:
        if now != self._t:
            self._advance(now)
        self._acc += 1
        key = b.key
        if key[0] < self._sample_below and self.gaps.observe(key, self._v):  # type: ignore[index,union-attr,arg-type]
            self._measured_half_life()
        if b.freq != self.gen:
            self._rescale(b)
        m = b.meta + self._w  # type: ignore[operator]
        b.meta = m if m < self._cap else self._cap
        b.next_use = self._v
        st = b.state
        if st > PINNED:
            if st & (EXTENSION | FRESH):
                self.reuse[0 if st & EXTENSION else 2] += 1.0
            b.state = st & PINNED  # seen again: no longer a one-off
        if (b.depth == 1 and self._feedback) or self.tuner is not None:
            self._observe(b, now, True)

    def _update_penalties(self) -> None:
        """Every 64 first-seen inserts: the extension penalty ∝ how much rarer extension
        reuse is; both penalties fade with the cache's eviction age."""
        r = self.reuse
        r[1] += self._ext_seen
        r[3] += self._first_seen - self._ext_seen
        self._first_seen = self._ext_seen = 0
        ratio = (r[0] / r[1]) / (r[2] / r[3])
        for i in range(4):
            r[i] *= 0.95  # the seed's smoothing (§2.4)
        fade = 1.0
        gap = self.gaps.estimate if self.gaps is not None else None
        if gap and self.penalty_fade < math.inf:
            fade = max(0.0, 1.0 - self.evict_age / (gap * self.penalty_fade))
        self.admit_penalty = self.max_admit_penalty * fade
        if self.adapt_extension:
            self.extension_penalty = self.max_extension_penalty * min(1.0, max(0.0, 1.0 - ratio)) * fade
        else:
            self.extension_penalty = self.max_extension_penalty * fade
        self._factors()

    def on_release(self, b: Block, now: float) -> None:
        # _push with the key computed inline: this runs once per block access.
        b.parked = None
        if b.freq != self.gen:
            self._rescale(b)
        k = b.meta * self._flag[b.state]  # type: ignore[operator]
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

    def release_all(self, blocks: Iterable[Block]) -> None:
        """`on_release` of each block in order, in one call (for a caller releasing many
        at once: the loop's lookups hoisted, the push inlined; the same heap after)."""
        gen, flag, bs, tail = self.gen, self._flag, self.block_size, self._tail
        rescale, nextafter, inf, heappush = self._rescale, math.nextafter, math.inf, heapq.heappush
        for b in blocks:
            b.parked = None
            if b.freq != gen:
                rescale(b)
            k = b.meta * flag[b.state]  # type: ignore[operator]
            if b.num_tokens < bs:
                k *= tail
            owner = self.owner
            if k == self._last_key:
                bucket = owner.get(self._last_slot)
                if bucket is not None:
                    bucket.append(b)
                    b.heap_ver = self._last_slot
                    self._entries += 1
                    continue
            u = k
            while u in owner:
                u = nextafter(u, inf)
            self._last_key = k
            self._last_slot = u
            owner[u] = [b]
            b.heap_ver = u
            heappush(self.heap, u)
            self._entries += 1
            if self._entries > self._compact_at:
                self._compact()

    def on_evict(self, b: Block) -> None:
        self.evict_age += (self._acc - b.next_use - self.evict_age) * 0.004  # type: ignore[operator]
        ghost = self.ghost
        ghost[b.key] = (b.meta, b.freq, b.next_use, b.state)  # type: ignore[index]
        if len(ghost) >= self.ghost_limit:
            self.ghost_old = ghost if self.ghost_limit else {}
            self.ghost = {}

    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        self.ghost_limit = int(self.ghost_mult * capacity_blocks * 2 / 3)
        self._compact_at = 2 * capacity_blocks + 256
        if self.fixed_half_life is None and self.gaps.estimate is None:  # type: ignore[union-attr]
            # Until the first reuse gaps are in: the cache's own size, in accesses.
            self.half_life = float(max(capacity_blocks, 1))
            self.lam = LN2 / self.half_life
            self.gens[self.gen] = (self.base, self.lam)

    def stats(self) -> dict[str, float]:
        out = {"half_life_accesses": self.half_life, "ghost_hits": self.ghost_hits,
               "admit_penalty": self.admit_penalty, "evict_age": self.evict_age,
               "extension_penalty": self.extension_penalty,
               "retunes": self.retunes}
        if self.gaps is not None and self.gaps.estimate is not None:
            out["reuse_gap_accesses"] = self.gaps.estimate
        if self.tracker is not None:
            out["entropy_bits"] = self.tracker.bits()
        if self.detector is not None:
            out["drifts"] = self.detector.drifts
        return out


@register_policy("lruk")
class LRUK(_HeapPolicy):
    """LRU-K: evict the block whose K-th most recent access is oldest (fewer than K
    accesses counts as infinitely old, LRU among those). History survives eviction in a
    ghost map, as LRU-K's retained-information period."""

    name = "lruk"

    def __init__(self, k: int = 2, ghost: float = 8.0) -> None:
        super().__init__()
        if k < 1:
            raise ValueError("K must be >= 1")
        self.k = k
        self.ghost_mult = ghost
        self.ghost = _Ghost()

    def _key(self, b: Block) -> float:
        times: list[float] = b.meta  # type: ignore[assignment]
        # Blocks with < K accesses sort before all others (offset), LRU among themselves.
        return times[0] if len(times) == self.k else times[-1] - 1e12

    def on_insert(self, b: Block, now: float) -> None:
        g = self.ghost.take(b.key)  # type: ignore[arg-type]
        times = [g[1]] if g is not None and self.k > 1 else []
        times.append(now)
        b.meta = times[-self.k:]

    def on_hit(self, b: Block, now: float) -> None:
        times: list[float] = b.meta  # type: ignore[assignment]
        times.append(now)
        if len(times) > self.k:
            del times[0]

    def on_evict(self, b: Block) -> None:
        times: list[float] = b.meta  # type: ignore[assignment]
        self.ghost.put(b.key, (0.0, times[-1]), int(self.ghost_mult * self.capacity))  # type: ignore[arg-type]


def _fused_scalar(h: float, ts: float, alpha: float, beta: float) -> float:
    """`fused_score` for one pair of floats (no numpy on the eviction path)."""
    gate = 1.0 / (1.0 + math.exp(alpha * (h - beta)))
    return gate * ts + (1.0 - gate) * (1.0 - h)


@register_policy("fused")
class Fused(EvictionPolicy):
    """Sampled eviction by the fused score of §2.3: among `sample` random evictable leaves
    evict the lowest fused_score(H_b, ts_b), where H_b is the block's self-information
    -log2 p(b) normalised by log2(#blocks) (a rarely used block has high entropy) and ts_b
    its recency normalised over the sample."""

    name = "fused"

    def __init__(self, sample: int = 8, alpha: float = 2.0, beta: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        self.sample = sample
        self.alpha, self.beta = alpha, beta
        self.cands: list[Block] = []
        self.total = 0
        self.rng = random.Random(seed)

    def _add(self, b: Block) -> None:
        if b.meta is None and b.ref_cnt == 0 and b.num_children == 0:
            b.meta = len(self.cands)
            self.cands.append(b)

    def _drop(self, b: Block) -> None:
        i = b.meta
        if i is None:
            return
        last = self.cands.pop()
        if last is not b:
            self.cands[i] = last  # type: ignore[index]
            last.meta = i
        b.meta = None

    def on_insert(self, b: Block, now: float) -> None:
        b.freq = 1
        b.meta = None
        self.total += 1

    def on_hit(self, b: Block, now: float) -> None:
        b.freq += 1
        self.total += 1

    def on_acquire(self, b: Block) -> None:
        self._drop(b)

    def on_release(self, b: Block, now: float) -> None:
        self._add(b)

    def on_leaf(self, b: Block) -> None:
        self._add(b)

    def victim(self) -> Block | None:
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

    def on_evict(self, b: Block) -> None:
        b.meta = None
