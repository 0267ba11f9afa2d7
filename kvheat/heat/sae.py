"""`sae`: Session-Aware Eviction, the policy vLLM PR #50422 proposes for its CPU offload
tier, as a baseline beside `lruk`, `arc` and the rest.

Implemented from the PR's published description (its purpose section and the design its
docstring states), not from its code; every constant is a named field of `SAEParams`
with the PR's default.

What the PR describes, and how it maps onto kvheat's block cache:

- **Sessions.** Blocks stored by one request form a session; a request whose lookup hit a
  resident block continues (merges into) the session of its last hit, a request with no
  hit opens a fresh one. The last hit of a prefix match is the parent of the request's
  first new block, so here a new block joins its parent's session and a root block opens
  a fresh session: the same grouping. (Requests sharing a system prompt thus share one
  session, as in the PR.)
- **Score** of a session, lower is evicted first::

      last_touch + touch_weight * hits + depth_bonus / (1 + prefix_depth / depth_half)

  `last_touch` is the logical time of the session's last touch; `hits` the touches that
  named one of its blocks (one per request however many it names, the request that
  stored them included), seeded at a fresh session's inserts by the ghost score each key
  had / `ghost_norm`; `prefix_depth` the
  blocks of the request already resident when its session opened (fixed for the
  session's life; 0 for every fresh session of a single-tier cache, whose prefix match
  always finds the parent's session first).
- **Eviction:** the worst-scoring session first, its blocks tail-first (last inserted
  first), so shared prefixes outlive their suffixes. Only evictable blocks go (refcount 0,
  no cached child: kvheat's rule; the PR skips busy keys the same way).
- **Ghost scores,** per key, kept after eviction: each request's touch adds
  `1 / log2(position + 2)` times `ghost_hit_weight` for a block it found resident and
  `ghost_miss_weight` for one it had to store; a fresh session is seeded from them.
- **Order within a request,** as the PR's hooks run: lookup, store (a session opened or
  continued, the gate, inserts seeded by the ghosts as they were), then the touch.
- **Decay:** every `decay_interval` touches, session hits and ghost scores are multiplied
  by `decay_factor`; non-resident ghosts under `ghost_prune` are dropped.
- **Admission gate:** a fresh session must score at least as much as the worst
  incumbent when its store needs an eviction; a continuing (merged) session bypasses the
  gate. The PR then declines the store. A device cache cannot decline: a running request
  must hold its KV. So a declined session's blocks are kept while referenced and are the
  first to go once released, which is what not storing them costs the cache, less the
  room the running request needed anyway.

**Units and clock.** The PR's clock is not seconds: `logical_time` ticks once per touch,
about once per request. We feed it the same: one tick per request (a request's first
block, hit or inserted, is the root block at depth 0), so `touch_weight` = 1500 means one
hit is worth 1,500 requests of recency and `depth_bonus` = 30000 is 30,000 requests. The
cache's `now` (seconds) is ignored: the policy is scale-free in time (`--time-scale`
leaves it unchanged), as the PR's is.

**Cost.** A session heap (score; lazy entries) and, per session, a heap of its evictable
blocks by insertion order: O(log n) per access, insert, release and eviction. Decay
multiplies one global scale (O(1)) and re-keys the session heap (O(sessions), once per
`decay_interval` requests); ghost pruning sweeps the ghost map when it has doubled since
the last sweep (amortized O(1) per key).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, cast

from ..cache.eviction import EvictionPolicy, register_policy
from ..cache.node import Node, PolicyRecord
from ..checks import check_fields


@dataclass(slots=True)
class SAEParams:
    """SAE's tunables, with the PR's defaults. Times are in touches (requests)."""

    touch_weight: float = 1500.0  # score per session hit, in touches of recency
    depth_bonus: float = 30000.0  # bonus of a session opened at prefix depth 0, in touches
    depth_half: float = 8.0  # prefix depth (blocks) at which the bonus halves
    decay_interval: int = 500  # touches between two decays
    decay_factor: float = 0.9  # what a decay multiplies session hits and ghost scores by
    ghost_hit_weight: float = 12.0  # ghost bump of a key the touch found resident
    ghost_miss_weight: float = 1.0  # ghost bump of a key it did not find
    ghost_norm: float = 12.0  # ghost score / this = the hits it seeds a fresh session with
    ghost_prune: float = 0.01  # non-resident ghosts below this are dropped at a decay
    admission_gate: bool = True  # a fresh session must beat the worst incumbent

    def __post_init__(self) -> None:
        check_fields(self, "sae")
        if self.decay_interval < 1:
            raise ValueError("sae: decay_interval must be >= 1")
        if not 0 < self.decay_factor <= 1:
            raise ValueError("sae: decay_factor must be in (0, 1]")
        for name in ("touch_weight", "depth_bonus", "ghost_hit_weight", "ghost_miss_weight",
                     "ghost_prune"):
            if getattr(self, name) < 0:
                raise ValueError(f"sae: {name} must be >= 0")
        for name in ("depth_half", "ghost_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sae: {name} must be > 0")


@dataclass(slots=True, eq=False)
class Session:
    """One session: its score's terms and its evictable blocks, tail (latest) first."""

    sid: int
    last_touch: int
    hits: float  # in units of the policy's `scale` (true hits = hits * scale)
    prefix_depth: int
    declined: bool = False  # failed the admission gate: its blocks go first
    size: int = 0  # resident blocks
    touched: int = -1  # the tick of its last touch (one hit per request)
    ver: int = 0  # its live entry in the session heap (0: none)
    blocks: list[tuple[int, Node]] = field(default_factory=list)  # (-seq, block) heap


@dataclass(slots=True)
class SAERecord(PolicyRecord):
    """A block's session and its insertion order in it."""

    session: Session | None
    seq: int
    queued: bool = False  # has a live entry in its session's block heap


@register_policy("sae")
class SAE(EvictionPolicy):
    """Session-Aware Eviction (vLLM PR #50422); see the module docstring."""

    name = "sae"

    def __init__(self, params: SAEParams | None = None, **kwargs: Any) -> None:
        super().__init__()
        if params is not None and kwargs:
            raise TypeError("sae: give params or keyword arguments, not both")
        self.p = params if params is not None else SAEParams(**kwargs)
        self.tick = 0  # logical time: requests seen
        self.scale = 1.0  # true hits / ghost = stored value * scale
        self.ghost: dict[bytes, float] = {}  # key -> ghost score / scale
        self._ghost_swept = 1024  # ghost entries at the last sweep (sweep at twice)
        self.heap: list[tuple[float, int, int]] = []  # (score, sid, ver): the incumbents
        self.declined: list[tuple[float, int, int]] = []  # the same, of declined sessions
        self.sessions: dict[int, Session] = {}
        self._next_sid = 0
        self._seq = 0
        self._ver = 0
        self.resident: set[bytes] = set()  # keys of the blocks in a session
        self._evicted = False  # an eviction since the last insert or hit
        self._fresh: Session | None = None  # the session this request opened
        self._req_gated = False  # this request's fresh session has met the gate
        self.declines = 0
        self.fresh = 0

    # ---- the score -------------------------------------------------------------------
    def score(self, s: Session) -> float:
        """A session's score from its recency, hits and prefix depth; the lowest goes first."""
        p = self.p
        return (s.last_touch + p.touch_weight * s.hits * self.scale
                + p.depth_bonus / (1.0 + s.prefix_depth / p.depth_half))

    def _list(self, s: Session) -> None:
        """(Re-)enter `s` in the session heap at its current score."""
        self._ver += 1
        s.ver = self._ver
        heapq.heappush(self.declined if s.declined else self.heap, (self.score(s), s.sid, s.ver))

    # ---- touches -----------------------------------------------------------------------
    def _begin_request(self) -> None:
        self.tick += 1
        self._fresh = None
        self._req_gated = False
        if self.tick % self.p.decay_interval == 0:
            self._decay()

    def _bump_ghost(self, key: bytes, depth: int, weight: float) -> float:
        g = self.ghost.get(key, 0.0) + weight / math.log2(depth + 2.0) / self.scale
        self.ghost[key] = g
        return g

    def _touch(self, s: Session) -> None:
        """This request's touch of session `s`: one hit per request, however many of its
        blocks it names, and the recency of now."""
        if s.touched != self.tick:
            s.touched = self.tick
            s.hits += 1.0 / self.scale
            s.last_touch = self.tick
            if s.ver:
                self._list(s)

    def on_hit(self, b: Node, now: float) -> None:
        if b.depth == 0:
            self._begin_request()
        assert b.key is not None
        self._bump_ghost(b.key, b.depth, self.p.ghost_hit_weight)
        s = cast(SAERecord, b.rec).session
        if s is not None:
            self._touch(s)
        self._evicted = False

    def on_insert(self, b: Node, now: float) -> None:
        # The PR's order for a request's new blocks: the store (session opened or
        # continued, gate, insert seeded by the ghost as it was), then the touch (the
        # key's ghost bumped as a miss, its session hit once).
        p = self.p
        if b.depth == 0:
            self._begin_request()
        key = b.key
        assert key is not None
        parent = b.parent
        s = cast(SAERecord, parent.rec).session if parent is not None and isinstance(
            parent.rec, SAERecord) else None
        if s is None or s.sid not in self.sessions:
            s = self._fresh = self._open(b.depth)
        if s is self._fresh:  # a session this request opened: seeded by its keys' ghosts
            s.hits += self.ghost.get(key, 0.0) / p.ghost_norm
            if self._evicted and not self._req_gated and p.admission_gate:
                self._gate(s)
        self._bump_ghost(key, b.depth, p.ghost_miss_weight)
        self._touch(s)
        self._seq += 1
        rec = b.rec
        if isinstance(rec, SAERecord):
            rec.session, rec.seq, rec.queued = s, self._seq, False
        else:
            b.rec = SAERecord(s, self._seq)
        s.size += 1
        self.resident.add(key)
        self._evicted = False

    def _open(self, depth: int) -> Session:
        # Opened before this request's touch: the logical time of the previous one.
        s = Session(self._next_sid, self.tick - 1, 0.0, depth)
        self._next_sid += 1
        self.sessions[s.sid] = s
        self.fresh += 1
        return s

    def _gate(self, s: Session) -> None:
        """The admission gate: a fresh session scoring under the worst incumbent is
        declined. Its score is the one it opens with, as when the PR's store asks for
        room: the previous touch's time, no hits, its depth's bonus."""
        self._req_gated = True
        worst = self._worst()  # (not `s`: unlisted while its blocks are referenced)
        if worst is None:
            return
        p = self.p
        fresh = self.tick - 1 + p.depth_bonus / (1.0 + s.prefix_depth / p.depth_half)
        if fresh < self.score(worst):
            s.declined = True
            self.declines += 1
            if s.ver:
                self._list(s)

    def _worst(self) -> Session | None:
        """The listed incumbent with the lowest score (stale entries dropped on the way)."""
        heap, sessions = self.heap, self.sessions
        while heap:
            _, sid, ver = heap[0]
            s = sessions.get(sid)
            if s is not None and s.ver == ver:
                return s
            heapq.heappop(heap)
        return None

    # ---- evictable blocks --------------------------------------------------------------
    def _queue(self, b: Node) -> None:
        rec = cast(SAERecord, b.rec)
        s = rec.session
        if rec.queued or s is None:
            return
        rec.queued = True
        heapq.heappush(s.blocks, (-rec.seq, b))
        if not s.ver:
            self._list(s)

    def on_release(self, b: Node, now: float) -> None:
        if b.num_children == 0:
            self._queue(b)

    def on_release_all(self, blocks: list[Node], now: float) -> None:
        for b in blocks:
            if b.num_children == 0 and b.ref_cnt == 0:
                self._queue(b)

    def on_leaf(self, b: Node) -> None:
        if b.ref_cnt == 0:
            self._queue(b)

    def victim(self) -> Node | None:
        # Declined sessions first (what the PR would not have stored), then the incumbents.
        return self._victim(self.declined) if self.declined else self._victim(self.heap)

    def _victim(self, heap: list[tuple[float, int, int]]) -> Node | None:
        sessions = self.sessions
        while heap:
            _, sid, ver = heap[0]
            s = sessions.get(sid)
            if s is None or s.ver != ver:
                heapq.heappop(heap)
                continue
            blocks = s.blocks
            while blocks:
                neg_seq, b = heapq.heappop(blocks)
                rec = cast(SAERecord, b.rec)
                if rec.session is not s or rec.seq != -neg_seq or not rec.queued:
                    continue  # stale: evicted, forgotten or re-inserted since
                rec.queued = False
                if b.ref_cnt == 0 and b.num_children == 0:
                    self._evicted = True
                    return b
                # busy or a parent: queued again when it is released or becomes a leaf
            heapq.heappop(heap)
            s.ver = 0  # nothing evictable: listed again when a block is
        return self._victim(self.heap) if heap is self.declined else None

    def on_evict(self, b: Node) -> None:
        self._drop(b)

    def forget(self, b: Node) -> None:
        self._drop(b)
        b.parked = None

    def _drop(self, b: Node) -> None:
        rec = b.rec
        if not isinstance(rec, SAERecord) or rec.session is None:
            return
        s = rec.session
        rec.session = None
        rec.queued = False
        if b.key is not None:
            self.resident.discard(b.key)
        s.size -= 1
        if s.size <= 0:
            self.sessions.pop(s.sid, None)
            s.ver = 0

    # ---- decay -------------------------------------------------------------------------
    def _decay(self) -> None:
        p = self.p
        self.scale *= p.decay_factor
        if self.scale < 1e-100:  # fold the scale into the values before it underflows
            for s in self.sessions.values():
                s.hits *= self.scale
            self.ghost = {k: g * self.scale for k, g in self.ghost.items()}
            self.scale = 1.0
        if len(self.ghost) >= 2 * self._ghost_swept:
            # Drop non-resident ghosts below the prune threshold (the PR prunes at every
            # decay; sweeping when the map has doubled keeps it amortized O(1) per key).
            cut = p.ghost_prune / self.scale
            resident = self.resident
            self.ghost = {k: g for k, g in self.ghost.items() if g >= cut or k in resident}
            self._ghost_swept = max(len(self.ghost), 1024)
        # Scores change unevenly (hits shrink, recency does not): re-key every session.
        self.heap, self.declined = [], []
        self._ver += 1
        v = self._ver
        for s in self.sessions.values():
            if s.ver:
                s.ver = v
                (self.declined if s.declined else self.heap).append((self.score(s), s.sid, v))
        heapq.heapify(self.heap)
        heapq.heapify(self.declined)

    def stats(self) -> dict[str, float]:
        return {"sessions": float(len(self.sessions)), "sessions_opened": float(self.fresh),
                "gate_declines": float(self.declines), "ghosts": float(len(self.ghost)),
                "touches": float(self.tick)}
