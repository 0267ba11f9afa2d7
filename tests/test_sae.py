"""`sae` (Session-Aware Eviction, vLLM PR #50422): its parameters, its score, worst session
first and tail first, ghost seeding, decay and the admission gate, on the real cache."""

from __future__ import annotations

import math
import random

import pytest

from kvheat.cache import CacheConfig, KVCacheManager, make_policy
from kvheat.heat.sae import SAE, SAEParams

BS = 4


def manager(blocks: int, **kw: object) -> tuple[KVCacheManager, SAE]:
    pol = make_policy("sae", **kw)
    assert isinstance(pol, SAE)
    return KVCacheManager(CacheConfig(num_blocks=blocks, block_size=BS), policy=pol), pol


def serve(m: KVCacheManager, rid: str, ids: list[int]) -> int:
    """One request of the given block ids (full blocks); returns the blocks it hit."""
    req = m.make_hashed_request(rid, ids, len(ids) * BS)
    m.allocate(req)
    hit = req.num_cached_tokens // BS
    m.free(req)
    m.check_invariants()
    return hit


def resident(m: KVCacheManager, ids: list[int]) -> int:
    """How many leading blocks of `ids` are cached."""
    return m.num_cached and len(m.match_prefix(m.make_hashed_request("probe", ids, len(ids) * BS)))


def test_defaults_are_the_prs_and_every_field_is_checked() -> None:
    p = SAEParams()
    assert (p.touch_weight, p.depth_bonus, p.depth_half) == (1500.0, 30000.0, 8.0)
    assert (p.decay_interval, p.decay_factor) == (500, 0.9)
    assert (p.ghost_hit_weight, p.ghost_miss_weight, p.ghost_norm) == (12.0, 1.0, 12.0)
    assert p.admission_gate is True
    with pytest.raises(ValueError, match="touch_weight must be"):
        SAEParams(touch_weight="1500")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decay_interval must be"):
        SAEParams(decay_interval=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decay_factor"):
        SAEParams(decay_factor=0.0)
    with pytest.raises(ValueError, match="admission_gate must be"):
        SAEParams(admission_gate=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        make_policy("sae", nope=1)


def test_score_is_recency_plus_hits_plus_depth_bonus() -> None:
    m, pol = manager(16)
    serve(m, "a0", [1, 2])  # tick 1: session a opens; its own request touches it
    serve(m, "b0", [9])  # tick 2
    serve(m, "a1", [1, 2, 3])  # tick 3: hits a again; block 3 joins a
    sa, sb = pol.sessions[0], pol.sessions[1]
    assert (sa.last_touch, sa.prefix_depth, sa.size) == (3, 0, 3)
    assert pol.score(sa) == pytest.approx(3 + 1500 * 2 + 30000)
    assert pol.score(sb) == pytest.approx(2 + 1500 * 1 + 30000)
    key2 = m.make_hashed_request("p", [1, 2], 2 * BS).keys[1]
    assert pol.ghost[key2] * pol.scale == pytest.approx((1 + 12) / math.log2(3))


def test_worst_session_goes_first_and_tail_first() -> None:
    """Session a (touched three times) outlives session b (once, but more recent); b
    loses its tail before its head."""
    m, pol = manager(8, admission_gate=False)
    for i in range(3):
        serve(m, f"a{i}", [1, 2])
    serve(m, "b0", [5, 6, 7])  # score 4 + 1500 + 30000 < a's 3 + 4500 + 30000
    assert serve(m, "c0", [20, 21, 22, 23]) == 0  # 9 blocks wanted, 8 held: 1 evicted
    assert resident(m, [5, 6, 7]) == 2  # b's tail went
    serve(m, "d0", [30, 31])  # 2 more: b (31504) is still under c (31505)
    assert resident(m, [5, 6, 7]) == 0
    assert resident(m, [20, 21, 22, 23]) == 4 and resident(m, [1, 2]) == 2


def test_a_new_block_joins_its_parents_session() -> None:
    m, pol = manager(16)
    serve(m, "a0", [1, 2])
    serve(m, "a1", [1, 2, 3, 4])
    serve(m, "b0", [1, 7])  # shares a's first block: merges into a's session (as the PR)
    assert len(pol.sessions) == 1
    assert pol.sessions[0].size == 5


def test_admission_gate_declines_a_fresh_session_below_the_worst_incumbent() -> None:
    m, pol = manager(6)
    for i in range(3):  # session a: 3 + 1500 * 3 + 30000
        serve(m, f"a{i}", [1, 2, 3])
    serve(m, "b0", [5, 6, 7])  # fills the cache, no eviction: admitted (4 + 1500 + 30000)
    assert pol.declines == 0
    # c needs room: it opens at 4 + 30000 (no hits yet) < b's score: declined. The room
    # its running request needed came from b's tail; c's blocks go first once released.
    serve(m, "c0", [10, 11])
    assert pol.declines == 1
    assert resident(m, [1, 2, 3]) == 3 and resident(m, [5, 6, 7]) == 1
    assert resident(m, [10, 11]) == 2
    serve(m, "d0", [40])  # c's tail makes room; d is declined too
    assert pol.declines == 2 and resident(m, [10, 11]) == 1
    serve(m, "e0", [50])  # c (touched earlier than d) goes before d
    assert pol.declines == 3 and resident(m, [10]) == 0 and resident(m, [40]) == 1
    assert resident(m, [1, 2, 3]) == 3 and resident(m, [5]) == 1


def test_without_the_gate_a_fresh_session_is_admitted() -> None:
    m, pol = manager(6, admission_gate=False)
    for i in range(3):
        serve(m, f"a{i}", [1, 2, 3])
        serve(m, f"b{i}", [5, 6, 7])
    serve(m, "d0", [40])  # a (last touched at 5) is the worst: its tail goes
    assert pol.declines == 0
    assert resident(m, [40]) == 1 and resident(m, [1, 2, 3]) == 2
    serve(m, "e0", [50])  # d, touched once, is under a and b: it goes
    assert resident(m, [40]) == 0 and resident(m, [50]) == 1


def test_ghost_scores_seed_a_returning_prefix() -> None:
    m, pol = manager(4, admission_gate=False)
    for i in range(3):
        serve(m, f"a{i}", [1, 2])  # ghosts: key 1: 1 + 12 + 12, key 2: that / log2(3)
    serve(m, "y", [200, 201, 202, 203])  # the whole cache: a goes
    assert resident(m, [1]) == 0
    serve(m, "a9", [1, 2])  # a returns: a fresh session, seeded by the ghosts it had
    s = max(pol.sessions.values(), key=lambda s: s.sid)
    seed = (25 + 25 / math.log2(3)) / 12
    assert s.hits * pol.scale == pytest.approx(1 + seed)


def test_decay_scales_hits_every_interval() -> None:
    m, pol = manager(64, decay_interval=4, decay_factor=0.5)
    serve(m, "a0", [1])
    serve(m, "a1", [1])
    serve(m, "a2", [1])  # tick 3: a has 2 hits (+ seed)
    before = pol.sessions[0].hits * pol.scale
    serve(m, "b0", [9])  # tick 4: a decay
    assert pol.sessions[0].hits * pol.scale == pytest.approx(before * 0.5)


def test_clock_is_requests_not_seconds() -> None:
    """The same requests at any timestamps give the same decisions (PR: a logical tick)."""
    from kvheat.replay import TraceRequest, replay

    rng = random.Random(3)
    trace = []
    for i in range(400):
        conv = rng.randrange(12)
        n = rng.randint(1, 6)
        trace.append(TraceRequest(i * 1000.0, n * BS, 1, [conv * 100 + j for j in range(n)]))
    a = replay(trace, "sae", 20 * BS, BS)
    b = replay(trace, "sae", 20 * BS, BS, time_scale=37.0)
    assert a.hit_tokens == b.hit_tokens and a.evictions == b.evictions
    assert 0 < a.hit_tokens < a.total_tokens


@pytest.mark.parametrize("gate", [True, False])
def test_random_traffic_keeps_the_cache_consistent(gate: bool) -> None:
    """Shared prefixes, overlapping requests held at once, eviction under pressure: the
    invariants hold, only leaves go, referenced blocks never do."""
    m, pol = manager(24, admission_gate=gate, decay_interval=7)
    rng = random.Random(5)
    held = []
    for i in range(1500):
        conv = rng.randrange(20)
        shared = [0, 1] if conv % 3 == 0 else []
        ids = shared + [1000 * conv + j for j in range(rng.randint(1, 5))]
        req = m.make_hashed_request(f"r{i}", ids, len(ids) * BS)
        try:
            m.allocate(req)
        except Exception:  # OutOfBlocks while too many are held: release one and go on
            if held:
                m.free(held.pop(0))
            continue
        held.append(req)
        if len(held) > 2 or rng.random() < 0.5:
            m.free(held.pop(0))
        m.check_invariants()
        for b in m.cached.values():
            assert b.parent is None or m.cached.get(b.parent.key) is b.parent  # type: ignore[arg-type]
    assert pol.tick > 1000 and m.stats.evicted_blocks > 100
    assert sum(s.size for s in pol.sessions.values()) == m.num_cached
