"""LIRS and LeCaR (kvheat/cache/lirs.py, lecar.py) on real replays and a real cache: the
prefix invariants, the behaviour each is known for, and the bounds of their histories."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvheat.cache import CacheConfig, KVCacheManager, OutOfBlocks, make_policy, policy_names
from kvheat.cache.block import Block
from kvheat.cache.eviction import EvictionPolicy
from kvheat.cache.lecar import LeCaR
from kvheat.cache.lirs import LIRS, LIRSEntry
from kvheat.replay import TraceRequest, WorkloadConfig, generate_workload, replay

BT = 16  # tokens per block in the replays


def trace_of(chains: list[list[int]]) -> list[TraceRequest]:
    """One request per chain of block ids (each id names its whole prefix), 1 s apart."""
    return [TraceRequest(1000.0 * i, len(ids) * BT, 1, list(ids)) for i, ids in enumerate(chains)]


def replay_with(trace: list[TraceRequest], make: Callable[[], EvictionPolicy], blocks: int,
                **kw: object) -> tuple[float, EvictionPolicy]:
    """Hit rate of a real replay with a cache of `blocks` blocks, and the policy it ran."""
    made: list[EvictionPolicy] = []

    def factory() -> EvictionPolicy:
        made.append(make())
        return made[-1]

    r = replay(trace, factory, blocks * BT, BT, **kw)  # type: ignore[arg-type]
    return r.hit_rate, made[0]


def check_lirs(p: LIRS, m: KVCacheManager) -> None:
    """LIRS's own invariants: every cached block is LIR or resident HIR, the LIR set within
    its target, S's bottom LIR, non-resident entries within their bound and all in S."""
    assert p.n_lir + p.n_hir == len(m.cached)
    assert p.n_lir <= p.lir_target
    assert sum(1 for b in m.cached.values() if b.state == 1) == p.n_lir
    assert len(p.ghosts) <= p.ghost_limit
    entries = list(p.s)
    assert all(isinstance(e, LIRSEntry) for e in entries)
    if p.n_lir:
        bottom = p.s.first()
        assert isinstance(bottom, LIRSEntry) and bottom.lir
    assert sum(1 for e in entries if e.node is None) == len(p.ghosts)  # type: ignore[attr-defined]
    assert all(e.owner is p.s for e in p.ghosts.values())
    for b in m.cached.values():
        e = b.rec
        assert isinstance(e, LIRSEntry) and e.node is b and e.key == b.key
        assert not e.lir or e.owner is p.s  # every LIR block is in S


def check_lecar(p: LeCaR, m: KVCacheManager) -> None:
    assert len(p.hist_lru) <= p.capacity and len(p.hist_lfu) <= p.capacity
    assert 0.01 <= p.w_lru <= 0.99 and abs(p.w_lru + p.w_lfu - 1) < 1e-12
    in_lru = sum(1 for b in m.cached.values() if b.queue is p.lru)
    in_lfu = sum(len(lst) for lst in p.buckets.values())
    unheld = sum(1 for b in m.cached.values() if b.ref_cnt == 0)
    parked = sum(1 for b in m.cached.values() if b.parked is p.lru)
    assert in_lru + parked == unheld  # each unreferenced block in LRU's order or parked
    assert in_lfu + sum(1 for b in m.cached.values() if b.rec.parked) == unheld
    assert not set(p.hist_lru) & set(m.cached) and not set(p.hist_lfu) & set(m.cached)


def test_both_are_registered() -> None:
    assert {"lirs", "lecar"} <= set(policy_names())
    assert isinstance(make_policy("lirs"), LIRS) and isinstance(make_policy("lecar"), LeCaR)
    with pytest.raises(ValueError, match="hir"):
        LIRS(hir=0.0)
    with pytest.raises(ValueError, match="learning_rate"):
        LeCaR(learning_rate=0)


@pytest.mark.parametrize("policy", ["lirs", "lecar"])
def test_prefix_invariants_with_held_requests(policy: str) -> None:
    """Sessions that grow and restart, up to three requests held at once, a small cache:
    only unreferenced leaves are evicted, the cache stays closed under prefixes, and the
    policy's own structures stay consistent."""
    rng = random.Random(7)
    m = KVCacheManager(CacheConfig(num_blocks=48, block_size=2), policy=make_policy(policy))

    def on_evict(b: Block) -> None:
        assert b.ref_cnt == 0 and b.num_children == 0, "evicted a held block or a parent"

    m.evict_listeners.append(on_evict)
    sessions = [[rng.randrange(1 << 30)] for _ in range(10)]
    held = []
    refused = 0
    for i in range(2500):
        s = rng.randrange(len(sessions))
        sessions[s] += [rng.randrange(1 << 30) for _ in range(rng.randint(0, 4))]
        if len(sessions[s]) > 16:
            sessions[s] = sessions[s][:rng.randint(1, 3)]
        req = m.make_request(f"q{i}", [t for x in sessions[s] for t in (x, x)])
        try:
            m.allocate(req)
            held.append(req)
        except OutOfBlocks:
            refused += 1
        while len(held) > rng.randint(0, 3):
            m.free(held.pop(rng.randrange(len(held))))
        if i % 25 == 0:
            m.check_invariants()
            for b in m.cached.values():
                assert b.parent is None or m.cached.get(b.parent.key) is b.parent  # type: ignore[arg-type]
            if policy == "lirs":
                check_lirs(m.policy, m)  # type: ignore[arg-type]
            else:
                check_lecar(m.policy, m)  # type: ignore[arg-type]
    assert m.stats.evicted_blocks > 1000 and m.stats.hit_tokens > 0
    assert refused < 50


@pytest.mark.parametrize("policy", ["lirs", "lecar"])
@pytest.mark.parametrize("hold", [False, True])
def test_generated_workload_replays_within_capacity(policy: str, hold: bool) -> None:
    trace = generate_workload(WorkloadConfig(num_conversations=150, seed=3), BT * 4)
    r = replay(trace, policy, 120 * BT * 4, BT * 4, hold=hold)
    assert r.num_blocks == 120 and r.evictions > 0 and 0 < r.hit_rate < 1
    lru = replay(trace, "lru", 120 * BT * 4, BT * 4, hold=hold)
    assert r.total_tokens == lru.total_tokens


def loop_trace(n_chains: int, depth: int, rounds: int) -> list[TraceRequest]:
    chains = [[1000 * c + j for j in range(depth)] for c in range(n_chains)]
    return trace_of([chains[i % n_chains] for i in range(n_chains * rounds)])


@pytest.mark.parametrize("depth", [1, 4])
def test_lirs_keeps_a_loop_slightly_larger_than_the_cache(depth: int) -> None:
    """A cyclic working set 10% larger than the cache: LRU always evicts what comes next
    (no hits), LIRS keeps most of the loop as LIR and cycles the rest through HIR."""
    blocks = 100
    trace = loop_trace(110 // depth, depth, 12)
    lru, _ = replay_with(trace, lambda: make_policy("lru"), blocks)
    lirs, pol = replay_with(trace, lambda: make_policy("lirs"), blocks)
    assert lru == 0.0
    assert lirs > 0.6, lirs
    assert isinstance(pol, LIRS) and pol.n_lir > 0.8 * blocks


def test_lirs_new_blocks_are_hir_until_reused() -> None:
    """Past the cold start, an inserted block is resident HIR; used again while in S it
    becomes LIR; evicted, its key stays in S and comes back as LIR."""
    m = KVCacheManager(CacheConfig(num_blocks=10, block_size=2), policy=LIRS(hir=0.2))
    pol = m.policy
    assert isinstance(pol, LIRS) and pol.lir_target == 8

    def use(name: int, n: int = 1) -> list[Block]:
        req = m.make_request(f"r{name}-{len(m.cached)}-{pol.n_lir}", [name, name] * n)
        m.allocate(req)
        blocks = list(req.blocks)
        m.free(req)
        return blocks

    for k in range(10):
        use(k)  # warming: the first 8 are LIR, then HIR
    assert pol.n_lir == 8 and pol.n_hir == 2
    b = use(100)[0]  # the cache is full: the first eviction ends the warm-up
    assert b.state == 2 and b.key in m.cached  # HIR
    b = use(100)[0]
    assert b.state == 1  # reused while in S: LIR (and the bottom LIR demoted)
    assert pol.n_lir == 8
    check_lirs(pol, m)


def test_lirs_a_held_request_larger_than_q_demotes_instead_of_failing() -> None:
    """A request whose new blocks fill the HIR queue (all held) still allocates: LIR
    blocks at S's bottom are demoted into Q and evicted from there."""
    m = KVCacheManager(CacheConfig(num_blocks=20, block_size=2), policy=LIRS())
    pol = m.policy
    assert isinstance(pol, LIRS)
    for k in range(20):
        req = m.make_request(f"w{k}", [k, k])
        m.allocate(req)
        m.free(req)
    big = m.make_request("big", [t for k in range(500, 512) for t in (k, k)])  # 12 blocks
    m.allocate(big)
    assert pol.fallbacks >= 11
    check_lirs(pol, m)
    m.free(big)
    m.check_invariants()


def test_lirs_ghosts_are_bounded_and_overflow_counted() -> None:
    """Non-resident entries are kept up to `ghost * capacity`; past it the oldest go."""
    m = KVCacheManager(CacheConfig(num_blocks=20, block_size=2), policy=LIRS(ghost=0.5))
    pol = m.policy
    assert isinstance(pol, LIRS) and pol.ghost_limit == 10
    rng = random.Random(1)
    for i in range(600):
        k = rng.randrange(8) if i % 3 == 0 else 1000 + i  # a hot few amid a scan
        req = m.make_request(f"q{i}", [k, k])
        m.allocate(req)
        m.free(req)
        assert len(pol.ghosts) <= 10
        assert len(pol.s) <= pol.n_lir + pol.n_hir + 10
    assert pol.ghost_overflow > 0
    check_lirs(pol, m)


def test_lecar_is_deterministic() -> None:
    trace = generate_workload(WorkloadConfig(num_conversations=150, seed=5), BT * 4)
    runs = [replay(trace, "lecar", 100 * BT * 4, BT * 4) for _ in range(2)]
    assert runs[0].hit_tokens == runs[1].hit_tokens
    assert runs[0].policy_stats == runs[1].policy_stats
    assert runs[0].policy_stats["by_lru"] > 0 and runs[0].policy_stats["by_lfu"] > 0


def hot_amid_scan(hot: int, scan_per_hot: int, n: int) -> list[TraceRequest]:
    """Single-block requests: a hot set used alone for a few rounds (its counts grow),
    then round robin, each use followed by one-off blocks, so a hot block's reuse
    distance exceeds the cache while its count keeps growing."""
    chains: list[list[int]] = [[k % hot] for k in range(5 * hot)]
    fresh = 10_000
    for i in range(n):
        chains.append([i % hot])
        for _ in range(scan_per_hot):
            chains.append([fresh])
            fresh += 1
    return trace_of(chains)


def test_lecar_moves_toward_lfu_where_lfu_wins() -> None:
    trace = hot_amid_scan(hot=10, scan_per_hot=3, n=400)
    lru, _ = replay_with(trace, lambda: make_policy("lru"), 20)
    lfu, _ = replay_with(trace, lambda: make_policy("lfu"), 20)
    lecar, pol = replay_with(trace, lambda: make_policy("lecar"), 20)
    assert isinstance(pol, LeCaR)
    assert lfu > 0.2 and lru < 0.5 * lfu
    assert pol.w_lfu > 0.9 and pol.regrets[0] > pol.regrets[1]
    assert lecar > 0.5 * lfu


def test_lecar_moves_toward_lru_where_lru_wins() -> None:
    """Blocks used heavily once, then never: LFU keeps the stale ones and regrets."""
    chains: list[list[int]] = []
    for phase in range(30):
        base = 1000 * phase
        for _ in range(6):
            chains += [[base + k] for k in range(8)]
    trace = trace_of(chains)
    _, pol = replay_with(trace, lambda: make_policy("lecar"), 12)
    assert isinstance(pol, LeCaR) and pol.w_lru > 0.5


def test_lecar_history_is_bounded_and_discounted() -> None:
    p = LeCaR(history=0.5)
    p.bind(20)
    assert p.history_limit == 10 and p.discount == pytest.approx(0.005 ** (1 / 20))
    m = KVCacheManager(CacheConfig(num_blocks=20, block_size=2), policy=LeCaR(history=0.5))
    pol = m.policy
    assert isinstance(pol, LeCaR)
    for i in range(300):
        k = i % 7 if i % 2 else 1000 + i
        req = m.make_request(f"q{i}", [k, k])
        m.allocate(req)
        m.free(req)
        assert len(pol.hist_lru) <= 10 and len(pol.hist_lfu) <= 10
    check_lecar(pol, m)
    # A regret just after the eviction weighs about the learning rate; one a cache's
    # worth of accesses later, 0.5% of it.
    fresh = LeCaR()
    fresh.bind(100)
    fresh.time = 100
    fresh._regret(0, 100)
    near = 0.5 - fresh.w_lru
    fresh = LeCaR()
    fresh.bind(100)
    fresh.time = 200
    fresh._regret(0, 100)
    far = 0.5 - fresh.w_lru
    assert near > 0.1 and 0 < far < near / 50
