"""The continuous-batching scheduler against the real block cache (no model needed here:
the forward pass is replaced by appending a deterministic next token; tests with real
forward passes are in test_engine_e2e.py)."""

from __future__ import annotations

import random

import pytest

from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.engine.config import SchedulerConfig
from kvheat.engine.load_classes import LONG, SHORT
from kvheat.engine.scheduler import Scheduler
from kvheat.engine.sequence import Seq, SeqStatus


class StepClock:
    """Time advances one unit per scheduler step (aging measured in steps)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 64, block_size: int = 4, **cfg) -> tuple[Scheduler, StepClock]:
    clock = StepClock()
    cache = KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=block_size))
    return Scheduler(SchedulerConfig(**cfg), cache, clock=clock), clock


def next_token(seq: Seq) -> int:
    return (len(seq.token_ids) * 31 + sum(map(ord, seq.seq_id))) % 997


def step(s: Scheduler, clock: StepClock, finished: list[Seq] | None = None) -> int:
    """One scheduler step with a stand-in forward pass; returns tokens run."""
    out = s.schedule()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    assert out.num_batched_tokens == sum(len(it.token_ids) for it in out.items)
    for it in out.items:  # block tables cover every position the item writes
        assert len(it.block_table) * s.block_size >= it.num_computed + len(it.token_ids)
    s.update(out)
    for it in out.items:
        if it.sample:
            seq = it.seq
            seq.token_ids.append(next_token(seq))
            if seq.num_output_tokens >= seq.max_tokens:
                s.finish(seq, "length")
                if finished is not None:
                    finished.append(seq)
    s.check_accounting()
    clock.t += 1
    return out.num_batched_tokens


def run_all(s: Scheduler, clock: StepClock, max_steps: int = 10_000) -> int:
    n = 0
    while s.has_work:
        step(s, clock)
        n += 1
        assert n < max_steps, "scheduler made no progress"
    return n


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_requests_complete_and_blocks_balance() -> None:
    s, clock = make(max_num_batched_tokens=32, max_num_seqs=4)
    rng = random.Random(0)
    seqs = [Seq(f"r{i}", toks(rng, rng.randint(1, 40)), rng.randint(1, 12)) for i in range(10)]
    for q in seqs:
        s.add(q)
    run_all(s, clock)
    for q in seqs:
        assert q.status is SeqStatus.FINISHED and q.num_output_tokens == q.max_tokens
    assert s.cache.num_referenced == 0


def test_chunked_prefill_respects_budget() -> None:
    s, clock = make(max_num_batched_tokens=16)
    q = Seq("long", list(range(100)), 2)
    s.add(q)
    chunks = []
    while s.has_work:
        out = s.schedule()
        chunks += [len(it.token_ids) for it in out.items]
        s.update(out)
        for it in out.items:
            if it.sample:
                it.seq.token_ids.append(1)
                if it.seq.num_output_tokens >= it.seq.max_tokens:
                    s.finish(it.seq, "length")
        s.check_accounting()
    assert chunks == [16] * 6 + [4, 1]  # 100 prompt tokens in chunks, then one decode


def test_finished_turn_blocks_serve_the_next_turn() -> None:
    s, clock = make(block_size=4)
    turn1 = Seq("t1", list(range(10)), 7, session="c")
    s.add(turn1)
    run_all(s, clock)
    # Next turn: the whole history (prompt + generated tokens) plus a new message.
    history = turn1.token_ids
    turn2 = Seq("t2", history + [500, 501, 502], 3, session="c")
    s.add(turn2)
    run_all(s, clock)
    # Every full block whose KV was computed in turn 1 (the last sampled token never was).
    assert turn2.num_cached_tokens == (len(history) - 1) // 4 * 4 == 16
    st = s.cache.stats
    assert st.requests == 2 and st.query_tokens == 10 + len(history) + 3 and st.hit_tokens == 16


def test_same_step_admission_never_reads_unwritten_blocks() -> None:
    s, clock = make(block_size=4, max_num_batched_tokens=64)
    prompt = list(range(20))
    a, b = Seq("a", prompt, 1), Seq("b", prompt + [50, 51, 52, 53, 54], 1)
    s.add(a)
    s.add(b)
    out = s.schedule()
    # b's prefix is cached by a's allocation, but its KV is written by this very forward
    # pass: b waits one step instead of reading it.
    assert [it.seq for it in out.items] == [a] and b.status is SeqStatus.WAITING
    s.update(out)
    a.token_ids.append(7)
    s.finish(a, "length")
    s.check_accounting()
    clock.t += 1
    step(s, clock)
    assert b.num_cached_tokens == 20  # now written, and shared
    run_all(s, clock)


def test_no_prefix_cache_with_shared_prefixes_keeps_the_tree_sound() -> None:
    # Without prefix reuse, blocks whose prefix another request already cached stay
    # private, and so does everything after them (the manager's tree stays consistent).
    s, clock = make(num_blocks=32, block_size=4, prefix_caching="off")
    rng = random.Random(5)
    shared = toks(rng, 12)
    for i in range(6):
        s.add(Seq(f"o{i}", shared + toks(rng, 9), 9))
        step(s, clock)  # check_accounting runs the manager's full invariant check
    run_all(s, clock)
    assert s.cache.stats.hit_tokens == 0


def test_prefix_modes() -> None:
    prompt = list(range(32))
    want = {"block": (28, 32, 32), "exact": (28, 0, 32), "off": (0, 0, 0)}
    for mode, expected in want.items():
        s, clock = make(block_size=4, prefix_caching=mode)
        s.add(Seq("first", prompt, 1))
        run_all(s, clock)
        got = []
        # the same prompt; a longer one sharing it; that longer one resubmitted
        for name, p in (("same", prompt), ("longer", prompt + [9, 9, 9]),
                        ("again", prompt + [9, 9, 9])):
            q = Seq(name, p, 1)
            s.add(q)
            run_all(s, clock)
            got.append(q.num_cached_tokens)
        assert tuple(got) == expected, mode


def test_no_starvation_of_a_long_request_under_short_stream() -> None:
    budget = 32
    s, clock = make(num_blocks=512, block_size=4, max_num_batched_tokens=budget, max_num_seqs=64,
                    short_max_tokens=32, long_min_tokens=256, aging_s=1e9)  # weights alone
    rng = random.Random(1)
    long = Seq("long", toks(rng, 600), 4)
    s.add(long)
    finished: list[Seq] = []
    i = 0
    steps = 0
    while long.status is not SeqStatus.FINISHED:
        for _ in range(3):  # more short work arrives each step than the budget can serve
            s.add(Seq(f"s{i}", toks(rng, 12), 4))
            i += 1
        step(s, clock, finished)
        steps += 1
        assert steps < 1000
    assert long.load_class == LONG and finished[0].load_class == SHORT
    # The long class keeps at least its weighted share of the budget every step:
    # 0.3 / (0.3 + 1.8 + 0.5) of 32 tokens, about 3.7 -> 3 tokens a step.
    assert steps <= 600 / 3 + 10
    assert len(s.waiting) > 0  # the shorts really did overload the engine


def test_aging_guard_lets_a_long_request_get_its_blocks() -> None:
    # A pool too small for the long request while shorts hold blocks: new shorts keep
    # arriving, and only the aging guard stops them from taking every freed block.
    def run(aging_s: float) -> int | None:
        s, clock = make(num_blocks=40, block_size=4, max_num_batched_tokens=64,
                        max_num_seqs=16, short_max_tokens=32, long_min_tokens=100,
                        aging_s=aging_s)
        rng = random.Random(2)
        for j in range(8):
            s.add(Seq(f"warm{j}", toks(rng, 12), 8))
        step(s, clock)
        long = Seq("long", toks(rng, 120), 8)
        s.add(long)
        i = 0
        for n in range(250):
            for _ in range(2):
                s.add(Seq(f"s{i}", toks(rng, 12), 8))
                i += 1
            step(s, clock)
            if long.status is SeqStatus.FINISHED:
                return n
        return None

    assert run(aging_s=1e9) is None  # without the guard the long request starves
    done = run(aging_s=20)
    assert done is not None and done <= 20 + 60


def test_preemption_frees_and_restores() -> None:
    # Eight sequences whose decodes outgrow the pool: some must be preempted, and each
    # resumes from where it was, with its tokens intact and the blocks balanced.
    s, clock = make(num_blocks=24, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    rng = random.Random(3)
    seqs = [Seq(f"p{i}", toks(rng, 6), 16) for i in range(8)]
    for q in seqs:
        s.add(q)
    history: dict[str, list[int]] = {}
    while s.has_work:
        out = s.schedule()
        for v in out.preempted:
            assert v.cache_req is None and v.status is SeqStatus.WAITING and v.num_computed == 0
            history[v.seq_id] = list(v.token_ids)
        s.update(out)
        for it in out.items:
            if it.sample:
                it.seq.token_ids.append(next_token(it.seq))
                if it.seq.num_output_tokens >= it.seq.max_tokens:
                    s.finish(it.seq, "length")
        s.check_accounting()
        clock.t += 1
    assert s.num_preemptions > 0
    for q in seqs:
        assert q.status is SeqStatus.FINISHED and q.num_output_tokens == 16
        if q.seq_id in history:  # the tokens before preemption are still the sequence's start
            assert q.token_ids[:len(history[q.seq_id])] == history[q.seq_id]
        # the stand-in "model" is deterministic, so a resumed sequence generates the same
        # tokens it would have without preemption
        ref = list(q.token_ids[:q.num_prompt_tokens])
        probe = Seq(q.seq_id, ref, 0)
        for _ in range(16):
            probe.token_ids.append(next_token(probe))
        assert probe.token_ids == q.token_ids
    assert s.cache.num_referenced == 0


def test_abort_frees_blocks_and_bad_requests_change_nothing() -> None:
    s, clock = make(num_blocks=16, block_size=4)
    a = Seq("a", list(range(20)), 8)
    b = Seq("b", list(range(100, 110)), 8)
    s.add(a)
    s.add(b)
    step(s, clock)
    s.finish(a, "abort")
    s.finish(b, "abort")
    s.check_accounting()
    assert s.cache.num_referenced == 0 and not s.has_work
    with pytest.raises(ValueError, match="blocks"):
        s.add(Seq("big", list(range(60)), 10))
    with pytest.raises(ValueError, match="token id"):
        s.add(Seq("neg", [1, -2, 3], 1))
    with pytest.raises(ValueError, match="empty"):
        s.add(Seq("empty", [], 1))
    assert not s.has_work
    with pytest.raises(ValueError):
        SchedulerConfig(prefix_caching="sometimes")
    with pytest.raises(ValueError, match="removed"):
        SchedulerConfig(preemption="swap")


def test_accounting_balances_with_a_pinned_prefix() -> None:
    """A pinned prefix holds references outside any sequence; the books still balance."""
    from kvheat.cache import CacheConfig, KVCacheManager
    from kvheat.engine import Scheduler, SchedulerConfig

    cache = KVCacheManager(CacheConfig(num_blocks=32, block_size=4))
    sched = Scheduler(SchedulerConfig(), cache)
    prompt = list(range(12))
    warm = cache.make_request("warm", prompt)
    cache.allocate(warm)
    cache.free(warm)
    assert cache.pin_prefix(prompt) == 12
    sched.check_accounting()
    assert cache.unpin_prefix(prompt) == 12
    sched.check_accounting()
