"""The replayer against the reference figures, its generator, and the CLI's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvheat.cli import main
from kvheat.replay import (
    PreparedTrace,
    TraceError,
    WorkloadConfig,
    generate_workload,
    load_trace,
    parse_tokens,
    replay,
)

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CONV = TRACES / "mooncake_conversation_part1.jsonl"


@pytest.mark.skipif(not CONV.exists(), reason="shared traces not present")
def test_lru_reproduces_reference_on_conversation_trace() -> None:
    pt = PreparedTrace(load_trace(CONV))
    assert round(pt.infinite_hit_rate(), 4) == 0.3465
    for cap, ref in (("1M", 0.0524), ("3M", 0.1378), ("10M", 0.2802)):
        assert round(replay(pt, "lru", parse_tokens(cap)).hit_rate, 4) == ref
    bel = replay(pt, "belady", parse_tokens("3M")).hit_rate
    assert 0.335 < bel <= pt.infinite_hit_rate()


def small_trace() -> PreparedTrace:
    return PreparedTrace(generate_workload(WorkloadConfig(num_conversations=300, seed=3)))


def test_belady_bounds_every_online_policy() -> None:
    pt = small_trace()
    inf = pt.infinite_hit_rate()
    for cap in (100_000, 400_000):
        bel = replay(pt, "belady", cap).hit_rate
        assert bel <= inf + 1e-12
        for p in ("lru", "fifo", "lfu", "arc", "s3fifo", "twoq"):
            assert replay(pt, p, cap).hit_rate <= bel + 1e-12, p


def test_hold_mode_and_miss_breakdown_add_up() -> None:
    pt = small_trace()
    r = replay(pt, "lru", 200_000, hold=True)
    m = r.misses
    assert r.hit_tokens + m.compulsory + m.capacity + m.sub_block + m.isolation + m.too_long == r.total_tokens
    assert m.capacity > 0 and m.compulsory > 0
    everything = sum(r.input_length for r in pt.trace) + 512 * len(pt.trace)
    assert replay(pt, "lru", everything).misses.capacity == 0  # nothing evicted, no capacity miss


def test_isolation_misses_are_counted_per_tenant() -> None:
    pt = PreparedTrace(generate_workload(WorkloadConfig(num_conversations=200, tenants=3, seed=1)))
    big = 2 * sum(r.input_length for r in pt.trace)
    r = replay(pt, "lru", big)
    assert r.misses.isolation > 0  # the same system prompt, cached for another tenant only
    single = PreparedTrace(generate_workload(WorkloadConfig(num_conversations=200, seed=1)))
    assert replay(single, "lru", big).misses.isolation == 0


def test_generator_is_seeded_and_chains_prefixes() -> None:
    a = generate_workload(WorkloadConfig(num_conversations=50, seed=7))
    b = generate_workload(WorkloadConfig(num_conversations=50, seed=7))
    c = generate_workload(WorkloadConfig(num_conversations=50, seed=8))
    assert [r.hash_ids for r in a] == [r.hash_ids for r in b]
    assert [r.hash_ids for r in a] != [r.hash_ids for r in c]
    by_conv: dict[str, list] = {}
    for r in a:
        by_conv.setdefault(r.session, []).append(r)  # type: ignore[arg-type]
    multi = [turns for turns in by_conv.values() if len(turns) > 1]
    assert multi
    for turns in multi:  # each turn's full blocks are a prefix of the next turn's
        for t1, t2 in zip(turns, turns[1:]):
            full = t1.input_length // 512
            assert t2.hash_ids[:full] == t1.hash_ids[:full]


def test_bad_trace_lines_are_named(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 1, "input_length": 9999, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=":2:"):
        load_trace(p)
    p.write_text("not json\n")
    with pytest.raises(TraceError, match=":1:"):
        load_trace(p)


def test_parse_tokens() -> None:
    assert parse_tokens("1M") == 1_000_000
    assert parse_tokens("512K") == 512_000
    assert parse_tokens("2500") == 2500
    for bad in ("x", "-1M", "0"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_cli_writes_the_documented_json_and_plot(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    from kvheat.replay import save_trace

    save_trace(generate_workload(WorkloadConfig(num_conversations=80, seed=2)), trace)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(main, ["replay", str(trace), "--capacity", "200K,1M",
                                    "--policy", "lru,twoq,belady", "--json", str(out),
                                    "--plot", str(png)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["trace"] == "t.jsonl" and d["block_tokens"] == 512 and 0 < d["infinite"] <= 1
    assert {(r["policy"], r["capacity_tokens"]) for r in d["results"]} == {
        (p, c) for p in ("lru", "twoq", "belady") for c in (200_000, 1_000_000)}
    assert all(0 <= r["hit_rate"] <= 1 for r in d["results"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(main, ["replay", str(trace), "--policy", "nope"])
    assert bad.exit_code != 0 and "unknown policy" in bad.output
