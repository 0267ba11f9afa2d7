"""kvheat's heat policy as the cache policy of vLLM's CPU offloading tier.

vLLM (0.32) loads an out-of-tree policy by name from a module path given in the
offloading connector's extra config, no fork and no patch::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
        "eviction_policy": "KVHeatCachePolicy",
        "cache_policy_module_path": "kvheat.integrations.vllm"}}'

`KVHeatCachePolicy` runs `kvheat.heat.KVHeat` (the project's default, scale-free policy)
over vLLM's offload chunks. Each chunk is a kvheat `Block` that also serves as its
`ChunkStatus`; the heat policy sees the same hooks the kvheat block cache gives it:

- `insert` (a store miss being written): `on_insert`, which also restores the heat an
  evicted chunk left in the ghost map. Its parent and depth come from the key's end-token
  position (`ReqContext.get_offload_key_position`, set by vLLM's scheduler for every key):
  a new chunk right after another new chunk of the same request has that chunk as parent;
  a first new chunk below depth 1 extends a prefix the cache knew before the request.
- `on_request_finished` (one request-scoped access, head-to-tail): `on_hit` for every ready
  chunk the request reused; the chunks with no heap entry (held, parked) enter it
  tail-first, so equal heat loses a chain's tail before its head (a prefix lookup stops at
  the first miss).
- `mark_evictable` / `mark_non_evictable`: the chunk enters / leaves the eviction heap (the
  pushes are queued and made in bulk, last marked first, before the next call that reads
  or re-keys the heap).
- `evict(n, protected)`: the n coldest evictable, unprotected chunks, or None with no state
  change when fewer exist (checked before anything is popped); when the heap runs out,
  the coldest of the evictable chunks held out of it (below). A hit raises a chunk's key
  without a push: its entry is a lower bound, and `KVHeat.take_lazy` pushes a chunk whose
  key rose back at its key when it meets it, so a chunk is pushed about once per eviction
  wave instead of once per access.

Two rules on top run only while the cache is tight (`gated`: the mean age of its evictions
under KVHeat's `penalty_fade` reuse gaps): `monotone` (a request's head is never left colder
than a chunk after it) and `early_hits` (a load's start counts the reuse; the request's end
moves it to then). While it is not (it has evicted, measured a reuse gap, and the mean age
is at least `penalty_fade` gaps) `hold` covers the same window without touching heat: a
chunk whose load completes stays out of the heap until a request listing it ends (kvheat's
own cache keeps a running request's blocks referenced), evicted before that only when no
other chunk is left. docs/vllm.md has the grid behind these defaults.

Request hints (kvheat/cache/hints.py) come from the request's `ReqContext`, which in vLLM
0.32 carries the client's `kv_transfer_params` and the orchestrator's `kv_hints` envelope
(and no finish status): the session is `kv_transfer_params["kvheat_session"]`, or the
payload's `session_id` of a `kv_hints` action of type `kvheat.session`; the outcome and
finish reason are FINISHED and unknown unless whoever sees the request end (a KV connector's
`request_finished`, which gets vLLM's `Request`) records them with `record_outcome`. The
heat policy hears the session before a request's inserts and hits, and the outcome at
`on_request_finished` before the request's chunks are released, as in kvheat's own cache;
a request with no hint calls no hint hook (the policy decides exactly as before).

The clock is kvheat's own: block accesses, with one timestamp per request event, so the
policy reads no wall clock. This module imports vLLM; kvheat itself never does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from math import isnan
from operator import attrgetter
from typing import Any, cast

try:
    from .vllm_env import check_torch_extras

    check_torch_extras()  # what vLLM loads later must load with this torch
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
except Exception as e:  # a broken torchvision says what to run, not a traceback
    from .vllm_env import import_error

    raise import_error(e) from None

from ..cache.hints import Outcome
from ..cache.node import NodeQueue
from ..heat.heat_policy import KVHeat
from .vllm_chunk import Chunk, Placement, RequestHints, record_outcome, request_hints

__all__ = ["KVHeatCachePolicy", "RequestHints", "record_outcome", "request_hints"]


def _tight(heat: KVHeat, evicted: int, evict_age: float) -> bool:
    """The gate: the cache has evicted, and the mean age of its evictions is under
    KVHeat's `penalty_fade` reuse gaps."""
    if not evicted:
        return False  # nothing evicted yet: every reuse so far was held
    gap = heat.gaps.estimate if heat.gaps is not None else None
    return gap is not None and evict_age < heat.penalties.fade * gap


# A chunk's `parked` while the request that loaded it runs (`hold`): a marker, never filled.
_HELD = NodeQueue("held")


def _loose(heat: KVHeat, evicted: int, evict_age: float) -> bool:
    """The hold's gate, the complement of `_tight` once the cache has evicted and measured
    a reuse gap: the mean age of its evictions is at least `penalty_fade` reuse gaps."""
    return (bool(evicted) and heat.gaps is not None and heat.gaps.estimate is not None
            and not _tight(heat, evicted, evict_age))


class KVHeatCachePolicy(CachePolicy):
    """vLLM `CachePolicy` driven by kvheat's `KVHeat`.

    Extra keyword arguments go to `KVHeat` (vLLM itself passes only `cache_capacity`).

    By default `monotone` and `early_hits` run `gated`: only while the cache is tight
    (docs/vllm.md has the grid: each rule alone loses where the cache holds nearly every
    reuse). `gated=False` runs them always; `finish_inserts` stays off. `hold` (on) keeps a
    loaded chunk out of the heap while its request runs, under the gate's complement."""

    def __init__(self, cache_capacity: int, finish_inserts: bool = False,
                 monotone: bool = True, early_hits: bool = True, gated: bool = True,
                 hold: bool = True, **heat_kwargs: Any) -> None:
        super().__init__(cache_capacity)
        # A chunk whose load completes stays out of the heap until the request that loaded
        # it ends, while the cache is not tight (the gate's complement: early_hits covers a
        # tight cache); evicted only when no other chunk is left.
        self.hold = hold
        self._held: dict[Chunk, None] = {}  # held chunks (and some released since)
        self.early_hits = early_hits
        self.finish_inserts = finish_inserts
        self.monotone = monotone
        # monotone and early_hits only while the cache is tight: the mean age of its
        # evictions (accesses since last use, over about the last capacity evictions)
        # under KVHeat's penalty_fade reuse gaps, the bound KVHeat fades its penalties by
        self.gated = gated
        self._heat_kwargs = heat_kwargs
        self.chunks: dict[OffloadKey, Chunk] = {}
        # Evictable chunks are those whose kvheat ref_cnt is 0; only their count is kept
        # (a set beside the chunk dict cost a hash-set update on every mark).
        self._free = 0
        # Chunks marked evictable whose heap push waits for the next evict or request end.
        self._pend: list[Chunk] = []
        self._reset()

    def _reset(self) -> None:
        self.heat = KVHeat(**self._heat_kwargs)
        self.heat.feed_by_request()  # stores and hits come apart: whole requests, at their end
        self.heat.bind(max(self.cache_capacity, 1))
        self._tick = 0.0  # one timestamp per request event; KVHeat counts accesses itself
        self.placement = Placement()  # the storing request: its chunks' prefix
        self._loading = False  # the last event was a load's start (early_hits)
        self.evicted = 0  # chunks evicted so far
        self.fallbacks = 0  # evictions of held chunks: nothing else was left
        self.evict_age = 0.0  # the gate's mean eviction age, accesses (gated)

    # -- lookups ---------------------------------------------------------------------
    # `get(key)`, the manager's most frequent call, is the chunk dict's own `get` (C speed,
    # no Python frame between): a Chunk is its ChunkStatus.
    get = property(attrgetter("chunks.get"))

    # -- stores ----------------------------------------------------------------------
    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Begin a request's stores: remember it, so `insert` places its chunks in its prefix."""
        # Not a use (the base class would touch): the inserts that follow are the accesses.
        # Remember the request, so `insert` can place its chunks in their prefix.
        if self._pend:
            self._flush()  # before the inserts (and any rebuild they start)
        self.placement.begin(req_context)
        self._loading = False
        self._tick += 1.0
        session = request_hints(req_context).session
        if session is not None:  # the inserts that follow are this session's
            self.heat.on_session(session, self._tick)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """Cache a newly allocated chunk, as kvheat's heat policy inserts a block."""
        c = Chunk(key, chunk)
        self.chunks[key] = c
        self.placement.place(c)
        c.inserted_at = self._tick
        self.heat.on_insert(c, self._tick)
        c.w_ins = self.heat.clock.weight  # this access's weight, in generation c.rec.gen
        if chunk.ref_cnt == 0:
            self._free += 1
            c.stored = True
            self._pend.append(c)

    def remove(self, key: OffloadKey) -> None:
        """Forget a chunk whose store failed."""
        c = self.chunks.pop(key)
        if not c.ref_cnt:
            self._free -= 1
        self.heat.forget(c)
        c.key = c.rec = None  # any heap entry left behind is stale; the cycle broken

    # -- accesses --------------------------------------------------------------------
    def _access(self, keys: Sequence[OffloadKey], hits: Iterable[OffloadKey]) -> None:
        """One request-scoped access: a hit per reused chunk, then the touched evictable
        chunks re-enter the heap tail-first."""
        if self._pend:
            self._flush()
        self._tick += 1.0
        now = self._tick
        chunks, heat = self.chunks, self.heat
        for key in hits:
            c = chunks.get(key)
            if c is not None and c.ref_cnt >= 0:
                heat.on_hit(c, now)
        for key in reversed(keys):
            c = chunks.get(key)
            if c is not None and not c.ref_cnt:
                heat.on_release(c, now)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Count one request-scoped access of `keys` (an older scheduler's call)."""
        # vLLM 0.32's scheduler no longer calls touch (accesses arrive through
        # on_request_finished); an older caller's touch is one request-scoped access.
        ordered = order_request_keys([list(keys)], req_context)
        self._access(ordered, ordered)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey], reused_keys: set[OffloadKey],
                            req_context: ReqContext) -> None:
        """Count a request's reuse and put its evictable chunks back in the heap."""
        # The manager sorts each group head-to-tail already; only several groups need
        # merging into one order.
        ordered = key_groups[0] if len(key_groups) == 1 else order_request_keys(
            key_groups, req_context)
        self._tick += 1.0
        self._loading = False
        now = self._tick
        chunks, heat = self.chunks, self.heat
        finish = self.finish_inserts
        if len(self._held) > self.cache_capacity + 64:
            self._prune_held()
        present = [c for key in ordered if (c := chunks.get(key)) is not None]
        if self._pend:
            self._flush()  # before any key changes, as when they were marked
        hints = request_hints(req_context)
        if hints.session is not None:  # the hits that follow are this session's
            heat.on_session(hints.session, now)
        hits: list[Chunk] = []  # counted in one call, in order with the moves between
        for c in present:
            if c.key in insertion_only_keys:
                # Counted by on_insert; with finish_inserts its access moves to the end of
                # the request, where the next turn's reuse gap starts.
                if finish and c.w_ins:
                    if hits:
                        heat.on_hit_all(hits, now)
                        hits = []
                    heat.move_access(c, c.w_ins, now)
                    c.w_ins = 0.0
            elif c.w_load:  # its load already counted the hit: move it to now
                if hits:
                    heat.on_hit_all(hits, now)
                    hits = []
                heat.move_access(c, c.w_load, now)
                c.w_load = 0.0
            elif c.ref_cnt >= 0:  # reused, or found pending from another's store
                hits.append(c)
        if hits:
            heat.on_hit_all(hits, now)
        if hints.session is not None or hints.outcome is not Outcome.FINISHED \
                or hints.reason is not None:  # how it ended, before its chunks go back
            heat.on_finish(present, hints.session, hints.outcome, hints.reason, now)
        heat.observe_request(ordered, hints.session, hints.outcome, hints.reason, now)
        if not self.monotone or (self.gated and not _tight(self.heat, self.evicted, self.evict_age)):
            heat.release_all([c for c in reversed(present) if not c.ref_cnt
                              and (c.parked is not None or isnan(c.heap_slot))])
            return
        # Every use of a chunk is a use of its whole prefix, so a head is at least as hot
        # as any chunk after it; where its count says otherwise its history was lost
        # (ghost dropped, admission penalty): raise it. Tail-first, so equal keys lose
        # the tail first.
        key, top = heat.key, 0.0
        back = []
        for c in reversed(present):
            k = key(c)
            if k < top:
                heat.raise_key(c, top)
            else:
                top = k
            if not c.ref_cnt and (c.parked is not None or isnan(c.heap_slot)):
                back.append(c)
        heat.release_all(back)

    # vLLM's manager calls these exactly when a chunk's ref_cnt reaches 0 / leaves 0, and
    # keeps the count itself (on the chunk `get` returned).
    def mark_evictable(self, key: OffloadKey) -> None:
        """Record that the chunk's ref_cnt reached 0: it may be evicted again."""
        self._free += 1
        c = self.chunks[key]
        if c.stored and self.hold and _loose(self.heat, self.evicted, self.evict_age):
            # A load completed (a store's completion is the first mark): held for the
            # request that loaded it, as kvheat's own cache keeps a running request's
            # blocks referenced; back in the heap when a request listing it ends.
            c.parked = _HELD
            c.heap_slot = math.nan  # its entry from before the load is stale
            self.heat.hold_out(c)  # (out of the probation queue too, while protecting)
            self._held[c] = None
        else:
            c.stored = True
            self._pend.append(c)  # pushed by the next evict or request end

    def _flush(self, busy: Chunk | None = None) -> None:
        """Push the chunks marked evictable since the last flush that have no entry in
        the heap, last marked first (vLLM marks a request's chunks head to tail: at equal
        heat its tail goes first). Every call that may change a key or re-key the heap
        (stores, request ends, early hits, evictions) flushes first, so the heap is as if
        each was pushed when marked, less `busy`, being made non-evictable."""
        pend, self._pend = self._pend, []
        self.heat.release_all([c for c in reversed(pend) if c.ref_cnt == 0 and c.key is not None
                               and (c.parked is not None or isnan(c.heap_slot))
                               and c is not busy])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Record that the chunk's ref_cnt left 0 (a load begins)."""
        # Its heap entry stays and is parked when met (ref_cnt > 0 by then: kvheat's rule).
        self._free -= 1
        # `_tight`, inlined (this runs at every load's start)
        if self.early_hits and (not self.gated or (
                self.evicted and (est := self.heat.gaps.estimate) is not None
                and self.evict_age < self.heat.penalties.fade * est)):
            c = self.chunks[key]
            if c.w_load:
                return
            if self._pend:
                self._flush(busy=c)  # c's ref_cnt is still 0: the manager raises it next
            # A load begins: a request reuses the chunk now. Count the hit now, so the
            # chunk is not cold while the request runs; the request's end moves it there.
            if not self._loading:  # the first load of a request: a new timestamp
                self._loading = True
                self._tick += 1.0
            heat = self.heat
            heat.on_hit(c, self._tick)
            c.w_load = heat.clock.weight

    # -- eviction --------------------------------------------------------------------
    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Remove and return the `n` coldest evictable, unprotected chunks (None: too few)."""
        if n <= 0:
            return []
        free = self._free
        chunks = self.chunks
        if free - len(protected) < n:  # count exactly only when it may not suffice
            free -= sum(1 for k in protected if (p := chunks.get(k)) is not None
                        and not p.ref_cnt)
        if free < n:
            return None  # atomic: nothing popped, nothing changed
        if self._pend:
            self._flush()
        heat = self.heat
        # the n coldest, setting protected chunks aside (the heap skips ref_cnt > 0 itself)
        # (the heap holds only this policy's chunks)
        picked, skipped = cast("tuple[list[Chunk], list[Chunk]]", heat.take_lazy(n, protected))
        if len(picked) < n:
            if not self.hold:  # cannot happen while every evictable chunk is in the heap
                for b in picked + skipped:
                    heat.on_release(b, self._tick)
                return None
            self._evict_rest(n - len(picked), protected, picked)  # the rest are held
        if skipped:  # back in the heap with their unchanged key
            heat.release_all([c for c in skipped if not c.ref_cnt])
        if self.gated or self.hold:
            acc, cap = heat.clock.accesses, max(self.cache_capacity, 1)
            ev, age = self.evicted, self.evict_age
            for c in picked:
                ev += 1
                age += (acc - c.last - age) / (ev if ev < cap else cap)
            self.evicted, self.evict_age = ev, age
        heat.on_evict_all(picked)  # the ghost keeps its heat
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for c in picked:
            key = cast(OffloadKey, c.key)  # (set: a chunk in the heap is stored)
            del chunks[key]
            c.key = c.rec = None  # any heap entry left behind is stale; the cycle broken
            out.append((key, cast(ChunkStatus, c)))  # a Chunk is its ChunkStatus
        self._free -= n
        return out

    def _evict_rest(self, k: int, protected: set[OffloadKey], picked: list[Chunk]) -> None:
        """Append the `k` coldest held, unprotected chunks (the heap is empty and the count
        said enough evictable chunks exist, so the rest are held for running requests)."""
        key = self.heat.key
        cands: list[tuple[float, int, Chunk]] = []
        for c in self._prune_held():
            if not c.ref_cnt and c.key not in protected:
                # equal heat: the later marked first (a load's tail after its head)
                cands.append((key(c), -len(cands), c))
        for *_, c in heapq.nsmallest(k, cands):
            self.heat.forget(c)  # no longer held, and no heap entry
            picked.append(c)
            self.fallbacks += 1

    def _prune_held(self) -> dict[Chunk, None]:
        """Drop the chunks released (or evicted) since they were held."""
        self._held = {c: None for c in self._held if c.parked is _HELD and c.key is not None}
        return self._held

    def clear(self) -> None:
        """Forget every chunk and start a fresh heat policy."""
        for c in self.chunks.values():
            c.key = c.rec = None
        self.chunks.clear()
        self._free = 0
        self._pend.clear()
        self._held = {}
        self._reset()  # a fresh heat policy: heap, ghosts, learned half-life and regime

    # -- introspection ---------------------------------------------------------------
    def evictable_keys(self) -> set[OffloadKey]:
        """The chunks `evict` may take (ref_cnt 0), protected or not."""
        return {k for k, c in self.chunks.items() if not c.ref_cnt}

    def num_evictable(self) -> int:
        """Chunks whose ref_cnt is 0."""
        return self._free

    def ghost_size(self) -> int:
        """Keys the heat policy's ghost history holds."""
        return self.heat.ghost_size()

    def stats(self) -> dict[str, float]:
        """The heat policy's counters (`KVHeat.stats`)."""
        return self.heat.stats()
