"""`kvheat`: the default eviction policy, decayed-frequency heat on the cache's own clock.

A block's key is its exponentially decayed access count on a virtual clock (`HeatClock`,
counts.py) times its penalty factors (`Penalties`, penalties.py): `KVHeat.key`. The
coldest evictable leaf goes first, from one `BlockHeap` (heap.py). While it runs the policy
adapts (feedback.py): the half-life follows the measured reuse gap times a multiple that
miniature simulations choose (miniature.py: two small caches of the same policy, an
octave of the multiple either side, on a spatial sample of the keys), the entropy regime
sets the penalties' flags, the optional drift detector drops stale heat. The cache's hooks
below have the per-access work inlined: they are the hot path of every replay and server.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Sequence
from typing import Any

from ..cache.eviction import EvictionPolicy, register_policy
from ..cache.hints import Outcome
from ..cache.node import Node
from .counts import SHARED, HeatClock, HeatFields, HeatRecord
from .entropy import EntropyTracker
from .feedback import Feedback
from .heap import BlockHeap
from .miniature import MIN_CAPACITY, MINI_BLOCKS, MultipleSelector
from .penalties import EXTENSION, FLAG_BITS, FRESH, PINNED, Penalties
from .protect import PROTECTED, Protection
from .reuse import ReuseGapEstimator
from .sessions import CLASS_MASK, CLASS_SHIFT, MAX_CLASSES, SessionBook

# What the ghost history keeps of an evicted block: its record's fields, as a tuple
# (count, generation, last access, flags).
Remembered = tuple[float, int, float, int]


@register_policy("kvheat")
class KVHeat(EvictionPolicy):
    """Decayed-frequency heat with history, suffix demotion and optional adaptation.

    The half-life is a multiple (`reuse_mult` to start) of the workload's typical reuse
    gap, measured online (`ReuseGapEstimator`), unless `half_life` fixes it (in block
    accesses); every penalty is a number of half-lives. `adapt` picks who moves the
    multiple: "miniature" (the default: `MultipleSelector`, miniature.py, whose
    miniatures hold at least `mini_blocks` blocks; a cache under 64 blocks falls back to
    "victims"), "victims" (the previous default: it follows which victims come back,
    feedback.py) or "off" (fixed). Each block's `rec` is its `HeatRecord`. Evicted keys keep
    their count for a while (the ghost history), so a prefix that comes back resumes its
    heat.

    Request hints (kvheat/cache/hints.py), where a caller passes them: a request's end
    (outcome, finish reason) charges its session's blocks the age its end class has earned
    (`SessionBook`, sessions.py: the class's return gaps and the share of its sessions that
    return, the session's own pace); blocks a queued request needs are held back from
    eviction while any other block can go. Without hints, no decision changes.
    """

    name = "kvheat"

    # Every default is dimensionless (a multiple of the learned half-life, a count of
    # depth-1 accesses for the entropy window, bits for the regime): docs/heat.md has the
    # measurements behind each, at every time scale and capacity.
    def __init__(self, half_life: float | None = None, reuse_mult: float = 1.0,
                 reuse_quantile: float = 0.5, ghost: float = 8.0, tail_penalty: float = 6.67,
                 regime: bool = True, admit_penalty: float = 3.2, pin_bonus: float = 4.0,
                 tune: bool = False, drift: bool = False, entropy_half_life: float = 1024.0,
                 drift_window: int = 2048, drift_threshold: float = 1.0,
                 extension_penalty: float = 2.67, adapt_extension: bool = True,
                 max_count: float = math.inf, entropy_sample: int = 1,
                 penalty_fade: float = 2.0, adapt_mult: bool = True,
                 session_hints: str = "horizon", session_rate: bool = True,
                 session_own: bool = False,
                 queue_hints: bool = True, admit_now: bool = True,
                 regime_warmup: bool = True, admit_floor: float | None = 1.6,
                 adapt: str = "miniature", mini_blocks: int = MINI_BLOCKS,
                 protect: bool = True) -> None:
        super().__init__()
        if type(protect) is not bool:
            raise ValueError(f"protect must be a bool, got {protect!r}")
        if adapt not in ("miniature", "victims", "off"):
            raise ValueError(f"adapt must be miniature, victims or off, got {adapt!r}")
        if type(mini_blocks) is not int or mini_blocks < 1:
            raise ValueError(f"mini_blocks must be an integer >= 1, got {mini_blocks!r}")
        self.mini_blocks = mini_blocks
        # A candidate of the miniature simulations is this policy with its multiple set
        # from outside (`set_multiple`) and the live one's regime (miniature.py).
        self._candidate: dict[str, Any] = dict(
            half_life=1024.0, reuse_mult=reuse_mult, reuse_quantile=reuse_quantile,
            ghost=ghost, tail_penalty=tail_penalty, regime=False, admit_penalty=admit_penalty,
            pin_bonus=pin_bonus, extension_penalty=extension_penalty,
            adapt_extension=adapt_extension, max_count=max_count, penalty_fade=penalty_fade,
            session_hints=session_hints, session_rate=session_rate, session_own=session_own,
            queue_hints=queue_hints, admit_now=admit_now, regime_warmup=regime_warmup,
            admit_floor=admit_floor, adapt="off", protect=False)
        # The miniatures may switch protection on (protect.py) where it serves more.
        self.protect = protect
        self.adapt = adapt if half_life is None and not tune else "off"
        if self.adapt != "victims":
            adapt_mult = False
        if entropy_sample < 1:
            raise ValueError("entropy_sample must be >= 1")
        if half_life is not None and half_life <= 0:
            raise ValueError("half_life must be positive (block accesses)")
        if reuse_mult <= 0:
            raise ValueError("reuse_mult must be positive")
        # (a floor at or above admit_penalty keeps all of it on, as None does: so
        # `admit_penalty=0.8` alone is the default with a lighter charge, not an error)
        if admit_floor is not None and not admit_floor >= 0:
            raise ValueError(f"admit_floor must be >= 0 half-lives (or None), got {admit_floor!r}")
        self.heap = BlockHeap(self.key, self.keys)
        # until bound (the cache's size) and then measured, unless fixed
        self.clock = HeatClock(half_life if half_life is not None else 1024.0, max_count,
                               self.heap.rekey)
        self.penalties = Penalties(tail_penalty, admit_penalty, pin_bonus, extension_penalty,
                                   adapt_extension, penalty_fade, admit_now)
        # The admission penalty above `admit_floor` half-lives fades with the eviction age
        # as the extension penalty does (None: all of it stays on). `admit_now`,
        # `regime_warmup` and 3.2 fading to 1.6 are docs/heat.md's "The regime's warm-up":
        # early one-timers charged like later ones. The previous default is
        # `admit_now=False, regime_warmup=False, admit_penalty=1.6, admit_floor=None`.
        if admit_floor is not None:
            self.penalties.admit_fade, self.penalties.admit_floor = True, admit_floor
        # The workload's reuse gap, measured on a sample of keys unless `half_life` fixes
        # the half-life (then nothing is sampled and the estimate stays None).
        self.gaps = ReuseGapEstimator(quantile=reuse_quantile)
        self._sample_below = self.gaps.threshold if half_life is None else 0
        self.feedback = Feedback(
            self.clock, self.penalties, self.heap, self.gaps, half_life, reuse_mult, regime,
            tune, drift, entropy_half_life, entropy_sample, drift_window, drift_threshold,
            adapt_mult and half_life is None and not tune, regime_warmup)
        self.evict_age = 0.0  # mean age at eviction since last access, accesses (EWMA)
        self.evictions = 0
        self.ghost_mult = ghost
        # History in two generations of plain dicts (O(1), no per-entry links): new
        # entries go to `ghost`; when it holds `ghost_limit` keys (2/3 of `ghost` ×
        # capacity) it becomes `ghost_old` and the older one is dropped, so the last
        # 2/3..4/3 × `ghost` × capacity evictions are kept, `ghost` × capacity on average.
        self.ghost: dict[bytes, Remembered] = {}
        self.ghost_old: dict[bytes, Remembered] = {}
        self.ghost_limit = 0
        self.ghost_hits = 0
        if session_hints not in ("log", "linear", "horizon", "off"):
            raise ValueError("session_hints must be log, linear, horizon or off, got "
                             f"{session_hints!r}")
        self.session_hints = session_hints
        self.session_rate = session_rate
        self.session_own = session_own
        self.book: SessionBook | None = None  # made at the first session hint
        self.session_charge: list[float] = []  # per end class, once the book is made
        self.classed = False  # blocks carry end classes (`_classes_on`)
        self.queue_hints = queue_hints
        self.selector: MultipleSelector | None = None  # made at the first insert (bind)
        self._want_selector = False
        # The miniatures read requests off the hooks (a depth-0 block or a new timestamp
        # starts one), unless the caller hands each whole request over (`observe_request`)
        self._hook_feed = True
        self.queued: dict[bytes, int] = {}  # keys queued requests need -> how many
        self.queued_by: dict[str, Sequence[bytes]] = {}
        self.held: list[Node] = []  # victims kept back while queued
        # While on, a protected set and a probation queue around the heap (protect.py):
        # switched by the miniatures (`set_protect`).
        self.guard: Protection | None = None

    # -- the key ---------------------------------------------------------------------
    def key(self, b: Node) -> float:
        """`b`'s eviction key, the smallest goes first (`keys`)."""
        return self.keys((b,))[0]

    def keys(self, blocks: Sequence[Node]) -> list[float]:
        """Each block's eviction key, in one call (the heap's push of a request's blocks).

        Its decayed access count (brought to the current generation) times its flags'
        factor, and the tail factor when it is shorter than a full block."""
        clock, p = self.clock, self.penalties
        gen, flag, tail, full = clock.gen, p.flag, p.tail, p.block_size
        rescale = clock.rescale
        out = []
        for b in blocks:
            r: HeatFields = b.rec
            if r.gen != gen:
                rescale(r)
            st = r.flags
            k = r.count * flag[st]
            if st >= FLAG_BITS and type(r) is HeatRecord:  # released by a session's request
                k *= r.own  # its own pace
            out.append(k * tail if b.num_tokens < full else k)
        return out

    def raise_key(self, b: Node, k: float) -> None:
        """Set `b`'s count so that its key is `k`, right after `key(b)` read a lower one.

        Its heap entry stays a lower bound: see `take_lazy`."""
        r: HeatFields = b.rec
        p = self.penalties
        if b.num_tokens < p.block_size:
            k /= p.tail
        if r.flags >= FLAG_BITS and type(r) is HeatRecord:
            k /= r.own
        r.count = k / p.flag[r.flags]

    # -- accesses --------------------------------------------------------------------
    def on_insert(self, b: Node, now: float) -> None:
        # Runs once per block filled: flags precomputed, few attribute lookups.
        clock, pen, fb = self.clock, self.penalties, self.feedback
        if now != clock.t:
            clock.advance(now)
        clock.accesses += 1
        w = clock.weight
        n = b.num_tokens
        bs = pen.block_size
        if n > bs:
            pen.block_size = bs = n
        key = b.key
        assert key is not None  # the block is cached
        if key[0] < self._sample_below and self.gaps.observe(key, clock.v):
            fb.reuse_gap_moved()
            w = clock.weight
        sel = self.selector
        if sel is None and self._want_selector:
            sel = self._start_selector()
        if sel is not None and self._hook_feed:
            if now != sel.pending.now or b.depth == 0:
                sel.boundary(now)
            if key[1] < sel.threshold:
                sel.access(key, b)
        r: HeatFields | None = b.rec
        if r is None:  # the block's first insert: its record is reused from then on
            r = b.rec = HeatRecord()
        g = self.ghost.pop(key, None)
        if g is None and self.ghost_old:
            g = self.ghost_old.pop(key, None)
        gap = 0.0
        if g is None:
            st = pen.new_flags
            p = b.parent
            if p is not None and pen.extensions:
                # A new block extending a prefix known before this request (hit now, or
                # back from the ghost: count > 1) below depth 0 is an appended suffix; a
                # new parent passes its flag on down the chain.
                pr: HeatFields = p.rec
                if p.inserted_at != now or pr.count != w:
                    if p.depth >= 1:
                        st |= EXTENSION
                else:
                    st |= pr.flags & EXTENSION
            if n == bs:
                # Inserted counts are added to `reuse` in batches of 64 (exact: the
                # smoothing only applies at the batch end).
                if st & EXTENSION:
                    pen.ext_seen += 1
                else:
                    st |= FRESH
                pen.first_seen += 1
                if pen.first_seen >= 64:
                    pen.update(self.gaps.estimate, self.evictions, self.evict_age)
            r.count = w
        else:
            self.ghost_hits += 1
            m, gen, v, st = g
            gap = clock.v - v
            if fb.adapt_mult:
                fb.victim_returned(m, gen, v, self.evictions)
                w = clock.weight
            if gen != clock.gen:
                m = clock.convert(m, gen, v)
            r.count = m + w
            if st & (EXTENSION | FRESH):
                pen.reuse[0 if st & EXTENSION else 2] += 1.0
            st = 0
        if pen.pin_roots and b.depth == 0:
            st |= PINNED
        if self.classed and type(r) is HeatRecord:
            r.owner = None  # a new key: no session has used it yet
        r.gen = clock.gen
        r.last = clock.v
        r.flags = st
        r.gap = gap
        if self.guard is not None:
            self.guard.inserted(b, gap, clock.v)
        if ((b.depth == 1 and fb.watch_keys) or fb.tuner is not None) \
                and fb.observe(b, False):
            self.forget_heat()

    def on_hit(self, b: Node, now: float) -> None:
        self.on_hit_all((b,), now)

    def on_hit_all(self, blocks: Iterable[Node], now: float) -> None:
        """`on_hit` of each block in order, at one timestamp, in one call.

        For a request's reused blocks."""
        clock, gaps, below = self.clock, self.gaps, self._sample_below
        if now != clock.t:
            clock.advance(now)
        fb = self.feedback
        observe = fb.observe if fb.watch_keys or fb.tuner is not None else None
        tuned = fb.tuner is not None
        reuse = self.penalties.reuse
        sel = self.selector if self._hook_feed else None
        t = sel.threshold if sel is not None else 0
        guard = self.guard
        for b in blocks:
            clock.accesses += 1
            key = b.key
            assert key is not None  # the block is cached
            if sel is not None:
                if now != sel.pending.now or b.depth == 0:
                    sel.boundary(now)
                if key[1] < t:
                    sel.access(key, b)
            if key[0] < below and gaps.observe(key, clock.v):
                fb.reuse_gap_moved()  # may start a generation: read the clock per block
            r: HeatFields = b.rec
            if r.gen != clock.gen:
                clock.rescale(r)
            m = r.count + clock.weight
            cap = clock.cap
            r.count = m if m < cap else cap
            if guard is not None:
                r.gap = clock.v - r.last
                r.last = clock.v
                guard.hit(b)
            else:
                r.last = clock.v
            st = r.flags
            if st > PINNED:
                if st & (EXTENSION | FRESH):
                    reuse[0 if st & EXTENSION else 2] += 1.0
                r.flags = st & PINNED  # seen again: no longer a one-off
            if observe is not None and (b.depth == 1 or tuned) and observe(b, True):
                self.forget_heat()

    def move_access(self, b: Node, weight: float, now: float) -> None:
        """Move `b`'s access counted earlier with `weight` (the clock's weight then) to `now`.

        The same count, dated later: a caller that counted a use early, at a load's start,
        moves it to the request's end. Nothing moves across a generation."""
        clock = self.clock
        if now != clock.t:
            clock.advance(now)
        r: HeatFields = b.rec
        if r.gen == clock.gen:
            r.count += clock.weight - weight
            r.last = clock.v
            if self.guard is not None and b.state == PROTECTED:
                self.guard.hit(b)  # (its place in the list by last use)

    # -- hints (kvheat/cache/hints.py, kvheat/heat/sessions.py) ------------------------
    # Each hook runs once per request, so its cost is per request, not per block (a short
    # request pays it over few blocks): a session hint alone is a dict pop, an end of one
    # class (sessions without finish reasons) a dict update, and the per-block work (the
    # class bits, the owner, a flag table with a row per class) starts at the first end
    # of a second class (`_classes_on`).
    def _sessions(self) -> SessionBook:
        book = self.book
        if book is None:
            book = self.book = SessionBook(use_rate=self.session_rate,
                                           track_own=self.session_own)
            # per class, the age it charges (`Penalties.session` once classes are on)
            self.session_charge = [0.0] * MAX_CLASSES
        return book

    def _classes_on(self) -> None:
        """Blocks start carrying end classes: the flag table gets its row per class (from
        the charges learned so far; the base row is what it was: `factors` is a function
        of the penalties' state alone), and a new key's owner is reset from now on
        (`on_insert`; no owner was set before)."""
        self.classed = True
        pen = self.penalties
        pen.session = self.session_charge
        pen.factors()

    def on_session(self, session: str, now: float) -> None:
        # (the clock is not advanced here: the accesses so far are the time, and a session
        # hint alone, without ends, changes no decision)
        if self.selector is not None and self._hook_feed:
            self.selector.session(session)
        book = self.book
        if book is None:
            if self.session_hints == "off":
                return
            book = self._sessions()
        if book.came_back(session, self.clock.accesses):  # (an int: exact, as a float)
            self._session_charges()

    def _session_charges(self) -> None:
        book = self._sessions()
        charge = self.session_charge
        if self.session_hints == "horizon":
            book.horizon = self.evict_age if self.evictions else None
            if book.horizon is None:
                return
            book._charges()
            charge[:] = book.charge
        elif self.session_hints == "linear":
            gap = self.gaps.estimate or self.clock.half_life
            ref = book.gaps[0].median
            for c in range(1, MAX_CLASSES):
                m = book.gaps[c].median
                charge[c] = 0.0 if m is None or ref is None else (2.0 ** m - 2.0 ** ref) / gap
        else:
            charge[:] = book.charge
        if self.classed:  # (before, no block has a class: the rows are read by none)
            self.penalties.factors()

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        """Put the request's end class on its blocks (the flags' class bits).

        The release that follows pushes them at their charged key."""
        if self.selector is not None and self._hook_feed:
            self.selector.finish(outcome, reason)
        book = self.book
        if book is None:
            if self.session_hints == "off":
                return
            book = self._sessions()
        c = book.finished.get(reason) if outcome is Outcome.FINISHED else None
        if c is None:
            c = book.class_of(outcome, reason)
        own = 1.0
        if session is not None:
            if book.ended_now(session, self.clock.accesses, c):
                self._session_charges()
            if self.session_own and book.reasons:
                # the pace within finish classes, once the caller passes finish reasons
                # (sessions alone pool every kind of wait: measured, it cost points on the
                # conversation trace, docs/heat.md)
                own = 2.0 ** (-book.own * self.penalties.scale)
        if own == 1.0 and len(book.classes) == 1:
            # One class alone is charged exactly 0 (sessions without finish reasons): the
            # blocks keep no class (their hits and inserts cleared it), at no cost per block.
            return
        if not self.classed:
            self._classes_on()
        bits = c << CLASS_SHIFT
        keep = ~CLASS_MASK
        paced = self.session_own  # (else every `own` is 1.0, as each record's)
        for b in blocks:  # every block of the request: the loop is kept lean
            r = b.rec
            if r is None or b.key is None:
                continue
            if type(r) is HeatRecord:
                owner = r.owner
                if owner is not session and session is not None:
                    if owner is None:
                        r.owner = session
                    elif owner is SHARED or owner != session:
                        # a prefix other sessions use too: no one's end
                        r.owner = SHARED
                        r.flags &= keep
                        continue
                elif owner is SHARED:  # (no session: only the shared are told apart)
                    r.flags &= keep
                    continue
                if paced:
                    r.own = own
                r.flags = (r.flags & keep) | bits
            else:  # a vLLM offload chunk is its own record: no owner, no pace
                r.flags = (r.flags & keep) | bits

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        if not self.queue_hints:
            return
        q = self.queued
        for k in keys:
            q[k] = q.get(k, 0) + 1
        self.queued_by[request_id] = keys

    def on_dequeue(self, request_id: str) -> None:
        keys = self.queued_by.pop(request_id, None)
        if keys is None:
            return
        q = self.queued
        for k in keys:
            n = q[k] - 1
            if n:
                q[k] = n
            else:
                del q[k]
        if self.held:  # victims kept back for a queued request: back in the heap
            held, self.held = self.held, []
            # those still cached and out of the heap (`BlockHeap.pop` set their heap_slot
            # to NaN; a release since pushed them back in, with a live one)
            back = [b for b in held if b.key is not None and math.isnan(b.heap_slot)
                    and not self.queued_on_probation(b)]
            if back:
                self.release_all(back)

    # -- the heap --------------------------------------------------------------------
    def on_release(self, b: Node, now: float) -> None:
        self.release_all((b,))

    def on_release_all(self, blocks: list[Node], now: float) -> None:
        # The cache's batched release (a request's blocks, tail-first, after their refcounts
        # changed): the same as `on_release` of each.
        self.release_all(blocks)

    def release_all(self, blocks: Iterable[Node]) -> None:
        """`on_release` of each block in order, in one call.

        For a caller releasing many at once, outside the cache."""
        if self.guard is None:
            self.heap.push(blocks)
        else:
            self.guard.route(blocks)

    def on_leaf(self, b: Node) -> None:
        if b.parked is not None:  # met while it had children: back in
            if self.guard is None:
                self.heap.push((b,))
            else:
                self.guard.leaf(b)

    def _next_victim(self) -> Node | None:
        guard = self.guard
        if guard is None:
            return self.heap.pop()
        return guard.victim(self.clock.v, self.gaps.estimate or float(self.capacity))

    def victim(self) -> Node | None:
        b = self._next_victim()
        if self.queued and b is not None and b.key in self.queued:
            # A queued request needs it: keep it back while a block no request waits for
            # is evictable.
            held, queued, pop = self.held, self.queued, self._next_victim
            while b is not None and b.key in queued:
                held.append(b)
                b = pop()
        if b is None and self.held:  # the last resort: the blocks kept back, oldest first
            held = self.held
            while held:
                h = held.pop(0)
                # (popped from the heap, so heap_slot NaN: not pushed back since; nor
                # queued again on probation)
                if (h.key is not None and math.isnan(h.heap_slot) and not h.ref_cnt
                        and not h.num_children and not self.queued_on_probation(h)):
                    return h
        return b

    def take_lazy(self, n: int, protected: Container[object]
                  ) -> tuple[list[Node], list[Node]]:
        """Up to `n` victims for a caller that saves the push at each hit.

        vLLM's offload tier, `KVHeatCachePolicy`: see `BlockHeap.take_lazy` (probation
        blocks first while protection is on)."""
        guard = self.guard
        if guard is None:
            return self.heap.take_lazy(n, protected)
        picked, skipped = guard.take(n, protected, self.clock.v,
                                     self.gaps.estimate or float(self.capacity))
        if len(picked) < n:
            more, skipped_more = self.heap.take_lazy(n - len(picked), protected)
            picked += more
            skipped += skipped_more
        return picked, skipped

    def forget(self, b: Node) -> None:
        self.heap.forget(b)
        if self.guard is not None:
            self.guard.forget(b)

    def queued_on_probation(self, b: Node) -> bool:
        """Whether `b` waits in the probation queue (protect.py) for its turn to go."""
        return self.guard is not None and b.queue is self.guard.probation

    def hold_out(self, b: Node) -> None:
        """Take unreferenced `b` out of the probation queue while a caller holds it back.

        As out of the heap: the caller pushes it back with `release_all`."""
        if self.guard is not None and self.queued_on_probation(b):
            self.guard.probation.remove(b)

    # -- evictions -------------------------------------------------------------------
    def on_evict(self, b: Node) -> None:
        """Record `b` leaving the cache: its age, its heat, and its count in the ghost history.

        The eviction age, the median victim's heat (for the multiple's feedback), and the
        ghost history keeps its count."""
        r: HeatFields = b.rec
        if self.guard is not None:
            self.guard.forget(b)
        # EWMA over about the last 250 evictions, its start unbiased (a mean until then)
        self.evictions = n_ev = self.evictions + 1
        last = r.last
        self.evict_age += ((self.clock.accesses - last - self.evict_age)
                           / (n_ev if n_ev < 250 else 250))
        m = r.count
        if m > 0 and self.feedback.adapt_mult:
            self.feedback.victim_heat(m, r.gen, last, n_ev)
        ghost = self.ghost
        key = b.key
        assert key is not None  # the block is still cached
        ghost[key] = (m, r.gen, last, r.flags)
        if len(ghost) >= self.ghost_limit:
            self.ghost_old = ghost if self.ghost_limit else {}
            self.ghost = {}

    def on_evict_all(self, blocks: Iterable[Node]) -> None:
        """`on_evict` of each block in order."""
        for b in blocks:
            self.on_evict(b)

    def ghost_size(self) -> int:
        """Keys the ghost history holds."""
        return len(self.ghost) + len(self.ghost_old)

    def forget_heat(self) -> None:
        """Drop every cached count to at most one access now, and forget the history.

        O(cached blocks): the drift detector's answer to stale heat."""
        clock = self.clock
        lam, base = clock.lam, clock.base
        for b in self.heap.live():
            r: HeatFields = b.rec
            if r.gen != clock.gen:
                clock.rescale(r)
            one = math.exp(lam * (r.last - base))
            if r.count > one:
                r.count = one
        self.ghost.clear()
        self.ghost_old.clear()
        self.heap.rebuild()

    # -- setup and reports -----------------------------------------------------------
    def bind(self, capacity_blocks: int) -> None:
        super().bind(capacity_blocks)
        self.heap.bind(capacity_blocks, compact_at=2 * capacity_blocks + 256)
        self.ghost_limit = int(self.ghost_mult * capacity_blocks * 2 / 3)
        if self.feedback.fixed_half_life is None and self.gaps.estimate is None:
            # Until the first reuse gaps are in: the cache's own size, in accesses.
            self.clock.start(float(max(capacity_blocks, 1)))
        self.feedback.bind(capacity_blocks, self.ghost_limit)
        if self.guard is not None:
            self.guard.resize(capacity_blocks)
        if self.adapt == "miniature":
            if self.selector is not None and self.selector.capacity != capacity_blocks:
                self.selector = None  # re-bound to another size: new miniatures, same multiple
            if capacity_blocks >= MIN_CAPACITY:
                self.feedback.adapt_mult = False
                self._want_selector = self.selector is None
            else:  # too small for miniatures: the victims' feedback instead
                self.feedback.adapt_mult = True

    # -- the multiple, chosen by miniature simulation (miniature.py) -------------------
    def _start_selector(self) -> MultipleSelector:
        """The miniatures, made at the first insert (the block size is known by then)."""
        self._want_selector = False
        sel = self.selector = MultipleSelector(
            self, self._make_candidate,
            self.capacity, self.penalties.block_size, math.log2(self.feedback.reuse_mult),
            self.mini_blocks, alternate=self.protect)
        sel.sync()
        return sel

    def feed_by_request(self) -> None:
        """Feed the miniatures whole requests only, handed over by `observe_request`.

        For a caller whose events are not request-shaped (vLLM's offload tier inserts a
        request's chunks at its stores and counts its hits at its end)."""
        self._hook_feed = False

    def observe_request(self, keys: Sequence[bytes], session: str | None, outcome: Outcome,
                        reason: str | None, now: float) -> None:
        """Feed one whole request to the miniatures.

        The keys of its full blocks in prefix order (cached now or not), its session and how
        it ended."""
        sel = self.selector
        if sel is None:
            if not self._want_selector or self.penalties.block_size < 1:
                return  # (the miniatures start at the first insert: the block size known)
            sel = self._start_selector()
        sel.boundary(now)
        sel.pending.session = session
        t, full = sel.threshold, sel.block_tokens
        for depth, key in enumerate(keys):
            if key[1] < t:
                sel.access_key(key, depth, full)
        sel.finish(outcome, reason)

    def follow_multiple(self, mult: float) -> None:
        """The miniatures chose a multiple: the live policy takes it."""
        self.feedback.set_mult(mult)

    def set_protect(self, on: bool) -> None:
        """Switch protection (protect.py) on or off; the cached blocks stay.

        On: the blocks in the heap become protected (those held or parked when released);
        off: the probation blocks go back into the heap."""
        if on == (self.guard is not None):
            return
        if on:
            self.guard = Protection(self.heap, max(self.capacity, 1))
            if self.clock.accesses:
                self.guard.adopt(self.heap.live())
            return
        old, self.guard = self.guard, None
        assert old is not None
        back = [b for b in old.disband() if b.key is not None]
        if back:
            self.heap.push(back)

    @property
    def protecting(self) -> bool:
        """Whether protection is on."""
        return self.guard is not None

    def set_multiple(self, mult: float, half_life: float, mode: str) -> None:
        """Take a miniature candidate's settings from its selector.

        The multiple (the penalties keep their length in reuse gaps, as
        `Feedback.set_mult`), the half-life on its own clock and the live policy's entropy
        regime."""
        fb, pen = self.feedback, self.penalties
        fb.reuse_mult = mult
        scale = fb.base_reuse_mult / mult
        rekey = pen.follow_regime(mode)
        if scale != pen.scale:
            pen.scale = scale
            pen.factors()
            rekey = True
        if abs(math.log2(half_life / self.clock.half_life)) > 0.25:
            self.clock.set_half_life(half_life)
        elif rekey:
            self.heap.rekey()

    def explain(self) -> list[dict[str, float | bool]]:
        """What the miniatures decided, round by round (empty without them)."""
        return self.selector.explain() if self.selector is not None else []

    def set_cluster_entropy(self, bits: float) -> None:
        """Take the entropy (bits) of the keys under the roots over all the cluster's traffic.

        That is all the traffic a router spreads across this cache and its peers:
        `Feedback.set_cluster_entropy`."""
        self.feedback.set_cluster_entropy(bits)

    @property
    def mode(self) -> str:
        """The entropy regime: "low", "mid" or "high"."""
        return self.feedback.mode

    @property
    def tracker(self) -> EntropyTracker | None:
        """The decayed entropy of the keys under the roots.

        None: neither the regime nor drift watches them."""
        return self.feedback.tracker

    def _make_candidate(self) -> tuple[KVHeat, KVHeat]:
        """A miniature's policy: this one's settings, its multiple held by the selector."""
        pol = KVHeat(**self._candidate)
        return pol, pol

    @property
    def accesses(self) -> int:
        """Block accesses so far (the virtual clock's count)."""
        return self.clock.accesses

    @property
    def half_life(self) -> float:
        """The half-life, in block accesses."""
        return self.clock.half_life

    @property
    def reuse_mult(self) -> float:
        """The half-life's multiple of the measured reuse gap."""
        return self.feedback.reuse_mult

    def log_count(self, b: Node, vtime: float | None = None) -> float:
        """ln of `b`'s decayed access count at virtual time `vtime` (default: now)."""
        return self.clock.log_count(b.rec, vtime)

    def stats(self) -> dict[str, float]:
        fb, pen = self.feedback, self.penalties
        out = {"half_life_accesses": self.clock.half_life, "ghost_hits": self.ghost_hits,
               "admit_penalty": pen.admit_penalty, "evict_age": self.evict_age,
               "extension_penalty": pen.extension_penalty,
               "retunes": self.clock.retunes, "reuse_mult": fb.reuse_mult}
        if fb.regime_rekeys:  # (admit_now: regime changes that re-keyed the heap)
            out["regime_rekeys"] = fb.regime_rekeys
        if self.gaps.estimate is not None:
            out["reuse_gap_accesses"] = self.gaps.estimate
        if fb.tracker is not None:
            out["entropy_bits"] = fb.tracker.bits()
        if fb.cluster_left > 0 and fb.cluster_bits is not None:
            out["cluster_entropy_bits"] = fb.cluster_bits
        if fb.detector is not None:
            out["drifts"] = fb.detector.drifts
        if self.selector is not None:
            out.update(self.selector.stats())
        out["protect"] = float(self.guard is not None)
        if self.guard is not None:
            out.update(self.guard.stats())
        return out
