"""Replay a trace through vLLM's own CPU offloading manager, as its scheduler drives it
(bench/vllm/offload.py and tests/test_vllm_offload.py; vLLM imports the out-of-tree
policies below by module path, this module's).

`replay_offload` builds `vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager` with a cache
policy by name (vLLM's `lru`, `arc`, or an out-of-tree one such as
`KVHeatCachePolicy` from `kvheat.integrations.vllm`) and plays each request as vLLM 0.32's
offloading connector does, on a simulated clock:

- arrival: `on_new_request`, key positions recorded in the `ReqContext` (as the scheduler
  does), `lookup` of the prefix chunk by chunk until the first miss, `prepare_load` of
  the hits (optionally `touch` too, which older schedulers called);
- `complete_load` once the hits are read back (`load_tps`);
- end of prefill (`prefill_tps` on the tokens not loaded): `prepare_store` of the chunks
  not hit, `complete_store` once written (`store_tps`);
- end of decode (`decode_tps`): `on_request_finished`.

Requests overlap when the traffic is fast enough, so chunks are pinned (loading, or not yet
written) while others evict: `time_scale` (every timestamp multiplied) changes what the
manager sees, not just a policy clock. There is no GPU prefix cache in front: every prompt
reaches the offload tier. vLLM offloads whole chunks only, so a prompt's last partial
chunk never hits. `BeladyCachePolicy` is the offline bound under the same driver.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    from .vllm_env import check_torch_extras

    check_torch_extras()  # what vLLM loads later must load with this torch
    from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
except Exception as e:  # a broken torchvision says what to run, not a traceback
    from .vllm_env import import_error

    raise import_error(e) from None

from ..cache import hit_rate
from ..cache.hashing import chain_key, root_key
from ..replay.traces import TraceRequest
from .vllm import KVHeatCachePolicy

KVHEAT = ("KVHeatCachePolicy", "kvheat.integrations.vllm")
BELADY = ("BeladyCachePolicy", "kvheat.integrations.vllm_replay")
# Where vLLM loads each offload policy from: (class or built-in name, module path).
VLLM_OFFLOAD_POLICIES: dict[str, tuple[str, str | None]] = {
    "lru": ("lru", None), "arc": ("arc", None), "kvheat": KVHEAT, "belady": BELADY,
    "kvheat-fixed": ("KVHeatFixedMultiple", "kvheat.integrations.vllm_replay"),
}


class KVHeatFixedMultiple(KVHeatCachePolicy):
    """kvheat's policy with the half-life's multiple held at 1.

    `adapt="off"`, the default before it followed returning victims: the comparison arm of
    the benchmark."""

    def __init__(self, cache_capacity: int, **kwargs: Any) -> None:
        super().__init__(cache_capacity, adapt="off", **kwargs)


class BeladyCachePolicy(CachePolicy):
    """Offline optimum for the driver: evict the evictable chunk whose next use is furthest.

    A chunk's next use is the index of the next request that wants it; the driver fills
    `next_use`."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.next_use: dict[OffloadKey, float] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[float, OffloadKey]] = []

    def set_next_use(self, key: OffloadKey, nu: float) -> None:
        """Set the index of the next request that wants `key`."""
        self.next_use[key] = nu
        if key in self._evictable:
            heapq.heappush(self._heap, (-nu, key))

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk of `key`, or None."""
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """Cache a newly allocated chunk."""
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    def remove(self, key: OffloadKey) -> None:
        """Forget a chunk whose store failed."""
        del self.chunks[key]
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: the future, not the past, orders this policy."""
        return  # the future, not the past, orders this policy

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: the future, not the past, orders this policy."""
        return

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey], reused_keys: set[OffloadKey],
                            req_context: ReqContext) -> None:
        """Nothing: the future, not the past, orders this policy."""
        return

    def mark_evictable(self, key: OffloadKey) -> None:
        """Record that the chunk may be evicted, at its next use."""
        self._evictable.add(key)
        heapq.heappush(self._heap, (-self.next_use.get(key, float("inf")), key))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Record that the chunk may not be evicted."""
        self._evictable.discard(key)

    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Remove and return the `n` unprotected evictable chunks used furthest ahead.

        None, changing nothing, when fewer exist."""
        if n <= 0:
            return []
        if len(self._evictable - protected) < n:
            return None
        picked: list[OffloadKey] = []
        kept: list[tuple[float, OffloadKey]] = []
        seen: set[OffloadKey] = set()
        while len(picked) < n:
            e = heapq.heappop(self._heap)
            nu, key = e
            if key not in self._evictable or key in seen or -nu != self.next_use.get(key, float("inf")):
                continue
            seen.add(key)
            if key in protected:
                kept.append(e)
            else:
                picked.append(key)
        for e in kept:
            heapq.heappush(self._heap, e)
        out = []
        for key in picked:
            self._evictable.discard(key)
            out.append((key, self.chunks.pop(key)))
        return out

    def clear(self) -> None:
        """Forget every chunk and next use."""
        self.chunks.clear()
        self._evictable.clear()
        self._heap.clear()
        self.next_use.clear()


@dataclass(slots=True)
class OffloadResult:
    """What one replay through vLLM's offload manager counted."""

    policy: str
    capacity_chunks: int
    chunk_tokens: int
    time_scale: float
    requests: int = 0
    total_tokens: int = 0
    hit_tokens: int = 0
    stores: int = 0
    store_failures: int = 0  # prepare_store returned None: nothing evictable enough
    evictions: int = 0
    calls: int = 0  # manager calls
    chunk_ops: int = 0  # chunks passed to those calls (lookups count one each)
    manager_s: float = 0.0  # time inside the manager's calls
    wall_s: float = 0.0
    policy_stats: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Offload prefix hit tokens over prompt tokens."""
        return hit_rate(self.hit_tokens, self.total_tokens)

    def as_dict(self) -> dict:
        """The result's fields, and its hit rate, as a dict."""
        d = {k: getattr(self, k) for k in self.__slots__}
        d["hit_rate"] = self.hit_rate
        return d


def request_keys(trace: Sequence[TraceRequest], chunk_tokens: int) -> list[list[OffloadKey]]:
    """Each request's full chunks as vLLM offload keys (chained prefix hashes, group 0)."""
    roots: dict[str | None, bytes] = {}
    out = []
    for r in trace:
        h = roots.get(r.tenant)
        if h is None:
            h = roots[r.tenant] = root_key(None if r.tenant is None else "tenant:" + r.tenant)
        keys = []
        for bid in r.hash_ids[: r.input_length // chunk_tokens]:
            h = chain_key(h, int(bid).to_bytes(8, "little"))
            keys.append(make_offload_key(h, 0))
        out.append(keys)
    return out


def replay_offload(trace: Sequence[TraceRequest], policy: str, capacity_chunks: int,
                   chunk_tokens: int = 512, time_scale: float = 1.0,
                   prefill_tps: float = 20_000.0, decode_tps: float = 50.0,
                   load_tps: float = 200_000.0, store_tps: float = 200_000.0,
                   touch: bool = False, keys: list[list[OffloadKey]] | None = None,
                   manager: CPUOffloadingManager | None = None) -> OffloadResult:
    """Play `trace` through vLLM's `CPUOffloadingManager` and count its prefix hits.

    The manager holds `capacity_chunks` chunks and runs `policy` (a key of
    VLLM_OFFLOAD_POLICIES); the hits are token-weighted."""
    steps = _replay_steps(trace, policy, capacity_chunks, chunk_tokens, time_scale,
                          prefill_tps, decode_tps, load_tps, store_tps, touch, keys, manager)
    return deque(steps, maxlen=1)[0]  # the last yield: the finished result


def replay_side_by_side(trace: Sequence[TraceRequest], policies: Sequence[str],
                        capacity_chunks: int, chunk_tokens: int = 512,
                        time_scale: float = 1.0, keys: list[list[OffloadKey]] | None = None,
                        slice_events: int = 16) -> list[OffloadResult]:
    """`replay_offload` of each policy, run in turns of `slice_events` events each.

    One manager per policy, each seeing exactly the calls it sees alone: a burst of load on
    a shared machine then falls on every policy's calls alike, so the ratio of their µs per
    call holds where run-after-run timings swing."""
    keys = keys if keys is not None else request_keys(trace, chunk_tokens)
    runs = [_replay_steps(trace, p, capacity_chunks, chunk_tokens, time_scale, keys=keys)
            for p in policies]
    out: list[OffloadResult | None] = [None] * len(runs)
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            run = runs[i]
            for _ in range(slice_events):
                res = next(run, None)
                if res is None:
                    live.remove(i)
                    break
                out[i] = res
    done = [r for r in out if r is not None]
    if len(done) != len(out):  # every replay yields its result at least once
        raise RuntimeError("a policy's replay ended without a result")
    return done


def _replay_steps(trace: Sequence[TraceRequest], policy: str, capacity_chunks: int,
                  chunk_tokens: int = 512, time_scale: float = 1.0,
                  prefill_tps: float = 20_000.0, decode_tps: float = 50.0,
                  load_tps: float = 200_000.0, store_tps: float = 200_000.0,
                  touch: bool = False, keys: list[list[OffloadKey]] | None = None,
                  manager: CPUOffloadingManager | None = None
                  ) -> Iterator[OffloadResult]:
    """The replay of `replay_offload`, yielding its (running) result after each event."""
    name, module = VLLM_OFFLOAD_POLICIES.get(policy, (policy, None))
    mgr = manager or CPUOffloadingManager(capacity_chunks, cache_policy=name,
                                          cache_policy_module_path=module)
    pol = mgr._policy  # the policy vLLM's factory built (read for stats and the oracle)
    keys = keys if keys is not None else request_keys(trace, chunk_tokens)
    oracle = pol if isinstance(pol, BeladyCachePolicy) else None
    next_use: list[list[float]] = []
    if oracle is not None:
        seen: dict[OffloadKey, float] = {}
        next_use = [[]] * len(keys)
        for i in range(len(keys) - 1, -1, -1):
            next_use[i] = [seen.get(k, float("inf")) for k in keys[i]]
            for k in keys[i]:
                seen[k] = i
    res = OffloadResult(policy, capacity_chunks, chunk_tokens, time_scale)
    clock = time.perf_counter
    events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, request)
    ARRIVE, LOADED, STORE, STORED, FINISH = range(5)
    ctxs: dict[int, ReqContext] = {}
    loads: dict[int, list[OffloadKey]] = {}
    stores: dict[int, list[OffloadKey]] = {}
    seq = 0
    for i, r in enumerate(trace):
        events.append((r.timestamp_ms * time_scale / 1000.0, seq, ARRIVE, i))
        seq += 1
    heapq.heapify(events)
    t_wall = clock()
    while events:
        now, _, kind, i = heapq.heappop(events)
        r, ks = trace[i], keys[i]
        if kind == ARRIVE:
            ctx = ctxs[i] = ReqContext(req_id=str(i))
            for j, k in enumerate(ks):
                ctx.set_offload_key_position(k, (j + 1) * chunk_tokens)
            if oracle is not None:
                for k, nu in zip(ks, next_use[i]):
                    oracle.set_next_use(k, nu)
            t0 = clock()
            mgr.on_new_request(ctx)
            hits = 0
            for k in ks:
                res.calls += 1
                if mgr.lookup(k, ctx) is not LookupResult.HIT:
                    break
                hits += 1
            if hits:
                mgr.prepare_load(ks[:hits], ctx)
                res.calls += 1
                if touch:
                    mgr.touch(ks[:hits], ctx)
                    res.calls += 1
            res.manager_s += clock() - t0
            res.calls += 1
            res.chunk_ops += min(hits + 1, len(ks)) + hits * (2 + touch)
            res.requests += 1
            res.total_tokens += r.input_length
            res.hit_tokens += hits * chunk_tokens
            t_prefill = now + hits * chunk_tokens / load_tps
            if hits:
                loads[i] = ks[:hits]
                heapq.heappush(events, (t_prefill, seq, LOADED, i))
                seq += 1
            stores[i] = ks[hits:]
            t_done = t_prefill + (r.input_length - hits * chunk_tokens) / prefill_tps
            heapq.heappush(events, (t_done, seq, STORE, i))
            heapq.heappush(events, (t_done + r.output_length / decode_tps, seq + 1, FINISH, i))
            seq += 2
        elif kind == LOADED:
            ld = loads.pop(i)
            t0 = clock()
            mgr.complete_load(ld, ctxs[i])
            res.manager_s += clock() - t0
            res.calls += 1
            res.chunk_ops += len(ld)
        elif kind == STORE:
            todo = stores.pop(i)
            if not todo:
                continue
            t0 = clock()
            out = mgr.prepare_store(todo, ctxs[i])
            res.manager_s += clock() - t0
            res.calls += 1
            res.chunk_ops += len(todo)
            if out is None:
                res.store_failures += 1
            elif out.keys_to_store:
                res.stores += len(out.keys_to_store)
                res.evictions += len(out.evicted_keys)
                stores[i] = out.keys_to_store
                heapq.heappush(events, (now + len(todo) * chunk_tokens / store_tps, seq, STORED, i))
                seq += 1
        elif kind == STORED:
            done = stores.pop(i, None)
            if not done:
                continue  # the request finished first and completed it
            t0 = clock()
            mgr.complete_store(done, ctxs[i])
            res.manager_s += clock() - t0
            res.calls += 1
            res.chunk_ops += len(done)
        else:  # FINISH; a store still in flight completes first (the connector waits for it)
            ctx = ctxs.pop(i)
            t0 = clock()
            pending = stores.pop(i, None)
            if pending:
                mgr.complete_store(pending, ctx)
                res.calls += 1
            mgr.on_request_finished(ctx)
            res.manager_s += clock() - t0
            res.calls += 1
            res.chunk_ops += len(ks)
        yield res
    res.wall_s = clock() - t_wall
    stats = getattr(pol, "stats", None)
    if callable(stats):
        res.policy_stats = stats()
    yield res
