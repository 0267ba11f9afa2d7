"""LRU's one-pass curve (kvheat/replay/stack.py) against the real replay: the same hit
tokens, exactly, at every capacity from the longest request up."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
from conftest import TRACES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvheat.replay import (
    PreparedTrace,
    TraceRequest,
    WorkloadConfig,
    generate_workload,
    load_trace,
    parse_tokens,
    replay,
)
from kvheat.replay.stack import (
    MAX_STEPS,
    LRUCurve,
    LRUStackDistance,
    dense_requests,
    lru_curve,
)

CONV = TRACES / "mooncake_conversation_part1.jsonl"
AGENTIC = TRACES / "agentic" / "agentic_dev.jsonl"
needs_conv = pytest.mark.skipif(not CONV.exists(), reason=f"the Mooncake traces are not in {TRACES}")
needs_agentic = pytest.mark.skipif(not AGENTIC.exists(),
                                   reason=f"the agentic traces are not in {TRACES / 'agentic'}")


def requests_of(pt: PreparedTrace) -> list[tuple[np.ndarray, int]]:
    return list(dense_requests(pt.keys, [r.input_length for r in pt.trace]))


def curve_of(pt: PreparedTrace, rate: float = 1.0, seed: int = 0, batch_refs: int = 384,
             chunked: bool = False) -> LRUCurve:
    sd = LRUStackDistance(pt.block_tokens, rate, seed, batch_refs)
    reqs = requests_of(pt)
    if chunked:  # as a spool hands them over: a few chunks of requests back to back
        for s in range(0, len(reqs), 97):
            part = reqs[s:s + 97]
            sd.add_chunk(np.concatenate([ids for ids, _ in part]),
                         np.array([len(ids) for ids, _ in part]),
                         np.array([n for _, n in part]))
    else:
        sd.extend(reqs)
    return sd.result()


def assert_exact(pt: PreparedTrace, curve: LRUCurve, capacities: list[int]) -> None:
    bt = pt.block_tokens
    for c in capacities:
        assert c >= curve.exact_from_blocks
        r = replay(pt, "lru", c * bt, bt)
        assert (c, curve.hit_tokens(c)) == (c, r.hit_tokens)
        assert curve.hit_rate(c) == r.hit_rate


def capacities(curve: LRUCurve) -> list[int]:
    """From the longest request (where exactness starts) to a cache holding everything."""
    lo, everything = curve.exact_from_blocks, curve.distinct_keys + curve.exact_from_blocks
    return sorted({lo, lo + 1, lo + 13, 2 * lo, (lo + everything) // 3, everything})


@cache
def generated(block_tokens: int) -> PreparedTrace:
    convs = 250 if block_tokens >= 512 else 120
    return PreparedTrace(generate_workload(WorkloadConfig(num_conversations=convs, seed=5),
                                           block_tokens), block_tokens)


@pytest.mark.parametrize("block_tokens", [512, 64])
def test_exact_on_the_generator(block_tokens: int) -> None:
    pt = generated(block_tokens)
    curve = curve_of(pt)
    assert curve.exact_from_blocks == max(len(ks) for ks in pt.keys)
    assert curve.distinct_keys == len({k for ks in pt.keys for k in ks})
    assert curve.total_tokens == sum(r.input_length for r in pt.trace)
    caps = capacities(curve)
    assert_exact(pt, curve, caps)
    # the largest holds everything: the unbounded cache's hit rate
    assert curve.hit_rate(caps[-1]) == pytest.approx(pt.infinite_hit_rate(), abs=1e-12)
    assert curve.unbounded_hit_rate == pytest.approx(pt.infinite_hit_rate(), abs=1e-12)


def test_batches_and_chunks_agree() -> None:
    """Requests one at a time, in batches of any size, or in spool-like chunks: the same
    histogram (the in-batch matrix against the request-at-a-time path)."""
    pt = generated(64)
    ref = curve_of(pt, batch_refs=1).tokens_by_distance
    for batch_refs in (7, 384, 5000):
        for chunked in (False, True):
            got = curve_of(pt, batch_refs=batch_refs, chunked=chunked).tokens_by_distance
            assert np.array_equal(got, ref), (batch_refs, chunked)


@needs_conv
def test_exact_on_a_conversation_slice() -> None:
    pt = PreparedTrace(load_trace(CONV, 512, limit=1500), 512)
    curve = curve_of(pt, chunked=True)
    assert_exact(pt, curve, capacities(curve))


@needs_conv
def test_whole_conversation_trace_matches_the_reference_figures() -> None:
    """The LRU figures test_replay pins for the full trace (1M, 3M, 10M tokens), from
    one pass instead of three replays."""
    pt = PreparedTrace(load_trace(CONV), 512)
    curve = curve_of(pt, chunked=True)
    for cap, ref in (("1M", 0.0524), ("3M", 0.1378), ("10M", 0.2802)):
        blocks = parse_tokens(cap) // 512
        assert blocks >= curve.exact_from_blocks
        assert round(curve.hit_rate(blocks), 4) == ref
    assert round(curve.unbounded_hit_rate, 4) == 0.3465


@st.composite
def prefix_trees(draw: st.DrawFn) -> tuple[list[TraceRequest], int]:
    """Requests that extend or cut short earlier ones (shared prefixes, branches, prompts
    repeated), some under a second tenant, with partial last blocks of any length: a key
    may be a full block in one request and a partial last block in another."""
    bt = draw(st.sampled_from([1, 4, 16]))
    prompts: list[list[int]] = []
    next_id = 0
    trace: list[TraceRequest] = []
    for i in range(draw(st.integers(1, 30))):
        extend = draw(st.booleans())
        if prompts and extend:
            base = draw(st.sampled_from(prompts))
            base = base[:draw(st.integers(0, len(base)))]
        else:
            base = []
        grow = draw(st.integers(0 if base else 1, 6))
        ids = base + list(range(next_id, next_id + grow))
        next_id += grow
        prompts.append(ids)
        n = len(ids)
        tokens = draw(st.integers((n - 1) * bt + 1, n * bt))
        tenant = draw(st.sampled_from([None, None, "b"]))
        trace.append(TraceRequest(float(i), tokens, 1, ids, None, tenant))
    return trace, bt


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix_trees(), st.sampled_from([1, 3, 384]))
def test_exact_on_random_prefix_trees(case: tuple[list[TraceRequest], int],
                                      batch_refs: int) -> None:
    trace, bt = case
    pt = PreparedTrace(trace, bt)
    curve = curve_of(pt, batch_refs=batch_refs)
    top = curve.distinct_keys + curve.exact_from_blocks
    assert_exact(pt, curve, list(range(curve.exact_from_blocks, min(top, 40) + 1)))


def test_a_key_used_with_different_token_counts() -> None:
    """Block 2 is a 3-token last block, then a full one, then partial again: a hit earns
    the tokens of the copy cached at that capacity (the last request that missed it)."""
    bt = 4
    trace = [TraceRequest(0.0, 7, 1, [1, 2]), TraceRequest(1.0, 9, 1, [1, 2, 3]),
             TraceRequest(2.0, 8, 1, [5, 6]), TraceRequest(3.0, 5, 1, [1, 2]),
             TraceRequest(4.0, 6, 1, [1, 2]), TraceRequest(5.0, 4, 1, [7])]
    pt = PreparedTrace(trace, bt)
    curve = curve_of(pt)
    assert_exact(pt, curve, list(range(curve.exact_from_blocks, 8)))
    assert curve.hit_tokens(3) != curve.hit_tokens(6)  # the staircase is exercised


@needs_agentic
def test_shards_estimates_the_curve() -> None:
    """SHARDS at rate 0.1 on agentic_dev (1.5M references) within 2 points of the exact
    curve from the longest request to everything. Deterministic (fixed hash seed 0, whose
    largest error here is 0.005); 0.02 is the worst of seeds 0-4 measured."""
    pt = PreparedTrace(load_trace(AGENTIC, 512), 512)
    exact = curve_of(pt, chunked=True)
    est = curve_of(pt, rate=0.1, seed=0, chunked=True)
    assert 0.08 * exact.references < est.sampled_references < 0.12 * exact.references
    assert est.total_tokens == exact.total_tokens
    d = exact.distinct_keys
    for c in (exact.exact_from_blocks, d // 20, d // 10, d // 5, d // 2, d):
        assert abs(est.hit_rate(c) - exact.hit_rate(c)) < 0.02, c
        assert abs(est.hit_tokens(c) - exact.hit_tokens(c)) < 0.02 * exact.total_tokens


def test_rate_one_is_the_exact_curve() -> None:
    pt = generated(512)
    exact = curve_of(pt)
    assert np.array_equal(curve_of(pt, rate=1.0, seed=9).tokens_by_distance,
                          exact.tokens_by_distance)
    sampled = curve_of(pt, rate=0.5, seed=1)
    assert sampled.sampled_references < exact.references
    assert 0.0 < sampled.hit_rate(10**6) <= 1.0


def test_time_axis_stays_bounded_by_the_keys() -> None:
    """20,000 requests over the same 40 keys: the time axis is renumbered, not grown."""
    sd = LRUStackDistance(16, batch_refs=64)
    base = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 40)]
    for ids in base:
        sd.add(ids, len(ids) * 16)
    for i in range(20_000):
        ids = base[i % 3][: 1 + i % 7]
        sd.add(ids, len(ids) * 16)
    # the smallest axis there is (two groups of 4096 times), where 80,000 references
    # without renumbering would have needed 80,000
    assert sd.time_slots <= 2 * 4096
    curve = sd.result()
    assert curve.distinct_keys == 40
    assert curve.hit_rate(40) > 0.99  # all but the first uses hit


def test_result_mid_stream_and_continue() -> None:
    pt = generated(512)
    reqs = requests_of(pt)
    sd = LRUStackDistance(512)
    sd.extend(reqs[:200])
    first = sd.result()
    assert first.requests == 200
    sd.extend(reqs[200:])
    assert np.array_equal(sd.result().tokens_by_distance, curve_of(pt).tokens_by_distance)


def test_bad_input_is_refused_and_loses_nothing() -> None:
    pt = generated(512)
    reqs = requests_of(pt)
    sd = LRUStackDistance(512)
    sd.extend(reqs[:50])
    seen = int(max(ids.max() for ids, _ in reqs[:50])) + 1
    bad = [
        (np.array([seen + 1]), 10),  # not dense: skips id `seen`
        (np.array([0, 1, 0]), 1200),  # a key twice
        (np.array([0, 1]), 1100),  # 1100 tokens do not fit 2 blocks of 512
        (np.array([0, 1]), 512),  # ... nor 512
        (np.array([-1]), 10),
        (np.array([], dtype=np.int64), 0),
        (np.array([0.5]), 10),
        (np.array([0]), True),
    ]
    for ids, n in bad:
        with pytest.raises(ValueError):
            sd.add(ids, n)
    bad_chunks = [
        ([0, 0], [2], [1000]),  # a key twice
        ([0, 1], [3], [1000]),  # counts do not add up to the ids
        ([seen + 3], [1], [10]),  # not dense
        ([0, 1], [1, 1], [10, 600]),  # 600 tokens in one block of 512
        ([0, 1], [1, 0], [10, 0]),  # an empty request
    ]
    for chunk_ids, counts, lengths in bad_chunks:
        with pytest.raises(ValueError):
            sd.add_chunk(np.array(chunk_ids), np.array(counts), np.array(lengths))
    for args in ((0, 1.0), (512, 0.0), (512, 1.5), (512, float("nan"))):
        with pytest.raises(ValueError):
            LRUStackDistance(*args)
    sd.extend(reqs[50:])  # the refusals changed nothing
    assert np.array_equal(sd.result().tokens_by_distance, curve_of(pt).tokens_by_distance)


def test_curve_and_json() -> None:
    pt = generated(512)
    curve = lru_curve(requests_of(pt), 512)
    lo = curve.exact_from_blocks
    points = curve.curve([lo, 4 * lo, 10**7])
    rates = [h for _, h in points]
    assert rates == sorted(rates) and rates[-1] == curve.unbounded_hit_rate
    knee = curve.blocks_for(0.9)
    assert knee is not None
    assert curve.hit_rate(knee) >= 0.9 * curve.unbounded_hit_rate > curve.hit_rate(knee - 1)
    d = json.loads(json.dumps(curve.as_dict([lo - 1, lo], histogram=True)))
    assert [p["exact"] for p in d["curve"]] == [False, True]
    assert d["curve"][1]["hit_tokens"] == replay(pt, "lru", lo * 512, 512).hit_tokens
    assert sum(d["histogram"]["tokens"]) == curve.hit_tokens(10**7)
    assert d["exact_from_blocks"] == lo


def test_a_staircase_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """One key used 80 times, alternately 1 and 2 tokens, each time after fewer others: a
    step per use. Past MAX_STEPS they merge, counted and logged, and no point claims to be
    exact any more."""
    sd = LRUStackDistance(4, batch_refs=16)
    sd.add([0], 1)  # the key, id 0
    for filler in range(1, 91):
        sd.add([filler], 4)
    for use in range(80):
        sd.add([0], 1 + use % 2)
        for filler in range(1, 90 - use):
            sd.add([filler], 4)
    curve = sd.result()
    assert curve.merged_steps > 0
    assert "steps of a key's token counts" in caplog.text
    assert not any(p["exact"] for p in curve.as_dict([100, 10**6])["curve"])
    assert len(sd._steps[0]) <= MAX_STEPS
