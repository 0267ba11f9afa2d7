"""kvheat with request hints (kvheat/heat/sessions.py) through the replayer's hints
(`replay(..., hints=True)`): what it learns of session ends, queued blocks held back,
scale-freedom with hints (that no hints replays as before: tests/test_replay_hints.py)."""

from __future__ import annotations

import random

import pytest

from kvheat.cache import CacheConfig, KVCacheManager, Outcome
from kvheat.heat import KVHeat
from kvheat.heat.sessions import CLASS_SHIFT, GapHistogram, SessionBook
from kvheat.replay import PreparedTrace, replay
from kvheat.replay.traces import TraceRequest


def _agentic(seed: int, n_sessions: int = 40, turns: int = 30) -> PreparedTrace:
    """Agent-like sessions: each request extends its session's previous prompt; after a
    "tool_use" the session is back within seconds, after an "end_turn" minutes later
    (or never)."""
    rng = random.Random(seed)
    events = []
    next_id = 0
    for s in range(n_sessions):
        t = rng.uniform(0, 600)
        ids: list[int] = []
        for _ in range(turns):
            for _ in range(rng.randint(1, 3)):
                ids.append(next_id)
                next_id += 1
            stop = "tool_use" if rng.random() < 0.8 else "end_turn"
            events.append((t, TraceRequest(t * 1000, len(ids) * 512, 10, list(ids), f"s{s}",
                                           finish_reason=stop)))
            if stop == "end_turn" and rng.random() < 0.3:
                break
            t += rng.expovariate(1 / 5) if stop == "tool_use" else rng.expovariate(1 / 300)
    events.sort(key=lambda e: e[0])
    return PreparedTrace([e[1] for e in events], 512)


def test_derived_sessions_follow_whole_prompts_not_a_shared_system_prompt() -> None:
    # two chats under one shared system-prompt block 0; a turn's partial last block is
    # re-keyed by the next turn (Mooncake ids name 512-token blocks)
    reqs = [TraceRequest(0, 1300, 1, [0, 1, 2]), TraceRequest(1, 1300, 1, [0, 3, 4]),
            TraceRequest(2, 2000, 1, [0, 1, 5, 6]), TraceRequest(3, 2000, 1, [0, 3, 7, 8]),
            TraceRequest(4, 2500, 1, [0, 1, 5, 9, 10]), TraceRequest(5, 700, 1, [0, 11])]
    s = PreparedTrace(reqs, 512).sessions  # the replayer's sessions (`replay(hints=True)`)
    assert s[0] == s[2] == s[4] and s[1] == s[3] and len({s[0], s[1], s[5]}) == 3


def test_slow_returning_end_class_is_charged_and_evicted_first() -> None:
    pt = _agentic(1)
    pol = KVHeat()
    replay(pt, lambda: pol, 40 * 512, hints=True)
    book = pol.book
    assert book is not None and book.returns > 50
    tool = book.classes[(Outcome.FINISHED, "tool_use")]
    end = book.classes[(Outcome.FINISHED, "end_turn")]
    # end_turn sessions come back later, and fewer of them: more age charged
    assert book.charge[end] > book.charge[tool] + 1.0
    # two blocks equal in all but the end class: the end_turn one has the lower key
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(8, 4), pol, clock=lambda: now[0])
    a = mgr.make_request("a", [1, 2, 3, 4], session="x")
    b = mgr.make_request("b", [5, 6, 7, 8], session="y")
    mgr.allocate(a)
    mgr.allocate(b)
    ka, kb = a.blocks[0], b.blocks[0]
    mgr.free(a, Outcome.FINISHED, "tool_use")
    mgr.free(b, Outcome.FINISHED, "end_turn")
    assert ka.rec.flags >> CLASS_SHIFT == tool and kb.rec.flags >> CLASS_SHIFT == end
    assert pol.key(kb) < pol.key(ka)


def test_hints_help_on_agent_like_sessions() -> None:
    pt = _agentic(2, n_sessions=60)
    cap = 120 * 512
    plain = replay(pt, "kvheat", cap, hints=False).hit_rate
    hinted = replay(pt, "kvheat", cap, hints=True).hit_rate
    assert hinted > plain


def test_cancelled_sessions_that_never_return_are_charged() -> None:
    book = SessionBook()
    v = 0.0
    for i in range(400):
        v += 10
        s = f"s{i % 40}"
        book.came_back(s, v)
        if i % 2:
            book.ended_now(f"gone{i}", v, book.class_of(Outcome.CANCELLED, None))
        book.ended_now(s, v, book.class_of(Outcome.FINISHED, "stop"))
    gone = book.classes[(Outcome.CANCELLED, None)]
    kept = book.classes[(Outcome.FINISHED, "stop")]
    assert book.charge[gone] > book.charge[kept] + 1.0


def test_queued_blocks_are_kept_back_while_others_can_go() -> None:
    now = [0.0]
    pol = KVHeat()
    mgr = KVCacheManager(CacheConfig(4, 4), pol, clock=lambda: now[0])
    reqs = []
    for i in range(4):
        now[0] += 1
        r = mgr.make_request(f"r{i}", [10 * i + j for j in range(4)])
        mgr.allocate(r)
        mgr.free(r)
        reqs.append(r)
    waiting = mgr.make_request("w", [0, 1, 2, 3, 99])  # needs r0's block, the coldest
    mgr.queue(waiting)
    now[0] += 1
    new = mgr.make_request("n", [500, 501, 502, 503])
    mgr.allocate(new)
    mgr.free(new)
    assert mgr.match_tokens([0, 1, 2, 3]) == 4  # kept
    assert mgr.match_tokens([10, 11, 12, 13]) == 0  # the next coldest went
    # Every cached block queued: they still go, oldest kept-back first, call after call
    # (never OutOfBlocks while the heap is empty and blocks are kept back)
    for r in [*reqs[2:], new]:
        mgr.queue(mgr.make_request("P" + r.request_id, _tokens(r)))
    assert len(pol.queued) == 4  # w's full block and the other three cached blocks
    for i in range(6):
        now[0] += 1
        r = mgr.make_request(f"x{i}", [2000 + 8 * i + j for j in range(8)])  # 2 blocks
        mgr.allocate(r)
        mgr.free(r)
        mgr.check_invariants()
    mgr.dequeue("w")
    assert "w" not in pol.queued_by


def _tokens(r) -> list[int]:  # type: ignore[no-untyped-def]
    raw = r.raw
    return [int.from_bytes(raw[k:k + 4], "little") for k in range(0, len(raw), 4)]


@pytest.mark.parametrize("j", [-3, 4])
def test_kvheat_with_hints_makes_the_same_evictions_at_every_traffic_rate(j: int) -> None:
    pt = _agentic(3)

    def log(scale: float) -> list[bytes]:
        pol = KVHeat()
        evicted: list[bytes] = []
        orig = pol.on_evict

        def on_evict(b):  # type: ignore[no-untyped-def]
            evicted.append(b.key)
            orig(b)

        pol.on_evict = on_evict  # type: ignore[method-assign]
        replay(pt, lambda: pol, 60 * 512, time_scale=scale, hints=True)
        return evicted

    base = log(1.0)
    assert base and log(2.0 ** j) == base


def test_gap_histogram_median() -> None:
    h = GapHistogram(window=64)
    for i in range(256):
        h.add(100.0 if i % 2 else 400.0)
    assert h.median is not None and 6.6 < h.median < 8.7  # between log2 100 and log2 400


def test_horizon_charges_follow_the_share_returning_within_the_eviction_age() -> None:
    book = SessionBook()
    fast = book.class_of(Outcome.FINISHED, "tool_use")
    slow = book.class_of(Outcome.FINISHED, "end_turn")
    v = 0.0
    for i in range(640):  # fast sessions back after 16 accesses, slow ones after 4096
        s, c, gap = (f"f{i}", fast, 16.0) if i % 2 else (f"s{i}", slow, 4096.0)
        book.ended_now(s, v, c)
        book.came_back(s, v + gap)
        v += 1
    book.horizon = 256.0  # a small cache: only the fast ones return in time
    book._charges()
    assert book.charge[slow] > book.charge[fast] + 3.0
    book.horizon = 1e6  # a cache that holds both: both return in time, little to choose
    book._charges()
    assert abs(book.charge[slow] - book.charge[fast]) < 0.2
    h = GapHistogram()
    for g in (4.0, 16.0, 64.0, 256.0):
        h.add(g)
    assert h.share_within(1.0) == 0.0 and h.share_within(20.0) == 1.0  # (log2 ages)
    assert 0.4 < h.share_within(5.0) < 0.6  # gaps up to 2^5 = 32: two of the four


def test_bench_policy_variants_are_kvheat_with_those_options() -> None:
    from bench.heat.sessions import base_policy, policy_spec

    assert policy_spec("kvheat") == "kvheat" and base_policy("kvheat[session_own=true]") == "kvheat"
    spec = policy_spec("kvheat[session_hints=log,session_own=true]")
    assert callable(spec)
    pol = spec()
    assert isinstance(pol, KVHeat) and pol.session_own is True
    for bad in ("kvheat[session_own]", "kvheat[session_own=true", "kvheat[=1]"):
        with pytest.raises(ValueError):
            policy_spec(bad)
    with pytest.raises(TypeError):
        policy_spec("kvheat[no_such_option=1]")()
