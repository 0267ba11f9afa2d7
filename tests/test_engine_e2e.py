"""LLMEngine end to end with real forward passes of the built-in tiny models: a prefix hit,
batching, preemption (recompute, host tier) and streaming never change the tokens."""

from __future__ import annotations

import random

import pytest

from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.engine.loader import load_model
from kvheat.tiers import TierSpec

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine(model_tok: tuple, num_blocks: int = 64, **sched) -> LLMEngine:
    model, tok, _ = model_tok
    host = sched.pop("host_blocks", 0)
    cfg = EngineConfig(num_blocks=num_blocks, block_size=16,
                       scheduler=SchedulerConfig(**sched), tiers=TierSpec(host_blocks=host))
    return LLMEngine(model, tok, cfg)


def prompts(seed: int, n: int, lo: int = 5, hi: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_checked(e: LLMEngine) -> None:
    while e.has_unfinished:
        e.step()
        e.check_accounting()


def test_cold_and_warm_give_identical_tokens(llama: tuple) -> None:
    e = engine(llama)
    p = prompts(0, 1, 70, 70)[0]
    cold = e.generate([p], GREEDY)[0]
    warm = e.generate([p], GREEDY)[0]
    assert cold.metrics.num_cached_tokens == 0 and warm.metrics.num_cached_tokens == 64
    assert warm.output_token_ids == cold.output_token_ids
    # A longer prompt sharing the prefix: same tokens as an engine with no prefix cache.
    longer = p + [7, 8, 9]
    hit = e.generate([longer], GREEDY)[0]
    ref = engine(llama, prefix_caching="off").generate([longer], GREEDY)[0]
    assert hit.metrics.num_cached_tokens == 64 and ref.metrics.num_cached_tokens == 0
    assert hit.output_token_ids == ref.output_token_ids


def test_batched_equals_one_at_a_time_and_blocks_balance(llama: tuple) -> None:
    ps = prompts(1, 5)
    e = engine(llama, max_num_batched_tokens=64)
    ids = [e.add_request(p, GREEDY) for p in ps]
    run_checked(e)
    batched = [e.release(i).output_token_ids for i in ids]
    solo = engine(llama, prefix_caching="off")
    for p, out in zip(ps, batched, strict=True):
        assert solo.generate([p], GREEDY)[0].output_token_ids == out
    assert e.cache.num_referenced == 0


def test_next_turn_reuses_the_generated_tokens(llama: tuple) -> None:
    e = engine(llama)
    p = prompts(2, 1, 40, 40)[0]
    t1 = e.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    history = t1.prompt_token_ids + t1.output_token_ids  # 70 tokens, 69 with KV
    t2 = e.generate([history + [11, 12, 13]], GREEDY)[0]
    assert t2.metrics.num_cached_tokens == 64  # includes blocks filled while decoding
    ref = engine(llama, prefix_caching="off").generate([history + [11, 12, 13]], GREEDY)[0]
    assert t2.output_token_ids == ref.output_token_ids


@pytest.mark.parametrize("mode", ["recompute", "host"])
def test_preemption_restores_the_same_tokens(llama: tuple, mode: str) -> None:
    """Preempted sequences resume with the same tokens: recomputed, or (with a host tier)
    their evicted full blocks loaded back from it."""
    ps = prompts(3, 6, 20, 40)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = engine(llama, num_blocks=64).generate(ps, params)
    # 14 blocks cannot hold six sequences of up to 64 tokens: some are preempted.
    e = engine(llama, num_blocks=14, max_num_seqs=6, host_blocks=64 if mode == "host" else 0)
    ids = [e.add_request(p, params) for p in ps]
    run_checked(e)
    tight = [e.release(i) for i in ids]
    assert e.stats.preemptions > 0
    if mode == "host":
        assert e.tiers is not None and e.tiers.counters.loaded_blocks > 0
    for a, b in zip(roomy, tight, strict=True):
        assert a.output_token_ids == b.output_token_ids
    assert e.cache.num_referenced == 0


def test_streaming_and_abort(llama: tuple) -> None:
    e = engine(llama)
    p1, p2 = prompts(4, 2, 30, 30)
    r1 = e.add_request(p1, GREEDY)
    r2 = e.add_request(p2, SamplingParams(max_tokens=40, ignore_eos=True))
    streamed = list(e.stream(r1))
    assert [t.index for t in streamed] == list(range(12))
    assert streamed[-1].finished and streamed[-1].finish_reason == "length"
    assert not any(t.finished for t in streamed[:-1])
    out1 = e.release(r1)
    assert [t.token_id for t in streamed] == out1.output_token_ids
    assert out1.metrics.ttft is not None and out1.metrics.ttft > 0
    assert len(out1.metrics.inter_token_latencies) == 11
    # r2 ran alongside; abort it midway: its blocks go back at once.
    assert e.scheduler.running and e.cache.num_referenced > 0
    e.abort(r2)
    e.check_accounting()
    assert e.cache.num_referenced == 0 and not e.has_unfinished
    assert e.release(r2).finish_reason == "abort"


def test_sampling_is_seeded_and_bad_input_is_refused(llama: tuple) -> None:
    p = prompts(5, 1)[0]
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7,
                        ignore_eos=True)
    a = engine(llama).generate([p], sp)[0].output_token_ids
    b = engine(llama).generate([p], sp)[0].output_token_ids
    assert a == b
    greedy = engine(llama).generate([p], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    top1 = engine(llama).generate([p], SamplingParams(max_tokens=10, temperature=1.0, top_k=1,
                                                       seed=1, ignore_eos=True))[0]
    assert top1.output_token_ids == greedy.output_token_ids
    e = engine(llama)
    with pytest.raises(ValueError, match="vocabulary"):
        e.add_request([1, 2, 5000])
    with pytest.raises(ValueError, match="context length of"):
        e.add_request([1, 2], SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert not e.has_unfinished and not e.requests


def test_logit_bias_is_a_sampling_parameter(llama: tuple) -> None:
    p = prompts(6, 1)[0]
    e = engine(llama)
    plain = e.generate([p], GREEDY)[0].output_token_ids
    forced = e.generate([p], SamplingParams(max_tokens=12, ignore_eos=True,
                                            logit_bias={13: 100.0}))[0].output_token_ids
    assert forced == [13] * 12
    # Only the request that asks is biased, greedy or sampled, in one batch.
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True,
                             logit_bias={13: 100.0})
    both = e.generate([p, p], [GREEDY, sampled])
    assert both[0].output_token_ids == plain and both[1].output_token_ids == [13] * 12
    with pytest.raises(ValueError, match="logit_bias token id 5000 is outside the vocabulary"):
        e.add_request(p, SamplingParams(logit_bias={5000: 1.0}))
    assert not e.has_unfinished and not e.requests


def test_deepseek_mla_prefix_hit_keeps_tokens() -> None:
    pytest.importorskip("kvheat.engine.deepseek")
    ds = load_model(None, "deepseek")
    e = engine(ds)
    p = prompts(6, 1, 50, 50)[0]
    cold = e.generate([p], GREEDY)[0]
    warm = e.generate([p], GREEDY)[0]
    assert warm.metrics.num_cached_tokens == 48
    assert warm.output_token_ids == cold.output_token_ids


def test_workload_prompts_share_exactly_the_trace_prefixes() -> None:
    from bench._lib.workload import add_resubmissions, materialize, scale_trace
    from kvheat.replay.traces import TraceRequest

    trace = [TraceRequest(0, 40, 5, [1, 2, 3]), TraceRequest(1, 33, 5, [1, 2, 4]),
             TraceRequest(2, 10, 5, [7])]
    reqs = materialize(trace, 16, 1024)
    a, b, c = (r.prompt for r in reqs)
    assert len(a) == 40 and len(b) == 33 and len(c) == 10
    assert a[:32] == b[:32] and a[32] != b[32]  # blocks 3 and 4 differ
    assert min(min(p) for p in (a, b, c)) >= 2 and max(max(p) for p in (a, b, c)) < 1024
    with pytest.raises(ValueError):
        materialize([TraceRequest(0, 50, 1, [1, 2])], 16, 1024)
    scaled = scale_trace([TraceRequest(0, 1500, 400, [1, 2, 3]), TraceRequest(0, 40000, 10, list(range(9, 88)))],
                         512, 16, max_input=1000, max_output=8)
    assert [(r.input_length, r.output_length) for r in scaled] == [(47, 8)]
    again = add_resubmissions(trace, 1.0, seed=0, max_gap=1)
    assert len(again) == 6 and sorted(map(tuple, (r.hash_ids for r in again))) == \
        sorted(map(tuple, (r.hash_ids for r in trace + trace)))


def test_bench_command_prints_the_table_and_writes_json(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from bench.engine.table import bench_command

    out = tmp_path / "bench.json"
    res = CliRunner().invoke(bench_command, [
        "--conversations", "3", "--num-blocks", "96", "--strategies", "none,whole,lru",
        "--max-batched-tokens", "512", "--json", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "Belady" in res.output and (tmp_path / "bench.png").stat().st_size > 0
    rep = json.loads(out.read_text())
    rows = {r["prefix_caching"]: r for r in rep["results"]}
    n = rep["workload"]["requests"]
    assert all(r["requests"] == n for r in rows.values())
    assert rows["off"]["hit_rate"] == 0 and rows["off"]["kv_memory_saved"] == 0
    assert rows["block"]["hit_rate"] > 0.2
    assert rows["block"]["hit_rate"] >= rows["exact"]["hit_rate"]
    assert rows["block"]["prefill_tokens"] < rows["off"]["prefill_tokens"]
    assert rep["bound"]["belady"] >= rep["bound"]["lru_one_at_a_time"]
    bad = CliRunner().invoke(bench_command, ["--strategies", "nope"])
    assert bad.exit_code != 0 and "unknown strategy" in bad.output


def test_host_tier_serves_blocks_the_device_evicted(llama: tuple) -> None:
    model, tok, _ = llama
    rng = random.Random(8)
    ps = [[rng.randrange(2, 1000) for _ in range(64 + 7 * (i % 2))] for i in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    for host in (0, 64):  # 12 device blocks cannot keep six 4-5 block prompts
        # LRU: which blocks the device evicts is the premise here, not the policy under test.
        e = LLMEngine(model, tok, EngineConfig(num_blocks=12, policy="lru",
                                               tiers=TierSpec(host_blocks=host)))
        first = e.generate(ps, sp)
        ids = [e.add_request(p, sp) for p in ps[:2]]
        run_checked(e)
        again = [e.release(i) for i in ids]
        assert [a.output_token_ids for a in again] == [f.output_token_ids for f in first[:2]]
        outs[host] = [a.metrics.num_cached_tokens for a in again]
    assert outs[0] == [0, 0]  # evicted from the device: recomputed
    # From the host tier: the whole 64-token prompt but its last token (run again for its
    # logits), and the four full blocks of the 71-token one.
    assert outs[64] == [63, 64]


def test_failed_forward_aborts_only_its_step(llama: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    p1, p2 = prompts(9, 2, 70, 70)[0], prompts(10, 1, 40, 40)[0]
    e = engine(llama, max_num_batched_tokens=64)
    r1 = e.add_request(p1, GREEDY)
    e.step()  # p1's first 64 tokens: 4 full blocks with their KV
    r2 = e.add_request(p2, GREEDY)
    real_forward = e.runner.forward
    calls = []

    def fail_once(batch):  # a forward pass that dies (out of memory, a kernel error)
        calls.append([len(it.token_ids) for it in batch])
        if len(calls) == 1:
            raise RuntimeError("simulated device failure")
        return real_forward(batch)

    monkeypatch.setattr(e.runner, "forward", fail_once)
    with pytest.raises(RuntimeError, match="simulated"):
        e.step()  # p1's last 6 tokens and p2's 40, which registered 2 full blocks
    assert sorted(calls[0]) == [6, 40]
    e.check_accounting()
    assert e.cache.num_referenced == 0 and not e.has_unfinished
    assert e.release(r1).finish_reason == "error" and e.release(r2).finish_reason == "error"
    assert e.cache.num_cached == 4 and e.stats.failed_steps == 1
    # The engine goes on; p2's unwritten blocks are not served, p1's written ones are.
    again = e.generate([p1, p2], GREEDY)
    assert [o.metrics.num_cached_tokens for o in again] == [64, 0]
    ref = engine(llama, prefix_caching="off").generate([p1, p2], GREEDY)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in ref]


def test_extreme_sampling_parameters_still_sample() -> None:
    """top_p below float32's smallest value and a vanishing temperature must not make the
    sampler drop every token (found by fuzzing the server)."""
    from kvheat.engine import LLMEngine, SamplingParams

    eng = LLMEngine.from_pretrained(None, "llama")
    outs = eng.generate([[1, 2, 3, 4, 5]] * 2, [SamplingParams(max_tokens=3, temperature=1.0, top_p=1e-300, seed=1, ignore_eos=True),
                                                SamplingParams(max_tokens=3, temperature=1e-300, seed=2, ignore_eos=True)])
    greedy = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [3, 3]
    assert outs[0].output_token_ids == outs[1].output_token_ids == greedy[0].output_token_ids  # both reduce to argmax


def test_request_that_can_never_get_its_blocks_ends_with_error(llama: tuple) -> None:
    """A tenant whose quota is below its prompt, in a pool full of another tenant's cached
    blocks, cannot evict them: its request ends with "error" and the engine keeps serving."""
    e = engine(llama, num_blocks=8)
    for p in prompts(5, 4, lo=32, hi=32):  # tenant a caches 2 full blocks per prompt
        e.generate([p], SamplingParams(max_tokens=1), tenant="a")
    assert e.cache.tenant_usage("a") == 8 and e.cache.num_free == 0
    e.cache.set_tenant_quota("b", 1)
    rid = e.add_request(prompts(6, 1, lo=40, hi=40)[0], SamplingParams(max_tokens=2), tenant="b")
    e.run()
    assert e.release(rid).finish_reason == "error"
    assert e.stats.unschedulable == 1
    assert e.pop_ended() == [rid] and e.pop_ended() == []  # the server answers these
    again = e.generate([prompts(7, 1, lo=10, hi=10)[0]], SamplingParams(max_tokens=2), tenant="a")
    assert again[0].finish_reason == "length"
    e.scheduler.check_accounting()


def test_a_repeat_that_fills_the_whole_pool_still_runs(llama: tuple) -> None:
    """Issue 12.2: a block-aligned prompt that is fully cached reruns its last block as a
    private copy, and the blocks it decodes hang off the cached original, which then
    cannot be evicted. With prompt + max_tokens filling the whole pool, the repeat ran out
    of blocks, preempted itself, and was ended as unschedulable within the same step."""
    e = engine(llama, num_blocks=32)
    prompt = prompts(8, 1, lo=480, hi=480)[0]  # 30 blocks; + 32 tokens = the whole pool
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    first = e.generate([prompt], sp)[0]
    again = e.generate([prompt], sp)[0]
    assert first.finish_reason == again.finish_reason == "length"
    assert again.metrics.num_cached_tokens == 464
    assert again.output_token_ids == first.output_token_ids
    assert e.stats.unschedulable == 0 and e.pop_ended() == []
    e.scheduler.check_accounting()


def test_disk_tier_survives_a_restart_and_never_serves_other_weights(llama: tuple,
                                                                     tmp_path) -> None:
    model, tok, _ = llama
    rng = random.Random(9)
    ps = [[rng.randrange(2, 1000) for _ in range(64 + 7 * (i % 2))] for i in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)

    def cfg() -> EngineConfig:  # 12 device blocks cannot keep six 4-5 block prompts
        return EngineConfig(num_blocks=12, policy="lru",
                            tiers=TierSpec(disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 24))

    e1 = LLMEngine(model, tok, cfg())
    first = e1.generate(ps, sp)
    assert (e1.prefill_tokens_per_s() or 0) > 0
    e1.close()  # writes the pending demotions
    # A new engine on the same folder (a restarted process) loads the first two prompts'
    # blocks from disk: the same tokens, without recomputing them.
    e2 = LLMEngine(model, tok, cfg())
    ids = [e2.add_request(p, sp) for p in ps[:2]]
    run_checked(e2)
    again = [e2.release(i) for i in ids]
    assert [a.output_token_ids for a in again] == [f.output_token_ids for f in first[:2]]
    assert [a.metrics.num_cached_tokens for a in again] == [63, 64]
    disk = e2.tiers.stores[0]
    assert disk.name == "disk" and disk.stats.hits >= 8
    e2.close()
    # Other weights on the same folder: the same prompts give the same block keys, but
    # their KV is never read (another model's files are not even listed).
    other, tok2, _ = load_model(None, "llama", seed=1)
    e3 = LLMEngine(other, tok2, cfg())
    assert e3.tiers.stores[0].used_bytes() == 0
    got = e3.generate(ps[:2], sp)
    assert [g.metrics.num_cached_tokens for g in got] == [0, 0]
    fresh = LLMEngine(other, tok2, EngineConfig(num_blocks=12)).generate(ps[:2], sp)
    assert [g.output_token_ids for g in got] == [f.output_token_ids for f in fresh]
    e3.close()


def test_engine_tier_config_is_checked(llama: tuple, tmp_path) -> None:
    with pytest.raises(ValueError, match="disk tier needs both"):
        EngineConfig(tiers=TierSpec(disk_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="Redis tier needs both"):
        EngineConfig(tiers=TierSpec(redis_bytes=1 << 20))
    with pytest.raises(ValueError, match="tier_mode"):
        EngineConfig(tiers=TierSpec(mode="inclusive"))


def test_redis_tier_under_host_tier_and_redis_dying(llama: tuple, redis_server) -> None:
    model, tok, _ = llama
    rng = random.Random(10)
    ps = [[rng.randrange(2, 1000) for _ in range(64)] for _ in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    # 12 device blocks, 4 host blocks: most evicted blocks go on down to Redis.
    e = LLMEngine(model, tok, EngineConfig(num_blocks=12, policy="lru", tiers=TierSpec(
        host_blocks=4, redis_url=redis_server.url, redis_bytes=1 << 24)))
    first = e.generate(ps, sp)
    e.tiers.flush()
    host, red = e.tiers.stores
    assert red.name == "redis" and red.used_bytes() > 0
    again = e.generate(ps[:2], sp)
    assert [a.output_token_ids for a in again] == [f.output_token_ids for f in first[:2]]
    assert [a.metrics.num_cached_tokens for a in again] == [63, 63]
    assert red.stats.hits > 0
    redis_server.stop()  # Redis dies: requests go on, recomputing what it held
    more = e.generate(ps[2:4], sp)
    assert [m.output_token_ids for m in more] == [f.output_token_ids for f in first[2:4]]
    assert red.stats.went_down == 1
    e.close()


def test_disk_loads_start_while_a_request_waits(llama: tuple, tmp_path) -> None:
    model, tok, _ = llama
    rng = random.Random(11)
    ps = [[rng.randrange(2, 1000) for _ in range(64)] for _ in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    e = LLMEngine(model, tok, EngineConfig(num_blocks=12, policy="lru",
                                           tiers=TierSpec(disk_dir=str(tmp_path), disk_bytes=1 << 24),
                                           scheduler=SchedulerConfig(max_num_seqs=1)))
    first = e.generate(ps, sp)  # ps[0] and ps[1] end on disk
    e.tiers.flush()
    tc = e.tiers
    plans = tc.counters.prefetch_plans
    ids = [e.add_request(p, sp) for p in (ps[0], ps[1], ps[0] + [7])]
    # Planned on arrival, the disk reads in flight while they wait (one runs at a time).
    assert tc.counters.prefetch_plans == plans + 3 and len(tc.plans) == 3
    e.abort(ids[2])  # a waiting request that goes away releases its pins
    assert len(tc.plans) == 2
    run_checked(e)
    outs = [e.release(i) for i in ids[:2]]
    assert [o.output_token_ids for o in outs] == [f.output_token_ids for f in first[:2]]
    assert [o.metrics.num_cached_tokens for o in outs] == [63, 63]
    assert tc.counters.prefetch_used >= 2 and not tc.plans
    assert not any(b.ref_cnt for idx in tc.lower.indexes for b in idx.entries.values())
    e.close()


def test_protection_on_device_and_host_tier_keeps_greedy_tokens(llama: tuple) -> None:
    """Interleaved multi-turn conversations through a 16-block device and a 24-block host
    tier, both kvheat with protection of a stable subset switched on (and switched off and
    on again midway), one turn cancelled each round: every finished turn's tokens are a
    plain engine's, the accounting holds at every step, and the tiers serve something."""
    from kvheat.heat import KVHeat

    model, tok, _ = llama
    e = LLMEngine(model, tok, EngineConfig(num_blocks=16, block_size=16,
                                           tiers=TierSpec(host_blocks=24)))
    assert e.tiers is not None
    pols = [e.cache.policy, *(idx.policy for idx in e.tiers.lower.indexes)]
    assert all(isinstance(p, KVHeat) for p in pols)
    for p in pols:
        p.set_protect(True)
    plain = engine(llama, prefix_caching="off")
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    rng = random.Random(11)
    chats = [[rng.randrange(2, 1000) for _ in range(40)] for _ in range(5)]
    cached = 0
    for turn in range(3):
        if turn == 1:  # off and on again with blocks cached and held
            for p in pols:
                p.set_protect(False)
                p.set_protect(True)
        ids = [e.add_request(c, sp) for c in chats]
        e.step()
        e.abort(ids[turn])  # cancelled after its first step
        run_checked(e)
        for i, c in enumerate(chats):
            out = e.release(ids[i])
            if i == turn:
                assert out.finish_reason == "abort"
                continue
            assert out.output_token_ids == plain.generate([c], sp)[0].output_token_ids
            cached += out.metrics.num_cached_tokens
            chats[i] = c + out.output_token_ids + [rng.randrange(2, 1000) for _ in range(12)]
    assert e.cache.num_referenced == 0 and cached > 0
    assert all(isinstance(p, KVHeat) and p.protecting for p in pols)
