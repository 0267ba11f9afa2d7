"""`replay(..., lookahead=N)` (`kvheat replay --lookahead N`): the next N requests wait in
the cache's queue while each is served, so the policy hears the queued-blocks hint."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from click.testing import CliRunner

from kvheat.cache.classic import LRU
from kvheat.cli import main
from kvheat.replay import PreparedTrace, replay
from kvheat.replay.traces import TraceRequest


class QueueLog(LRU):
    name = "queue-log"

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        self.log.append(("queue", request_id))

    def on_dequeue(self, request_id: str) -> None:
        self.log.append(("dequeue", request_id))


def _trace(ids: list[int]) -> PreparedTrace:
    return PreparedTrace([TraceRequest(i, 512, 1, [b]) for i, b in enumerate(ids)], 512)


def test_the_next_requests_wait_in_the_queue_until_their_turn() -> None:
    pol = QueueLog()
    replay(_trace([1, 2, 3, 4]), lambda: pol, 8 * 512, lookahead=2)
    # while request i is admitted (`allocate` dequeues it), i+1..i+2 wait
    assert pol.log == [("queue", "1"), ("queue", "2"), ("queue", "3"), ("dequeue", "1"),
                       ("dequeue", "2"), ("dequeue", "3")]
    none = QueueLog()
    replay(_trace([1, 2, 3, 4]), lambda: none, 8 * 512)
    assert none.log == []


def test_a_queued_block_is_kept_for_its_request() -> None:
    # two blocks of cache: serving 3 evicts the colder of 1 and 2; with one request of
    # lookahead, kvheat keeps 1 (the next request needs it) and 4 hits
    pt = _trace([1, 2, 3, 1])
    plain = replay(pt, "kvheat", 2 * 512)
    ahead = replay(pt, "kvheat", 2 * 512, lookahead=1)
    assert plain.hit_tokens == 0
    assert ahead.hit_tokens == 512
    assert replay(pt, "kvheat", 2 * 512, lookahead=0).hit_tokens == plain.hit_tokens


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_lookahead_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="lookahead"):
        replay(_trace([1]), "lru", 4 * 512, lookahead=bad)  # type: ignore[arg-type]


def test_the_cli_passes_the_lookahead() -> None:
    run = CliRunner().invoke(main, ["replay", "builtin", "--policy", "kvheat", "--limit", "50",
                                    "--capacity", "64K", "--lookahead", "1", "--no-misses"])
    assert run.exit_code == 0, run.output
    bad = CliRunner().invoke(main, ["replay", "builtin", "--lookahead", "-1"])
    assert bad.exit_code != 0 and "lookahead" in bad.output.lower()


def test_the_window_holds_at_most_its_key_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvheat.replay.replayer as replayer

    trace = _trace(list(range(1, 11)))
    unbounded = QueueLog()
    full = replay(trace, lambda: unbounded, 16 * 512, lookahead=6)
    assert full.lookahead_short == 0 and "lookahead_short" not in full.as_dict()
    monkeypatch.setattr(replayer, "LOOKAHEAD_KEYS", 3)  # one key a request: 3 in the window
    pol = QueueLog()
    cut = replay(trace, lambda: pol, 16 * 512, lookahead=6)
    assert cut.requests == full.requests == 10  # every request still served
    assert cut.lookahead_short > 0 and cut.as_dict()["lookahead_short"] == cut.lookahead_short
    queued = [rid for what, rid in pol.log if what == "queue"]
    assert len(queued) == len(set(queued)) == 9  # each once, in order, all but the first
    assert queued == [str(i) for i in range(1, 10)]
    # queued at once: the window's 3 keys, and the request being admitted (queued in its
    # own window turns, dequeued at its allocate) -- against 7 + 1 without the budget
    def peak(log: list[tuple[str, str]]) -> int:
        depth = top = 0
        for what, _ in log:
            depth += 1 if what == "queue" else -1
            top = max(top, depth)
        return top

    assert peak(pol.log) == 4 and peak(unbounded.log) == 8
