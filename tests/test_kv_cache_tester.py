"""kv-cache-tester's agentic session files (`kvheat replay --format kv-cache-tester`): the
real raw sessions of ../shared/traces/agentic, sub-agents, seeded offsets, grouping, and
one clear error per malformed file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvheat.cli import main
from kvheat.replay import replay
from kvheat.replay.traces import (
    SessionDraw,
    TraceError,
    load_kv_cache_tester,
    session_files,
)

AGENTIC = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic"
RAW = AGENTIC / "raw"
needs_raw = pytest.mark.skipif(not RAW.is_dir(), reason="shared agentic traces not present")


@needs_raw
def test_real_sessions_with_their_sub_agents() -> None:
    files = session_files(AGENTIC)  # the folder's raw/
    assert [f.parent.name for f in files] == ["raw"] * len(files) and len(files) >= 8
    tr = load_kv_cache_tester(AGENTIC, SessionDraw(sessions=("trace_0004",)))
    doc = json.loads((RAW / "trace_0004.json").read_text())
    subs = [r for r in doc["requests"] if r["type"] == "subagent"]
    main_reqs = [r for r in doc["requests"] if r["type"] != "subagent"]
    by = {}
    for r in tr:
        by.setdefault(r.session, []).append(r)
    assert set(by) == {"trace_0004", *(f"trace_0004/{s['agent_id']}" for s in subs)}
    assert len(by["trace_0004"]) == sum(1 for r in main_reqs if len(r["hash_ids"]) >= 8)
    # A sub-agent's clock starts at its `t` in the parent's.
    s0 = subs[0]
    got = by[f"trace_0004/{s0['agent_id']}"]
    assert [r.timestamp_ms for r in got] == [
        pytest.approx((s0["t"] + x["t"]) * 1000) for x in s0["requests"] if len(x["hash_ids"]) >= 8]
    # Full 8-block groups only; the input is the tokens they cover.
    x = s0["requests"][0]
    assert len(got[0].hash_ids) == len(x["hash_ids"]) // 8
    assert got[0].input_length == 512 * len(got[0].hash_ids)
    assert got[0].finish_reason == x["stop"]
    # The two sub-agents share their file's ids (the same system prompt: the same blocks).
    a, b = (by[f"trace_0004/{s['agent_id']}"][0] for s in subs[:2])
    assert a.hash_ids[:10] == b.hash_ids[:10]
    assert [r.timestamp_ms for r in tr] == sorted(r.timestamp_ms for r in tr)


@needs_raw
def test_files_never_share_a_block_and_groups_change_the_block_size() -> None:
    tr = load_kv_cache_tester(RAW)
    per: dict[str, set[int]] = {}
    for r in tr:
        per.setdefault(r.session.split("/")[0], set()).update(r.hash_ids)  # type: ignore[union-attr]
    stems = list(per)
    for i, s in enumerate(stems):
        for t in stems[i + 1:]:
            assert not per[s] & per[t]
    fine = load_kv_cache_tester(RAW, SessionDraw(group=1))
    assert fine[0].input_length == 64 * len(fine[0].hash_ids)
    assert sum(len(r.hash_ids) for r in fine) > 7 * sum(len(r.hash_ids) for r in tr)
    flat = load_kv_cache_tester(RAW, SessionDraw(subagents=False))
    assert all("/" not in (r.session or "") for r in flat) and len(flat) < len(tr)


@needs_raw
def test_seeded_offsets_spans_draws_and_copies() -> None:
    d = SessionDraw(offset_s=7200.0, seed=4, span_s=4 * 3600.0)
    a, b = load_kv_cache_tester(RAW, d), load_kv_cache_tester(RAW, d)
    assert [(r.timestamp_ms, r.hash_ids) for r in a] == [(r.timestamp_ms, r.hash_ids) for r in b]
    c = load_kv_cache_tester(RAW, SessionDraw(offset_s=7200.0, seed=5, span_s=4 * 3600.0))
    assert [r.timestamp_ms for r in a] != [r.timestamp_ms for r in c]
    firsts: dict[str, float] = {}
    for r in a:
        firsts.setdefault(r.session, r.timestamp_ms)  # type: ignore[arg-type]
    assert all(0 <= t < 7200e3 for s, t in firsts.items() if "/" not in s)
    assert max(r.timestamp_ms for r in a) <= (7200 + 4 * 3600) * 1000
    assert len(a) < len(load_kv_cache_tester(RAW, SessionDraw(offset_s=7200.0, seed=4)))
    two = load_kv_cache_tester(RAW, SessionDraw(max_sessions=2, seed=1))
    assert len({r.session.split("/")[0] for r in two}) == 2  # type: ignore[union-attr]
    x3 = load_kv_cache_tester(RAW, SessionDraw(copies=3, sessions=("trace_0028",)))
    assert {r.session for r in x3} == {"trace_0028#0", "trace_0028#1", "trace_0028#2"}
    ids = [{h for r in x3 if r.session == s for h in r.hash_ids} for s in sorted({r.session for r in x3})]
    assert not ids[0] & ids[1] and len(ids[0]) == len(ids[1])


@needs_raw
def test_cli_replays_the_raw_folder(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["replay", str(AGENTIC), "--format", "kv-cache-tester",
                                    "--capacity", "200K", "--policy", "lru,sae", "--seed", "2",
                                    "--session-offset-s", "600", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["block_tokens"] == 512 and len(d["results"]) == 2
    res = CliRunner().invoke(main, ["replay", str(RAW), "--group", "1", "--capacity", "200K",
                                    "--policy", "lru", "--no-misses", "--sessions", "trace_0028"])
    assert res.exit_code == 0 and "64-token blocks" in res.output, res.output
    res = CliRunner().invoke(main, ["replay", str(RAW), "--group", "2", "--block-tokens", "512"])
    assert res.exit_code == 2 and "--group 2 makes 128-token blocks" in res.output
    res = CliRunner().invoke(main, ["replay", "builtin", "--seed", "3"])
    assert res.exit_code == 2 and "only with --format kv-cache-tester" in res.output
    res = CliRunner().invoke(main, ["replay", str(RAW), "--sessions", "trace_9999"])
    assert res.exit_code == 1 and "no session file trace_9999" in res.output


def _file(tmp_path: Path, doc: object | str) -> Path:
    p = tmp_path / "trace_0001.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


REQ = {"t": 0.0, "type": "n", "in": 1024, "out": 5, "hash_ids": list(range(16)), "stop": "end_turn"}


@pytest.mark.parametrize("doc,needle", [
    ("{not json", "not valid JSON"),
    ([], "a session file is a JSON object"),
    ({"block_size": 16, "requests": []}, "block_size must be 64"),
    ({"hash_id_scope": "global", "requests": []}, "hash_id_scope must be"),
    ({"requests": {}}, "requests must be a list"),
    ({"requests": [5]}, "requests[0]: a request is a JSON object"),
    ({"requests": [{**REQ, "type": "x"}]}, "requests[0]: type must be"),
    ({"requests": [{**REQ, "t": -1}]}, "requests[0]: t must be a finite number >= 0"),
    ({"requests": [{**REQ, "t": "0"}]}, "requests[0]: t must be a number"),
    ({"requests": [{**REQ, "hash_ids": [1, "2"]}]}, "requests[0]: hash_ids[1] must be an integer"),
    ({"requests": [{**REQ, "hash_ids": 3}]}, "hash_ids must be a list"),
    ({"requests": [{**REQ, "in": 100}]}, "16 blocks of 64 tokens are more than its 100"),
    ({"requests": [{**REQ, "out": 1.5}]}, "out must be an integer"),
    ({"requests": [{**REQ, "stop": 3}]}, "stop must be a non-empty string"),
    ({"requests": [{"t": 1, "type": "subagent", "agent_id": "a",
                    "requests": [{**REQ, "in": True}]}]}, "requests[0]: requests[0]: in must be"),
])
def test_a_malformed_session_file_is_one_error_naming_it(tmp_path: Path, doc: object,
                                                         needle: str) -> None:
    p = _file(tmp_path, doc)  # type: ignore[arg-type]
    with pytest.raises(TraceError) as e:
        load_kv_cache_tester(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_bounds_on_nesting_size_and_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nest: dict = {"t": 0, "type": "subagent", "agent_id": "a", "requests": [REQ]}
    for _ in range(5):
        nest = {"t": 0, "type": "subagent", "agent_id": "a", "requests": [nest]}
    p = _file(tmp_path, {"requests": [nest]})
    with pytest.raises(TraceError, match="nested more than 4 deep"):
        load_kv_cache_tester(p)
    import kvheat.replay.traces as traces

    monkeypatch.setattr(traces, "MAX_SESSION_FILE_BYTES", 10)
    with pytest.raises(TraceError, match="more than a session file may hold"):
        load_kv_cache_tester(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no trace_"):
        session_files(tmp_path / "empty")
    with pytest.raises(TraceError, match="no such file"):
        load_kv_cache_tester(tmp_path / "nothing")
    for bad in ({"group": 0}, {"offset_s": -1.0}, {"copies": 0}, {"group": "8"},
                {"sessions": ["a"]}):
        with pytest.raises(TraceError):
            SessionDraw(**bad)  # type: ignore[arg-type]


def test_a_small_session_file_replays_with_sessions_and_finish_reasons(tmp_path: Path) -> None:
    doc = {"requests": [
        {**REQ, "t": 0.0, "stop": "tool_use"},
        {**REQ, "t": 2.0, "in": 2048, "hash_ids": list(range(32)), "stop": ""},
        {"t": 1.0, "type": "subagent", "agent_id": "x", "requests": [
            {**REQ, "t": 0.5, "hash_ids": list(range(100, 116))}]},
        {**REQ, "t": 3.0, "in": 200, "hash_ids": [0, 1, 2]},  # no full group: left out
    ]}
    tr = load_kv_cache_tester(_file(tmp_path, doc))
    assert [(r.timestamp_ms, r.session, r.finish_reason, len(r.hash_ids)) for r in tr] == [
        (0.0, "trace_0001", "tool_use", 2), (1500.0, "trace_0001/x", "end_turn", 2),
        (2000.0, "trace_0001", None, 4)]
    r = replay(tr, "lru", 10 * 512, 512)
    assert r.hit_tokens == 1024  # the third request extends the first
