"""Routing policies: which replica serves a request.

Every policy sees the same things: the request (its chained block keys, as the replicas'
caches key it, and the tokens per block) and each replica's load (requests in flight,
prefill tokens routed to it and not done yet, its measured prefill speed). They are
used alike by `kvheat route` (live replicas) and by the trace simulation
(`kvheat replay --replicas`).

- `rr`: round robin.
- `least-load`: fewest requests in flight.
- `prefix-hash`: rendezvous hashing of the first block's key (a fixed-depth prefix hash,
  as routers that shard by the prompt's first tokens do).
- `sglang-like`: a model of SGLang's router's cache_aware policy: per replica an
  approximate tree of what was routed there (never told of evictions, pruned LRU past
  `max_tree_tokens`); when load is imbalanced (max - min in-flight > `balance_abs` and
  max > `balance_rel` x min) the least-loaded replica; else the replica with the longest
  match (on a tie the one that held it first) if the match covers more than
  `cache_threshold` of the prompt, else the least-loaded one (ties: the first). Defaults
  are SGLang's (0.3, 64, 1.5; its 2**26-character tree is taken as 2**24 tokens).
  `bench/cluster/sglang_fidelity.py` checks it against sglang-router's own binary.
- `kvheat`: see `KVHeatRouting`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..heat.entropy import EntropyTracker
from .index import Match, PrefixIndex


@dataclass(slots=True)
class RouteRequest:
    """A request as a routing policy sees it: its keys, its blocks' tokens and its arm."""

    keys: Sequence[bytes]  # chained keys of the prompt's full blocks (and a partial last one)
    block_tokens: list[int]  # tokens in each of those blocks
    num_tokens: int  # prompt tokens
    rank: int = 0  # the replicas' arm (event rank) this request reaches
    # Can a hot head be copied to other replicas (prewarmed)? Not in an "exact" arm, whose
    # keys match the whole prompt only: a hot prompt there stays where it is cached.
    replicable: bool = True


@dataclass(slots=True)
class ReplicaState:
    """A replica's load as a routing policy sees it."""

    name: str
    in_flight: int = 0  # requests routed there and not finished
    pending_prefill: float = 0.0  # prompt tokens routed there still to compute (estimate)
    prefill_tps: float | None = None  # measured prompt tokens per second; None: unknown
    healthy: bool = True


@dataclass(slots=True)
class Decision:
    """A routing choice: the replica, why, and the hit tokens expected there."""

    replica: int  # index into the replicas passed to `choose`
    mode: str  # affinity, shard, balance, round_robin, least_load, hash, cache, load
    expected_hit_tokens: int = 0
    regime: str = ""
    scores: list[float] = field(default_factory=list)


class RoutingPolicy:
    """Chooses a replica for each request (`choose`) and hears where each one went (`routed`)."""

    name = "base"

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        """The replica among `replicas` that serves `req`, and why."""
        raise NotImplementedError

    def routed(self, req: RouteRequest, replica: str, expected_hit_tokens: int = 0) -> None:
        """Record that the request went to `replica`, after `choose` or a failover.

        `expected_hit_tokens` of its prompt are expected cached there."""

    def forget_replica(self, replica: str) -> None:
        """`replica` left the cluster."""


def _healthy(replicas: Sequence[ReplicaState]) -> list[int]:
    ok = [i for i, r in enumerate(replicas) if r.healthy]
    if not ok:
        raise NoReplica("no healthy replica")
    return ok


class NoReplica(RuntimeError):
    """No healthy replica is left to route to."""


class RoundRobin(RoutingPolicy):
    """`rr`: the healthy replicas in turn."""

    name = "rr"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        ok = _healthy(replicas)
        i = ok[self._next % len(ok)]
        self._next += 1
        return Decision(i, "round_robin")


class LeastLoad(RoutingPolicy):
    """`least-load`: fewest requests in flight (ties in turn)."""

    name = "least-load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        ok = _healthy(replicas)
        low = min(replicas[i].in_flight for i in ok)
        ties = [i for i in ok if replicas[i].in_flight == low]
        self._turn += 1
        return Decision(ties[self._turn % len(ties)], "least_load")


def rendezvous(key: bytes, names: Sequence[str]) -> int:
    """Highest-random-weight hashing: the index of `key`'s replica among `names`.

    A replica leaving moves only its own keys."""
    return rendezvous_order(key, names, 1)[0]


def rendezvous_order(key: bytes, names: Sequence[str], k: int) -> list[int]:
    """The indices of `key`'s first `k` replicas among `names`, by rendezvous weight."""
    w = [hashlib.blake2b(key + n.encode(), digest_size=8).digest() for n in names]
    return sorted(range(len(names)), key=w.__getitem__, reverse=True)[:k]


class PrefixHash(RoutingPolicy):
    """`prefix-hash`: rendezvous hashing of the key at `depth_blocks` (default: the first)."""

    name = "prefix-hash"

    def __init__(self, depth_blocks: int = 1) -> None:
        self.depth = depth_blocks

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        ok = _healthy(replicas)
        if not req.keys:
            return Decision(ok[0], "hash")
        key = req.keys[min(self.depth, len(req.keys)) - 1]
        j = rendezvous(key, [replicas[i].name for i in ok])
        return Decision(ok[j], "hash")


class SglangLike(RoutingPolicy):
    """`sglang-like`: a model of SGLang's router's cache_aware policy (see the module docstring)."""

    name = "sglang-like"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_tree_tokens: int = 1 << 24) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_tokens = max_tree_tokens
        # replica -> key -> tokens, oldest first (its approximate tree, LRU-pruned)
        self.trees: dict[str, OrderedDict[bytes, int]] = {}
        self.sizes: dict[str, int] = {}
        self.first_holder: dict[bytes, str] = {}  # key -> the replica that held it first

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        ok = _healthy(replicas)
        loads = [replicas[i].in_flight for i in ok]
        lo, hi = min(loads), max(loads)
        least = ok[loads.index(lo)]  # the first of the least loaded, as SGLang's min_by_key
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return Decision(least, "balance")
        best, best_tokens, best_blocks, tied = least, 0, 0, [least]
        for i in ok:  # the longest match
            tree = self.trees.get(replicas[i].name)
            if not tree:
                continue
            n = b = 0
            for k, t in zip(req.keys, req.block_tokens):
                if k not in tree:
                    break
                n += t
                b += 1
            if n > best_tokens:
                best, best_tokens, best_blocks, tied = i, n, b, [i]
            elif n == best_tokens and n:
                tied.append(i)
        if len(tied) > 1:  # SGLang's tree node names one tenant: the first that held it
            first = self.first_holder.get(req.keys[best_blocks - 1])
            best = next((i for i in tied if replicas[i].name == first), best)
        rate = best_tokens / req.num_tokens if req.num_tokens else 0.0
        if rate > self.cache_threshold:
            return Decision(best, "cache", best_tokens)
        return Decision(least, "load")

    def routed(self, req: RouteRequest, replica: str, expected_hit_tokens: int = 0) -> None:
        tree = self.trees.setdefault(replica, OrderedDict())
        size = self.sizes.get(replica, 0)
        for k, t in zip(req.keys, req.block_tokens):
            if k in tree:
                tree.move_to_end(k)
            else:
                tree[k] = t
                size += t
                self.first_holder.setdefault(k, replica)
        while size > self.max_tree_tokens and tree:
            k, t = tree.popitem(last=False)
            size -= t
            if self.first_holder.get(k) == replica:
                del self.first_holder[k]
        self.sizes[replica] = size

    def forget_replica(self, replica: str) -> None:
        self.trees.pop(replica, None)
        self.sizes.pop(replica, None)
        self.first_holder = {k: r for k, r in self.first_holder.items() if r != replica}


@dataclass(slots=True)
class KVHeatRoutingConfig:
    """The kvheat routing policy's settings."""

    # Tokens found on a lower tier save this share of their prefill (a load costs the
    # rest): a host-memory copy nearly all of it, a disk or network read about half.
    local_tier_efficiency: float = 0.9
    shared_tier_efficiency: float = 0.5
    # Memory of popularity, utilisation and routed work, in requests per replica: enough
    # samples to tell a prefix carrying 1/N of the traffic from one that does not.
    window_per_replica: int = 32
    # New prefixes are sharded by hash over the replicas whose recent routed prefill work
    # is at most (1 + this) x the mean (the bound the balance target leaves, with room).
    balance_slack: float = 0.1
    # Leave an overloaded affinity replica (see KVHeatRouting). Off by default: on the
    # Mooncake traces it moved the modelled P99 TTFT by -21% to +2% and the hit rate by
    # -1.3 to +0.5 points (docs/cluster.md); the placement of new prefixes by work and
    # queue already keeps queues even, and a hot prefix never pins traffic to one replica.
    overload_guard: bool = False
    # The regime: hashing spreads load only over many more routing keys than replicas
    # (perplexity 2**H at least this x N); fewer, and new prefixes go by work instead.
    shard_keys_per_replica: float = 16.0
    # A new prefix goes to the least-queued of the first this-many replicas its routing
    # key hashes to (the power of two choices: most of the queue imbalance of one random
    # choice goes, and a prefix still lands on one of two replicas before its events
    # arrive). 1: the first only.
    shard_choices: int = 2

    def __post_init__(self) -> None:
        if not (0 <= self.local_tier_efficiency <= 1 and 0 <= self.shared_tier_efficiency <= 1):
            raise ValueError("tier efficiencies are shares in [0, 1]")
        if self.window_per_replica < 1 or self.balance_slack < 0 or \
                self.shard_keys_per_replica <= 0 or self.shard_choices < 1:
            raise ValueError("window_per_replica >= 1, balance_slack >= 0, "
                             "shard_keys_per_replica > 0 and shard_choices >= 1")


class PrefixHeat:
    """Decayed share of recent requests that contain each key (half-life `window` requests).

    O(1) per key: a new request's weight grows as 2**(n / window) instead of decaying every
    count; weights are rebased before they overflow."""

    def __init__(self, window: int, max_keys: int = 1 << 18) -> None:
        self.window = max(1, window)
        self.max_keys = max_keys
        self.counts: dict[bytes, float] = {}
        self.total = 0.0
        self.n = 0

    def add(self, keys: Sequence[bytes]) -> None:
        """Count one request's keys."""
        self.n += 1
        if self.n > 500 * self.window:  # rebase: scale every count down together
            f = 2.0 ** (-self.n / self.window)
            self.counts = {k: v * f for k, v in self.counts.items() if v * f > 1e-9}
            self.total *= f
            self.n = 0
        w = 2.0 ** (self.n / self.window)
        c = self.counts
        for k in keys:
            c[k] = c.get(k, 0.0) + w
        self.total += w
        if len(c) > self.max_keys:  # keep the heavier half
            cut = sorted(c.values())[len(c) // 2]
            self.counts = {k: v for k, v in c.items() if v > cut}

    def share(self, key: bytes, prior: float = 0.0) -> float:
        """The key's share of recent requests, with `prior` pseudo-requests that lack it.

        So a key seen once, in the only request so far, is not yet hot."""
        w = 2.0 ** (self.n / self.window)
        d = self.total + prior * w
        return self.counts.get(key, 0.0) / d if d else 0.0


class KVHeatRouting(RoutingPolicy):
    """Expected prefill saved, from the global prefix index, against the queues.

    1. Saved tokens per replica: its device prefix of the prompt, then what its lower
       tiers and the shared tier hold after it, at their efficiencies. Hot prefixes (a key
       in more than 1/N of recent requests: no one replica could take all of its traffic)
       count as held by every replica: the router prewarms them on the replicas that
       lack them, or the first request that lands there warms them, so they never pull
       traffic onto one replica. The first key after that hot head is the request's
       routing key.
    2. Affinity: the replica that saves the most (ties: the shorter queue). With the
       overload guard, it keeps the request unless the time to first token there (queue
       and misses) exceeds the least-queued replica's by the factor 1 / (1 - utilisation)
       **2 (the marginal delay extra work causes in a loaded queue).
    3. No replica saves more than another (a new prefix, or one evicted everywhere):
       the replica that held this prefix last (its eviction policy remembers it, the
       index keeps recent evictions) if any; else, when the routing keys are many (high
       entropy), rendezvous hashing of the routing key over the replicas within the
       work bound, the less queued of its first two, so a prefix goes to one of two
       replicas even before its events arrive; when they are few (low entropy, hashing
       cannot spread them), the replica with the least recent routed prefill work.
    """

    name = "kvheat"

    def __init__(self, index: PrefixIndex, config: KVHeatRoutingConfig | None = None) -> None:
        self.index = index
        self.config = config or KVHeatRoutingConfig()
        self.heat = PrefixHeat(self.config.window_per_replica)
        self.entropy = EntropyTracker(half_life=256.0)
        self._n_replicas = 1
        self.mode_counts: dict[str, int] = {}
        self.busy: dict[str, float] = {}  # replica -> utilisation estimate
        self.work: dict[str, float] = {}  # replica -> decayed prefill tokens routed there

    def regime(self) -> str:
        """The regime: "high" when routing keys far outnumber the replicas, else "low".

        Hashing spreads load only over many more routing keys than replicas: perplexity
        2**H at least `shard_keys_per_replica` x N."""
        if len(self.entropy) == 0:
            return "high"
        perplexity = 2.0 ** self.entropy.bits()
        return "high" if perplexity >= self.config.shard_keys_per_replica * self._n_replicas \
            else "low"

    def hot_head(self, req: RouteRequest, n_replicas: int) -> int:
        """Blocks at the start of the prompt whose key is hot (share > 1/N)."""
        if n_replicas <= 1 or not req.replicable:
            return 0
        limit = 1.0 / n_replicas
        h = 0
        for k in req.keys:
            if self.heat.share(k, prior=n_replicas) <= limit:
                break
            h += 1
        return h

    def utilisation(self, names: Sequence[str]) -> float:
        """The mean recent utilisation of the replicas `names`."""
        return sum(self.busy.get(n, 0.0) for n in names) / max(1, len(names))

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        cfg = self.config
        ok = _healthy(replicas)
        self._n_replicas = len(ok)
        names = [replicas[i].name for i in ok]
        self._observe_busy(replicas, ok)
        matches = self.index.match(req.keys, req.block_tokens, names, req.rank)
        head = self.hot_head(req, len(ok))
        head_tokens = sum(req.block_tokens[:head])
        saved = [self._saved(m, head, req, cfg) for m in matches]
        regime = self.regime()
        best = max(saved)
        if best > head_tokens:
            cand = [t for t in range(len(ok)) if saved[t] >= best]
            j = min(cand, key=lambda t: (replicas[ok[t]].pending_prefill,
                                         self.work.get(names[t], 0.0)))
            mode = "affinity"
        else:
            pending = [replicas[i].pending_prefill for i in ok]
            j, mode = self._place_new(req, matches, names, pending, head, regime)
        if cfg.overload_guard:
            # A hit is worth waiting for, up to a point: leave the affinity replica when
            # the request's time to first token there (its queue, then its misses) is more
            # than 1 / (1 - utilisation)**2 times what it would be on the least-queued one.
            alt = min(range(len(ok)), key=lambda t: replicas[ok[t]].pending_prefill)
            rho = min(self.utilisation(names), 0.95)
            here = replicas[ok[j]].pending_prefill + req.num_tokens - saved[j]
            there = replicas[ok[alt]].pending_prefill + req.num_tokens - saved[alt]
            if alt != j and here > there / (1.0 - rho) ** 2:
                j, mode = alt, "overload"
        self.mode_counts[mode] = self.mode_counts.get(mode, 0) + 1
        m = matches[j]
        return Decision(ok[j], mode, m.device_tokens + m.local_tokens + m.shared_tokens,
                        regime, saved)

    def _place_new(self, req: RouteRequest, matches: list[Match], names: list[str],
                   pending: list[float], head: int, regime: str) -> tuple[int, str]:
        recent = max(m.recent_blocks for m in matches)
        work = [self.work.get(n, 0.0) for n in names]
        if recent > head:  # it lived somewhere lately: back there
            cand = [t for t, m in enumerate(matches) if m.recent_blocks == recent]
            return min(cand, key=lambda t: work[t]), "home"
        if regime == "high" and head < len(req.keys):
            bound = (1.0 + self.config.balance_slack) * sum(work) / len(work)
            within = [t for t in range(len(names)) if work[t] <= bound] or list(range(len(names)))
            first = rendezvous_order(req.keys[head], [names[t] for t in within],
                                     self.config.shard_choices)
            # min keeps the first on ties: an idle cluster shards by the hash alone
            return within[min(first, key=lambda o: pending[within[o]])], "shard"
        return min(range(len(names)), key=lambda t: work[t]), "balance"

    def _observe_busy(self, replicas: Sequence[ReplicaState], ok: list[int]) -> None:
        """Each replica's utilisation: the decayed share of arrivals that found prefill
        queued there (arrivals see time averages)."""
        a = 1.0 / (self.config.window_per_replica * max(1, len(ok)))
        busy = self.busy
        for i in ok:
            r = replicas[i]
            b = busy.get(r.name, 0.0)
            busy[r.name] = b + a * ((1.0 if r.pending_prefill > 0 else 0.0) - b)

    @staticmethod
    def _saved(m: Match, head: int, req: RouteRequest, cfg: KVHeatRoutingConfig) -> float:
        bt = req.block_tokens
        d = max(m.device_blocks, head)  # a hot head counts as held everywhere
        saved = float(sum(bt[:d]))
        j = max(d, m.device_blocks + m.local_blocks)
        saved += cfg.local_tier_efficiency * sum(bt[d:j])
        s = max(j, m.blocks)
        saved += cfg.shared_tier_efficiency * sum(bt[j:s])
        return saved

    def routed(self, req: RouteRequest, replica: str, expected_hit_tokens: int = 0) -> None:
        head = self.hot_head(req, self._n_replicas)
        self.heat.add(req.keys)
        if req.keys:
            if len(self.entropy) >= 1 << 16:  # keys are never forgotten there: start over
                self.entropy = EntropyTracker(half_life=256.0)
            self.entropy.update(req.keys[min(head, len(req.keys) - 1)])
        a = 1.0 / (self.config.window_per_replica * max(1, self._n_replicas))
        for n in list(self.work):
            self.work[n] *= 1.0 - a
        self.work[replica] = self.work.get(replica, 0.0) + max(
            0, req.num_tokens - expected_hit_tokens)

    def forget_replica(self, replica: str) -> None:
        self.busy.pop(replica, None)
        self.work.pop(replica, None)


# The routing policies by name. Named apart from the cache's eviction policies
# (`kvheat.cache.make_policy`, `policy_names`): in kvheat a bare "policy" is the cache's.
ROUTING_POLICIES = ("rr", "least-load", "prefix-hash", "sglang-like", "kvheat")


def make_routing_policy(name: str, index: PrefixIndex | None = None,
                        **settings: Any) -> RoutingPolicy:
    """The routing policy `name` (one of ROUTING_POLICIES) with its `settings`.

    The kvheat policy reads the prefix `index`."""
    if name == "rr":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-hash":
        return PrefixHash(**settings)
    if name == "sglang-like":
        return SglangLike(**settings)
    if name == "kvheat":
        if index is None:
            raise ValueError("the kvheat policy needs the prefix index")
        return KVHeatRouting(index, KVHeatRoutingConfig(**settings))
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTING_POLICIES)}")
