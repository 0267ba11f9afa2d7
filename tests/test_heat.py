"""Heat: decayed entropy, the fused score, tuning, drift and the heat policies."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvheat.cache import CacheConfig, KVCacheManager, make_policy, policy_names
from kvheat.heat import (
    DriftDetector,
    EntropyTracker,
    KVHeat,
    LRUKHistory,
    OnlineTuner,
    Regime,
    fused_score,
    shannon_bits,
)
from kvheat.heat.feedback import MULT_HI, MULT_LO
from kvheat.heat.reuse import ReuseGapEstimator
from kvheat.replay import PreparedTrace, replay
from kvheat.replay.traces import WorkloadConfig, generate_workload


# ---- entropy ---------------------------------------------------------------------------
def test_entropy_incremental_equals_from_scratch_after_1e6_updates() -> None:
    # A short half-life forces several rebases of the growing weights along the way.
    tr = EntropyTracker(half_life=300)
    rng = random.Random(7)
    for _ in range(1_000_000):
        tr.update(rng.randrange(5000) if rng.random() < 0.5 else int(rng.paretovariate(1.0)))
    assert len(tr.shifts) > 1, "test should exercise rebasing"
    fast, ref = tr.entropy(), tr.entropy_from_scratch()
    assert ref > 1.0
    assert abs(fast - ref) / ref < 1e-9


def test_entropy_of_uniform_and_single_key() -> None:
    tr = EntropyTracker(half_life=1e12)
    for i in range(4096):
        tr.update(i % 256)
    assert tr.bits() == pytest.approx(8.0, abs=1e-6)
    one = EntropyTracker()
    for t in range(100):
        one.update("k", now=float(t))
    assert one.bits() == pytest.approx(0.0, abs=1e-9)
    assert EntropyTracker().bits() == 0.0


def test_entropy_decay_forgets_old_keys() -> None:
    tr = EntropyTracker(half_life=10.0)
    for i in range(1000):
        tr.update(i, now=0.0)  # 1000 distinct keys: ~10 bits
    assert tr.bits() > 9.9
    for t in range(1, 500):
        tr.update("hot", now=float(t))  # then a single key for 50 half-lives
    assert tr.bits() < 0.01
    assert tr.probability("hot") > 0.999


def test_entropy_adaptive_sampling_error_is_small() -> None:
    rng = random.Random(3)
    keys = [int(rng.paretovariate(1.5)) for _ in range(200_000)]  # low entropy (< 4.2 bits)
    full, sampled = EntropyTracker(half_life=1e9), EntropyTracker(half_life=1e9, sample_low=0.25)
    for k in keys:
        full.update(k)
        sampled.update(k)
    assert full.bits() < 4.2
    assert sampled.recorded < 0.3 * sampled.updates
    assert abs(sampled.bits() - full.bits()) < 0.05


def test_shannon_bits() -> None:
    assert shannon_bits(np.array([1, 1, 1, 1])) == pytest.approx(2.0)
    assert shannon_bits(np.array([0, 5])) == 0.0


# ---- scores ----------------------------------------------------------------------------
def test_fused_score_gate() -> None:
    h = np.linspace(0, 1, 11)
    s = fused_score(h, np.full(11, 0.7))
    assert np.all((s >= 0) & (s <= 1))
    # Low entropy: the recency term dominates; high entropy: (1 - H) does.
    assert fused_score(0.0, 1.0) > fused_score(0.0, 0.0)
    assert fused_score(1.0, 1.0) == pytest.approx(fused_score(1.0, 0.0), abs=0.3)
    g = 1 / (1 + math.exp(2.0 * (0.3 - 0.5)))
    assert fused_score(0.3, 0.6) == pytest.approx(g * 0.6 + (1 - g) * 0.7)
    with pytest.raises(ValueError):
        fused_score(1.5, 0.5)


def test_lruk_history_and_regime() -> None:
    from kvheat.cache.block import Block
    from kvheat.heat import LRUK

    pol = LRUK(k=2)
    pol.bind(8)
    b = Block(0)
    b.key = b"k"
    pol.on_insert(b, 1.0)
    assert isinstance(b.rec, LRUKHistory) and b.rec.times == [1.0]
    assert pol.key(b) == 1.0 - 1e12  # fewer than K accesses: before all others
    pol.on_hit(b, 5.0)
    pol.on_hit(b, 9.0)
    assert b.rec.times == [5.0, 9.0] and pol.key(b) == 5.0  # the K-th most recent access
    pol.on_evict(b)
    pol.on_insert(b, 12.0)  # back from the ghost: its last access is remembered
    assert b.rec.times == [9.0, 12.0]
    r = Regime()
    assert [r.classify(b) for b in (0.5, 4.0, 9.0)] == ["low", "mid", "high"]


def test_regime_reads_a_warm_up_of_distinct_keys_as_high() -> None:
    r = Regime()
    # 150 samples can show at most log2(150) = 7.23 bits: all distinct is already high
    assert r.classify(7.2, samples=150) == "high"
    # repeated keys read well below their sample count's log2: the tiers as before
    assert r.classify(3.0, samples=1000) == "mid"
    assert r.classify(0.5, samples=1000) == "low"
    assert r.classify(9.0, samples=1000) == "high"
    tr = EntropyTracker(half_life=1e9)  # no decay to speak of: samples = updates
    for k in range(200):
        tr.update(k)
    assert tr.samples() == pytest.approx(200, rel=1e-6)
    assert tr.bits() == pytest.approx(math.log2(200), rel=1e-6)
    assert r.classify(tr.bits(), tr.samples()) == "high"
    assert r.classify(tr.bits()) == "mid"  # without the sample count, a mid reading


def test_admit_now_charges_every_first_seen_block_by_the_current_regime() -> None:
    from kvheat.heat.penalties import ONE_OFF, Penalties

    pen = Penalties(6.67, 3.2, 4.0, 2.67, True, 2.0, admit_now=True)
    assert not pen.follow_regime("mid")  # nothing to re-key: the flag was never charged
    assert pen.new_flags == ONE_OFF and pen.flag[ONE_OFF] == 1.0
    assert pen.follow_regime("high")  # every cached one-off's factor changed
    assert pen.flag[ONE_OFF] == pytest.approx(2.0 ** -3.2)
    assert not pen.follow_regime("high")
    assert pen.follow_regime("mid") and pen.flag[ONE_OFF] == 1.0
    old = Penalties(6.67, 3.2, 4.0, 2.67, True, 2.0)  # flags by the regime at insert
    old.follow_regime("mid")
    assert old.new_flags == 0 and old.flag[ONE_OFF] == pytest.approx(2.0 ** -3.2)


def test_admission_penalty_above_its_floor_fades_with_the_eviction_age() -> None:
    from kvheat.heat.penalties import Penalties

    pen = Penalties(6.67, 3.2, 4.0, 2.67, True, 2.0)
    pen.admit_fade, pen.admit_floor = True, 1.6
    pen.update(gap=100.0, evictions=0, evict_age=0.0)
    assert pen.admit_penalty == 0.0  # nothing evicted: nothing charged
    pen.update(gap=100.0, evictions=10, evict_age=0.0)
    assert pen.admit_penalty == pytest.approx(3.2)  # a short-lived cache: in full
    pen.update(gap=100.0, evictions=10, evict_age=100.0)
    assert pen.admit_penalty == pytest.approx(2.4)  # one reuse gap of two
    pen.update(gap=100.0, evictions=10, evict_age=500.0)
    assert pen.admit_penalty == pytest.approx(1.6)  # the floor stays


# ---- tuning and drift ------------------------------------------------------------------
def test_online_tuner_climbs_towards_the_better_value() -> None:
    # Hit probability peaks at value = 50; start far below it.
    t = OnlineTuner(5.0, 1.0, 500.0, step=0.2, step_events=2000)
    rng = random.Random(0)
    for _ in range(400_000):
        p = max(0.05, 0.9 - 0.2 * abs(math.log(t.value / 50.0)))
        t.record(rng.random() < p)
    assert 20.0 < t.value < 125.0
    assert t.moves > 0


def test_drift_detector_fires_on_entropy_drop_only() -> None:
    rng = random.Random(1)
    d = DriftDetector(window=1000, threshold=1.0, min_count=100)
    fired = [d.observe(rng.randrange(4096)) for _ in range(10_000)]
    assert not any(fired)
    fired = [d.observe(rng.randrange(8)) for _ in range(2000)]
    assert any(fired) and d.drifts == 1
    with pytest.raises(ValueError):
        DriftDetector(window=10, min_count=20)


# ---- policies in the real cache ---------------------------------------------------------
HEAT_POLICIES = ["kvheat", "lruk", "fused"]


def test_heat_policies_registered() -> None:
    assert set(HEAT_POLICIES) <= set(policy_names())


def _run(policy, trace, capacity_blocks: int, check_every: int = 0) -> KVCacheManager:
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(capacity_blocks, 512), policy, clock=lambda: now[0])
    for i, r in enumerate(trace):
        now[0] = r.timestamp_ms / 1000
        if len(r.hash_ids) > capacity_blocks:
            continue
        req = mgr.make_hashed_request(str(i), r.hash_ids, r.input_length)
        mgr.allocate(req)
        mgr.free(req)
        if check_every and i % check_every == 0:
            mgr.check_invariants()
    return mgr


@pytest.mark.parametrize(("name", "kw"), [(n, {}) for n in HEAT_POLICIES] + [
    ("kvheat", {"tune": True, "drift": True, "max_count": 3.0}),
    ("kvheat", {"regime": False, "ghost": 0.0, "extension_penalty": 0.0}),
    ("kvheat", {"half_life": 50.0}),
])
def test_heat_policy_keeps_cache_invariants(name: str, kw: dict) -> None:
    trace = generate_workload(WorkloadConfig(num_conversations=150, seed=5))
    mgr = _run(make_policy(name, **kw), trace, 64, check_every=25)
    mgr.check_invariants()
    assert mgr.stats.evicted_blocks > 0 and mgr.stats.hit_tokens > 0


def test_kvheat_beats_lru_when_reuse_outlives_the_cache() -> None:
    # Conversations come back after longer than LRU keeps them: history and decayed
    # counts keep the returning ones.
    cfg = WorkloadConfig(num_conversations=600, arrival_rate=4.0, think_time_s=120.0, seed=11)
    trace = generate_workload(cfg)
    lru = _run(make_policy("lru"), trace, 100).stats.hit_rate
    heat = _run(make_policy("kvheat"), trace, 100).stats.hit_rate
    assert heat > lru + 0.04, (heat, lru)


def test_kvheat_demotes_the_partial_tail_block() -> None:
    pol = KVHeat()
    mgr = KVCacheManager(CacheConfig(3, 4), pol, clock=lambda: 0.0)
    a = mgr.make_hashed_request("a", [1, 2], 6)  # second block is partial (2 of 4 tokens)
    mgr.allocate(a)
    mgr.free(a)
    b = mgr.make_hashed_request("b", [9], 4)  # full block, released later
    mgr.allocate(b)
    mgr.free(b)
    evicted = []
    mgr.evict_listeners.append(lambda blk: evicted.append(blk.num_tokens))
    mgr.evict(1)
    assert evicted == [2]


def test_kvheat_history_restores_heat_after_eviction() -> None:
    now = [0.0]
    pol = KVHeat(half_life=100.0)
    mgr = KVCacheManager(CacheConfig(2, 4), pol, clock=lambda: now[0])
    for t in range(5):  # block 1 gets hot
        now[0] = float(t)
        r = mgr.make_hashed_request(f"h{t}", [1], 4)
        mgr.allocate(r)
        mgr.free(r)
    mgr.evict(1)
    r = mgr.make_hashed_request("back", [1], 4)
    mgr.allocate(r)
    assert pol.log_count(mgr.requests["back"].blocks[0]) > math.log(4.5)  # count resumed, not 1
    assert pol.ghost_hits == 1


def test_lruk_evicts_blocks_with_fewer_than_k_accesses_first() -> None:
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(3, 4), make_policy("lruk"), clock=lambda: now[0])
    for t, bid in ((0.0, 1), (10.0, 1), (20.0, 2)):  # block 1 twice (older), block 2 once
        now[0] = t
        r = mgr.make_hashed_request(f"r{t}", [bid], 4)
        mgr.allocate(r)
        mgr.free(r)
    evicted: list[bytes] = []
    mgr.evict_listeners.append(lambda b: evicted.append(b.content))
    mgr.evict(1)
    assert evicted == [(2).to_bytes(8, "little")]


def test_kvheat_drift_detector_resets_stale_heat() -> None:
    now = [0.0]
    pol = KVHeat(drift=True, drift_window=64, drift_threshold=1.0)
    mgr = KVCacheManager(CacheConfig(200, 4), pol, clock=lambda: now[0])
    for i in range(256):  # phase A: 64 distinct conversations under one root, hot root
        now[0] = float(i)
        r = mgr.make_hashed_request(f"a{i}", [0, 1000 + i % 64], 8)
        mgr.allocate(r)
        mgr.free(r)
    root = mgr.match_prefix(mgr.make_hashed_request("q", [0], 4))[0]
    assert pol.log_count(root, root.rec.last) > 3.0  # the root got hot
    for i in range(256):  # phase B: a single conversation takes over
        now[0] = 256.0 + i
        r = mgr.make_hashed_request(f"b{i}", [7, 9], 8)
        mgr.allocate(r)
        mgr.free(r)
    assert pol.stats()["drifts"] >= 1
    assert root.key is None or pol.log_count(root, root.rec.last) <= 1e-9  # stale heat dropped (or evicted)
    mgr.check_invariants()


def test_kvheat_learns_extension_penalty_from_reuse() -> None:
    # Documents queried with a new question each time: the question block extends a known
    # prefix and is never reused, while fresh documents are: the penalty goes up.
    rng = random.Random(2)
    now = [0.0]
    pol = KVHeat()
    mgr = KVCacheManager(CacheConfig(400, 4), pol, clock=lambda: now[0])
    for i in range(3000):
        now[0] = i * 0.5
        doc = rng.randrange(300)
        ids = [10_000 + doc * 8 + j for j in range(4)] + [1_000_000 + i]
        r = mgr.make_hashed_request(str(i), ids, 20)
        mgr.allocate(r)
        mgr.free(r)
    assert pol.penalties.extension_penalty > 0.5 * pol.penalties.max_extension_penalty
    # Growing conversations: every extension is reused by the next turn: no penalty.
    pol2 = KVHeat()
    mgr2 = KVCacheManager(CacheConfig(400, 4), pol2, clock=lambda: now[0])
    convs: dict[int, list[int]] = {}
    for i in range(3000):
        now[0] = i * 0.5
        c = rng.randrange(100)
        hist = convs.setdefault(c, [])
        if len(hist) > 20:
            hist.clear()
        hist.append(i + 1)  # a new block id per turn
        r = mgr2.make_hashed_request(str(i), [0, *hist], 4 * (len(hist) + 1))
        mgr2.allocate(r)
        mgr2.free(r)
    assert pol2.penalties.extension_penalty < 0.25 * pol2.penalties.max_extension_penalty


def test_kvheat_admission_penalty_stays_on_in_a_long_lived_cache() -> None:
    # The extension penalty fades as the eviction age reaches penalty_fade reuse gaps; with
    # admit_floor the admission penalty fades down to it, the floor staying in full once
    # the cache has evicted (none before); admit_floor=None (the previous default), or a floor
    # at or above the penalty, keeps all of it on. The default is 3.2 fading to 1.6.
    pol = KVHeat(adapt_extension=False)
    pol.bind(100)
    pen = pol.penalties
    pen.update(10.0, 0, 0.0)
    assert pen.admit_penalty == 0.0 and pen.extension_penalty == 0.0  # nothing evicted yet
    top, floor = pen.max_admit_penalty, pen.admit_floor
    assert top == 3.2 and floor == 1.6
    for age, ext, admit in ((0.0, pen.max_extension_penalty, top),
                            (10.0, pen.max_extension_penalty / 2, (top + floor) / 2),
                            (1e6, 0.0, floor)):
        pen.update(10.0, 50, age)
        assert abs(pen.admit_penalty - admit) < 1e-9
        assert abs(pen.extension_penalty - ext) < 1e-9
    with pytest.raises(ValueError, match="admit_floor"):
        KVHeat(admit_floor=-0.5)
    for kept in (KVHeat(adapt_extension=False, admit_penalty=1.6, admit_floor=None),
                 KVHeat(adapt_extension=False, admit_penalty=0.8)):  # (floor 1.6 above it)
        kept.bind(100)
        kept.penalties.update(10.0, 50, 1e6)
        assert kept.penalties.admit_penalty == kept.penalties.max_admit_penalty


def test_cluster_entropy_sets_the_regime_for_one_window() -> None:
    # A cache of 8 documents reads as middling on its own; told a higher cluster entropy
    # it takes that regime (first-seen blocks flagged) for one entropy window of its
    # depth-1 accesses, then reads its own again. A lower report never lowers it.
    from kvheat.heat.penalties import ONE_OFF

    mgr = KVCacheManager(CacheConfig(num_blocks=4096, block_size=4),
                         policy=make_policy("kvheat", entropy_half_life=64.0))
    pol = mgr.policy
    n = 0

    def serve(doc: int) -> list:
        nonlocal n
        n += 1
        req = mgr.make_request(str(n), [1, 2, 3, 4, 100 + doc, 5, 6, 7, n, n, n, n])
        mgr.allocate(req, mgr.match_prefix(req))
        blocks = list(req.blocks)
        mgr.free(req)
        return blocks

    for i in range(200):
        serve(i % 8)
    assert pol.mode == "mid" and 2.5 < pol.tracker.bits() < 3.5
    assert "cluster_entropy_bits" not in pol.stats()
    mgr.set_cluster_entropy(9.0)
    assert pol.stats()["cluster_entropy_bits"] == 9.0
    last = serve(3)[-1]  # a first-seen block under a depth-1 key: charged now
    assert pol.mode == "high" and last.rec.flags & ONE_OFF and pol.penalties.admitting
    for _ in range(62):
        serve(3)
    assert pol.mode == "high"
    serve(3)  # the window (64 depth-1 accesses) is over: its own reading again
    serve(3)
    assert pol.mode in ("low", "mid") and "cluster_entropy_bits" not in pol.stats()
    own = pol.tracker.bits()
    assert own > 1.0
    mgr.set_cluster_entropy(0.5)  # lower than its own (a router just started): no effect
    serve(1)
    # (admit_now, the default: every root carries the flag, the regime decides its charge)
    assert pol.mode == "mid" and not pol.penalties.pinning and not pol.penalties.admitting
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            pol.set_cluster_entropy(bad)
    off = KVHeat(regime=False)
    off.set_cluster_entropy(9.0)  # no regime: nothing to set
    assert off.feedback.cluster_bits is None


def test_cluster_entropy_reaches_every_tenant_partition() -> None:
    # A tenant with a quota has a policy of its own; the report reaches it and the shared
    # one alike, and a policy without a regime (LRU) ignores it.
    mgr = KVCacheManager(CacheConfig(num_blocks=256, block_size=4), policy=make_policy("kvheat"))
    mgr.set_tenant_quota("small", 16)
    req = mgr.make_request("a", list(range(12)), tenant="small")
    mgr.allocate(req, mgr.match_prefix(req))
    mgr.free(req)
    pols = [mgr.policy, *mgr.tenants.partitions.values()]
    assert len(pols) == 2 and all(isinstance(p, KVHeat) for p in pols)
    mgr.set_cluster_entropy(8.5)
    assert all(p.feedback.cluster_bits == 8.5 and p.mode == "high" for p in pols)
    lru = KVCacheManager(CacheConfig(num_blocks=64, block_size=4), policy=make_policy("lru"))
    lru.set_cluster_entropy(8.5)  # no regime: nothing happens, nothing raised


def test_drift_detector_time_windows_need_min_count() -> None:
    rng = random.Random(4)
    d = DriftDetector(threshold=1.0, min_count=200, window_s=10.0)
    t = 0.0
    for _ in range(3000):  # 100 accesses/s over 1024 keys
        t += 0.01
        assert not d.observe(rng.randrange(1024), t)
    for _ in range(50):  # sparse: 5 accesses/s on 2 keys, windows too small to judge
        t += 0.2
        assert not d.observe(rng.randrange(2), t)
    for _ in range(3000):  # dense again on 4 keys: the drop is judged against nothing
        t += 0.01
        d.observe(rng.randrange(4), t)
    assert d.drifts == 0
    for _ in range(3000):  # back to 1024 keys, then down to 4: a real drop
        t += 0.01
        d.observe(rng.randrange(1024), t)
    fired = [d.observe(rng.randrange(4), t + 0.01 * (i + 1)) for i in range(3000)]
    assert any(fired) and d.drifts == 1
    with pytest.raises(ValueError):
        d.observe(1)


def _eviction_log(pol: KVHeat, seed: int = 5) -> tuple[list[bytes], float]:
    """Evicted block contents, in order, and the hit rate, on a random multi-turn load."""
    rng = random.Random(seed)
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(64, 4), pol, clock=lambda: now[0])
    evicted: list[bytes] = []
    mgr.evict_listeners.append(lambda b: evicted.append(b.content))
    for i in range(3000):
        now[0] = i * 3.0
        conv = rng.randrange(40)
        turns = 1 + rng.randrange(6)
        ids = [conv * 100 + j for j in range(turns)]
        r = mgr.make_hashed_request(f"r{i}", ids, 4 * turns - rng.randrange(3))
        mgr.allocate(r)
        mgr.free(r)
    mgr.check_invariants()
    return evicted, mgr.stats.hit_rate


def test_kvheat_base_moves_without_changing_decisions() -> None:
    # The heat sums grow as e^{λ v}; moving their base (here every few hundred accesses
    # instead of every ~865 half-lives) rescales them and must not change any eviction.
    plain, moved = KVHeat(half_life=200.0), KVHeat(half_life=200.0)
    moved.clock.rebase_at = 1.0
    ev_plain, hit_plain = _eviction_log(plain)
    ev_moved, hit_moved = _eviction_log(moved)
    assert moved.clock.gen > 10 and plain.clock.gen == 0
    assert hit_moved == hit_plain
    assert ev_moved == ev_plain


def test_kvheat_equal_keys_leave_tail_first_and_a_colder_newcomer_cuts_in() -> None:
    # A request's blocks share one heat (one access, same time): they leave tail-first.
    # A colder block (a partial tail) released while that group is being evicted goes
    # before the rest of the group.
    mgr = KVCacheManager(CacheConfig(6, 4), KVHeat(), clock=lambda: 0.0)
    evicted: list[int] = []
    mgr.evict_listeners.append(lambda b: evicted.append(int.from_bytes(b.content, "little")))
    a = mgr.make_hashed_request("a", [1, 2, 3], 12)
    mgr.allocate(a)
    mgr.free(a)
    mgr.evict(1)
    b = mgr.make_hashed_request("b", [9], 2)
    mgr.allocate(b)
    mgr.free(b)
    mgr.evict(3)
    assert evicted == [3, 9, 2, 1]
    mgr.check_invariants()


# ---- scale-free: the traffic rate changes nothing ----------------------------------------
def _scaled_eviction_log(policy: str, trace, scale: float, capacity_blocks: int,
                         **options: object) -> list[bytes]:
    """Evicted keys, in order, replaying `trace` with every timestamp multiplied by `scale`."""
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(capacity_blocks, 512), make_policy(policy, **options),
                         clock=lambda: now[0])
    evicted: list[bytes] = []
    mgr.evict_listeners.append(lambda b: evicted.append(b.key))
    for i, r in enumerate(trace):
        now[0] = r.timestamp_ms * scale / 1000
        if len(r.hash_ids) > capacity_blocks:
            continue
        req = mgr.make_hashed_request(str(i), r.hash_ids, r.input_length)
        mgr.allocate(req)
        mgr.free(req)
    mgr.check_invariants()
    return evicted


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), j=st.integers(-8, 8), capacity=st.integers(24, 160),
       think=st.floats(5.0, 600.0))
def test_kvheat_makes_the_same_evictions_at_every_traffic_rate(seed: int, j: int, capacity: int,
                                                               think: float) -> None:
    # Multiplying every timestamp by 2^j is exact in floating point: a scale-free policy
    # must evict exactly the same blocks in the same order.
    cfg = WorkloadConfig(num_conversations=120, seed=seed, think_time_s=think, single_turn_frac=0.4)
    trace = generate_workload(cfg)
    base = _scaled_eviction_log("kvheat", trace, 1.0, capacity)
    scaled = _scaled_eviction_log("kvheat", trace, 2.0 ** j, capacity)
    assert len(base) > 0
    assert scaled == base


@pytest.mark.parametrize("j", [-5, 3])
def test_kvheat_robust_variant_makes_the_same_evictions_at_every_traffic_rate(j: int) -> None:
    # The warm-up reading counts samples (accesses), not seconds: still scale-free.
    robust = {"admit_now": True, "regime_warmup": True, "admit_penalty": 3.2, "admit_floor": 1.6}
    cfg = WorkloadConfig(num_conversations=120, seed=3, think_time_s=60.0, single_turn_frac=0.4)
    trace = generate_workload(cfg)
    base = _scaled_eviction_log("kvheat", trace, 1.0, 64, **robust)
    assert len(base) > 0
    assert _scaled_eviction_log("kvheat", trace, 2.0 ** j, 64, **robust) == base


def test_reuse_gap_estimator_finds_the_period() -> None:
    # 512 keys accessed round-robin: every gap is 512 accesses, so is every quantile.
    est = ReuseGapEstimator(rate=1.0, window=64)
    keys = [bytes([i % 256, i // 256]) + b"k" for i in range(512)]
    v = 0
    for _ in range(6):
        for k in keys:
            est.observe(k, float(v))
            v += 1
    assert est.estimate is not None
    assert 512 / 2 ** 0.25 <= est.estimate <= 512 * 2 ** 0.25
    # Spatial sampling: only keys whose first byte is below rate * 256 are followed.
    sparse = ReuseGapEstimator(rate=1 / 16)
    assert sparse.sampled(bytes([3])) and not sparse.sampled(bytes([16]))
    with pytest.raises(ValueError):
        ReuseGapEstimator(rate=0.0)


def test_kvheat_half_life_follows_the_workloads_reuse_gap() -> None:
    # Documents revisited in shuffled rounds: the reuse gap is about the number of
    # documents (in accesses, whatever the clock says), and the half-life follows it.
    def learned(docs: int) -> float:
        rng = random.Random(docs)
        pol = KVHeat()
        now = [0.0]
        mgr = KVCacheManager(CacheConfig(64, 4), pol, clock=lambda: now[0])
        for rnd in range(40):
            order = list(range(docs))
            rng.shuffle(order)
            for d in order:
                now[0] += 1.0
                r = mgr.make_hashed_request(f"{rnd}-{d}", [10_000 + d], 4)
                mgr.allocate(r)
                mgr.free(r)
        assert pol.gaps is not None and pol.gaps.estimate is not None
        assert docs / 2 < pol.gaps.estimate < 2 * docs
        return pol.half_life

    assert learned(1600) > 4 * learned(200)


def test_reduced_grid_kvheat_is_scale_free_and_beats_lru() -> None:
    # A reduced form of bench/heat/grid.py: the generator at two capacities and three
    # time scales through the project's replayer.
    pt = PreparedTrace(generate_workload(WorkloadConfig(num_conversations=500, seed=7)), 512)
    for cap in (100_000, 300_000):
        lru = replay(pt, "lru", cap).hit_rate
        heat = {k: replay(pt, "kvheat", cap, time_scale=k).hit_rate for k in (0.01, 1.0, 100.0)}
        assert len(set(heat.values())) == 1, heat
        assert heat[1.0] > lru, (heat, lru)


def test_kvheat_bulk_release_keeps_the_heap_order_through_rekeys() -> None:
    """`release_all` is `on_release` in a loop: the same victims in the same order (ties
    included), through new half-lives (each re-keys the heap before the next victim)."""
    from kvheat.cache.block import Block

    def run(bulk: bool) -> list[int]:
        rng = random.Random(7)
        pol = KVHeat()
        pol.bind(64)
        blocks = []
        for i in range(48):
            b = Block(i)
            b.key, b.depth, b.parent, b.num_tokens, b.ref_cnt = (i, 0), 2, None, 1, 0
            now = float(i // 3)  # three blocks per timestamp: equal keys
            pol.on_insert(b, now)
            blocks.append(b)
        for t in range(16, 40):
            hit = rng.sample(blocks, 5)
            for b in hit:
                pol.on_hit(b, float(t))
            order = rng.sample(blocks, 20)
            if bulk:
                pol.release_all(order)
            else:
                for b in order:
                    pol.on_release(b, float(t))
            if t % 8 == 0:
                pol.clock.set_half_life(pol.half_life * 1.5)
                assert pol.heap.stale
        out = []
        while (b := pol.victim()) is not None:
            out.append(b.block_id)
            b.key = None
        return out

    assert run(True) == run(False)
    assert len(run(True)) == 48


def test_kvheat_multiple_lengthens_when_hot_victims_return() -> None:
    # A hot set twice the cache's size, crossed by one-off blocks: the hot blocks that come
    # back after eviction are hotter than the median victim (a one-off), so the multiple
    # grows towards frequency, within its bounds.
    rng = random.Random(3)
    pol = KVHeat(adapt="victims")
    mgr = KVCacheManager(CacheConfig(64, 4), pol, clock=lambda: 0.0)
    one_off = 1_000_000
    for i in range(6000):
        if rng.random() < 0.5:
            key = rng.randrange(128)
        else:
            key, one_off = one_off, one_off + 1
        r = mgr.make_hashed_request(str(i), [key], 4)
        mgr.allocate(r)
        mgr.free(r)
    mgr.check_invariants()
    assert pol.ghost_hits > 0
    assert 4.0 <= pol.reuse_mult <= 2.0 ** MULT_HI, pol.reuse_mult
    assert KVHeat(adapt="off").reuse_mult == 1.0


def test_kvheat_multiple_steps_by_victim_heat_and_stays_in_bounds() -> None:
    pol = KVHeat()
    pol.bind(100)
    fb = pol.feedback
    fb.victim_median = 3.0  # the median victim: 8 accesses' worth of heat
    hot, cold = 64.0, 1.0
    now = pol.clock.accesses
    fb.victim_returned(hot, pol.clock.gen, now, pol.evictions)
    assert fb.mult_log == pytest.approx((MULT_HI - MULT_LO) / 100)
    for _ in range(1000):
        fb.victim_returned(cold, pol.clock.gen, now, pol.evictions)
    # Re-keyed once (the first time it moved a quarter octave), then not again within
    # one cache turnover (capacity evictions), however far the multiple moves meanwhile.
    assert fb.mult_log == MULT_LO and 2.0 ** -0.35 < pol.reuse_mult < 2.0 ** -0.25
    fb.victim_returned(cold, pol.clock.gen, now, pol.evictions + 100)
    assert pol.reuse_mult == 2.0 ** MULT_LO
    for _ in range(1000):
        fb.victim_returned(hot, pol.clock.gen, now, pol.evictions + 100)
    assert fb.mult_log == MULT_HI and pol.reuse_mult == 2.0 ** MULT_LO
    fb.victim_returned(hot, pol.clock.gen, now, pol.evictions + 200)
    assert pol.reuse_mult == 2.0 ** MULT_HI
    # Penalties keep their length in reuse gaps: their half-life count scales by 1/mult.
    assert pol.penalties.scale == pytest.approx(1.0 / pol.reuse_mult)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hit", "hit", "hit", "evict", "pin"]),
                          st.integers(0, 59), st.integers(1, 4)), min_size=20, max_size=160))
def test_kvheat_lazy_take_evicts_what_a_push_per_access_would(ops) -> None:
    """`take_lazy` with no push on a hit takes the same victims, in the same order, as
    `victim` with a push at every access (each access at its own time: no equal keys);
    protected blocks are set aside and come back when pushed."""
    from kvheat.cache.block import Block

    pols, blocks = [], []
    for _ in range(2):
        pol = KVHeat()
        pol.bind(64)
        bs = []
        for i in range(60):
            b = Block(i)
            b.key, b.depth, b.num_tokens = i.to_bytes(2, "big") * 8, 2, 1
            pol.on_insert(b, float(i))
            pol.on_release(b, float(i))
            bs.append(b)
        pols.append(pol)
        blocks.append(bs)
    eager, lazy = pols
    t = 60.0
    taken: list[list[int]] = [[], []]
    for op, i, n in ops:
        t += 1.0
        be, bl = blocks[0][i], blocks[1][i]
        if op == "hit" and be.key is not None:
            eager.on_hit(be, t)
            eager.on_release(be, t)  # eager: re-pushed at its new key
            lazy.on_hit(bl, t)  # lazy: its entry stays, now below its key
        elif op in ("evict", "pin"):
            guard = {blocks[1][i].key} if op == "pin" else set()
            got_e = []
            while len(got_e) < n and (b := eager.victim()) is not None:
                got_e.append(b)
            set_aside = [b for b in got_e if b.key in {blocks[0][i].key} and op == "pin"]
            got_e = [b for b in got_e if b not in set_aside]
            while set_aside and len(got_e) < n and (b := eager.victim()) is not None:
                got_e.append(b)
            got_l, skipped = lazy.take_lazy(n, guard)
            assert [b.block_id for b in got_l] == [b.block_id for b in got_e]
            for pol, got, rest in ((eager, got_e, set_aside), (lazy, got_l, skipped)):
                pol.on_evict_all(got)
                for b in got:
                    b.key = None
                pol.release_all(rest)
            taken[0] += [b.block_id for b in got_e]
            taken[1] += [b.block_id for b in got_l]
    assert taken[0] == taken[1]
    # what is left comes out in the same order too
    rest_e = []
    while (b := eager.victim()) is not None:
        rest_e.append(b.block_id)
        b.key = None
    rest_l, _ = lazy.take_lazy(100, set())
    assert [b.block_id for b in rest_l] == rest_e


def test_kvheat_bulk_hits_count_as_one_at_a_time() -> None:
    """`on_hit_all` is `on_hit` of each block in order: the same counts, flags, clock,
    learned half-life and entropy, through half-life changes and depth-1 feedback."""
    from kvheat.cache.block import Block

    rng = random.Random(3)
    twins = []
    for _ in range(2):
        pol = KVHeat()
        pol.bind(256)
        bs = []
        for i in range(300):
            b = Block(i)
            b.key = i.to_bytes(4, "big") * 4
            b.depth, b.num_tokens = i % 4, 1
            pol.on_insert(b, float(i // 10))
            bs.append(b)
        twins.append((pol, bs))
    picks = [[rng.randrange(300) for _ in range(rng.randrange(1, 12))] for _ in range(400)]
    for t, pick in enumerate(picks, start=100):
        (one, b1), (bulk, b2) = twins
        for i in pick:
            one.on_hit(b1[i], float(t))
        bulk.on_hit_all([b2[i] for i in pick], float(t))
    (one, b1), (bulk, b2) = twins
    assert one.clock.retunes == bulk.clock.retunes > 0  # the half-life moved along the way
    assert [(r.rec.count, r.rec.flags, r.rec.gen, r.rec.last) for r in b1] == \
        [(r.rec.count, r.rec.flags, r.rec.gen, r.rec.last) for r in b2]
    assert (one.clock.accesses, one.half_life, one.tracker.bits()) == \
        (bulk.clock.accesses, bulk.half_life, bulk.tracker.bits())


@pytest.mark.parametrize("floor", ["None", "null"])
def test_kvheat_previous_default_is_one_spelling_away(floor: str) -> None:
    # The default charges early one-timers like later ones (docs/heat.md, "The regime's
    # warm-up"); the previous default stays an option line away, in the benches' spelling.
    from bench.heat.sessions import policy_spec

    now = KVHeat()
    assert now.penalties.admit_now and now.feedback.regime_warmup
    assert now.penalties.max_admit_penalty == 3.2 and now.penalties.admit_floor == 1.6
    spec = policy_spec("kvheat[admit_now=false,regime_warmup=false,admit_penalty=1.6,"
                       f"admit_floor={floor}]")
    assert callable(spec)
    old = spec()
    assert isinstance(old, KVHeat)
    assert not old.penalties.admit_now and not old.feedback.regime_warmup
    assert old.penalties.max_admit_penalty == 1.6 and not old.penalties.admit_fade
