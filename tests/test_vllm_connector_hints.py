"""Request hints below the device (`TierManager.begin` / `finish`, what KVHeatConnector's
worker calls with the hints its scheduler sent): each tier's policy hears a request's
session and its end with the entries of its keys that tier holds, re-filed as the device
cache re-files a request's blocks; a policy that takes no finish hint keeps its order
exactly. (The connector inside real vLLM servers: tests/test_vllm_connector.py.)"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from test_tier_client import NS_A, chain, client
from test_tiers import random_pool

from kvheat.cache import Node, Outcome, register_policy
from kvheat.cache import eviction as policy_registry
from kvheat.cache.classic import LRU
from kvheat.tiers import TierManager, TierSpec

torch.set_num_threads(1)
RECORDING = "test-recording-tier-hints"


class Recording(LRU):
    """LRU that keeps the hints it hears (it takes finish hints: its tier re-files)."""

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple] = []

    def on_session(self, session: str, now: float) -> None:
        self.heard.append(("session", session))

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.heard.append(("finish", [b.key for b in blocks], [b.ref_cnt for b in blocks],
                           session, outcome, reason))


@pytest.fixture(autouse=True)
def recording() -> Iterator[None]:
    register_policy(RECORDING)(Recording)  # for this module only
    try:
        yield
    finally:
        policy_registry._REGISTRY.pop(RECORDING, None)


def _client(policy: str, host_blocks: int = 8) -> tuple[TierManager, object]:
    pool = random_pool("gqa", 8)
    return client(TierSpec(host_blocks=host_blocks, policy=policy), pool), pool


def test_the_tier_policy_hears_the_session_and_the_end_with_the_entries_it_holds() -> None:
    tc, pool = _client(RECORDING)
    keys, parents = chain(4)
    tc.begin("vllm:s1")
    assert tc.save(NS_A, keys, parents, [0, 1, 2, 3], pool) == 4
    plan = tc.lookup(NS_A, keys, 0)  # the first blocks are being loaded: pinned
    pol = tc.lower.indexes[0].policy
    assert isinstance(pol, Recording)
    told = tc.finish([*keys, b"never-saved" * 2], "vllm:s1", "cancelled", "abort")
    assert told == 4
    assert pol.heard[0] == ("session", "vllm:s1")
    kind, got, refs, session, outcome, reason = pol.heard[1]
    assert (kind, got, session, outcome, reason) == ("finish", keys, "vllm:s1",
                                                     Outcome.CANCELLED, "abort")
    assert refs == [1] * len(plan.keys) + [0] * (4 - len(plan.keys))  # pinned stay pinned
    tc.release(plan)
    # No session: the end alone; and keys no tier holds: told of nothing, heard all the same.
    assert tc.finish([b"x" * 16], None, Outcome.FINISHED, "stop") == 0
    assert pol.heard[2] == ("finish", [], [], None, Outcome.FINISHED, "stop")
    tc.close()


@pytest.mark.parametrize(("policy", "refiled"), [("lru", False), (RECORDING, True)])
def test_a_policy_without_finish_hints_keeps_its_order(policy: str, refiled: bool) -> None:
    """Two clients, the same saves, one told of request A's end: a policy that takes no
    finish hint (LRU) evicts exactly as the other; one that takes them re-files A's
    entries as released last (in LRU order, most recent), so B's go first."""
    kept = []
    for tell in (False, True):
        tc, pool = _client(policy, host_blocks=4)
        a, pa = chain(2, b"a")
        b, pb = chain(2, b"b")
        c, pc = chain(2, b"c")
        tc.save(NS_A, a, pa, [0, 1], pool)
        tc.save(NS_A, b, pb, [2, 3], pool)
        if tell:
            assert tc.finish(a, "vllm:s", "finished", "stop") == (2 if refiled else 0)
        tc.save(NS_A, c, pc, [4, 5], pool)  # the host tier holds 4: two go
        tc.flush()
        kept.append([k for k in a + b + c if tc.holds(NS_A, k) is not None])
        tc.close()
    if refiled:
        assert kept[1] == [*chain(2, b"a")[0], *chain(2, b"c")[0]] != kept[0]
    else:
        assert kept[1] == kept[0]


def test_bad_hints_are_refused() -> None:
    tc, _ = _client(RECORDING)
    with pytest.raises(ValueError, match="outcome must be one of"):
        tc.finish([], None, "exploded")
    with pytest.raises(ValueError, match="finish_reason must be"):
        tc.finish([], None, "finished", "")
    with pytest.raises(ValueError, match="session must be"):
        tc.finish([], 42, "finished")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="begin needs a session"):
        tc.begin(None)  # type: ignore[arg-type]
    tc.close()
