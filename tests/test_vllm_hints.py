"""Request hints inside vLLM's real CPU offloading manager: the session a vLLM request
names (its `kv_transfer_params` or a `kv_hints` action) and the outcome a connector records
reach kvheat's heat policy, before the request's chunks are released; a request with no
hint calls no hint hook."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
pytestmark = pytest.mark.vllm

from test_vllm_offload import _chain_request  # noqa: E402
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvheat.cache import Node, Outcome  # noqa: E402
from kvheat.heat.heat_policy import KVHeat  # noqa: E402
from kvheat.integrations.vllm import KVHeatCachePolicy, record_outcome  # noqa: E402


class RecordingHeat(KVHeat):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def on_session(self, session: str, now: float) -> None:
        self.log.append(("session", session))
        super().on_session(session, now)

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.log.append(("finish", len(blocks), session, outcome, reason,
                         [b.ref_cnt for b in blocks]))
        super().on_finish(blocks, session, outcome, reason, now)


def _key(i: int):
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)


def _setup() -> tuple[CPUOffloadingManager, RecordingHeat]:
    mgr = CPUOffloadingManager(16, cache_policy="KVHeatCachePolicy",
                               cache_policy_module_path="kvheat.integrations.vllm")
    pol = mgr._policy
    assert isinstance(pol, KVHeatCachePolicy)
    heat = RecordingHeat()
    heat.bind(16)
    pol.heat = heat  # the manager holds no chunks yet
    return mgr, heat


def _request(mgr: CPUOffloadingManager, ctx: ReqContext, keys, outcome=None) -> None:
    _chain_request(mgr, keys, ctx.req_id, ctx,
                   None if outcome is None else lambda c: record_outcome(c, *outcome))


def test_sessions_and_outcomes_reach_the_heat_policy() -> None:
    mgr, heat = _setup()
    keys = [_key(i) for i in range(4)]
    _request(mgr, ReqContext("a", kv_transfer_params={"kvheat_session": "s1"}), keys[:2],
             (Outcome.FINISHED, "tool_use"))
    hint = KvHintsEnvelope("1", "m1", [KvHintAction("x", "other", "1", {"session_id": "no"}),
                                       KvHintAction("y", "kvheat.session", "1",
                                                    {"session_id": "s2"})])
    _request(mgr, ReqContext("b", kv_hints=hint), keys, ("cancelled", None))
    assert heat.log == [
        ("session", "s1"),  # its stores
        ("session", "s1"), ("finish", 2, "s1", Outcome.FINISHED, "tool_use", [0, 0]),
        ("session", "s2"),  # stores of its new chunks
        ("session", "s2"), ("finish", 4, "s2", Outcome.CANCELLED, None, [0, 0, 0, 0]),
    ]


def test_no_hint_no_hook_and_bad_hints_are_ignored() -> None:
    mgr, heat = _setup()
    _request(mgr, ReqContext("a"), [_key(i) for i in range(3)])
    for bad in ({"kvheat_session": 7}, {"kvheat_session": ""}, {"kvheat_session": "x" * 257},
                {"other": "s"}):
        _request(mgr, ReqContext(f"b{len(heat.log)}", kv_transfer_params=bad),
                 [_key(10 + i) for i in range(2)])
    assert heat.log == []
    with pytest.raises(ValueError, match="outcome"):
        record_outcome(ReqContext("c"), "exploded")
    with pytest.raises(ValueError, match="finish_reason"):
        record_outcome(ReqContext("c"), Outcome.FINISHED, "")
