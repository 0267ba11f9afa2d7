"""The streaming replayer: the spool a trace is read into, Belady's next use from its
backward pass, SHARDS miniatures, `--copies` as a stream, parallel replays and the
miss-ratio curves (`kvheat replay --curve`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvheat.cli import main
from kvheat.replay import (
    PreparedTrace,
    TraceRequest,
    WorkloadConfig,
    generate_workload,
    replay,
    save_trace,
)
from kvheat.replay.curves import adjusted_hit_rate, capacity_grid, knee, policy_curves
from kvheat.replay.parallel import ReplayTask, run_replays
from kvheat.replay.spool import NEVER, Spool, key_hash
from kvheat.replay.traces import iter_copies, load_trace

BT = 64


def workload(n: int = 200, seed: int = 5) -> list[TraceRequest]:
    """Short chats (tens of blocks a prompt), so brute-force checks stay quick."""
    return generate_workload(WorkloadConfig(num_conversations=n, seed=seed,
                                            system_tokens=(256, 1024), user_tokens_mean=200.0,
                                            output_tokens_mean=50.0, max_input_tokens=8000), BT)


def test_the_spool_streams_back_the_keys_and_facts_of_the_trace() -> None:
    trace = workload()
    pt = PreparedTrace(trace, BT)
    sp = Spool.build(iter(trace), BT)  # a generator: read once, in order
    got = list(sp.requests())
    assert [r.keys for r in got] == pt.keys
    assert [(r.timestamp_ms, r.input_length, r.output_length) for r in got] == \
        [(r.timestamp_ms, r.input_length, r.output_length) for r in trace]
    s = sp.summary
    assert s.requests == len(trace) and s.refs == sum(map(len, pt.keys))
    assert s.distinct == len({k for ks in pt.keys for k in ks})
    assert s.max_blocks == max(map(len, pt.keys))
    assert sp.footprint_blocks() == pt.footprint_blocks()
    assert sp.infinite_hit_rate() == pt.infinite_hit_rate()
    # Only the distinct keys live in memory; the references are in files, 5 bytes each.
    sizes = {p.name: p.stat().st_size for p in sp.folder.iterdir()}
    assert sizes["ids.bin"] == 4 * s.refs and sizes["kinds.bin"] == s.refs
    folder = sp.folder
    sp.close()
    assert not folder.exists()


def test_next_use_from_the_backward_pass_is_the_brute_force_one() -> None:
    trace = workload(120)
    sp = Spool.build(trace, BT)
    reqs = list(sp.requests(next_use=True))
    for i, r in enumerate(reqs):
        assert r.next_use is not None
        for k, nxt in zip(r.keys, r.next_use):
            want = next((j for j in range(i + 1, len(reqs)) if k in reqs[j].keys), NEVER)
            assert nxt == want


def test_a_miniature_keeps_exactly_the_sampled_keys_and_their_reuse() -> None:
    trace = workload(300)
    sp = Spool.build(trace, BT)
    rate = 0.25
    mini = sp.sample(rate, seed=7)
    kept = {k for k, h in zip(sp.keys, key_hash(sp.keys, 7).tolist()) if h < rate * 2**32}
    want = []  # the slow definition: each request's kept keys in order; none left: dropped
    for r in sp.requests():
        ks = [k for k in r.keys if k in kept]
        if ks:
            last_kept = r.keys[-1] in kept
            short = (len(r.keys) * BT - r.input_length) if last_kept else 0
            want.append((r.timestamp_ms, ks, len(ks) * BT - short))
    assert [(r.timestamp_ms, r.keys, r.input_length) for r in mini.requests()] == want
    assert mini.summary.total_tokens == sum(n for _t, _k, n in want)
    assert mini.summary.refs == sum(len(k) for _t, k, _n in want)
    assert 0 < mini.summary.distinct < sp.summary.distinct
    assert mini.infinite_hit_rate() == pytest.approx(
        PreparedTrace([TraceRequest(t, n, 0, [hash(k) % 2**60 for k in ks])
                       for t, ks, n in want], BT).infinite_hit_rate())
    assert sp.sample(1.0) is sp
    with pytest.raises(ValueError, match="sample rate"):
        sp.sample(0.0)


def test_adjusted_rate_counts_the_sample_shortfall_as_hits() -> None:
    class R:  # a miniature's replay: what `adjusted_hit_rate` reads
        hit_tokens, total_tokens = 30, 90

    # expected 100 tokens at rate 0.1 of 1000; the sample saw 90: 10 more count as hits
    assert adjusted_hit_rate(R(), 0.1, 1000) == pytest.approx(0.4)  # type: ignore[arg-type]
    assert knee([(100, 0.1), (1000, 0.5), (10000, 0.9)], 1.0, 0.9) == 10000
    assert knee([(100, 0.1), (1000, 0.5)], 1.0, 0.9) is None
    k = knee([(100, 0.0), (10000, 1.0)], 1.0, 0.5)
    assert k == 1000  # halfway in log capacity


def test_copies_stream_as_many_users_and_copy_zero_is_the_trace(tmp_path: Path) -> None:
    trace = workload(60)
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    one = load_trace(path, BT)
    three = list(iter_copies(path, BT, 3, seed=1))
    assert len(three) == 3 * len(one)
    assert [r.timestamp_ms for r in three] == sorted(r.timestamp_ms for r in three)
    base = [r for r in three if not (r.session or "").count("#")]
    assert [(r.timestamp_ms, r.hash_ids) for r in base] == [(r.timestamp_ms, r.hash_ids) for r in one]
    ids = [{h for r in three if (r.session or "").endswith(f"#{c}") for h in r.hash_ids}
           for c in (1, 2)]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert not ids[0] & {h for r in one for h in r.hash_ids}
    sp = Spool.build(iter_copies(path, BT, 3, seed=1), BT)
    assert sp.summary.distinct == 3 * Spool.build(one, BT).summary.distinct


def test_parallel_replays_give_the_sequential_results() -> None:
    sp = Spool.build(workload(150), BT)
    tasks = [ReplayTask(0, p, c) for p in ("lru", "kvheat", "belady") for c in (300, 1200)]
    seq = run_replays([sp], tasks, jobs=1)
    par = run_replays([sp], tasks, jobs=2)
    assert [(r.policy, r.capacity_tokens, r.hit_tokens, r.evictions) for r in seq] == \
        [(r.policy, r.capacity_tokens, r.hit_tokens, r.evictions) for r in par]
    assert [r.hit_rate for r in seq] == [replay(sp, t.policy, t.capacity_tokens, BT).hit_rate
                                         for t in tasks]


def test_curves_are_exact_where_whole_and_close_where_sampled() -> None:
    trace = workload(400)
    sp = Spool.build(trace, BT)
    grid = capacity_grid(sp, 6)
    assert grid == sorted(grid) and grid[-1] == sp.footprint_blocks() * BT
    full = [replay(sp, p, c, BT) for p in ("lru", "kvheat") for c in grid]
    curves = policy_curves(sp, ["lru", "kvheat"], grid, checks=full[:2])
    lru, heat = curves
    # LRU by stack distance and the others replayed whole: the replayer's own numbers
    assert [p.hit_rate for p in lru.points] == [r.hit_rate for r in full[:len(grid)]]
    assert {p.method for p in lru.points if p.capacity_tokens // BT >= sp.summary.max_blocks} \
        == {"stack distance"}
    assert [p.hit_rate for p in heat.points] == [r.hit_rate for r in full[len(grid):]]
    assert lru.points[-1].hit_rate == sp.infinite_hit_rate()
    assert lru.knee_tokens is not None and grid[0] <= lru.knee_tokens <= grid[-1]
    assert [c["error_points"] for c in lru.checks] == [0.0, 0.0]
    # A miniature (budget forced small): estimated, the error stated beside full replays
    mini = policy_curves(sp, ["kvheat"], grid[-3:], checks=full[-3:], budget_refs=2000,
                         seed=1)[0]
    # (a miniature cache keeps at least MIN_MINI_BLOCKS: a small capacity is replayed whole)
    assert any(p.method == "miniature" for p in mini.points)
    assert all((p.method == "miniature") == (p.sample_rate < 1) for p in mini.points)
    assert len(mini.checks) == 3
    for c in mini.checks:
        assert abs(c["error_points"]) < 10, c


def test_cli_curve_and_jobs(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(workload(150), path)
    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"r{jobs}.json"
        res = CliRunner().invoke(main, ["replay", str(path), "--block-tokens", str(BT),
                                        "--policy", "lru,kvheat", "--capacity", "600,2K",
                                        "--jobs", jobs, "--curve", "--curve-points", "5",
                                        "--json", str(out)])
        assert res.exit_code == 0, res.output
        outs.append(json.loads(out.read_text()))
    a, b = outs
    assert [r["hit_rate"] for r in a["results"]] == [r["hit_rate"] for r in b["results"]]
    cur = a["curves"]
    assert len(cur["capacities"]) == 5 and cur["knee_share"] == 0.9
    assert [p["policy"] for p in cur["policies"]] == ["lru", "kvheat"]
    for p in cur["policies"]:
        assert len(p["points"]) == 5 and len(p["checks"]) == 2
        assert all(0 <= q["hit_rate"] <= cur["unbounded"] + 1e-12 for q in p["points"])
    assert a["curves"] == b["curves"]
    assert a["trace_stats"]["block_references"] > 0
    res = CliRunner().invoke(main, ["replay", str(path), "--curve", "--replicas", "2"])
    assert res.exit_code != 0 and "--curve" in res.output


def test_key_hash_is_uniform_and_seeded() -> None:
    keys = [i.to_bytes(16, "big") for i in range(20000)]  # (bytes 8..15 vary)
    h = key_hash(keys, 0)
    assert h.dtype == np.uint64 and (h < 2**32).all()
    assert abs(float((h < 2**31).mean()) - 0.5) < 0.02
    assert not np.array_equal(h, key_hash(keys, 1))
