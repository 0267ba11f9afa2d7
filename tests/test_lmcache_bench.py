"""bench/vllm/lmcache.py's pure parts, with no vLLM and no LMCache: the workload gives every
row the same prompts, the order is round-robin, the rows rotate, the connectors get the
same budget in bytes, and a differing greedy answer is reported."""

from __future__ import annotations

import pytest

from bench._lib.load import Reply
from bench.vllm.lmcache import (
    BLOCK,
    BLOCK_BYTES,
    CONVERSATIONS,
    POOL_BLOCKS,
    SYSTEM_TOKENS,
    TURN_TOKENS,
    TURNS,
    Run,
    chats,
    figures,
    lmcache_command,
    lmcache_l1_gb,
    messages,
    mismatches,
    repeats_table,
    rotation,
    schedule,
    summarize,
    transfer_config,
    working_set_blocks,
)
from kvheat.engine.loader import Tokenizer, tiny_config


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.tiny(tiny_config("llama").vocab_size)


def test_same_seed_same_prompts_and_new_text_per_repeat(tok: Tokenizer) -> None:
    a, b, other = chats(tok, 0), chats(tok, 0), chats(tok, 1)
    assert a == b
    assert len(a) == CONVERSATIONS and all(len(c.turns) == TURNS for c in a)
    assert len({c.system for c in a}) == CONVERSATIONS  # a system prompt of its own each
    assert not {c.system for c in a} & {c.system for c in other}
    for c in a:
        assert len(tok.encode(c.system, add_special_tokens=False)) >= SYSTEM_TOKENS
        for user, answer in c.turns:
            assert len(tok.encode(user, add_special_tokens=False)) >= TURN_TOKENS
            assert answer  # a fixed answer in the history, whatever the model says


def test_round_robin_order_and_histories(tok: Tokenizer) -> None:
    order = schedule(3, 2)
    assert order == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    c = chats(tok, 0, n=1, turns=3)[0]
    m2 = messages(c, 2)
    assert [x["role"] for x in m2] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m2[:4] == messages(c, 1)[:4]  # each turn's prompt extends the last one
    assert m2[2]["content"] == c.turns[0][1] and m2[-1]["content"] == c.turns[2][0]


def test_working_set_overflows_the_pool_and_fits_the_largest_budget(tok: Tokenizer) -> None:
    ws = working_set_blocks(tok, chats(tok, 0))
    assert ws > 4 * POOL_BLOCKS
    assert ws * BLOCK_BYTES < 256 << 20
    assert BLOCK_BYTES == 128 * 1024  # the tiny Llama: 16 MiB is 128 blocks


def test_rotation() -> None:
    rows = ["vllm", "lmcache", "kvheat"]
    assert [rotation(rows, r) for r in range(4)] == [
        ["vllm", "lmcache", "kvheat"], ["lmcache", "kvheat", "vllm"],
        ["kvheat", "vllm", "lmcache"], ["vllm", "lmcache", "kvheat"]]
    assert rotation([], 2) == []


def test_both_connectors_get_the_same_bytes() -> None:
    for mib in (8, 16, 256):
        kv = transfer_config("kvheat", mib, None)
        assert kv is not None and kv["kv_connector_extra_config"]["host_tier_size"] == mib << 20
        assert lmcache_l1_gb(mib) * 2**30 == mib << 20
        cmd = lmcache_command("py", 1, 2, 3, mib)
        assert float(cmd[cmd.index("--l1-size-gb") + 1]) * 2**30 == mib << 20
        assert cmd[cmd.index("--chunk-size") + 1] == str(BLOCK)
    lm = transfer_config("lmcache", 16, 5555)
    assert lm is not None and lm["kv_connector"] == "LMCacheMPConnector"
    assert lm["kv_connector_extra_config"]["lmcache.mp.port"] == 5555
    assert transfer_config("vllm", 16, None) is None
    with pytest.raises(ValueError):
        transfer_config("other", 16, None)


def _run(row: str, budget: int, texts: list[str], cached: int = 0) -> Run:
    replies = {}
    for t, text in enumerate(texts):
        r = Reply(0.0, ttft=0.01, e2e=0.01 + 0.002 * 7, text=text, prompt_tokens=100,
                  cached_tokens=cached, completion_tokens=8)
        replies[(0, t)] = r
    return Run(row, budget, 0, 1.0, 0.5, replies)


def test_mismatch_reported_and_figures() -> None:
    runs = [_run("vllm", 16, ["a", "b"]), _run("kvheat", 16, ["a", "b"], 50),
            _run("lmcache", 256, ["a", "x"], 25)]
    bad = mismatches(runs)
    assert len(bad) == 1 and bad[0]["row"] == "lmcache" and bad[0]["turn"] == 1
    assert bad[0]["reference_row"] == "vllm"
    f = figures(runs[1])
    assert f["served"] == 0.5 and f["errors"] == 0
    assert f["tpot_mean_s"] == pytest.approx(0.002)
    s = summarize([figures(r) for r in runs])
    assert [(c["budget_mib"], c["row"]) for c in s] == [(16, "vllm"), (16, "kvheat"),
                                                       (256, "lmcache")]
    table = repeats_table({"runs": [figures(r) for r in runs]})
    assert "| 16 MiB | KVHeatConnector (host) | 50.0% |" in table
