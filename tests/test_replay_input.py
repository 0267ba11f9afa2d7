"""`kvheat replay` on bad input: every bad trace line or option is one clear error line
(file, line and field, or the option) and a non-zero exit, never a traceback, never a
silent table; valid input replays as before. All through the real CLI on real files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvheat.cache import policy_names
from kvheat.cli import main
from kvheat.replay import PreparedTrace, WorkloadConfig, generate_workload, replay, save_trace
from kvheat.replay import replayer as replayer_mod

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}


def line(**kw: object) -> str:
    return json.dumps({**GOOD, **kw})


def without(key: str) -> str:
    return json.dumps({k: v for k, v in GOOD.items() if k != key})


def trace_file(tmp_path: Path, *lines: str, name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(x + "\n" for x in lines))
    return p


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["replay", *args])


def refused(res: Result, *needles: str) -> str:
    """The one error line of a refused run; it must contain every needle."""
    assert res.exit_code != 0, res.output
    # A click error exits through SystemExit; anything else is a crash (a traceback).
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output and "┏" not in res.output, res.output
    errors = [x for x in res.output.splitlines() if x.startswith("Error")]
    assert len(errors) == 1, res.output
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


# ---- trace lines -----------------------------------------------------------------------------

BAD_LINES = {
    # block ids: tracebacks before (OverflowError)
    "negative block id": (line(hash_ids=[-1, 2]), "hash_ids[0]"),
    "block id 2**64": (line(hash_ids=[2**64, 2]), "hash_ids[0]"),
    # silently truncated or split before
    "float block id": (line(hash_ids=[1.7, 2]), "hash_ids[0]"),
    "hash_ids a string": (line(hash_ids="12"), "hash_ids"),
    "bool block id": (line(hash_ids=[True, 2]), "hash_ids[0]"),
    "string block id": (line(hash_ids=["1", 2]), "hash_ids[0]"),
    "hash_ids null": (line(hash_ids=None), "hash_ids"),
    "hash_ids empty": (line(hash_ids=[]), "hash_ids"),
    "no hash_ids": (without("hash_ids"), "hash_ids"),
    # lengths
    "bool input_length": (line(input_length=True, hash_ids=[1]), "input_length"),
    "float input_length": (line(input_length=600.0), "input_length"),
    "string input_length": (line(input_length="600"), "input_length"),
    "zero input_length": (line(input_length=0, hash_ids=[1]), "input_length"),
    "no input_length": (without("input_length"), "input_length"),
    "input_length beyond its blocks": (line(input_length=9999), "input tokens"),
    "negative output_length": (line(output_length=-5), "output_length"),
    "float output_length": (line(output_length=1.5), "output_length"),
    "string output_length": (line(output_length="1"), "output_length"),
    "output_length 2**63": (line(output_length=2**63), "output_length"),
    # timestamps: NaN / Infinity read silently before
    "NaN timestamp": (line(timestamp=0).replace('"timestamp": 0', '"timestamp": NaN'), "NaN"),
    "Infinity timestamp": (line(timestamp=0).replace('"timestamp": 0', '"timestamp": Infinity'),
                           "Infinity"),
    "1e999 timestamp": (line(timestamp=0).replace('"timestamp": 0', '"timestamp": 1e999'),
                        "timestamp"),
    "huge int timestamp": (line(timestamp=10**400), "timestamp"),
    "negative timestamp": (line(timestamp=-1), "timestamp"),
    "string timestamp": (line(timestamp="0"), "timestamp"),
    "bool timestamp": (line(timestamp=True), "timestamp"),
    # names
    "int tenant": (line(tenant=5), "tenant"),
    "empty tenant": (line(tenant=""), "tenant"),
    "object tenant": (line(tenant={"a": 1}), "tenant"),
    "int session_id": (line(session_id=3), "session_id"),
    "list session_id": (line(session_id=["a"]), "session_id"),
    # the line itself
    "not an object": ("[1, 2]", "JSON object"),
    "a string": ('"x"', "JSON object"),
    "not JSON": ("{", "JSON"),
    "deeply nested": ('{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
    "an integer of 5000 digits": (line(output_length=0).replace('"output_length": 0',
                                                               '"output_length": ' + "9" * 5000),
                                  "JSON"),
}


@pytest.mark.parametrize("bad", list(BAD_LINES), ids=list(BAD_LINES))
def test_a_bad_trace_line_is_one_error_naming_file_line_and_field(tmp_path: Path, bad: str) -> None:
    text, field = BAD_LINES[bad]
    p = trace_file(tmp_path, line(), text)
    for fmt in ("auto", "mooncake"):
        refused(run(str(p), "--format", fmt, "--policy", "lru"), f"{p}:2:", field)


def test_bad_utf8_is_named(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(line().encode() + b"\n" + b'{"hash_ids": [1], "input_length": \xff1}\n')
    refused(run(str(p), "--format", "mooncake"), f"{p}:2:", "UTF-8")


def test_an_over_long_line_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    with p.open("w") as f:  # 40 MB on one line
        f.write('{"input_length": 1, "hash_ids": [')
        f.write("1, " * 13_500_000)
        f.write("1]}\n")
    t = time.perf_counter()
    refused(run(str(p), "--format", "mooncake"), f"{p}:1:", "longer than")
    assert time.perf_counter() - t < 20


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank lines"])
def test_an_empty_trace_is_an_error(tmp_path: Path, text: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    refused(run(str(p)), str(p), "no requests")
    refused(run(str(p), "--format", "mooncake"), str(p), "no requests")


def test_a_file_in_no_known_format_is_no_silent_table(tmp_path: Path) -> None:
    p = tmp_path / "t.bin"
    p.write_bytes(b"\xff\xfe\x00garbage\n")
    refused(run(str(p)), str(p), "no requests", "vllm-log", "--format")


# ---- vLLM KV events and request logs ---------------------------------------------------------

def _stored(hashes: str = "[1]", parent: str = "null", size: str = "16") -> str:
    return (f'{{"type": "BlockStored", "block_hashes": {hashes}, "parent_block_hash": {parent}, '
            f'"block_size": {size}, "medium": "GPU"}}')


def batch(ts: str = "0.0", **kw: str) -> str:
    return f"[{ts}, [{_stored(**kw)}]]"


OK_BATCH = batch()
BAD_BATCHES = {
    "NaN ts": (batch("NaN"), "NaN"),
    "bool ts": (batch("true"), "ts"),
    "huge ts": (batch("9" * 400), "ts"),
    "negative ts": (batch("-1"), "ts"),
    "events a string": ('[0.0, "abc"]', "events"),
    "not a batch": ('{"a": 1}', "KV event batch"),
    "block_size 0": (batch(size="0"), "block_size"),
    "float block_size": (batch(size="16.5"), "block_size"),
    "nested hash": (batch(hashes="[[[1]]]"), "block_hashes[0]"),
    "object hash": (batch(hashes='[{"a": 1}]'), "block_hashes[0]"),
    "float hash": (batch(hashes="[1.5]"), "block_hashes[0]"),
    "list parent": (batch(parent="[[1]]"), "parent_block_hash"),
    "hashes a string": (batch(hashes='"abc"'), "block_hashes"),
    "no block_size": ('[0.0, [{"type": "BlockStored", "block_hashes": [1]}]]', "block_size"),
    "deeply nested": ("[0.0, " + "[" * 100_000 + "]" * 100_000 + "]", "nested"),
}


@pytest.mark.parametrize("bad", list(BAD_BATCHES), ids=list(BAD_BATCHES))
def test_a_bad_kv_event_batch_is_named(tmp_path: Path, bad: str) -> None:
    text, field = BAD_BATCHES[bad]
    p = trace_file(tmp_path, OK_BATCH, text)
    refused(run(str(p), "--format", "vllm-events"), f"{p}:2:", field)


def test_kv_events_with_no_stored_block_are_an_error(tmp_path: Path) -> None:
    p = trace_file(tmp_path, "[0.0, []]", '[1.0, [{"type": "AllBlocksCleared"}]]')
    refused(run(str(p), "--format", "vllm-events"), str(p), "no requests")


def test_kv_events_block_tokens_not_a_multiple_names_the_option(tmp_path: Path) -> None:
    p = trace_file(tmp_path, batch(size="24"))
    refused(run(str(p), "--format", "vllm-events"), str(p), "--block-tokens", "24")


LOG_LINE = ("(APIServer pid=7) DEBUG {date} 10:00:01 [request_logger.py:55] Request cmpl-1 "
            "details: prompt: 'hi', prompt_token_ids: [{toks}], prompt_embeds shape: None.")


@pytest.mark.parametrize("date,toks,needle", [
    ("05-14", "1, 4294967296", "prompt_token_ids"),
    ("05-14", "1, " + "9" * 5000, "prompt_token_ids"),
    ("13-14", "1, 2", "timestamp"),
], ids=["token id 2**32", "token id of 5000 digits", "month 13"])
def test_a_bad_request_log_line_is_named(tmp_path: Path, date: str, toks: str, needle: str) -> None:
    ok = LOG_LINE.format(date="05-14", toks="1, 2")
    p = trace_file(tmp_path, ok, LOG_LINE.format(date=date, toks=toks), name="vllm.log")
    refused(run(str(p), "--format", "vllm-log", "--block-tokens", "16", "--capacity", "64"),
            f"{p}:2:", needle)


def test_a_hostile_log_line_is_read_in_linear_time(tmp_path: Path) -> None:
    # Before: one regex backtracked over this line for 10 s (200 KB; minutes at 1 MB),
    # then printed an empty table with exit 0.
    p = trace_file(tmp_path, "01-02 03:04:05 Request " * 40_000, name="vllm.log")
    t = time.perf_counter()
    refused(run(str(p), "--format", "vllm-log"), str(p), "no requests")
    assert time.perf_counter() - t < 5


# ---- options ---------------------------------------------------------------------------------

BAD_OPTIONS = {
    "capacity inf": (["--capacity", "inf"], "--capacity"),
    "capacity nan": (["--capacity", "nan"], "--capacity"),
    "capacity blank": (["--capacity", " "], "--capacity"),
    "capacity empty item": (["--capacity", "1M,"], "--capacity"),
    "capacity zero": (["--capacity", "0"], "--capacity"),
    "capacity negative": (["--capacity", "-1M"], "--capacity"),
    "capacity fractional": (["--capacity", "1.5"], "--capacity"),
    "capacity below a block": (["--capacity", "100"], "--capacity"),
    "capacity beyond any cache": (["--capacity", "1e16"], "--capacity"),
    "capacity not a number": (["--capacity", "x"], "--capacity"),
    "block-tokens 0": (["--block-tokens", "0"], "--block-tokens"),
    "block-tokens negative": (["--block-tokens", "-5"], "--block-tokens"),
    "limit 0": (["--limit", "0"], "--limit"),
    "limit negative": (["--limit", "-1"], "--limit"),
    "time-scale nan": (["--time-scale", "nan"], "--time-scale"),
    "time-scale inf": (["--time-scale", "inf"], "--time-scale"),
    "time-scale 0": (["--time-scale", "0"], "--time-scale"),
    "time-scale overflowing the timestamps": (["--time-scale", "1e308"], "--time-scale"),
    "policy empty": (["--policy", ""], "--policy"),
    "policy comma": (["--policy", ","], "--policy"),
    "policy twice": (["--policy", "lru,lru"], "--policy"),
    "policy unknown": (["--policy", "nope"], "unknown policy"),
    "router without replicas": (["--router", "rr"], "--router"),
    "shared-capacity without replicas": (["--shared-capacity", "1M"], "--shared-capacity"),
    "prefill-tps without replicas": (["--prefill-tps", "1000"], "--prefill-tps"),
    "overload-guard without replicas": (["--overload-guard"], "--overload-guard"),
    "hold with replicas": (["--replicas", "2", "--hold"], "--hold"),
    "replicas 0": (["--replicas", "0"], "--replicas"),
    "router comma": (["--replicas", "2", "--router", ","], "--router"),
    "router twice": (["--replicas", "2", "--router", "rr,rr"], "--router"),
    "router unknown": (["--replicas", "2", "--router", "x"], "unknown router"),
    "two policies with replicas": (["--replicas", "2", "--policy", "lru,arc"], "--policy"),
    "shared-capacity inf": (["--replicas", "2", "--shared-capacity", "inf"], "--shared-capacity"),
    "shared-capacity below a block": (["--replicas", "2", "--shared-capacity", "100"],
                                      "--shared-capacity"),
    "shared-capacity list": (["--replicas", "2", "--shared-capacity", "1M,2M"],
                             "--shared-capacity"),
    "prefill-tps nan": (["--replicas", "2", "--prefill-tps", "nan"], "--prefill-tps"),
    "decode-tps inf": (["--replicas", "2", "--decode-tps", "inf"], "--decode-tps"),
    "format not a format": (["--format", "csv"], "--format"),
}


@pytest.mark.parametrize("bad", list(BAD_OPTIONS), ids=list(BAD_OPTIONS))
def test_a_bad_option_is_one_error_naming_it(tmp_path: Path, bad: str) -> None:
    args, needle = BAD_OPTIONS[bad]
    p = trace_file(tmp_path, line(timestamp=5), line(timestamp=9, hash_ids=[1, 3]))
    refused(run(str(p), *args), needle)


def test_builtin_options_are_checked(tmp_path: Path) -> None:
    refused(run("builtin", "--block-tokens", "0"), "--block-tokens")
    refused(run("builtin", "--format", "mooncake"), "--format")


def test_an_unwritable_output_is_an_error_naming_it(tmp_path: Path) -> None:
    p = trace_file(tmp_path, line())
    blocker = tmp_path / "file"
    blocker.write_text("")
    for opt in ("--json", "--plot"):
        if opt == "--plot":
            pytest.importorskip("matplotlib")
        refused(run(str(p), "--policy", "lru", opt, str(blocker / "out")), opt)


def test_a_missing_trace_names_it(tmp_path: Path) -> None:
    refused(run(str(tmp_path / "nope.jsonl")), "nope.jsonl")


# ---- sizes: clamped to what the trace can fill, or refused -----------------------------------

@pytest.mark.timeout(60)
def test_a_huge_capacity_runs_at_the_trace_footprint(tmp_path: Path) -> None:
    # Before: 1e12 tokens preallocated 2 x 10^9 blocks (3 GB in 30 s, then on).
    p = tmp_path / "t.jsonl"
    save_trace(generate_workload(WorkloadConfig(num_conversations=40, seed=1)), p)
    out = tmp_path / "r.json"
    t = time.perf_counter()
    res = run(str(p), "--capacity", "1e12", "--policy", "lru,kvheat", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert time.perf_counter() - t < 30
    d = json.loads(out.read_text())
    for r in d["results"]:  # reported as asked; the hit rate of an unbounded cache
        assert r["capacity_tokens"] == 10**12 and r["num_blocks"] == 10**12 // 512
        assert r["evictions"] == 0 and r["hit_rate"] == pytest.approx(d["infinite"])
    res = run(str(p), "--capacity", "1e12", "--replicas", "3", "--router", "rr,kvheat",
              "--json", str(out))
    assert res.exit_code == 0, res.output
    assert {r["capacity_tokens"] for r in json.loads(out.read_text())["results"]} == {10**12}


def test_sizes_beyond_free_memory_are_refused(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replayer_mod, "available_memory", lambda: 64 << 10, raising=False)
    p = tmp_path / "t.jsonl"
    save_trace(generate_workload(WorkloadConfig(num_conversations=40, seed=1)), p)
    refused(run(str(p), "--replicas", "64", "--capacity", "1M"), "--replicas", "GiB")
    refused(run(str(p), "--capacity", "1G", "--hold", "--policy", "lru"), "--capacity", "GiB")


@pytest.mark.parametrize("hold", [False, True], ids=["one at a time", "hold"])
def test_clamping_a_capacity_to_the_footprint_changes_no_result(
        hold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = PreparedTrace(generate_workload(WorkloadConfig(num_conversations=60, tenants=2, seed=5)))
    caps = [pt.footprint_blocks(hold) * 512 // 2, 3 * pt.footprint_blocks(hold) * 512]

    def results() -> list[dict]:
        out = []
        for c in caps:
            for p in policy_names():
                d = replay(pt, p, c, hold=hold).as_dict()
                del d["seconds"]
                out.append(d)
        return out

    clamped = results()
    monkeypatch.setattr(replayer_mod, "pool_blocks", lambda t, c, hold=False: c // t.block_tokens)
    assert results() == clamped


def test_clamped_cluster_results_match_unclamped(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "t.jsonl"
    save_trace(generate_workload(WorkloadConfig(num_conversations=60, seed=4)), p)
    pt = PreparedTrace(generate_workload(WorkloadConfig(num_conversations=60, seed=4)))
    big = str(4 * pt.footprint_blocks() * 512)

    def cluster() -> list[dict]:
        out = tmp_path / "c.json"
        res = run(str(p), "--replicas", "2", "--capacity", f"200K,{big}", "--shared-capacity",
                  "100K", "--json", str(out))
        assert res.exit_code == 0, res.output
        rows = json.loads(out.read_text())["results"]
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    clamped = cluster()
    monkeypatch.setattr(replayer_mod, "pool_blocks", lambda t, c, hold=False: c // t.block_tokens)
    assert cluster() == clamped


# ---- valid input is read as before -----------------------------------------------------------

def test_valid_lines_with_every_field_replay(tmp_path: Path) -> None:
    p = trace_file(
        tmp_path,
        json.dumps({**GOOD, "timestamp": 0.5, "session_id": "s1", "tenant": "a", "stop": "x"}),
        json.dumps({**GOOD, "timestamp": 7, "session_id": None, "tenant": None}),
        json.dumps({"input_length": 512, "hash_ids": [1], "future_field": [1, {"a": None}]}),
        json.dumps({**GOOD, "hash_ids": [0, 2**64 - 1]}),
        "",
    )
    out = tmp_path / "r.json"
    res = run(str(p), "--capacity", "1M", "--policy", "lru", "--json", str(out))
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"][0]
    assert r["requests"] == 4 and r["total_tokens"] == 600 + 600 + 512 + 600


def test_token_counts_are_read_exactly() -> None:
    from kvheat.replay import parse_tokens

    assert parse_tokens("4.1M") == 4_100_000  # float arithmetic made this 4,099,999
    assert parse_tokens("2.5M") == 2_500_000 and parse_tokens("1e6") == 1_000_000
    assert parse_tokens(" 1 M ") == 1_000_000 and parse_tokens("1e15") == 10**15
    for bad in ("inf", "nan", "-inf", "1.5", "1e16", "", " ", "1T", "0x10", "1e999999999"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
