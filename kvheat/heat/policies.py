"""Heat-driven eviction policies the block cache runs (registered on import).

- `kvheat`: the default heat policy. A block's heat is its exponentially decayed access
  count (half-life `half_life_s`), kept in log space against a growing base so that the
  eviction key ln Σe^{λ t_i} never needs refreshing while the block sits idle (LRFU);
  the coldest evictable leaf goes first (a min-heap, lazy deletion, parking for blocks
  that are referenced or still have cached children). On top of that:
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

from ..cache.block import Block, BlockQueue
from ..cache.policy import EvictionPolicy, register_policy
from .decay import rate_for_half_life
from .drift import DriftDetector
from .entropy import EntropyTracker
from .scoring import HIGH, LOW, Regime
from .tuning import OnlineTuner

_PARKED = BlockQueue("parked")
# KVHeat block flags (Block.state bits); all but PINNED clear at the block's first reuse.
PINNED, ONE_OFF, EXTENSION, FRESH = 1, 2, 4, 8


class _HeapPolicy(EvictionPolicy):
    """Evict the evictable leaf with the smallest key; subclasses define `_key`."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple[float, int, int, Block]] = []  # key, seq, version, block
        self._seq = 0

    def _key(self, b: Block) -> float:
        raise NotImplementedError

    def _push(self, b: Block) -> None:
        b.heap_ver += 1
        self._seq += 1
        # Ties go to the earlier push: the cache releases a request tail-first, so a
        # chain's tail leaves before its head.
        heapq.heappush(self.heap, (self._key(b), self._seq, b.heap_ver, b))

    def _rebuild(self) -> None:
        live = [e[3] for e in self.heap if e[2] == e[3].heap_ver and e[3].key is not None]
        self.heap = []
        for b in live:
            self._push(b)

    def on_acquire(self, b: Block) -> None:
        b.heap_ver += 1  # invalidates its heap entry
        b.parked = None

    def on_release(self, b: Block, now: float) -> None:
        b.parked = None
        self._push(b)

    def on_leaf(self, b: Block) -> None:
        if b.parked is not None:
            b.parked = None
            self._push(b)

    def victim(self) -> Block | None:
        heap = self.heap
        while heap:
            _, _, ver, b = heapq.heappop(heap)
            if ver != b.heap_ver or b.key is None:
                continue
            if b.ref_cnt or b.num_children:
                b.parked = _PARKED
                continue
            b.heap_ver += 1
            return b
        return None


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
    """Decayed-frequency heat with history, suffix demotion and optional adaptation.

    Per block: `meta` = ln(decayed count) at time `next_use` (the block's own heat clock).
    Heap key = meta + λ·next_use = ln Σ_i e^{λ t_i}, comparable across blocks at any time.
    """

    name = "kvheat"

    # Defaults chosen on the synthetic Mooncake trace and the generator, then confirmed
    # on the conversation trace (docs/heat.md): the regime helps everywhere, tuning and
    # drift only on workloads that change, so they stay opt-in.
    def __init__(self, half_life_s: float = 150.0, ghost: float = 8.0,
                 tail_penalty_s: float = 1000.0, regime: bool = True,
                 admit_penalty_s: float = 120.0, pin_bonus_s: float = 600.0,
                 tune: bool = False, drift: bool = False, entropy_half_life_s: float = 300.0,
                 drift_window: int = 2048, drift_threshold: float = 1.0,
                 extension_penalty_s: float = 400.0, adapt_extension: bool = True,
                 max_count: float = math.inf) -> None:
        super().__init__()
        self.half_life_s = half_life_s
        self.lam = rate_for_half_life(half_life_s)
        self.ghost_mult = ghost
        self.ghost: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self.ghost_limit = 0
        self.tail_penalty_s = tail_penalty_s
        self.block_size = 0  # largest block seen: a smaller last block is a partial tail
        self.use_regime = regime
        self.regime = Regime()
        self.admit_penalty_s = admit_penalty_s
        self.pin_bonus_s = pin_bonus_s
        # Extension demotion, learned (§2.4): the penalty scales with how much less often
        # appended suffixes are reused than fresh prompts, measured online (hits and ghost
        # hits of first-seen blocks), updated every 64 first-seen inserts, smoothing 0.95.
        self.max_extension_penalty_s = extension_penalty_s
        self.adapt_extension = adapt_extension
        self.extension_penalty_s = 0.0 if adapt_extension else extension_penalty_s
        self.reuse = [1.0, 4.0, 1.0, 4.0]  # extension reused, inserted; fresh reused, inserted
        self._first_seen = 0
        # Saturating the count lets a burst that ended cool down in a few half-lives.
        self.log_max_count = math.log(max_count)
        self.mode = "mid"
        self.tracker = EntropyTracker(entropy_half_life_s) if (regime or drift) else None
        self.tuner = OnlineTuner(half_life_s, half_life_s / 8, half_life_s * 8) if tune else None
        self.detector = DriftDetector(drift_window, drift_threshold, drift_window // 4) if drift else None
        self.ghost_hits = 0
        self.retunes = 0
        self._feedback = regime or drift  # entropy regime / drift watch depth-1 keys
        self._extensions = extension_penalty_s > 0
        self._set_mode("mid")

    # -- heat ------------------------------------------------------------------------
    def _key(self, b: Block) -> float:
        k = b.meta + self.lam * b.next_use  # type: ignore[operator]
        if b.num_tokens < self.block_size:
            k -= self.lam * self.tail_penalty_s
        st = b.state
        if st:  # flags set at insert: pinned root, first-seen in high H, extension
            if st & PINNED:
                k += self.lam * self.pin_bonus_s
            if st & ONE_OFF:
                k -= self.lam * self.admit_penalty_s
            if st & EXTENSION:
                k -= self.lam * self.extension_penalty_s
        return k

    def _set_half_life(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.lam = rate_for_half_life(half_life_s)
        self._rebuild()  # keys depend on λ; per-block state does not
        self.retunes += 1

    def _observe(self, b: Block, now: float, hit: bool) -> None:
        """Feedback for the optional tuner, entropy regime and drift detector."""
        if self.tuner is not None and self.tuner.record(hit):
            self._set_half_life(self.tuner.value)
        if b.depth == 1:  # the key right under a root names a conversation or document
            if self.tracker is not None:
                self.tracker.update(b.key, now)
                self._set_mode(self.regime.classify(self.tracker.bits()))
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
        for e in self.heap:
            b = e[3]
            if e[2] == b.heap_ver and b.meta > 0.0:  # type: ignore[operator]
                b.meta = 0.0
        self.ghost.clear()
        self._rebuild()

    def on_insert(self, b: Block, now: float) -> None:
        # Runs once per block filled: flags precomputed, few attribute lookups.
        n = b.num_tokens
        if n > self.block_size:
            self.block_size = n
        full = n == self.block_size
        g = self.ghost.pop(b.key, None)  # type: ignore[arg-type]
        if g is None:
            b.meta = 0.0
            st = self._new_flags
            p = b.parent
            if p is not None and self._extensions:
                # A new block extending a prefix known before this request (hit now, or
                # back from the ghost: log-count > 0) below depth 0 is an appended
                # suffix; a new parent passes its flag on down the chain.
                if p.inserted_at != now or p.meta > 0.0:  # type: ignore[operator]
                    if p.depth >= 1:
                        st |= EXTENSION
                else:
                    st |= p.state & EXTENSION
            if full and self.adapt_extension:
                r = self.reuse
                if st & EXTENSION:
                    r[1] += 1.0
                else:
                    st |= FRESH
                    r[3] += 1.0
                self._first_seen += 1
                if self._first_seen >= 64:
                    self._update_extension_penalty()
        else:
            self.ghost_hits += 1
            ln_count, t, st = g
            c = ln_count - self.lam * (now - t)
            b.meta = c + math.log1p(math.exp(-c)) if c > 0 else math.log1p(math.exp(c))
            if st & (EXTENSION | FRESH):
                self.reuse[0 if st & EXTENSION else 2] += 1.0
            st = 0
        if self._pin_roots and b.depth == 0:
            st |= PINNED
        b.next_use = now
        b.state = st
        if self.tuner is not None or (self._feedback and b.depth == 1):
            self._observe(b, now, False)

    def on_hit(self, b: Block, now: float) -> None:
        c = b.meta - self.lam * (now - b.next_use)  # type: ignore[operator]
        c = c + math.log1p(math.exp(-c)) if c > 0 else math.log1p(math.exp(c))  # ln(1 + e^c)
        b.meta = c if c < self.log_max_count else self.log_max_count
        b.next_use = now
        if b.state > PINNED:
            if b.state & (EXTENSION | FRESH):
                self.reuse[0 if b.state & EXTENSION else 2] += 1.0
            b.state &= PINNED  # seen again: no longer a one-off
        if self.tuner is not None or (self._feedback and b.depth == 1):
            self._observe(b, now, True)

    def _update_extension_penalty(self) -> None:
        """Every 64 first-seen inserts: penalty ∝ how much rarer extension reuse is."""
        self._first_seen = 0
        r = self.reuse
        ratio = (r[0] / r[1]) / (r[2] / r[3])
        self.extension_penalty_s = self.max_extension_penalty_s * min(1.0, max(0.0, 1.0 - ratio))
        for i in range(4):
            r[i] *= 0.95  # the seed's smoothing (§2.4)

    def on_release(self, b: Block, now: float) -> None:
        # _push with the key computed inline: this runs once per block access.
        b.parked = None
        lam = self.lam
        k = b.meta + lam * b.next_use  # type: ignore[operator]
        if b.num_tokens < self.block_size:
            k -= lam * self.tail_penalty_s
        st = b.state
        if st:
            if st & ONE_OFF:
                k -= lam * self.admit_penalty_s
            if st & EXTENSION:
                k -= lam * self.extension_penalty_s
            if st & PINNED:
                k += lam * self.pin_bonus_s
        b.heap_ver += 1
        self._seq += 1
        heapq.heappush(self.heap, (k, self._seq, b.heap_ver, b))

    def on_evict(self, b: Block) -> None:
        ghost = self.ghost
        ghost[b.key] = (b.meta, b.next_use, b.state)  # type: ignore[index]
        if len(ghost) > self.ghost_limit:
            ghost.popitem(last=False)

    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        self.ghost_limit = int(self.ghost_mult * capacity_blocks)

    def stats(self) -> dict[str, float]:
        out = {"half_life_s": self.half_life_s, "ghost_hits": self.ghost_hits,
               "admit_penalty_s": self.admit_penalty_s,
               "extension_penalty_s": self.extension_penalty_s,
               "retunes": self.retunes}
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
