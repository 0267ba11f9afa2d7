"""The engine's hints to the cache policy (SchedulerConfig.cache_hints): each request's
session, the blocks of waiting requests (queued, dequeued on admission or abort, queued
again when preempted), and how it ended (FINISHED with the finish reason, CANCELLED on
abort), with real forward passes of the built-in tiny Llama. Without hints the policy
hears nothing and decides as before."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvheat.cache import Node, Outcome
from kvheat.cache.classic import LRU
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 16


class Recording(LRU):
    """LRU that writes down every hint it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def on_session(self, session: str, now: float) -> None:
        self.log.append(("session", session))

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.log.append(("finish", session, outcome, reason))

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        self.log.append(("queue", request_id, len(keys), session))

    def on_dequeue(self, request_id: str) -> None:
        self.log.append(("dequeue", request_id))


def engine(llama: tuple, hints: bool = True, num_blocks: int = 64, policy=None,
           **sched) -> LLMEngine:
    model, tok, _ = llama
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BS, policy="lru",
                       scheduler=SchedulerConfig(cache_hints=hints, **sched))
    return LLMEngine(model, tok, cfg, policy=policy if policy is not None else Recording())


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def log_of(e: LLMEngine) -> list[tuple]:
    pol = e.cache.policy
    assert isinstance(pol, Recording)
    return pol.log


def test_queue_session_and_finish_reach_the_policy(llama: tuple) -> None:
    e = engine(llama, max_num_seqs=1)  # one at a time: the second request waits
    a = e.add_request(prompt(0, 40), SamplingParams(max_tokens=3, ignore_eos=True),
                      session="s-a", request_id="a")
    b = e.add_request(prompt(1, 40), SamplingParams(max_tokens=3, ignore_eos=True),
                      session="s-b", request_id="b")
    e.run()
    e.release(a), e.release(b)
    log = [x for x in log_of(e) if x[0] != "session" or x[1] in ("s-a", "s-b")]
    # both queued on arrival with their full blocks' keys (40 tokens: 2 full blocks)
    assert log[:2] == [("queue", "a", 2, "s-a"), ("queue", "b", 2, "s-b")]
    # a is admitted (dequeued by the cache's allocate), runs and finishes; then b
    assert log[2:4] == [("dequeue", "a"), ("session", "s-a")]
    fin = [x for x in log if x[0] == "finish"]
    assert fin == [("finish", "s-a", Outcome.FINISHED, "length"),
                   ("finish", "s-b", Outcome.FINISHED, "length")]
    assert log.index(("dequeue", "b")) > log.index(fin[0])
    assert not e.cache.queued
    e.check_accounting()


def test_abort_is_cancelled_and_a_waiting_abort_is_dequeued(llama: tuple) -> None:
    e = engine(llama, max_num_seqs=1)
    a = e.add_request(prompt(2, 40), SamplingParams(max_tokens=20, ignore_eos=True),
                      session="s", request_id="a")
    b = e.add_request(prompt(3, 40), SamplingParams(max_tokens=20, ignore_eos=True),
                      session="s", request_id="b")
    e.step()
    e.step()  # a runs, b waits
    e.abort(a)
    e.abort(b)  # never admitted: nothing to free, its queue entry goes
    # a stop string matched in the server: the answer was delivered
    c = e.add_request(prompt(4, 40), SamplingParams(max_tokens=20, ignore_eos=True),
                      session="s", request_id="c")
    e.step()
    e.abort(c, "stop", Outcome.FINISHED)
    log = log_of(e)
    assert [x for x in log if x[0] == "finish"] == [
        ("finish", "s", Outcome.CANCELLED, "abort"), ("finish", "s", Outcome.FINISHED, "stop")]
    assert ("dequeue", "b") in log and not e.cache.queued
    assert e.release(c).finish_reason == "stop"
    e.release(a), e.release(b)
    e.check_accounting()


def test_preempted_requests_are_queued_again_without_ending(llama: tuple) -> None:
    # Long decodes in a small pool: sequences are preempted and resume.
    e = engine(llama, num_blocks=12, max_num_seqs=4)
    ids = [e.add_request(prompt(10 + i, 30), SamplingParams(max_tokens=40, ignore_eos=True),
                         session=f"s{i}") for i in range(4)]
    while e.has_unfinished:
        e.step()
        e.check_accounting()
    assert e.stats.preemptions > 0
    log = log_of(e)
    fin = [x for x in log if x[0] == "finish"]
    assert len(fin) == 4 and all(x[2] is Outcome.FINISHED and x[3] == "length" for x in fin)
    queued = [x for x in log if x[0] == "queue"]
    assert len(queued) == 4 + e.stats.preemptions  # arrival, and each preemption
    assert not e.cache.queued
    for i in ids:
        e.release(i)


def test_without_hints_the_policy_hears_nothing_and_decides_alike(llama: tuple) -> None:
    def run(hints: bool) -> tuple[list[tuple], list[list[int]], list[int]]:
        e = engine(llama, hints=hints, num_blocks=24, max_num_seqs=2)
        ids = []
        for i in range(6):  # two sessions of three turns over a shared head
            head = prompt(99, 48) + prompt(i % 2, 16 * (1 + i // 2))
            ids.append(e.add_request(head, SamplingParams(max_tokens=5, ignore_eos=True),
                                     session=f"s{i % 2}"))
        e.abort(ids[5])
        e.run()
        outs = [e.release(i) for i in ids]
        return (log_of(e), [o.output_token_ids for o in outs],
                [o.metrics.num_cached_tokens for o in outs])

    on, off = run(True), run(False)
    assert off[0] == []  # not one hint hook
    assert on[0] and on[1:] == off[1:]  # LRU ignores hints: the same tokens and hits


def test_no_queue_hints_without_prefix_caching(llama: tuple) -> None:
    e = engine(llama, prefix_caching="off", max_num_seqs=1)
    for i in range(2):
        e.add_request(prompt(i, 40), SamplingParams(max_tokens=2, ignore_eos=True),
                      session="s")
    e.run()
    assert not [x for x in log_of(e) if x[0] in ("queue", "dequeue")]
