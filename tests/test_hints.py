"""The request-hint API (kvheat/cache/hints.py): sessions, outcomes, finish reasons and the
waiting queue reach the policy, in order, and without hints nothing changes."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvheat.cache import CacheConfig, KVCacheManager, Node, Outcome, make_policy, policy_names
from kvheat.cache.classic import LRU

BS = 4


class Recording(LRU):
    """LRU that writes down every hint hook and the hits/inserts between them."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def on_session(self, session: str, now: float) -> None:
        self.log.append(("session", session))

    def on_insert(self, b: Node, now: float) -> None:
        self.log.append(("insert", b.depth))

    def on_hit(self, b: Node, now: float) -> None:
        self.log.append(("hit", b.depth))

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.log.append(("finish", len(blocks), session, outcome, reason,
                         [b.ref_cnt for b in blocks]))

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        self.log.append(("queue", request_id, len(keys), session))

    def on_dequeue(self, request_id: str) -> None:
        self.log.append(("dequeue", request_id))


def mgr(policy=None, num_blocks: int = 16) -> KVCacheManager:
    t = [0.0]

    def clock() -> float:
        t[0] += 1
        return t[0]

    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=BS),
                          policy=policy if policy is not None else Recording(), clock=clock)


def test_session_reaches_the_policy_before_its_hits_and_inserts() -> None:
    m = mgr()
    pol = m.policy
    assert isinstance(pol, Recording)
    r1 = m.make_request("a", list(range(8)), session="s1")
    m.allocate(r1)
    m.free(r1, Outcome.FINISHED, "tool_use")
    r2 = m.make_request("b", list(range(12)), session="s1")
    m.allocate(r2)
    m.append_tokens(r2, [99] * 4)  # fills a 4th block: cached under the session too
    m.free(r2, "cancelled")
    assert pol.log == [
        ("session", "s1"), ("insert", 0), ("insert", 1),
        ("finish", 2, "s1", Outcome.FINISHED, "tool_use", [1, 1]),  # before release
        ("session", "s1"), ("hit", 0), ("hit", 1), ("insert", 2),
        ("session", "s1"), ("insert", 3),
        ("finish", 4, "s1", Outcome.CANCELLED, None, [1, 1, 1, 1]),
    ]


def test_no_hint_calls_no_hint_hook() -> None:
    m = mgr()
    r = m.make_request("a", list(range(8)))
    m.allocate(r)
    m.free(r)
    assert [e[0] for e in m.policy.log] == ["insert", "insert"]  # type: ignore[attr-defined]
    # a finish reason or a cancellation alone is a hint
    r = m.make_request("b", list(range(8)))
    m.allocate(r)
    m.free(r, finish_reason="length")
    r = m.make_request("c", list(range(8)))
    m.allocate(r)
    m.free(r, Outcome.CANCELLED)
    fins = [e for e in m.policy.log if e[0] == "finish"]  # type: ignore[attr-defined]
    assert [(f[2], f[3], f[4]) for f in fins] == [
        (None, Outcome.FINISHED, "length"), (None, Outcome.CANCELLED, None)]


def test_queue_and_dequeue_and_admission_dequeues() -> None:
    m = mgr()
    pol = m.policy
    q1 = m.make_request("q1", list(range(10)), session="s")
    q2 = m.make_request("q2", list(range(6)))
    m.queue(q1)
    m.queue(q2)
    m.queue(q1)  # again: replaces
    assert m.dequeue("q2") is True
    assert m.dequeue("q2") is False  # harmless
    m.allocate(q1)  # admitted: leaves the queue
    assert not m.queued
    assert pol.log[:6] == [  # type: ignore[attr-defined]
        ("queue", "q1", 2, "s"), ("queue", "q2", 1, None), ("dequeue", "q1"),
        ("queue", "q1", 2, "s"), ("dequeue", "q2"), ("dequeue", "q1")]
    with pytest.raises(TypeError, match="Request"):
        m.queue("q3")  # type: ignore[arg-type]


def test_bad_hints_are_clear_errors_and_change_nothing() -> None:
    m = mgr()
    r = m.make_request("a", list(range(8)), session="s")
    m.allocate(r)
    with pytest.raises(ValueError, match="outcome must be one of"):
        m.free(r, "aborted")
    with pytest.raises(ValueError, match="finish_reason"):
        m.free(r, finish_reason="")
    with pytest.raises(ValueError, match="finish_reason"):
        m.free(r, finish_reason=7)  # type: ignore[arg-type]
    assert "a" in m.requests  # still held
    m.free(r, Outcome.FINISHED, "end_turn")
    m.check_invariants()
    with pytest.raises(ValueError, match="session"):
        m.make_request("b", [1, 2], session=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session"):
        m.make_hashed_request("b", [1], 3, session=b"x")  # type: ignore[arg-type]


def _run(policy: str, hints: bool, seed: int = 7) -> tuple[list[bytes], float]:
    """Random multi-turn traffic; with `hints` every request carries a session, a finish
    reason, sometimes a cancellation, and the next request is queued first."""
    rng = random.Random(seed)
    evicted: list[bytes] = []
    m = mgr(make_policy(policy), num_blocks=24)
    m.evict_listeners.append(lambda b: evicted.append(b.key))  # type: ignore[arg-type]
    convs: dict[int, list[int]] = {}
    for i in range(400):
        c = rng.randrange(12)
        toks = convs.setdefault(c, [c * 1000])
        toks += [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        if len(toks) > 60:
            toks[:] = [c * 1000]
        req = m.make_request(str(i), toks, session=f"s{c}" if hints else None)
        if hints and i % 3 == 0:
            m.queue(req)
        m.allocate(req)
        reason = rng.choice(["tool_use", "end_turn", "length"])
        if hints:
            m.free(req, Outcome.CANCELLED if i % 7 == 0 else Outcome.FINISHED, reason)
        else:
            m.free(req)
    return evicted, m.stats.hit_rate


@pytest.mark.parametrize("policy", [p for p in policy_names() if p not in ("belady",)])
def test_policies_without_hint_hooks_decide_the_same_with_hints(policy: str) -> None:
    """Hint hooks are no-ops by default: a policy that does not use them makes the same
    evictions whether hints are given or not (kvheat's own heat policy excepted: it
    reads them)."""
    if policy == "kvheat":
        pytest.skip("reads hints")
    assert _run(policy, hints=False) == _run(policy, hints=True)


def test_hints_reach_the_tenant_partitions_under_a_quota() -> None:
    """With a tenant quota the pool runs TenantPartitions: sessions and queue entries reach
    every policy, a request's end reaches the policy that orders its blocks."""
    m = mgr(num_blocks=32)
    shared = m.policy
    m.set_tenant_quota("acme", 8)
    part = m.tenants.partitions["acme"]
    assert isinstance(part, Recording) and part is not shared
    r = m.make_request("a", list(range(8)), tenant="acme", session="s1")
    m.queue(r)
    m.allocate(r)
    m.free(r, Outcome.CANCELLED, None)
    log = part.log
    assert ("queue", "a", 2, "s1") in log and ("dequeue", "a") in log
    assert ("session", "s1") in log
    assert ("finish", 2, "s1", Outcome.CANCELLED, None, [1, 1]) in log
    # the shared policy heard the session, but no end of blocks it does not order
    assert ("session", "s1") in shared.log  # type: ignore[attr-defined]
    assert not [e for e in shared.log if e[0] == "finish"]  # type: ignore[attr-defined]
