"""vLLM's KV events and request logs read as replay traces (`kvheat replay --format`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvheat.cli import main
from kvheat.replay import TraceError
from kvheat.replay.vllm_trace import detect_format, iter_vllm_log, load_kv_events


def _stored(hashes, parent, size=16, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [], "block_size": size, "lora_id": None, "medium": medium,
            "lora_name": None}


def _write(path: Path, batches) -> Path:
    path.write_text("".join(json.dumps(b) + "\n" for b in batches))
    return path


def test_kv_events_become_prefix_chains(tmp_path: Path) -> None:
    f = _write(tmp_path / "ev.jsonl", [
        [0.0, [_stored([1, 2, 3], None)], None],
        [0.5, [_stored([4], 3)], None],  # the next prefill step of the same request
        [10.0, [_stored([5, 6], 2)], None],  # a later request sharing blocks 1-2
        [11.0, [_stored([9], None, medium="CPU"), {"type": "BlockRemoved",
                                                     "block_hashes": [1], "medium": "GPU"}]],
        {"ts": 12.0, "events": [_stored([7], 4), {"type": "AllBlocksCleared"}]},
    ])
    assert detect_format(f) == "vllm-events"
    reqs = load_kv_events(f, block_tokens=32)
    assert [r.timestamp_ms for r in reqs] == [0.0, 10_000.0, 12_000.0]
    assert [r.input_length for r in reqs] == [64, 64, 80]
    a, b, c = (r.hash_ids for r in reqs)
    assert a[0] == b[0] and a[1] != b[1]  # blocks 1-2 shared, then 3-4 against 5-6
    assert c[:2] == a and len(c) == 3  # extends the first chain; last block partial


def test_kv_events_errors_name_the_line(tmp_path: Path) -> None:
    f = _write(tmp_path / "ev.jsonl", [[0.0, [_stored([1], None)]], [1.0, [_stored([2], 1, size=32)]]])
    with pytest.raises(TraceError, match=":2:"):
        load_kv_events(f)
    with pytest.raises(TraceError, match="multiple"):
        load_kv_events(_write(tmp_path / "ok.jsonl", [[0.0, [_stored([1], None)]]]), 24)


@pytest.mark.vllm
def test_real_vllm_event_batches_read_back(tmp_path: Path) -> None:
    msgspec = pytest.importorskip("msgspec")
    kv = pytest.importorskip("vllm.distributed.kv_events")
    batches = [kv.KVEventBatch(ts=t, events=[kv.BlockStored(
        block_hashes=hs, parent_block_hash=p, token_ids=list(range(16 * len(hs))), block_size=16,
        lora_id=None, medium="GPU", lora_name=None)])
        for t, hs, p in ((0.0, [b"a", b"b"], None), (5.0, [b"c"], b"b"))]
    f = tmp_path / "ev.jsonl"
    f.write_bytes(b"".join(msgspec.json.encode(b) + b"\n" for b in batches))
    reqs = load_kv_events(f)
    assert [r.hash_ids for r in reqs] == [[0, 1], [0, 1, 2]]


LOG = """\
(APIServer pid=7) INFO 05-14 10:00:00 [api_server.py:1] Started server process
(APIServer pid=7) DEBUG 05-14 10:00:01 [request_logger.py:55] Request cmpl-1 details: prompt: 'hi', prompt_token_ids: [{a}], prompt_embeds shape: None.
(APIServer pid=7) INFO 05-14 10:00:01 [request_logger.py:65] Received request cmpl-1: params: SamplingParams(n=1), lora_request: None.
(APIServer pid=7) DEBUG 05-14 10:00:31 [request_logger.py:55] Request cmpl-2 details: prompt: 'hi', prompt_token_ids: [{b}], prompt_embeds shape: None.
"""


def _log(tmp_path: Path) -> Path:
    a = ", ".join(str(t) for t in range(40))
    b = ", ".join(str(t) for t in [*range(32), 99, 98])
    f = tmp_path / "vllm.log"
    f.write_text(LOG.format(a=a, b=b))
    return f


def test_request_log_hashes_prompts_into_chained_blocks(tmp_path: Path) -> None:
    f = _log(tmp_path)
    assert detect_format(f) == "vllm-log"
    reqs = list(iter_vllm_log(f, block_tokens=16))
    assert [r.timestamp_ms for r in reqs] == [0.0, 30_000.0]
    assert [r.input_length for r in reqs] == [40, 34]
    a, b = (r.hash_ids for r in reqs)
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.vllm
def test_real_vllm_request_logger_lines_are_read(tmp_path: Path) -> None:
    rl = pytest.importorskip("vllm.entrypoints.serve.utils.request_logger")
    from vllm.logger import _DATE_FORMAT, _FORMAT  # vLLM's own log line layout

    f = tmp_path / "vllm.log"
    handler = logging.FileHandler(f)
    handler.setFormatter(logging.Formatter(
        _FORMAT.replace("%(vllm_process_name)s", "APIServer").replace("%(fileinfo)s", "%(filename)s"),
        _DATE_FORMAT))
    log = rl.logger
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        req_logger = rl.RequestLogger(max_log_len=None)
        for i, toks in enumerate(([1] * 20, [1] * 16 + [2] * 4)):
            req_logger.log_inputs(f"r{i}", None, toks, None, None, None)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
        handler.close()
    reqs = list(iter_vllm_log(f, block_tokens=16))
    assert [len(r.hash_ids) for r in reqs] == [2, 2]
    assert reqs[0].hash_ids[0] == reqs[1].hash_ids[0] != reqs[0].hash_ids[1]


def test_cli_replays_vllm_traffic(tmp_path: Path) -> None:
    f = _log(tmp_path)
    res = CliRunner().invoke(main, ["replay", str(f), "--block-tokens", "16", "--capacity", "64",
                                    "--policy", "lru,kvheat", "--no-misses", "--json",
                                    str(tmp_path / "out.json")])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "out.json").read_text())
    hits = {r["policy"]: r["hit_tokens"] for r in out["results"]}
    assert hits == {"lru": 32, "kvheat": 32}  # the second prompt reuses two 16-token blocks
