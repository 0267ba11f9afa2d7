"""KVHeat's eviction key: a block's count times its penalty factors, and the penalties
learned online.

A penalty of p half-lives is a constant factor 2^-p on the count, whatever the half-life:
- a partial last block (the end of a prompt, which the next turn extends and so re-keys)
  is charged `tail_penalty`;
- a first-seen block is flagged ONE_OFF while the entropy regime is high (`admit_penalty`),
  and EXTENSION when it extends a prefix known before its request (`extension_penalty`,
  scaled by how much less often such suffixes are reused than fresh prompts, measured on
  hits and ghost hits of first-seen blocks); both flags clear at the block's first reuse;
- a root is PINNED while the regime is low (`pin_bonus`, a bonus).
The extension penalty fades as the cache's eviction age reaches `penalty_fade` reuse gaps
(a cache that holds most suffix reuses anyway loses by demoting them); the admission
penalty does not: a long-lived cache still has to choose between one-offs and the rest,
which is where ARC's scan resistance beat it. Neither applies before the first eviction.
docs/heat.md has the measurements behind each default.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container

from ..cache.block import Block
from ..cache.policy import PARKED
from .counts import HeatCounts, HeatRecord

# HeatRecord.flags bits; all but PINNED clear at the block's first reuse.
PINNED, ONE_OFF, EXTENSION, FRESH = 1, 2, 4, 8


class HeatPenalties(HeatCounts):
    def _init_penalties(self, tail_penalty: float, admit_penalty: float, pin_bonus: float,
                        extension_penalty: float, adapt_extension: bool,
                        penalty_fade: float) -> None:
        self.tail_penalty = tail_penalty
        self.block_size = 0  # largest block seen: a smaller last block is a partial tail
        self.max_admit_penalty = admit_penalty
        self.admit_penalty = admit_penalty
        self.penalty_fade = penalty_fade
        self.evict_age = 0.0  # mean age at eviction since last access, accesses (EWMA)
        self.evictions = 0
        self.pin_bonus = pin_bonus
        # Updated every 64 first-seen inserts, smoothing 0.95 (docs/heat.md, "Online
        # tuning and drift").
        self.max_extension_penalty = extension_penalty
        self.adapt_extension = adapt_extension
        self.extension_penalty = 0.0 if adapt_extension else extension_penalty
        self.reuse = [1.0, 4.0, 1.0, 4.0]  # extension reused, inserted; fresh reused, inserted
        self._first_seen = 0  # first-seen full blocks since the last update
        self._ext_seen = 0  # of which extensions
        self._extensions = extension_penalty > 0
        self.penalty_scale = 1.0  # (adapt_mult) the starting multiple over the current one
        self._factors()

    def _factors(self) -> None:
        """Key multipliers, precomputed: per flag combination and for a partial tail."""
        scale = self.penalty_scale
        self._tail = 2.0 ** (-self.tail_penalty * scale)
        f = []
        for st in range(16):
            s = 0.0
            if st & PINNED:
                s += self.pin_bonus
            if st & ONE_OFF:
                s -= self.admit_penalty
            if st & EXTENSION:
                s -= self.extension_penalty
            f.append(2.0 ** (s * scale))
        self._flag = f

    def _key(self, b: Block) -> float:
        r: HeatRecord = b.rec
        if r.gen != self.gen:
            self._rescale(r)
        k = r.count * self._flag[r.flags]
        return k * self._tail if b.num_tokens < self.block_size else k

    def _update_penalties(self) -> None:
        """Every 64 first-seen inserts: the extension penalty ∝ how much rarer extension
        reuse is, fading with the cache's eviction age; the admission penalty in full
        once the cache has evicted."""
        r = self.reuse
        r[1] += self._ext_seen
        r[3] += self._first_seen - self._ext_seen
        self._first_seen = self._ext_seen = 0
        ratio = (r[0] / r[1]) / (r[2] / r[3])
        for i in range(4):
            r[i] *= 0.95
        fade = 1.0
        gap = self.gaps.estimate
        if not self.evictions:
            fade = 0.0  # nothing evicted yet: every reuse so far was held
        elif gap and self.penalty_fade < math.inf:
            fade = max(0.0, 1.0 - self.evict_age / (gap * self.penalty_fade))
        self.admit_penalty = self.max_admit_penalty if self.evictions else 0.0
        if self.adapt_extension:
            self.extension_penalty = self.max_extension_penalty * min(1.0, max(0.0, 1.0 - ratio)) * fade
        else:
            self.extension_penalty = self.max_extension_penalty * fade
        self._factors()

    def _rebuild(self) -> None:
        """`HeapPolicy._rebuild` in one pass over the old buckets, with the key, the
        rescale and the push inlined and one heapify at the end (the same buckets and slots
        as re-pushing `_live()`, so the same order): this runs over every cached block at
        each new generation or half-life."""
        self._stale = False
        self._park_bucket()
        gen, gens, lam, base = self.gen, self.gens, self.lam, self.base
        flag, bs, tail = self._flag, self.block_size, self._tail
        exp, nextafter, inf = math.exp, math.nextafter, math.inf
        owner: dict[float, list[Block]] = {}
        last_k = last_u = math.nan
        bucket: list[Block] = []
        n = 0
        for u0, old in self.owner.items():
            for b in old:
                # live: its newest entry (and the first of duplicates, as `_live`)
                if u0 != b.heap_ver or b.key is None:
                    continue
                b.heap_ver = inf  # taken: another entry of it reads as stale
                n += 1
                r: HeatRecord = b.rec
                if r.gen != gen:
                    g_base, g_lam = gens[r.gen]
                    v = r.last
                    r.count = r.count * exp(g_lam * (g_base - v) + lam * (v - base))
                    r.gen = gen
                k = r.count * flag[r.flags]
                if b.num_tokens < bs:
                    k *= tail
                if k == last_k:
                    bucket.append(b)
                    continue
                u = k
                while u in owner:
                    u = nextafter(u, inf)
                last_k = k
                last_u = u
                bucket = owner[u] = [b]
        for u, bucket in owner.items():
            for b in bucket:
                b.heap_ver = u
        self.owner = owner
        self.heap = heap = list(owner)
        heapq.heapify(heap)
        self._last_key = last_k
        self._last_slot = last_u
        self._entries = n

    def take_lazy(self, n: int, protected: Container[object]
                  ) -> tuple[list[Block], list[Block]]:
        """Up to `n` victims in one call, for a caller that does not push a block again
        when its key rises (a hit, a cleared flag, a raised head): between re-keys keys
        only rise, so a block's heap entry is a lower bound of its key, and a block met
        with a key above its entry is pushed back at its key instead of taken. The victims
        are the coldest blocks, as `victim` with a push at every access would give (ties
        aside); the caller saves that push (vLLM's offload tier, `KVHeatCachePolicy`).
        Blocks whose key is in `protected` are taken and returned apart, for the caller
        to push back; fewer than `n` victims when the heap runs dry."""
        if self._stale:
            self._rebuild()
        heap, owner, heappop, heappush = self.heap, self.owner, heapq.heappop, heapq.heappush
        nan, nextafter, inf = math.nan, math.nextafter, math.inf
        gen, flag, bs, tail = self.gen, self._flag, self.block_size, self._tail
        picked: list[Block] = []
        skipped: list[Block] = []
        if n <= 0:
            return picked, skipped
        if self._cur_i < len(self._cur) and heap and heap[0] < self._cur_u:
            self._park_bucket()  # a smaller key arrived since the bucket was taken
        cur, i, u = self._cur, self._cur_i, self._cur_u
        last_k, last_u = self._last_key, self._last_slot
        pushed = 0
        while True:
            if i >= len(cur):
                if not heap:
                    cur, i = [], 0
                    break
                u = heappop(heap)
                cur = owner.pop(u)
                i = 0
            m = len(cur)
            while i < m:
                b = cur[i]
                i += 1
                if u != b.heap_ver or b.key is None:
                    continue
                if b.ref_cnt or b.num_children:
                    b.parked = PARKED
                    continue
                r: HeatRecord = b.rec
                if r.gen != gen:
                    self._rescale(r)
                k = r.count * flag[r.flags]
                if b.num_tokens < bs:
                    k *= tail
                if k > u:  # hotter since its entry: back in at its key (above this one)
                    pushed += 1
                    bucket = owner.get(last_u) if k == last_k else None
                    if bucket is not None:
                        bucket.append(b)
                        b.heap_ver = last_u
                        continue
                    v = k
                    while v in owner:
                        v = nextafter(v, inf)
                    last_k, last_u = k, v
                    owner[v] = [b]
                    b.heap_ver = v
                    heappush(heap, v)
                    continue
                b.heap_ver = nan
                if b.key in protected:
                    skipped.append(b)
                    continue
                picked.append(b)
                if len(picked) == n:
                    break
            else:
                continue
            break
        self._cur, self._cur_i, self._cur_u = cur, i, u
        self._last_key, self._last_slot = last_k, last_u
        self._entries += pushed
        if self._entries > self._compact_at:
            self._compact()
        return picked, skipped
