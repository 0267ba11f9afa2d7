"""LRU's whole hit-rate curve in one pass: Mattson's stack distances over a trace's
prefix blocks, optionally on a SHARDS spatial sample (Waldspurger et al., FAST'15).

Why one pass is exact. The replayer serves one request at a time: it matches the longest
cached prefix, allocates the rest (evicting least recently used unreferenced leaves) and
releases the request tail-first, so the request's first block ends most recent. A parent
is therefore always more recent than its children, the least recent block is always a
leaf, and prefix-LRU is a stack algorithm: at a capacity of C blocks, block j of a request
hits iff its stack distance (distinct blocks above it in the stack as it was before the
request) is < C, and those hits form a prefix by themselves. After the request its blocks
sit on top: first block, second, ..., last. A request of more blocks than C is not cached
at all at capacity C (the replayer counts it `too_long` and leaves the cache untouched),
which one pass cannot follow: the curve is exact from `exact_from_blocks` (the longest
request's block count) up.

How. Requests are laid out as one reference stream, each request's blocks last-first (the
order they are released in), and processed in batches of whole requests. A block whose
previous use was before the batch counts the keys live above that use (a bitmap over
access times with two levels of counts: `_LiveTimes`) plus the keys that earlier requests
of the batch moved above it; one used earlier in the batch counts only the latter. Both
are numpy operations over the whole batch; the in-batch count is a small matrix, so a
batch is kept to a few hundred references. Memory is bounded by the number of distinct
keys: the time axis is renumbered when it outgrows about twice that.

Token weights. A hit counts the tokens of the cached block, i.e. of the request that last
inserted it, which at capacity C is the key's latest use with a distance >= C. When a key
is used with different token counts (a partial last block), its weights are kept as a
small staircase over distances (`_staircase_hit`), exact at every capacity; otherwise (real
traces: always) a hit at distance d adds its tokens at d.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cache import hit_rate as _hit_rate
from ..checks.bounds import Overflow

log = logging.getLogger(__name__)

# A batch gathers whole requests up to this many references (the in-batch matrix is
# quadratic in it); a longer request is processed alone, which needs no matrix.
BATCH_REFS = 384
_WORD = 64  # time slots per bitmap word
_GROUP = 64  # words per counted group
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_NEVER = -1  # the last use of a key never seen
_INF = 1 << 62  # the distance of a first use
# Steps kept per key used with different token counts (real traces have none); past it the
# oldest finite step is merged into the first use, and the curve no longer claims exactness.
MAX_STEPS = 64


def _popcount_bytes(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (numpy < 2 has no `bitwise_count`)."""
    b = np.ascontiguousarray(x).view(np.uint8).reshape(*x.shape, 8)
    return _BYTE_BITS[b].sum(axis=-1, dtype=np.uint8)


_BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)
popcount = getattr(np, "bitwise_count", _popcount_bytes)


def splitmix64(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """Vigna's splitmix64 finaliser of `x + (seed + 1) * golden` (uint64, wrapping).

    The fixed integer hash SHARDS samples dense key ids with."""
    return mix64(x.astype(np.uint64) + np.uint64(((seed + 1) * _GOLDEN) & _MASK64))


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 values (wrapping): every SHARDS filter's hash."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass(slots=True, eq=False)
class LRUCurve:
    """The result: the token-weighted stack-distance histogram and what it answers.

    `tokens_by_distance[d]`: the tokens that become hits when the capacity grows from d to
    d + 1 (sampled) blocks; with one token count per key (real traces) simply the tokens
    of all hits at stack distance d. Compulsory misses (first uses) are not in it.
    With `rate` < 1 (SHARDS) distances are among sampled keys, so capacity C blocks
    reads the histogram below C * rate, and the hit rate is sampled hits over sampled
    tokens."""

    block_tokens: int
    rate: float
    seed: int
    requests: int
    references: int  # block references, all
    sampled_references: int
    distinct_keys: int  # tracked (sampled) keys
    total_tokens: int  # prompt tokens, all
    sampled_tokens: int
    compulsory_tokens: int  # sampled tokens of first uses
    exact_from_blocks: int  # the longest request's blocks: below it the curve is not exact
    tokens_by_distance: np.ndarray  # int64
    merged_steps: int = 0  # staircase steps merged past MAX_STEPS: then nothing is exact
    _cum: np.ndarray = field(init=False, repr=False)  # hit tokens below each distance

    def __post_init__(self) -> None:
        self._cum = np.concatenate(([0], np.cumsum(self.tokens_by_distance, dtype=np.int64)))

    def _sampled_hits(self, capacity_blocks: int) -> int:
        if type(capacity_blocks) is not int and not isinstance(capacity_blocks, np.integer):
            raise TypeError(f"capacity must be an integer number of blocks, not {capacity_blocks!r}")
        if capacity_blocks < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
        # hit iff distance / rate < C, i.e. distance <= ceil(C * rate) - 1
        cut = capacity_blocks if self.rate == 1.0 else math.ceil(capacity_blocks * self.rate)
        return int(self._cum[min(cut, len(self._cum) - 1)])

    def hit_rate(self, capacity_blocks: int) -> float:
        """Token-weighted prefix hit rate of LRU at `capacity_blocks` blocks.

        An estimate when sampled; exact for `rate` 1 and capacity >= `exact_from_blocks`."""
        return _hit_rate(self._sampled_hits(capacity_blocks), self.sampled_tokens)

    def hit_tokens(self, capacity_blocks: int) -> int:
        """Prompt tokens served from cache at `capacity_blocks`.

        `replay(..., "lru", C * block_tokens, ...).hit_tokens` exactly, for rate 1 and C >=
        exact_from_blocks; sampled: the hit rate times all tokens."""
        hits = self._sampled_hits(capacity_blocks)
        if self.rate == 1.0:
            return hits
        return round(_hit_rate(hits, self.sampled_tokens) * self.total_tokens)

    @property
    def unbounded_hit_rate(self) -> float:
        """The hit rate of a cache that never evicts."""
        return _hit_rate(int(self._cum[-1]), self.sampled_tokens)

    def blocks_for(self, fraction: float) -> int | None:
        """The smallest capacity (blocks) reaching `fraction` of the unbounded hit rate.

        E.g. 0.9: the knee operators size to. None when nothing ever hits."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        top = int(self._cum[-1])
        if top <= 0:
            return None
        # the running hit tokens may dip (staircase weights): take the first index from
        # which it stays at or above the target
        reach = self._cum >= fraction * top
        below = np.flatnonzero(~reach)
        cut = int(below[-1]) + 1 if below.size else 0
        if self.rate == 1.0 or cut == 0:
            return cut
        return math.floor((cut - 1) / self.rate) + 1  # the least C with ceil(C * rate) >= cut

    def is_exact(self, capacity_blocks: int) -> bool:
        """Whether `hit_tokens(capacity_blocks)` is the replay's figure exactly."""
        return (self.rate == 1.0 and self.merged_steps == 0
                and capacity_blocks >= self.exact_from_blocks)

    def curve(self, capacities: Iterable[int]) -> list[tuple[int, float]]:
        """(capacity in blocks, hit rate) for each capacity."""
        return [(int(c), self.hit_rate(int(c))) for c in capacities]

    def as_dict(self, capacities: Iterable[int] = (), histogram: bool = False) -> dict:
        """A JSON-ready summary of the curve.

        `capacities`: the curve at those (each point says whether it is exact); `histogram`:
        the nonzero entries of `tokens_by_distance` too."""
        out: dict = {
            "policy": "lru", "method": "stack distance" if self.rate == 1.0 else "SHARDS",
            "block_tokens": self.block_tokens, "rate": self.rate, "seed": self.seed,
            "requests": self.requests, "references": self.references,
            "sampled_references": self.sampled_references,
            "distinct_keys": self.distinct_keys, "total_tokens": self.total_tokens,
            "sampled_tokens": self.sampled_tokens,
            "compulsory_tokens": self.compulsory_tokens,
            "exact_from_blocks": self.exact_from_blocks, "merged_steps": self.merged_steps,
            "unbounded_hit_rate": self.unbounded_hit_rate,
            "curve": [{"capacity_blocks": c, "capacity_tokens": c * self.block_tokens,
                       "hit_rate": h, "hit_tokens": self.hit_tokens(c),
                       "exact": self.is_exact(c)}
                      for c, h in self.curve(capacities)],
        }
        if histogram:
            nz = np.flatnonzero(self.tokens_by_distance)
            out["histogram"] = {"distance": nz.tolist(),
                                "tokens": self.tokens_by_distance[nz].tolist()}
        return out


class _LiveTimes:
    """The access times that are some key's latest use, as a bitmap with two levels of
    counts: how many live times lie above time p is one popcount and two lookups, and a
    batch's updates recount only the groups of 4096 times they touch."""

    def __init__(self, slots: int) -> None:
        self.words = np.zeros(slots // _WORD, np.uint64)
        self.after_word = np.zeros(slots // _WORD, np.int32)  # live in later words of its group
        self.group_live = np.zeros(slots // (_WORD * _GROUP), np.int64)
        self.after_group = np.zeros(len(self.group_live) + 1, np.int64)  # live in groups >= g

    @property
    def slots(self) -> int:
        return len(self.words) * _WORD

    def above(self, p: np.ndarray) -> np.ndarray:
        """Live times strictly after each time in `p` (each one live)."""
        w = p >> 6
        bits = (self.words[w] >> (p & 63).astype(np.uint64)) >> np.uint64(1)
        return (popcount(bits).astype(np.int64) + self.after_word[w]
                + self.after_group[(w >> 6) + 1])

    def update(self, dead: np.ndarray, start: int, count: int, live: np.ndarray | None) -> None:
        """Clear the times `dead`; set times `start + i` for i < `count` where `live[i]`
        (None: all) (`start` a word boundary, those words empty)."""
        touched = np.zeros(len(self.group_live), bool)
        touched[dead >> 12] = True
        if dead.size:
            np.bitwise_and.at(self.words, dead >> 6,
                              ~(np.uint64(1) << (dead & 63).astype(np.uint64)))
        w0 = start // _WORD
        full, rest = divmod(count, _WORD)
        if live is None:
            self.words[w0:w0 + full] = np.uint64(_MASK64)
            if rest:
                self.words[w0 + full] = np.uint64((1 << rest) - 1)
        else:
            pad = np.zeros((full + (rest > 0)) * _WORD, np.uint8)
            pad[:count] = live
            packed = np.packbits(pad, bitorder="little").view("<u8")
            self.words[w0:w0 + packed.size] = packed
        touched[w0 >> 6:((w0 + full + (rest > 0) - 1) >> 6) + 1] = True
        self._recount(np.flatnonzero(touched))

    def _recount(self, groups: np.ndarray) -> None:
        counts = popcount(self.words.reshape(-1, _GROUP)[groups]).astype(np.int32)
        inclusive = np.cumsum(counts, axis=1, dtype=np.int32)
        total = inclusive[:, -1]
        self.after_word.reshape(-1, _GROUP)[groups] = total[:, None] - inclusive
        self.group_live[groups] = total
        self.after_group[:-1] = np.cumsum(self.group_live[::-1])[::-1]

    def reset(self, live_count: int) -> None:
        """Times 0 .. live_count - 1 live, nothing else (after renumbering)."""
        self.words[:] = 0
        full, rest = divmod(live_count, _WORD)
        self.words[:full] = np.uint64(_MASK64)
        if rest:
            self.words[full] = np.uint64((1 << rest) - 1)
        self._recount(np.arange(len(self.group_live)))


def _staircase_hit(steps: list[tuple[int, int]], distance: int, tokens: int,
                   hist: np.ndarray) -> None:
    """A hit at `distance`, by a use of `tokens`, of a key used with different token counts
    (which count a hit earns then depends on the capacity). `steps`: (distance threshold,
    tokens) of its past uses that still matter, oldest first, thresholds falling, the first
    use's at `_INF`: at capacity C the cached copy holds the tokens of the latest use with
    distance >= C (the last time it missed and was inserted). Adds what this hit earns at
    each capacity to `hist` (as increments by capacity), then pushes this use."""
    while steps[-1][0] <= distance:  # uses that hit wherever this one hits: not inserters
        steps.pop()
    earned, at = 0, distance
    for threshold, w in reversed(steps):  # C in (at, threshold]: w tokens
        hist[at] += w - earned
        earned, at = w, threshold
    if steps[-1][1] != tokens:
        steps.append((distance, tokens))


class LRUStackDistance:
    """Accumulates requests (`add`), one batch at a time, into an `LRUCurve` (`result`).

    Each request is `(ids, input_length)`: `ids` the dense key ids of its blocks in prefix
    order (a key never seen before is numbered the count of keys seen so far), the
    request's tokens filling `block_tokens`-token blocks, the last one partly. `rate` < 1
    tracks only keys whose `splitmix64(id, seed)` falls below `rate * 2**64` (SHARDS)."""

    def __init__(self, block_tokens: int, rate: float = 1.0, seed: int = 0,
                 batch_refs: int = BATCH_REFS) -> None:
        if type(block_tokens) is not int or not 1 <= block_tokens < 1 << 31:
            raise ValueError(f"block_tokens must be a positive integer, not {block_tokens!r}")
        if not (isinstance(rate, float | int) and not isinstance(rate, bool)
                and 0.0 < rate <= 1.0):
            raise ValueError(f"rate must be a number in (0, 1], not {rate!r}")
        if type(seed) is not int or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, not {seed!r}")
        if type(batch_refs) is not int or batch_refs < 1:
            raise ValueError(f"batch_refs must be a positive integer, not {batch_refs!r}")
        self.block_tokens = block_tokens
        self.rate = float(rate)
        self.seed = seed
        self.batch_refs = batch_refs
        self._threshold = None if self.rate == 1.0 else np.uint64(min(int(self.rate * 2**64), _MASK64))
        self.requests = 0
        self.references = 0
        self.sampled_references = 0
        self.total_tokens = 0
        self.sampled_tokens = 0
        self.compulsory_tokens = 0
        self.longest = 0
        self._seen = 0  # dense ids seen (sampled or not)
        self._tracked = 0  # sampled keys seen
        # per dense id: its latest use's time (-1: none) and tokens; keys with a staircase
        self._last = np.full(1024, _NEVER, np.int64)
        self._tokens = np.zeros(1024, np.int32)
        self._stepped = np.zeros(1024, bool)
        self._slot = np.zeros(1024, np.int32)  # scratch: `add`'s duplicate check
        self._arange = np.arange(1024, dtype=np.int64)
        self._steps: dict[int, list[tuple[int, int]]] = {}  # at most MAX_STEPS each
        self._merged = Overflow(log, "LRU stack distance: steps of a key's token counts")
        self._hist = np.zeros(1024, np.int64)
        self._live = _LiveTimes(_WORD * _GROUP)
        self._now = 0  # the next free time (a word boundary)
        self._pending: list[tuple[np.ndarray, int]] = []  # (sampled ids last-first, last tokens)
        self._pending_refs = 0

    # ---- input --------------------------------------------------------------------------
    def add(self, ids: Sequence[int] | np.ndarray, input_length: int) -> None:
        """One request, in trace order. Bad input raises ValueError and changes nothing."""
        a = np.asarray(ids)
        n = a.size
        if a.ndim != 1 or n == 0 or a.dtype.kind not in "iu":
            raise ValueError("a request's ids must be a non-empty 1-d sequence of integers")
        bt = self.block_tokens
        if not isinstance(input_length, int | np.integer) or isinstance(input_length, bool):
            raise ValueError(f"input_length must be an integer, not {input_length!r}")
        if not (n - 1) * bt < input_length <= n * bt:
            raise ValueError(f"{input_length} tokens do not fit {n} blocks of {bt}")
        if a.dtype.kind == "i" and a.min() < 0:
            raise ValueError("ids must be >= 0")
        seen = self._seen
        fresh = 0
        top = int(a.max())
        if top >= seen:  # new keys: with no key twice, exactly seen .. seen + fresh - 1
            fresh = int(np.count_nonzero(a >= seen))
            if top >= seen + fresh:
                raise ValueError("ids must be dense: a new key is numbered the count of keys "
                                 f"seen so far ({seen}), in order of first appearance")
        self._grow_keys(seen + fresh)
        slot, iota = self._slot, self._iota(n)  # each id's position here, by scatter: no sort
        slot[a] = iota
        if (slot[a] != iota).any():
            raise ValueError("a request names the same key twice (ids name prefixes)")
        self._seen = seen + fresh
        self.requests += 1
        self.references += n
        self.total_tokens += int(input_length)
        self.longest = max(self.longest, n)
        last_tokens = int(input_length) - (n - 1) * bt
        rev = a[::-1]  # released last block first: the first block ends most recent
        if self._threshold is not None:
            keep = splitmix64(rev, self.seed) < self._threshold
            if not keep[0]:
                last_tokens = bt  # the partial block was not sampled
            rev = rev[keep]
            if rev.size == 0:
                return
        self.sampled_tokens += (rev.size - 1) * bt + last_tokens
        if self._pending_refs and self._pending_refs + rev.size > self.batch_refs:
            self._flush()  # a batch ends before the request that would overfill it
        self._pending.append((rev, last_tokens))
        self._pending_refs += rev.size

    def add_chunk(self, ids: np.ndarray, counts: np.ndarray, input_lengths: np.ndarray) -> None:
        """Add many requests at once, in trace order.

        `ids` their blocks' ids back to back, `counts[i]` request i's blocks,
        `input_lengths[i]` its tokens (a spool chunk's ids and its records' `n` and
        `input`). As `add` on each, without Python per request; bad input raises ValueError
        and changes nothing."""
        ids, counts, lengths = np.asarray(ids), np.asarray(counts), np.asarray(input_lengths)
        if (ids.ndim != 1 or counts.ndim != 1 or lengths.shape != counts.shape
                or any(a.dtype.kind not in "iu" for a in (ids, counts, lengths))):
            raise ValueError("add_chunk takes 1-d integer arrays: ids, and counts and "
                             "input_lengths with one entry per request")
        m, n = counts.size, ids.size
        if m == 0:
            if n:
                raise ValueError(f"{n} ids but no requests")
            return
        counts, lengths = counts.astype(np.int64), lengths.astype(np.int64)
        if counts.min() < 1 or int(counts.sum()) != n:
            raise ValueError(f"counts must be >= 1 each and add up to the {n} ids")
        bt = self.block_tokens
        bad = np.flatnonzero((lengths <= (counts - 1) * bt) | (lengths > counts * bt))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"request {i} of the chunk: {lengths[i]} tokens do not fit "
                             f"{counts[i]} blocks of {bt}")
        if ids.dtype.kind == "i" and ids.min() < 0:
            raise ValueError("ids must be >= 0")
        top = int(ids.max())
        req_of = np.repeat(np.arange(m, dtype=np.int64), counts)
        if m * (top + 1) < 1 << 62:  # (request, id) pairs in one int64 each
            pairs = np.sort(req_of * (top + 1) + ids)
            twice = pairs[1:] == pairs[:-1]
        else:
            order = np.lexsort((ids, req_of))
            twice = (ids[order][1:] == ids[order][:-1]) & (req_of[order][1:] == req_of[order][:-1])
        if twice.any():
            raise ValueError("a request names the same key twice (ids name prefixes)")
        seen, fresh = self._seen, 0
        if top >= seen:  # the new ids must be exactly seen .. seen + fresh - 1
            fresh = int(np.unique(ids[ids >= seen]).size)
            if top != seen + fresh - 1:
                raise ValueError("ids must be dense: a new key is numbered the count of keys "
                                 f"seen so far ({seen}), in order of first appearance")
        self._grow_keys(seen + fresh)
        self._seen = seen + fresh
        self.requests += m
        self.references += n
        self.total_tokens += int(lengths.sum())
        self.longest = max(self.longest, int(counts.max()))

        starts = np.cumsum(counts) - counts
        keys = ids[np.repeat(2 * starts + counts - 1, counts) - np.arange(n)]  # last-first
        tokens = np.full(n, bt, np.int64)
        tokens[starts] = lengths - (counts - 1) * bt
        lens = counts
        if self._threshold is not None:
            keep = splitmix64(keys, self.seed) < self._threshold
            keys, tokens = keys[keep], tokens[keep]
            lens = np.add.reduceat(keep.astype(np.int64), starts)
            lens = lens[lens > 0]
        self.sampled_tokens += int(tokens.sum())
        self._flush()  # requests `add`ed before come first
        # batches as `add` makes them: one ends before the request that would overfill it
        cuts, filled = [0], 0
        for i, size in enumerate(lens.tolist()):
            if filled and filled + size > self.batch_refs:
                cuts.append(i)
                filled = 0
            filled += size
        cuts.append(lens.size)
        ends = np.cumsum(lens)
        for a, b in zip(cuts[:-1], cuts[1:]):
            r0, r1 = int(ends[a] - lens[a]), int(ends[b - 1])
            self._process(keys[r0:r1], tokens[r0:r1], lens[a:b] if b - a > 1 else None)

    @property
    def time_slots(self) -> int:
        """The length of the time axis the live-times bitmap covers.

        About twice the tracked keys, renumbered as it fills: what bounds the memory, with
        the keys."""
        return self._live.slots

    def extend(self, requests: Iterable[tuple[Sequence[int] | np.ndarray, int]]) -> LRUStackDistance:
        """`add` each `(ids, input_length)` request in order; returns self."""
        for ids, input_length in requests:
            self.add(ids, input_length)
        return self

    def result(self) -> LRUCurve:
        """The curve of every request added so far (more may be added after)."""
        self._flush()
        return LRUCurve(self.block_tokens, self.rate, self.seed, self.requests, self.references,
                        self.sampled_references, self._tracked, self.total_tokens,
                        self.sampled_tokens, self.compulsory_tokens, self.longest,
                        self._hist[:self._tracked + 1].copy(), self._merged.count)

    # ---- the batch ----------------------------------------------------------------------
    def _flush(self) -> None:
        if not self._pending:
            return
        reqs, self._pending, self._pending_refs = self._pending, [], 0
        if len(reqs) == 1:
            keys, lens = reqs[0][0], None
        else:
            keys = np.concatenate([r for r, _ in reqs])
            lens = np.fromiter((r.size for r, _ in reqs), np.int64, len(reqs))
        tokens = np.full(keys.size, self.block_tokens, np.int64)
        if lens is None:
            tokens[0] = reqs[0][1]  # a request's last block comes first
        else:
            tokens[np.cumsum(lens) - lens] = [t for _, t in reqs]
        self._process(keys, tokens, lens)

    def _process(self, keys: np.ndarray, tokens: np.ndarray, lens: np.ndarray | None) -> None:
        """One batch: requests back to back (`lens` each one's sampled blocks; None: one
        request), each last block first, with each block's tokens."""
        k = keys.size
        self.sampled_references += k
        if self._now + k > self._live.slots:
            self._renumber(k)
        now = self._now
        before = self._last[keys]  # the latest use before the batch (-1: none)
        latest: np.ndarray | None
        if lens is None or len(lens) == 1:  # no key twice: each previous use is before it
            fresh = before < 0
            from_before = ~fresh
            dist = self._live.above(before)  # (meaningless where fresh, and unused)
            prev_tokens = self._tokens[keys]
            latest = None
        else:
            dist, fresh, from_before, prev_tokens, latest = self._batch(keys, tokens, lens,
                                                                        before, now)
        self._tracked += int(np.count_nonzero(fresh))
        self._grow_hist(self._tracked + 1)
        odd = ~fresh & ((prev_tokens != tokens) | self._stepped[keys])
        if odd.any():
            slow = np.isin(keys, keys[odd])
            self._staircases(keys, dist, tokens, fresh, slow)
            fast = ~fresh & ~slow
        else:
            fast = ~fresh
        np.add.at(self._hist, dist[fast], tokens[fast])
        self.compulsory_tokens += int(tokens[fresh].sum())

        self._live.update(before[from_before], now, k, latest)
        if latest is None:
            self._last[keys] = now + self._iota(k)
            self._tokens[keys] = tokens
        else:
            kept = keys[latest]
            self._last[kept] = now + np.flatnonzero(latest)
            self._tokens[kept] = tokens[latest]
        self._now = now + -(-k // _WORD) * _WORD

    def _batch(self, keys: np.ndarray, tokens: np.ndarray, lens: np.ndarray,
               before: np.ndarray, now: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Distances in a batch of several requests (laid out one after another, each last
        block first, at times `now`, `now + 1`, ...): (distances, fresh, previous use before
        the batch, the previous use's tokens, latest use in the batch), by key use."""
        k = keys.size
        starts = np.cumsum(lens) - lens
        order = np.argsort(keys, kind="stable")  # the previous use within the batch, if any
        sorted_keys = keys[order]
        same = sorted_keys[1:] == sorted_keys[:-1]
        earlier, later = order[:-1][same], order[1:][same]
        prev_in = np.full(k, -1, np.int64)
        prev_in[later] = earlier
        latest = np.ones(k, bool)
        latest[earlier] = False
        start_of = np.repeat(starts, lens)
        inside = prev_in >= 0
        used_at = np.where(inside, now + prev_in, before)  # the previous use's time
        fresh = used_at < 0
        from_before = ~inside & ~fresh
        dist = np.zeros(k, np.int64)
        dist[from_before] = self._live.above(before[from_before])
        # Keys that earlier requests of the batch used and that were below this one (used
        # before its previous use, or new) now lie above it...
        rows = np.flatnonzero(~fresh & (start_of > 0))
        if rows.size:
            width = int(starts[-1])  # uses in requests before the last
            new_before: np.ndarray = np.cumsum(fresh[:width + 1]) - fresh[:width + 1]
            dist[rows] += new_before[start_of[rows]]  # new keys: below everything
            cols = np.flatnonzero(~fresh[:width])  # the others: a small matrix
            if cols.size:
                above = (used_at[cols][None, :] < used_at[rows, None]) & (
                    cols[None, :] < start_of[rows, None])
                dist[rows] += np.count_nonzero(above, axis=1)
        # ... less the uses up to its previous use in the batch, which counted them
        dist[inside] -= prev_in[inside] + 1
        prev_tokens = np.where(inside, tokens[np.maximum(prev_in, 0)], self._tokens[keys])
        return dist, fresh, from_before, prev_tokens, latest

    def _iota(self, n: int) -> np.ndarray:
        if n > len(self._arange):
            self._arange = np.arange(max(n, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:n]

    def _staircases(self, keys: np.ndarray, dist: np.ndarray, tokens: np.ndarray,
                    fresh: np.ndarray, slow: np.ndarray) -> None:
        """The uses of keys with more than one token count, in order (rare: a Python loop)."""
        hist = self._hist
        for i in np.flatnonzero(slow).tolist():
            key, w = int(keys[i]), int(tokens[i])
            if fresh[i]:
                steps = self._steps[key] = [(_INF, w)]
            else:
                steps = self._steps.setdefault(key, [(_INF, int(self._tokens[key]))])
                _staircase_hit(steps, int(dist[i]), w, hist)
                if len(steps) > MAX_STEPS:
                    del steps[1]
                    self._merged(1, f"key {key}: {MAX_STEPS} steps; the curve is no longer exact")
            self._tokens[key] = w
        for key in np.unique(keys[slow]).tolist():
            if len(self._steps[key]) == 1:  # one count again: back to the fast path
                del self._steps[key]
                self._stepped[key] = False
            else:
                self._stepped[key] = True

    # ---- memory -------------------------------------------------------------------------
    def _renumber(self, batch: int) -> None:
        """Give the live times the numbers 0..n-1 in their order, so the time axis stays
        about twice the tracked keys (growing it if the keys have outgrown it)."""
        live_keys = np.flatnonzero(self._last[:self._seen] >= 0)
        n = live_keys.size
        ranked = live_keys[np.argsort(self._last[live_keys], kind="stable")]
        self._last[ranked] = np.arange(n)
        need = 2 * n + 2 * batch + _WORD * _GROUP
        if need > self._live.slots:
            step = _WORD * _GROUP
            self._live = _LiveTimes(-(-need // step) * step)
        self._live.reset(n)
        self._now = -(-n // _WORD) * _WORD

    def _grow_keys(self, n: int) -> None:
        size = len(self._last)
        if n <= size:
            return
        size = max(n, 2 * size)
        self._last = np.concatenate((self._last, np.full(size - len(self._last), _NEVER, np.int64)))
        self._tokens = np.concatenate((self._tokens, np.zeros(size - len(self._tokens), np.int32)))
        self._stepped = np.concatenate((self._stepped, np.zeros(size - len(self._stepped), bool)))
        self._slot = np.zeros(size, np.int32)

    def _grow_hist(self, n: int) -> None:
        if n > len(self._hist):
            self._hist = np.concatenate((self._hist, np.zeros(max(n, 2 * len(self._hist))
                                                               - len(self._hist), np.int64)))


def dense_requests(keys: Iterable[Sequence[bytes]], input_lengths: Iterable[int]
                   ) -> Iterator[tuple[np.ndarray, int]]:
    """`(ids, input_length)` per request, from each request's block keys.

    The keys are e.g. `PreparedTrace.keys`; they are numbered densely in order of first
    appearance (a dict of the distinct keys)."""
    ids: dict[bytes, int] = {}
    for ks, n in zip(keys, input_lengths, strict=True):
        yield np.fromiter((ids.setdefault(k, len(ids)) for k in ks), np.uint32, len(ks)), n


def lru_curve(requests: Iterable[tuple[Sequence[int] | np.ndarray, int]], block_tokens: int,
              rate: float = 1.0, seed: int = 0) -> LRUCurve:
    """LRU's hit-rate curve of a stream of `(ids, input_length)` requests, in one pass.

    See `LRUStackDistance`."""
    return LRUStackDistance(block_tokens, rate, seed).extend(requests).result()
