"""A cluster on a trace: N replicas' caches behind a routing policy (`kvheat replay
--replicas N --router ...`).

Each replica is a real `KVCacheManager` of `capacity_tokens` with the chosen eviction
policy; its index listeners feed the router's `PrefixIndex`, as KV events feed it in
`kvheat route`. Requests go in trace order, one at a time through the caches (match,
allocate, free, as `kvheat replay` does); a shared tier (a Redis-tier budget common to
all replicas, LRU) optionally takes every device eviction and serves any replica's misses
after its device prefix.

Load is modelled so that load-aware policies have something to see: each replica computes
prompts at `prefill_tps` tokens per second, one after the other (a request waits for the
prefill queued before it), and decodes at `decode_tps` tokens per second per sequence; a
request is in flight from arrival to its last token. The report: hit rate (device, shared),
and per replica the requests, prefill tokens (prompt tokens computed) and hit tokens, with
the max/mean imbalance of each, and the modelled TTFT.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..cache import Block, CacheConfig, KVCacheManager, hit_rate, make_policy
from ..replay.replayer import PreparedTrace, replay
from .index import DEVICE, SHARED_TIER, PrefixIndex
from .regime import ClusterEntropy
from .routing import KVHeatRouting, RouteRequest, RoutingPolicy, make_routing_policy


@dataclass(slots=True)
class ClusterConfig:
    """A simulated cluster: replicas, their capacity and policy, a shared tier, speeds."""

    replicas: int = 4
    capacity_tokens: int = 1_000_000  # per replica
    cache_policy: str = "kvheat"
    shared_tokens: int = 0  # a shared tier of this many tokens (0: none)
    shared_efficiency: float = 0.5  # share of a shared-tier block's prefill a load saves
    prefill_tps: float = 20_000.0
    decode_tps: float = 50.0
    time_scale: float = 1.0
    # Which routers report the cluster's entropy to the replicas' eviction regime (as
    # `kvheat route` does, `ClusterEntropy`): "kvheat" (that router only), "all" (any,
    # an ablation) or "none".
    regime_hints: str = "kvheat"
    # The replicas' names (default replica-0 ... replica-N-1). Hashing routers place by
    # name, so another set of names is another, equally valid, run of the same trace.
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.names and (len(self.names) != self.replicas
                           or len(set(self.names)) != len(self.names)):
            raise ValueError("names: one distinct name per replica")
        if self.regime_hints not in ("kvheat", "all", "none"):
            raise ValueError("regime_hints is one of kvheat, all, none")
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.capacity_tokens <= 0 or self.shared_tokens < 0:
            raise ValueError("capacity must be positive and the shared tier >= 0")
        if self.prefill_tps <= 0 or self.decode_tps <= 0 or self.time_scale <= 0:
            raise ValueError("prefill_tps, decode_tps and time_scale must be positive")


@dataclass(slots=True)
class ReplicaTotals:
    """One simulated replica's counts: requests, prompt tokens, hits."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # device hits
    shared_hit_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the replica computed (not hit on its device or the shared tier)."""
        return self.prompt_tokens - self.hit_tokens - self.shared_hit_tokens


@dataclass(slots=True)
class ClusterResult:
    """What one simulated cluster counted, with the single-cache bound."""

    router: str
    replicas: int
    capacity_tokens: int
    shared_tokens: int
    block_tokens: int
    requests: int
    total_tokens: int
    hit_tokens: int
    shared_hit_tokens: int
    per_replica: list[ReplicaTotals]
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    seconds: float
    modes: dict[str, int] = field(default_factory=dict)
    bound_hit_rate: float | None = None  # one cache of N x C (+ the shared tier)

    @property
    def hit_rate(self) -> float:
        """Device and shared-tier hit tokens over prompt tokens."""
        return hit_rate(self.hit_tokens + self.shared_hit_tokens, self.total_tokens)

    @property
    def imbalance_requests(self) -> float:
        """The busiest replica's requests over the mean."""
        return _max_over_mean([r.requests for r in self.per_replica])

    @property
    def imbalance_prefill(self) -> float:
        """The busiest replica's prefill tokens over the mean."""
        return _max_over_mean([r.prefill_tokens for r in self.per_replica])

    @property
    def of_bound(self) -> float | None:
        """The hit rate as a share of the single-cache bound (None without it)."""
        if not self.bound_hit_rate:
            return None
        return self.hit_rate / self.bound_hit_rate

    def as_dict(self) -> dict:
        """The result as the JSON report writes it."""
        return {
            "router": self.router, "replicas": self.replicas,
            "capacity_tokens": self.capacity_tokens, "shared_tokens": self.shared_tokens,
            "hit_rate": self.hit_rate, "device_hit_tokens": self.hit_tokens,
            "shared_hit_tokens": self.shared_hit_tokens, "total_tokens": self.total_tokens,
            "requests": self.requests, "bound_hit_rate": self.bound_hit_rate,
            "of_bound": self.of_bound, "imbalance_requests": self.imbalance_requests,
            "imbalance_prefill_tokens": self.imbalance_prefill,
            "per_replica": [{"requests": r.requests, "prompt_tokens": r.prompt_tokens,
                             "prefill_tokens": r.prefill_tokens, "hit_tokens": r.hit_tokens,
                             "shared_hit_tokens": r.shared_hit_tokens}
                            for r in self.per_replica],
            "ttft_mean_s": self.ttft_mean_s, "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s, "modes": self.modes,
            "seconds": round(self.seconds, 2),
        }


def _max_over_mean(xs: list[int]) -> float:
    mean = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean else 1.0


class _SharedTier:
    """An LRU of keys every replica can load from; it remembers which replica put each
    key there, to tell the index."""

    def __init__(self, capacity_blocks: int, index: PrefixIndex, names: list[str]) -> None:
        self.capacity = capacity_blocks
        self.index = index
        self.names = names
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # key -> writer

    def put(self, key: bytes, writer: int) -> None:
        if self.capacity <= 0:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        while len(self.entries) >= self.capacity:
            k, w = self.entries.popitem(last=False)
            self.index.removed(self.names[w], [k], SHARED_TIER, "redis")
        self.entries[key] = writer
        self.index.stored(self.names[writer], [key], SHARED_TIER, "redis")

    def continuation(self, keys: Sequence[bytes], start: int) -> int:
        """Blocks from `start` on found here (refreshed as they are read)."""
        n = start
        while n < len(keys) and keys[n] in self.entries:
            self.entries.move_to_end(keys[n])
            n += 1
        return n - start


def simulate(pt: PreparedTrace,
             router: str | RoutingPolicy | Callable[[PrefixIndex], RoutingPolicy],
             cfg: ClusterConfig,
             bound: bool = True) -> ClusterResult:
    """Replay the trace through N caches behind `router`, on a modelled clock."""
    bt = pt.block_tokens
    n_blocks = cfg.capacity_tokens // bt
    if n_blocks <= 0:
        raise ValueError(f"capacity {cfg.capacity_tokens} tokens holds no {bt}-token block")
    names = list(cfg.names) or [f"replica-{i}" for i in range(cfg.replicas)]
    index = PrefixIndex()
    for n in names:
        index.add_replica(n)
    if isinstance(router, str):
        policy = make_routing_policy(router, index)
    elif isinstance(router, RoutingPolicy):
        policy = router
    else:  # a factory given the index (a policy that reads it)
        policy = router(index)
    now = [0.0]
    shared = _SharedTier(cfg.shared_tokens // bt, index, names) if cfg.shared_tokens else None
    caches: list[KVCacheManager] = []
    for i, name in enumerate(names):
        mgr = KVCacheManager(CacheConfig(num_blocks=n_blocks, block_size=bt,
                                         share_groups=pt.share_groups),
                             policy=make_policy(cfg.cache_policy), clock=lambda: now[0])
        mgr.index_listeners.append(_feed(index, name))
        if shared is not None:
            mgr.evict_listeners.append(_to_shared(shared, i))
        caches.append(mgr)
    from .routing import ReplicaState

    hints = ClusterEntropy() if cfg.regime_hints == "all" or (
        cfg.regime_hints == "kvheat" and isinstance(policy, KVHeatRouting)) else None
    states = [ReplicaState(n, prefill_tps=cfg.prefill_tps) for n in names]
    free_at = [0.0] * cfg.replicas  # when each replica's prefill queue empties
    finishing: list[list[float]] = [[] for _ in names]  # finish times in flight (heaps)
    totals = [ReplicaTotals() for _ in names]
    ttfts: list[float] = []
    t0 = time.perf_counter()
    for i, r in enumerate(pt.trace):
        t = r.timestamp_ms * cfg.time_scale / 1000.0
        now[0] = t
        for j, st in enumerate(states):
            h = finishing[j]
            while h and h[0] <= t:
                heapq.heappop(h)
            st.in_flight = len(h)
            st.pending_prefill = max(0.0, free_at[j] - t) * cfg.prefill_tps
        keys, bts = pt.keys[i], pt.block_tokens_of[i]
        rreq = RouteRequest(keys, bts, r.input_length)
        d = policy.choose(rreq, states)
        j = d.replica
        policy.routed(rreq, names[j], d.expected_hit_tokens)
        if hints is not None:
            # `kvheat route` reports it every health check; here, at every request
            hints.observe(keys)
            bits = hints.bits()
            if bits is not None:
                for c in caches:
                    c.set_cluster_entropy(bits)
        mgr = caches[j]
        tot = totals[j]
        tot.requests += 1
        tot.prompt_tokens += r.input_length
        if len(bts) > n_blocks:  # never fits this cache: computed whole, not cached
            hit = loaded = 0
        else:
            req = mgr.make_hashed_request(str(i), r.hash_ids, r.input_length, r.tenant,
                                          r.session)
            matched = mgr.match_prefix(req)
            n_dev = len(matched)
            n_sh = shared.continuation(keys, n_dev) if shared is not None else 0
            mgr.allocate(req, matched)
            mgr.free(req)
            hit = sum(bts[:n_dev])
            loaded = sum(bts[n_dev:n_dev + n_sh])
        tot.hit_tokens += hit
        tot.shared_hit_tokens += loaded
        work = r.input_length - hit - cfg.shared_efficiency * loaded
        start = max(t, free_at[j])
        done = start + work / cfg.prefill_tps
        free_at[j] = done
        ttfts.append(done - t)
        heapq.heappush(finishing[j], done + r.output_length / cfg.decode_tps)
    seconds = time.perf_counter() - t0
    ttfts.sort()
    res = ClusterResult(
        policy.name, cfg.replicas, cfg.capacity_tokens, cfg.shared_tokens, bt,
        len(pt.trace), sum(x.prompt_tokens for x in totals), sum(x.hit_tokens for x in totals),
        sum(x.shared_hit_tokens for x in totals), totals,
        sum(ttfts) / len(ttfts) if ttfts else 0.0, _pct(ttfts, 0.5), _pct(ttfts, 0.99),
        seconds, dict(getattr(policy, "mode_counts", {})))
    if bound:
        res.bound_hit_rate = single_cache_bound(pt, cfg)
    return res


_bounds: dict[tuple, float] = {}


def single_cache_bound(pt: PreparedTrace, cfg: ClusterConfig) -> float:
    """Hit rate of one cache of N x C tokens with the same eviction policy.

    Plus the shared tier's budget: all the memory the cluster has. What N caches could reach
    if routing cost nothing."""
    key = (id(pt), cfg.replicas * cfg.capacity_tokens + cfg.shared_tokens, cfg.cache_policy)
    if key not in _bounds:
        _bounds[key] = replay(pt, cfg.cache_policy, key[1], pt.block_tokens,
                              time_scale=cfg.time_scale).hit_rate
    return _bounds[key]


def _to_shared(shared: _SharedTier, writer: int) -> Callable[[Block], None]:
    """An evict listener: replica `writer`'s evicted blocks go to the shared tier."""
    def on_evict(b: Block) -> None:
        if b.key is not None:  # always: an evicted block was a cached one
            shared.put(b.key, writer)
    return on_evict


def _feed(index: PrefixIndex, name: str):
    def on_change(b, stored: bool) -> None:
        if stored:
            index.stored(name, (b.key,), DEVICE)
        else:
            index.removed(name, (b.key,), DEVICE)
    return on_change


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(q * len(xs)))]
