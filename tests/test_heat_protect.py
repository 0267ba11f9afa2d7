"""Protection of a stable subset (kvheat/heat/protect.py): a cycle of conversations longer
than the cache keeps something, the miniatures switch it on only where it serves more, and
no block is lost however often it is switched, with tenants, queues and lower tiers."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
from test_miniature import run as run_kvheat
from test_tiers_hierarchy import BS, Engine, make_pool, prompts, unreachable
from tierstack import Stack

from bench.heat.cycles import cyclic
from bench.heat.cycles import run as run_cycles
from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.cache.request import CacheError
from kvheat.heat import KVHeat
from kvheat.heat.protect import PROBATION, PROTECTED
from kvheat.replay.traces import TraceRequest, WorkloadConfig, generate_workload
from kvheat.tiers import DiskStore, HostStore, TierSpec

BLOCK = 16


def per_set(sets: list[list[TraceRequest]], capacity_blocks: int, **kw: object
            ) -> tuple[list[float], KVHeat]:
    """kvheat's hit rate in each set of the trace (replayed from the start each time), and
    the policy of the whole replay."""
    rates, before = [], 0.0
    for n in range(1, len(sets) + 1):
        trace = [q for s in sets[:n] for q in s]
        rate, pol = run_kvheat(trace, capacity_blocks * BLOCK, BLOCK, **kw)
        total = sum(q.input_length for q in trace)
        rates.append((rate * total - before) / sum(q.input_length for q in sets[n - 1]))
        before = rate * total
    return rates, pol


def test_a_cycle_longer_than_the_cache_keeps_a_stable_subset() -> None:
    """12 conversations of 4 turns (a 288-block cycle) through 128 blocks, three sets of new
    conversations one after the other: recency keeps nothing, protection about a quarter of
    the prompts, and each new set takes over from the last."""
    sets = cyclic(12, 4, 8, 4, 3)
    plain, off = per_set(sets, 128, protect=False)
    assert plain == [0.0, 0.0, 0.0] and not off.protecting
    rates, pol = per_set(sets, 128)
    assert pol.protecting and pol.stats()["mini_switches"] == 1
    assert rates[0] > 0.05  # switched on during the first set
    assert min(rates[1:]) > 0.2  # the sets after it: stale conversations give way
    st = pol.stats()
    assert st["protect_stale"] > 0 and st["protect_promotions"] > 0
    rounds = pol.explain()
    assert [d["switched"] for d in rounds].count(True) == 1
    on = next(d for d in rounds if d["switched"])
    assert on["protect"] and on["alt_lead_z"] > 3.0


def test_the_cycles_bench_shows_no_cliff() -> None:
    a = argparse.Namespace(conversations=12, turns=4, system_blocks=8, turn_blocks=4, sets=3,
                           policy="lru,kvheat", capacity="64,128")
    got = {(c["policy"], c["capacity_blocks"]): c for c in run_cycles(a)["cells"]}
    assert got[("lru", 64)]["hit_rate"] == got[("lru", 128)]["hit_rate"] == 0.0
    assert got[("kvheat", 64)]["hit_rate"] > 0.0
    assert got[("kvheat", 128)]["hit_rate"] > 0.15


def random_requests(n: int, seed: int) -> list[list[int]]:
    """Prompts sharing heads of many lengths, some long: a mix of hits, inserts and
    evictions in a small cache."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1000) for _ in range(rng.randrange(1, 5) * BLOCK)]
             for _ in range(6)]
    out = []
    for _ in range(n):
        h = rng.choice(heads)
        tail = [rng.randrange(1000) for _ in range(rng.randrange(0, 4 * BLOCK))]
        out.append(h[:rng.randrange(0, len(h) + 1)] + tail or [1])
    return out


def check_protection(pol: KVHeat) -> None:
    """The sets agree with the blocks' states and no block is in two places."""
    g = pol.guard
    if g is None:
        return
    seen: set[int] = set()
    for q, state in ((g.recent, PROTECTED), (g.probation, PROBATION)):
        b = q.first()
        while b is not None and b is not q.end:
            assert b.state == state and b.key is not None and id(b) not in seen
            seen.add(id(b))
            b = b.next if b.next is not q.end else None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_switching_protection_loses_no_block(seed: int) -> None:
    """Random requests (some queued, some cancelled, two tenants) through a 24-block cache
    while protection is switched at random: every request is served, the cache stays
    consistent, and at the end every unreferenced block can still be evicted."""
    rng = random.Random(seed)
    mgr = KVCacheManager(CacheConfig(num_blocks=24, block_size=BLOCK, policy="kvheat"))
    pol = mgr.policy
    assert isinstance(pol, KVHeat)
    prompts = random_requests(400, seed)
    for i, p in enumerate(prompts):
        if rng.random() < 0.1:
            pol.set_protect(not pol.protecting)
        tenant = "a" if i % 3 else None
        req = mgr.make_request(f"r{i}", p[:20 * BLOCK], tenant=tenant)
        if rng.random() < 0.2:
            mgr.queue(req)
        try:
            mgr.allocate(req)
        except CacheError:
            mgr.dequeue(req.request_id)
            continue
        if rng.random() < 0.1:  # while the request holds its blocks
            pol.set_protect(not pol.protecting)
        mgr.free(req, "cancelled" if rng.random() < 0.1 else "finished")
        check_protection(pol)
        if i % 50 == 0:
            mgr.check_invariants()
    mgr.check_invariants()
    cached = mgr.num_cached
    assert mgr.evict(cached) == cached and mgr.num_cached == 0


def test_tiers_evict_through_protection(tmp_path: Path) -> None:
    """The device and both lower tiers with protection on: whatever each evicts, no entry is
    left behind a missing key (the hierarchy test's checks) and every block served holds
    its own KV (`Engine` compares each with the truth), as with protection off."""
    def run(protect: bool, sub: str) -> list[int]:
        pool = make_pool("gqa", 6)
        mgr = KVCacheManager(CacheConfig(6, BS, policy="kvheat"))
        host = HostStore(4 * pool.bytes_per_block, pool.bytes_per_block)
        disk = DiskStore(tmp_path / sub, 5 * (pool.bytes_per_block + 200), fsync=False)
        tc = Stack(mgr, pool, [host, disk], TierSpec(policy="kvheat", async_io=False,
                                                     calibrate=False))
        pols = [mgr.policy, *(idx.policy for idx in tc.tiers.lower.indexes)]
        if protect:
            for p in pols:
                assert isinstance(p, KVHeat)
                p.set_protect(True)
        eng = Engine(tc, pool)
        rng = random.Random(7)
        families = [prompts(4, 5, seed=s, shared=s % 4 + 1) for s in range(4)]
        ps = [p[:rng.randrange(1, 6) * BS] for fam in families for p in fam]
        keys = [mgr.make_request("k", p).keys for p in ps]
        hits = []
        for step in range(200):
            hits.append(eng.run(rng.choice(ps)))
            if step % 40 == 39:
                tc.tiers.flush()
                assert unreachable(tc, keys) == []
        assert tc.tiers.counters.worker_errors == 0 and tc.tiers.counters.load_failed == 0
        if protect:
            assert all(isinstance(p, KVHeat) and p.protecting for p in pols)
        tc.close()
        return hits

    on, off = run(True, "on"), run(False, "off")
    assert len(on) == len(off) == 200 and sum(on) > 0


def test_protect_is_type_checked() -> None:
    with pytest.raises(ValueError, match="protect"):
        KVHeat(protect="yes")  # type: ignore[arg-type]
    pol = KVHeat(protect=False)
    pol.bind(4096)
    pol.penalties.block_size = BLOCK
    assert pol._start_selector().alt is None  # nothing to switch: no third miniature


@pytest.mark.parametrize("policy", ["lru", "kvheat"])
def test_kvheats_engine_tiers_keep_conversations_past_the_cycle(policy: str, tmp_path: Path) -> None:
    """kvheat's own tier stack: an LRU device of 48 blocks over a 128-block host tier
    (write-through, `policy`), the cycle above three times over, real KV checked on every
    block served. Recency serves what the device keeps (under 10% a set); kvheat's host
    tier, protecting, serves more in every set, the third included."""
    rng = random.Random(0)
    words: dict[int, list[int]] = {}

    def tokens(ids: list[int]) -> list[int]:
        out: list[int] = []
        for i in ids:
            if i not in words:
                words[i] = [rng.randrange(50_000) for _ in range(BS)]
            out += words[i]
        return out

    pool = make_pool("gqa", 48)
    mgr = KVCacheManager(CacheConfig(48, BS, policy="lru"))
    host = HostStore(128 * pool.bytes_per_block, pool.bytes_per_block)
    tc = Stack(mgr, pool, [host], TierSpec(mode="write_through", policy=policy, async_io=False,
                                           calibrate=False))
    eng = Engine(tc, pool)
    shares = []
    for s in cyclic(12, 4, 8, 4, 3):
        served = total = 0
        for r in s:
            t = tokens(r.hash_ids)
            served += eng.run(t)
            total += len(t)
        shares.append(served / total)
    tier_policy = tc.tiers.lower.indexes[0].policy
    tc.close()
    if policy == "lru":
        assert max(shares) < 0.1
    else:
        assert isinstance(tier_policy, KVHeat) and tier_policy.protecting
        assert min(shares) > 0.15


def test_where_protection_loses_its_miniature_rests_and_nothing_switches() -> None:
    """The built-in conversation generator at 1M tokens (the grid's `gen` cell): the
    third miniature falls 3 standard errors behind, rests, and the live policy never
    protects."""
    _, pol = run_kvheat(generate_workload(WorkloadConfig(), 512), 1_000_000, 512)
    sel = pol.selector
    assert sel is not None and sel.alt is not None
    assert not pol.protecting and sel.switches == 0
    assert sel.alt_pause >= 1 and min(d["alt_lead_z"] for d in pol.explain()) < -3.0
    assert sel.alt.requests < sel.minis[0].requests  # it served less than the candidates
