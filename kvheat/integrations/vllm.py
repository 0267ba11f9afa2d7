"""kvheat's heat policy as the cache policy of vLLM's CPU offloading tier.

vLLM (0.32) loads an out-of-tree policy by name from a module path given in the
offloading connector's extra config, no fork and no patch::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
        "eviction_policy": "KVHeatCachePolicy",
        "cache_policy_module_path": "kvheat.integrations.vllm"}}'

`KVHeatCachePolicy` runs `kvheat.heat.KVHeat` (the project's default, scale-free policy)
over vLLM's offload chunks. Each chunk is a kvheat `Block` carrying vLLM's `ChunkStatus`;
the heat policy sees the same hooks the kvheat block cache gives it:

- `insert` (a store miss being written): `on_insert`, which also restores the heat an
  evicted chunk left in the ghost map. Its parent and depth come from the key's end-token
  position (`ReqContext.get_offload_key_position`, set by vLLM's scheduler for every key):
  a new chunk right after another new chunk of the same request has that chunk as parent;
  a first new chunk below depth 1 extends a prefix the cache knew before the request.
- `on_request_finished` (one request-scoped access, head-to-tail): `on_hit` for every ready
  chunk the request reused, then the changed keys re-enter the heap tail-first, so equal
  heat loses a chain's tail before its head (a prefix lookup stops at the first miss).
- `mark_evictable` / `mark_non_evictable`: the chunk enters / leaves the eviction heap.
- `evict(n, protected)`: the n coldest evictable, unprotected chunks, or None with no state
  change when fewer exist (checked before anything is popped).

The clock is kvheat's own: block accesses, with one timestamp per request event, so the
policy reads no wall clock. This module imports vLLM; kvheat itself never does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from ..cache.block import Block
from ..heat.policies import EXTENSION, FRESH, KVHeat

__all__ = ["KVHeatCachePolicy"]


class _Chunk(Block):
    """A kvheat block standing for one vLLM offload chunk."""

    __slots__ = ("status", "w_ins", "w_load")

    def __init__(self, key: OffloadKey, status: ChunkStatus) -> None:
        # Only the fields KVHeat and its heap read (Block.__init__ sets twenty: this runs
        # once per stored chunk). on_insert sets meta, freq, next_use and state.
        self.block_id = status.chunk_id
        self.key = key
        self.status = status
        self.num_tokens = 1  # vLLM offloads whole chunks only: no partial-tail demotion
        self.ref_cnt = 0 if status.ref_cnt == 0 else 1  # kvheat's view: evictable or not
        self.parent = None
        self.num_children = 0
        self.parked = None
        self.heap_ver = math.nan
        self.w_ins = 0.0  # weight of the insert's access while the storing request runs
        self.w_load = 0.0  # weight of an early hit (a load began) not yet claimed


def _known(depth: int) -> Block:
    """A stand-in parent for a chunk whose predecessor this request did not store: the
    cache knew that prefix before (vLLM stores a request's chunks head-to-tail)."""
    b = Block(-1)
    b.depth = depth
    b.inserted_at = -math.inf
    return b


_KNOWN_ROOT, _KNOWN = _known(0), _known(1)


class _Stores:
    """Per request (kept in its ReqContext): the last chunk it inserted, per KV group."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, _Chunk]] = {}  # group -> (end token, chunk)


class KVHeatCachePolicy(CachePolicy):
    """vLLM `CachePolicy` driven by kvheat's `KVHeat`. Extra keyword arguments go to
    `KVHeat` (vLLM itself passes only `cache_capacity`)."""

    def __init__(self, cache_capacity: int, finish_inserts: bool = False,
                 monotone: bool = False, early_hits: bool = False,
                 **heat_kwargs: object) -> None:
        super().__init__(cache_capacity)
        self.early_hits = early_hits
        self.finish_inserts = finish_inserts
        self.monotone = monotone
        self._heat_kwargs = heat_kwargs
        self.chunks: dict[OffloadKey, _Chunk] = {}
        self._evictable: set[OffloadKey] = set()
        self._reset()

    def _reset(self) -> None:
        self.heat = KVHeat(**self._heat_kwargs)  # type: ignore[arg-type]
        self.heat.bind(max(self.cache_capacity, 1))
        self._tick = 0.0  # one timestamp per request event; KVHeat counts accesses itself
        self._ctx: ReqContext | None = None  # the request whose store misses come next
        self._loading = False  # the last event was a load's start (early_hits)
        self._chunk_tokens = 0  # tokens per chunk: gcd of the positions seen

    # -- lookups ---------------------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        c = self.chunks.get(key)
        return None if c is None else c.status

    # -- stores ----------------------------------------------------------------------
    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Not a use (the base class would touch): the inserts that follow are the accesses.
        # Remember the request, so `insert` can place its chunks in their prefix.
        self._ctx = req_context
        self._loading = False
        self._tick += 1.0

    def _place(self, c: _Chunk) -> None:
        """Set `c`'s depth from its position in the storing request, and its parent to a
        stand-in that gives KVHeat's extension rule the answer kvheat's own cache would:
        a chunk after this request's previous new chunk inherits that chunk's flag; one
        after a chunk the request did not store extends a prefix known before it."""
        ctx = self._ctx
        pos = ctx.get_offload_key_position(c.key) if ctx is not None else None
        if pos is None or pos <= 0:
            c.depth = -1  # unknown: neither a root nor the key naming a conversation
            return
        tpc = math.gcd(self._chunk_tokens, pos)
        self._chunk_tokens = tpc
        c.depth = depth = pos // tpc - 1
        stores = ctx.get_state(_Stores)  # type: ignore[union-attr]
        if stores is None:
            stores = _Stores()
            ctx.set_state(stores)  # type: ignore[union-attr]
        group = get_offload_group_idx(c.key)
        prev = stores.last.get(group)
        stores.last[group] = (pos, c)
        if depth == 0:
            return
        if prev is not None and prev[0] == pos - tpc:
            p = prev[1]
            # New in this request: inherit its flag; back from the ghost: a known prefix.
            known = bool(p.state & EXTENSION) or (not p.state & FRESH and p.depth >= 1)
            c.parent = _KNOWN if known else _KNOWN_ROOT
        else:
            c.parent = _KNOWN if depth > 1 else _KNOWN_ROOT

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        c = _Chunk(key, chunk)
        self.chunks[key] = c
        self._place(c)
        c.inserted_at = self._tick
        self.heat.on_insert(c, self._tick)
        c.w_ins = self.heat._w  # this access's weight, in generation c.freq
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            self.heat.on_release(c, self._tick)

    def remove(self, key: OffloadKey) -> None:
        c = self.chunks.pop(key)
        self._evictable.discard(key)
        self.heat.forget(c)
        c.key = None  # any heap entry left behind is stale

    # -- accesses --------------------------------------------------------------------
    def _access(self, keys: Sequence[OffloadKey], hits: Iterable[OffloadKey]) -> None:
        """One request-scoped access: a hit per reused chunk, then the touched evictable
        chunks re-enter the heap tail-first."""
        self._tick += 1.0
        now = self._tick
        chunks, heat = self.chunks, self.heat
        for key in hits:
            c = chunks.get(key)
            if c is not None and c.status.ref_cnt >= 0:
                heat.on_hit(c, now)
        evictable = self._evictable
        for key in reversed(keys):
            if key in evictable:
                heat.on_release(chunks[key], now)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM 0.32's scheduler no longer calls touch (accesses arrive through
        # on_request_finished); an older caller's touch is one request-scoped access.
        ordered = order_request_keys([list(keys)], req_context)
        self._access(ordered, ordered)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey], reused_keys: set[OffloadKey],
                            req_context: ReqContext) -> None:
        # The manager sorts each group head-to-tail already; only several groups need
        # merging into one order.
        ordered = key_groups[0] if len(key_groups) == 1 else order_request_keys(
            key_groups, req_context)
        self._tick += 1.0
        self._loading = False
        now = self._tick
        chunks, heat = self.chunks, self.heat
        finish = self.finish_inserts
        present = []
        for key in ordered:
            c = chunks.get(key)
            if c is None:
                continue
            present.append(c)
            if key in insertion_only_keys:
                # Counted by on_insert; with finish_inserts its access moves to the end of
                # the request, where the next turn's reuse gap starts.
                if finish and c.w_ins:
                    if now != heat._t:
                        heat._advance(now)
                    if c.freq == heat.gen:
                        c.meta += heat._w - c.w_ins
                        c.next_use = heat._v
                    c.w_ins = 0.0
            elif c.w_load:  # its load already counted the hit: move it to now
                if now != heat._t:
                    heat._advance(now)
                if c.freq == heat.gen:
                    c.meta += heat._w - c.w_load
                    c.next_use = heat._v
                c.w_load = 0.0
            elif c.status.ref_cnt >= 0:  # reused, or found pending from another's store
                heat.on_hit(c, now)
        evictable = self._evictable
        if not self.monotone:
            for c in reversed(present):
                if c.key in evictable:
                    heat.on_release(c, now)
            return
        # Every use of a chunk is a use of its whole prefix, so a head is at least as hot
        # as any chunk after it; where its count says otherwise its history was lost
        # (ghost dropped, admission penalty): raise it. Tail-first, so equal keys lose
        # the tail first.
        flag, gen, top = heat._flag, heat.gen, 0.0
        for c in reversed(present):
            if c.freq != gen:
                heat._rescale(c)
            f = flag[c.state]
            k = c.meta * f
            if k < top:
                c.meta = top / f
            else:
                top = k
            if c.key in evictable:
                heat.on_release(c, now)

    def mark_evictable(self, key: OffloadKey) -> None:
        c = self.chunks[key]
        c.ref_cnt = 0
        self._evictable.add(key)
        self.heat.on_release(c, self._tick)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        c = self.chunks[key]
        c.ref_cnt = 1  # its heap entry is parked when met (kvheat's rule)
        self._evictable.discard(key)
        if self.early_hits and not c.w_load:
            # A load begins: a request reuses the chunk now. Count the hit now, so the
            # chunk is not cold while the request runs; the request's end moves it there.
            if not self._loading:  # the first load of a request: a new timestamp
                self._loading = True
                self._tick += 1.0
            heat = self.heat
            heat.on_hit(c, self._tick)
            c.w_load = heat._w

    # -- eviction --------------------------------------------------------------------
    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        evictable = self._evictable
        free = len(evictable)
        if free - len(protected) < n:  # count exactly only when it may not suffice
            free -= len(protected & evictable) if len(protected) < free else sum(
                1 for k in evictable if k in protected)
        if free < n:
            return None  # atomic: nothing popped, nothing changed
        heat = self.heat
        picked: list[_Chunk] = []
        skipped: list[_Chunk] = []
        while len(picked) < n:
            c = heat.victim()
            if c is None:  # cannot happen while every evictable chunk is in the heap
                for b in picked + skipped:
                    heat.on_release(b, self._tick)
                return None
            if c.key in protected or c.status.ref_cnt != 0:
                skipped.append(c)
            else:
                picked.append(c)
        for c in skipped:  # back in the heap with their unchanged key
            if c.status.ref_cnt == 0:
                heat.on_release(c, self._tick)
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for c in picked:
            heat.on_evict(c)  # the ghost keeps its heat
            key = c.key
            del self.chunks[key]  # type: ignore[arg-type]
            evictable.discard(key)  # type: ignore[arg-type]
            c.key = None
            out.append((key, c.status))  # type: ignore[arg-type]
        return out

    def clear(self) -> None:
        for c in self.chunks.values():
            c.key = None
        self.chunks.clear()
        self._evictable.clear()
        self._reset()  # a fresh heat policy: heap, ghosts, learned half-life and regime

    # -- introspection ---------------------------------------------------------------
    def ghost_size(self) -> int:
        return len(self.heat.ghost) + len(self.heat.ghost_old)

    def stats(self) -> dict[str, float]:
        return self.heat.stats()
