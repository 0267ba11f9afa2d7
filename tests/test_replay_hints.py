"""The replayer as a source of request hints (kvheat/cache/hints.py): each request's
session (the trace's, else derived from the earlier prompt it extends), its finish reason
and outcome, queued requests in hold mode; and nothing at all with hints off."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from click.testing import CliRunner

from kvheat.cache import Outcome
from kvheat.cache.classic import LRU
from kvheat.cache.node import Node
from kvheat.cli import main
from kvheat.replay import PreparedTrace, TraceRequest, replay, save_trace

BT = 4


class Recorder(LRU):
    """LRU that records every hint the cache passes it."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def on_session(self, session: str, now: float) -> None:
        self.calls.append(("session", session))

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.calls.append(("finish", session, outcome, reason))

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        self.calls.append(("queue", request_id, session))


def req(t: float, ids: list[int], session: str | None = None, stop: str | None = None,
        out: int = 1) -> TraceRequest:
    return TraceRequest(t, len(ids) * BT, out, ids, session, None, stop)


def test_sessions_are_the_traces_else_derived_from_the_prompt_extended() -> None:
    trace = [req(0, [1, 2]), req(1, [1, 2, 3]), req(2, [1, 2, 9]), req(3, [1, 2, 3, 4]),
             req(4, [7], "s7"), req(5, [7, 8]), req(6, [1, 2, 3, 4, 5, 6])]
    pt = PreparedTrace(trace, BT)
    # B extends A; C extends A too, but A's prompt was continued already: a new session;
    # D extends B (the longest), a session's own id wins, F extends E.
    assert pt.sessions == ["prompt:0", "prompt:0", "prompt:2", "prompt:0", "s7", "s7", "prompt:0"]
    # a partial last block is not part of the prompt another extends
    partial = [TraceRequest(0, 2 * BT - 1, 1, [1, 2]), TraceRequest(1, 3 * BT, 1, [1, 5, 6])]
    assert PreparedTrace(partial, BT).sessions == ["prompt:0", "prompt:0"]


def test_hints_reach_the_policy_and_none_without_them() -> None:
    trace = [req(0, [1, 2], stop="tool_use"), req(1, [1, 2, 3], stop="end_turn"),
             req(2, [5], "x")]
    rec = Recorder()
    replay(trace, lambda: rec, 64, BT, hints=True)
    assert rec.calls == [
        ("session", "prompt:0"), ("finish", "prompt:0", Outcome.FINISHED, "tool_use"),
        ("session", "prompt:0"), ("finish", "prompt:0", Outcome.FINISHED, "end_turn"),
        ("session", "x"), ("finish", "x", Outcome.FINISHED, None)]
    off = Recorder()
    a = replay(trace, lambda: off, 64, BT, hints=False)
    assert off.calls == []
    own = Recorder()  # the default: the trace's own session ids only, as always
    replay(trace, lambda: own, 64, BT)
    assert own.calls == [("session", "x"), ("finish", "x", Outcome.FINISHED, None)]
    assert a.hit_tokens == replay(trace, "lru", 64, BT, hints=True).hit_tokens


def test_hold_mode_queues_a_request_waiting_for_room() -> None:
    # Two long requests overlap in a 4-block cache: the second waits for the first.
    trace = [req(0, [1, 2, 3], out=100), req(1, [7, 8, 9], "b")]
    rec = Recorder()
    replay(trace, lambda: rec, 4 * BT, BT, hold=True, hints=True)
    assert ("queue", "1", "b") in rec.calls
    assert rec.calls.index(("queue", "1", "b")) < rec.calls.index(("session", "b"))


@pytest.mark.parametrize("policy", ["lru", "lruk", "kvheat", "sae", "belady"])
def test_no_hints_is_the_replay_of_before(policy: str) -> None:
    """--no-hints: no hint reaches any policy, so the figures are those of a trace that
    carries none (as every replay before hints existed)."""
    trace = [req(i, [i % 5 * 100 + j for j in range(i % 4 + 1)], f"s{i % 5}",
                 "end_turn" if i % 3 else "tool_use") for i in range(300)]
    bare = [TraceRequest(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
            for r in trace]
    for hold in (False, True):
        a = replay(trace, policy, 12 * BT, BT, hold=hold, hints=False).as_dict()
        b = replay(bare, policy, 12 * BT, BT, hold=hold, hints=False).as_dict()
        a.pop("seconds"), b.pop("seconds")
        assert a == b


def test_cli_hints_flag(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    save_trace([req(i, [i % 3, 10 + i % 3], f"s{i % 3}", "end_turn") for i in range(40)], path)
    for flag in ("--hints", "--no-hints"):
        res = CliRunner().invoke(main, ["replay", str(path), "--block-tokens", str(BT),
                                        "--capacity", "16", "--policy", "lru,kvheat", flag])
        assert res.exit_code == 0, res.output
