"""The engine's models against Hugging Face transformers, built from the same
config.json and model.safetensors (written by kvheat, read by both): prefill logits with
and without a prefix-cache hit, batches mixing lengths and decode steps, 32 greedy tokens,
and the MLA pool's bytes per token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.engine import ModelConfig, ModelRunner, SeqBatchItem, load_model, save_model
from kvheat.engine.kv_pool import DeviceKVPool
from kvheat.engine.loader import Tokenizer, build_model, init_random_weights

transformers = pytest.importorskip("transformers")
torch.set_num_threads(2)

BLOCK = 16
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=512, bos_token_id=0,
             eos_token_id=1)
CONFIGS = {
    "llama": ModelConfig(model_type="llama", num_key_value_heads=2, head_dim=16,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}, **SMALL),
    "qwen2": ModelConfig(model_type="qwen2", num_key_value_heads=1, head_dim=16,
                         qkv_bias=True, tie_word_embeddings=True, **SMALL),
    "qwen3": ModelConfig(model_type="qwen3", num_key_value_heads=2, head_dim=32, qk_norm=True,
                         rope_theta=1e6, **SMALL),
    "deepseek": ModelConfig(model_type="deepseek_v3", num_key_value_heads=4, head_dim=8,
                            q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                            first_k_dense_replace=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True, n_group=2, topk_group=1,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 128},
                            **SMALL),
    "deepseek_v2": ModelConfig(model_type="deepseek_v2", num_key_value_heads=4, head_dim=8,
                               q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8,
                               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=6,
                               n_shared_experts=2, num_experts_per_tok=2,
                               moe_intermediate_size=16, first_k_dense_replace=1,
                               routed_scaling_factor=1.5, n_group=3, topk_group=2,
                               topk_method="group_limited_greedy", scoring_func="softmax",
                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "mscale": 0.707, "mscale_all_dim": 0.707,
                                             "beta_fast": 32, "beta_slow": 1,
                                             "original_max_position_embeddings": 64},
                               **SMALL),
    "deepseek_noqlora": ModelConfig(model_type="deepseek_v3", num_key_value_heads=4,
                                    head_dim=8, q_lora_rank=None, kv_lora_rank=24,
                                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                    rope_interleave=False, n_routed_experts=4,
                                    n_shared_experts=2, num_experts_per_tok=2,
                                    moe_intermediate_size=16, first_k_dense_replace=0,
                                    routed_scaling_factor=1.0, n_group=1, topk_group=1,
                                    **SMALL),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(kvheat model, HF model, config) from one saved directory."""
    name = request.param
    cfg = CONFIGS[name]
    model = build_model(cfg)
    init_random_weights(model, seed=1)
    d: Path = tmp_path_factory.mktemp(name)
    save_model(model, Tokenizer.tiny(cfg.vocab_size), d)
    ours, _, _ = load_model(d)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # compare 32 tokens even past an EOS
    return ours, ref, cfg


def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


def make_runner(model, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(model, DeviceKVPool.for_model(model.config, num_blocks, BLOCK))


def prompt(seed: int, n: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def test_prefill_mixed_lengths_matches_hf(pair) -> None:
    ours, ref, cfg = pair
    runner = make_runner(ours)
    # 150 tokens: more than one query chunk of the CPU prefill path
    prompts = [prompt(1, 7), prompt(2, 40), prompt(3, 16), prompt(4, 1), prompt(5, 150)]
    tables = [[3], [9, 4, 60], [5], [7], list(range(30, 20, -1))]  # scattered, out of order
    got = runner.forward_all_logits(
        [SeqBatchItem(p, 0, t) for p, t in zip(prompts, tables)])
    for p, g in zip(prompts, got):
        assert g.shape == (len(p), cfg.vocab_size)
        assert_rel_close(g, hf_logits(ref, p))


def test_prefix_hit_with_cache_manager_matches_hf(pair) -> None:
    """Request B shares 2 full blocks with A: its suffix runs against A's cached KV,
    in one batch with a cold prefill and a decode step of another sequence."""
    ours, ref, cfg = pair
    runner = make_runner(ours)
    mgr = KVCacheManager(CacheConfig(num_blocks=64, block_size=BLOCK))
    a = prompt(10, 37)
    b = a[:32] + prompt(11, 13)
    c = prompt(12, 21)
    d = prompt(13, 9)
    ra = mgr.make_request("a", a)
    runner.forward([SeqBatchItem(a, 0, mgr.allocate(ra))])
    rd = mgr.make_request("d", d)
    runner.forward([SeqBatchItem(d[:8], 0, mgr.allocate(rd))])  # d's last token decodes below
    mgr.free(ra)
    rb, rc = mgr.make_request("b", b), mgr.make_request("c", c)
    tb, tc = mgr.allocate(rb), mgr.allocate(rc)
    assert rb.num_cached_tokens == 32 and rc.num_cached_tokens == 0
    got = runner.forward_all_logits([
        SeqBatchItem(b[32:], 32, tb), SeqBatchItem(c, 0, tc),
        SeqBatchItem(d[8:], 8, rd.block_table)])
    assert_rel_close(got[0], hf_logits(ref, b)[32:])
    assert_rel_close(got[1], hf_logits(ref, c))
    assert_rel_close(got[2], hf_logits(ref, d)[8:])
    last = runner.forward([SeqBatchItem(b[-1:], len(b) - 1, tb)])  # rerun b's last token
    assert_rel_close(last[0], hf_logits(ref, b)[-1])
    mgr.check_invariants()


def greedy(runner: ModelRunner, mgr: KVCacheManager, prompts: list[list[int]],
           n_new: int, prefix: str) -> list[list[int]]:
    """Greedy decoding of several prompts together: prefill what the cache lacks, then
    one batched decode step per token, growing each block table via the manager."""
    reqs = [mgr.make_request(f"{prefix}{i}", p) for i, p in enumerate(prompts)]
    items = []
    for r, p in zip(reqs, prompts):
        table = mgr.allocate(r)
        start = min(r.num_cached_tokens, len(p) - 1)  # always run at least the last token
        items.append(SeqBatchItem(p[start:], start, table))
    logits = runner.forward(items)
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(n_new):
        nxt = logits.argmax(-1).tolist()
        items = []
        for i, (r, t) in enumerate(zip(reqs, nxt)):
            outs[i].append(t)
            pos = r.num_tokens
            mgr.append_tokens(r, [t])
            items.append(SeqBatchItem([t], pos, r.block_table))
        logits = runner.forward(items)
    for r in reqs:
        mgr.free(r)
    return outs


def test_greedy_32_tokens_match_hf_generate(pair) -> None:
    ours, ref, cfg = pair
    runner = make_runner(ours)
    mgr = KVCacheManager(CacheConfig(num_blocks=64, block_size=BLOCK))
    prompts = [prompt(20, 11), prompt(21, 30)]
    got = greedy(runner, mgr, prompts, 32, "g")
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert g == want


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_prefix_hit_does_not_change_output(name: str) -> None:
    """The same request served cold, then warm (its prompt blocks cached), gives the same
    tokens; the warm run computes only the uncached suffix."""
    ours = build_model(CONFIGS[name])
    init_random_weights(ours, seed=2)
    runner = make_runner(ours)
    mgr = KVCacheManager(CacheConfig(num_blocks=64, block_size=BLOCK))
    p = prompt(30, 50)
    cold = greedy(runner, mgr, [p], 32, "cold")
    before = runner.num_forward_tokens
    warm = greedy(runner, mgr, [p], 32, "warm")
    assert mgr.stats.hit_tokens == 48
    assert runner.num_forward_tokens - before == 2 + 32  # tokens 48, 49, then 32 decodes
    assert warm == cold


def test_mla_pool_holds_only_latent_and_rope_key() -> None:
    for name in ("deepseek", "deepseek_noqlora"):
        cfg = CONFIGS[name]
        for dtype in (torch.float32, torch.bfloat16):
            pool = DeviceKVPool.for_model(cfg, 10, BLOCK, dtype=dtype)
            size = torch.empty((), dtype=dtype).element_size()
            per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
            assert pool.layout == "mla"
            assert pool.bytes_per_token == per_token
            assert pool.total_bytes == per_token * 10 * BLOCK
            assert pool.kv.shape == (cfg.num_hidden_layers, 10, BLOCK,
                                     cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_absorbed_prefill_equals_expanded() -> None:
    """MLA's absorbed form (used for decode) computes the same attention as the
    expanded form (used for prefill), on prefills with and without a cached prefix."""
    cfg = CONFIGS["deepseek"]
    model = build_model(cfg)
    init_random_weights(model, seed=4)
    p = prompt(40, 45)
    results = []
    for absorb in (False, True):
        model.set_absorb_prefill(absorb)
        runner = make_runner(model)
        first = runner.forward_all_logits([SeqBatchItem(p[:20], 0, [1, 2])])[0]
        rest = runner.forward_all_logits([SeqBatchItem(p[20:], 20, [1, 2, 3])])[0]
        results.append(torch.cat([first, rest]))
    model.set_absorb_prefill(False)
    assert_rel_close(results[1], results[0])


def test_bad_batches_raise_and_leave_pool_unchanged() -> None:
    cfg = CONFIGS["llama"]
    model = build_model(cfg)
    init_random_weights(model)
    runner = make_runner(model, num_blocks=8)
    runner.forward([SeqBatchItem(prompt(50, 20), 0, [0, 1])])
    snapshot = runner.kv_pool.kv.clone()
    bad = [
        [],
        [SeqBatchItem([], 0, [0])],
        [SeqBatchItem([5, 6], -1, [0])],
        [SeqBatchItem([cfg.vocab_size], 0, [2])],
        [SeqBatchItem(prompt(51, 20), 0, [2])],  # needs 2 blocks
        [SeqBatchItem([5], 0, [8])],  # outside the pool
        [SeqBatchItem([5], 0, [3]), SeqBatchItem([6], 0, [3])],  # same slot twice
        [SeqBatchItem([5], cfg.max_position_embeddings, list(range(8)))],
    ]
    for batch in bad:
        with pytest.raises(ValueError):
            runner.forward(batch)
    assert torch.equal(runner.kv_pool.kv, snapshot)
    with pytest.raises(ValueError):  # a pool of the other layout
        ModelRunner(model, DeviceKVPool.for_model(CONFIGS["deepseek"], 4, BLOCK))
    with pytest.raises(ValueError, match="model is on cpu"):  # a pool elsewhere
        ModelRunner(model, DeviceKVPool.for_model(cfg, 4, BLOCK, device="meta"))


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_tiny_default_is_seeded_and_round_trips_through_a_directory(
        family: str, tmp_path: Path) -> None:
    model, tok, cfg = load_model(None, family, seed=3)
    again, _, _ = load_model(None, family, seed=3)
    other, _, _ = load_model(None, family, seed=4)
    w = dict(model.named_parameters())
    assert all(torch.equal(p, w[n]) for n, p in again.named_parameters())
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    save_model(model, tok, tmp_path)
    # a chat model's end-of-turn token listed only in generation_config.json
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 5]}')
    loaded, tok2, cfg2 = load_model(tmp_path)
    assert cfg2 == cfg
    assert tok2.eos_token_ids == [1, 5] and tok2.eos_token_id == 1
    ids = tok.encode("The capital of France is Paris.")
    assert ids[0] == tok.bos_token_id and tok2.encode("The capital of France is Paris.") == ids
    outs = []
    for m in (model, loaded):
        runner = make_runner(m, num_blocks=8)
        outs.append(runner.forward([SeqBatchItem(ids, 0, [0, 1])]))
    assert torch.equal(outs[0], outs[1])


def test_tiny_tokenizer_text_and_chat() -> None:
    tok = Tokenizer.tiny()
    text = "Hello, world! Numbers 12345 and ünïcödé."
    assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids[-1:], skip_special_tokens=False) == "<|assistant|>"
    assert tok.decode(ids) == "Be brief.What is the capital of France?"
    assert max(ids) < tok.vocab_size <= 1024
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"content": "no role"}])


def test_loader_rejects_bad_directories(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    cfg = CONFIGS["llama"]
    model = build_model(cfg)
    init_random_weights(model)
    save_model(model, Tokenizer.tiny(cfg.vocab_size), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())

    def expect(error: type[Exception], match: str, **changes: dict) -> None:
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes.get("cfg", {})}))
        save_file(changes.get("weights", weights), str(tmp_path / "model.safetensors"))
        with pytest.raises(error, match=match):
            load_model(tmp_path)

    missing = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    expect(ValueError, "lacks", weights=missing)
    expect(ValueError, "unknown", weights={**weights, "model.extra.weight": torch.zeros(2)})
    expect(ValueError, "shape", weights={**weights, "model.norm.weight": torch.zeros(3)})
    expect(ValueError, "quantized",
           weights={**weights, "model.layers.0.mlp.up_proj.weight_scale_inv": torch.zeros(1)})
    expect(ValueError, "model_type", cfg={"model_type": "gpt2"})
    expect(ValueError, "rope_type", cfg={"rope_scaling": {"type": "longrope", "factor": 2.0}})
    expect(ValueError, "sliding", cfg={"use_sliding_window": True})
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_config_reads_old_and_new_rope_spellings() -> None:
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 100}
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 500.0,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf_dict({**base, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}})
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.rope_theta == new.rope_theta == 500.0
    assert old.num_key_value_heads == 2 and old.head_dim == 4
    qwen2 = ModelConfig.from_hf_dict({**base, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias
    assert ModelConfig.from_hf_dict(qwen2.to_hf_dict()) == qwen2


def test_bfloat16_model_and_pool_track_fp32() -> None:
    """bf16 weights and KV: the same forward, within bf16 rounding of the fp32 logits."""
    ids = prompt(60, 40, vocab=1000)
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _, cfg = load_model(None, "llama", dtype=dtype)
        pool = DeviceKVPool.for_model(cfg, 8, BLOCK, dtype=dtype)
        runner = ModelRunner(model, pool)
        runner.forward([SeqBatchItem(ids[:32], 0, [0, 1])])
        got[dtype] = runner.forward([SeqBatchItem(ids[32:], 32, [0, 1, 2])])[0]
        assert got[dtype].dtype == torch.float32
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert_rel_close(got[torch.bfloat16], got[torch.float32], rel=0.1)
    assert got[torch.bfloat16].argmax() == got[torch.float32].argmax()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    for family in ("llama", "deepseek"):
        ids = prompt(61, 45, vocab=1000)
        outs = []
        for dev in ("cpu", "cuda"):
            model, _, cfg = load_model(None, family, device=dev)
            runner = ModelRunner(model, DeviceKVPool.for_model(cfg, 8, BLOCK, device=dev))
            runner.forward([SeqBatchItem(ids[:32], 0, [3, 1])])
            outs.append(runner.forward([SeqBatchItem(ids[32:], 32, [3, 1, 5]),
                                        SeqBatchItem(ids[:1], 0, [0])]).cpu())
        assert_rel_close(outs[1], outs[0], rel=1e-3)


def test_saved_tokenizer_agrees_with_transformers(tmp_path: Path) -> None:
    """Other engines read the same directory: transformers' tokenizer must encode text
    and render the chat template exactly as kvheat does."""
    model, tok, _ = load_model(None, "llama")
    save_model(model, tok, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(msgs) == want
    assert tok.encode("hello world, again") == hf("hello world, again")["input_ids"]
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)


def test_mla_decode_never_expands_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps run absorbed: kv_b_proj is never applied to cached latents."""
    cfg = CONFIGS["deepseek"]
    model = build_model(cfg)
    init_random_weights(model, seed=5)
    runner = make_runner(model)
    p = prompt(70, 30)
    runner.forward([SeqBatchItem(p[:29], 0, [0, 1]), SeqBatchItem(p[:10], 0, [2])])
    expanded: list[int] = []
    for layer in model.model.layers:
        attn = layer.self_attn
        monkeypatch.setattr(attn, "expand_kv",
                            lambda c, f=attn.expand_kv: expanded.append(c.shape[0]) or f(c))
    runner.forward([SeqBatchItem(p[29:30], 29, [0, 1]), SeqBatchItem(p[10:11], 10, [2])])
    assert expanded == []
    runner.forward([SeqBatchItem(p[11:30], 11, [2, 3])])  # a prefill on a prefix does expand
    assert expanded == [30] * cfg.num_hidden_layers


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_loads_directories_written_by_transformers(name: str, tmp_path: Path) -> None:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg.to_hf_dict())).eval()
    hf.save_pretrained(tmp_path)
    Tokenizer.tiny(cfg.vocab_size).save(tmp_path)
    ours, _, _ = load_model(tmp_path)
    p = prompt(80, 33)
    got = make_runner(ours).forward_all_logits([SeqBatchItem(p, 0, [4, 8, 2])])[0]
    assert_rel_close(got, hf_logits(hf, p))


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path: Path) -> None:
    """Checkpoints with experts stacked as [E, 2I, D] gate_up and [E, D, I] down
    (transformers 5's in-memory layout) load to the same model."""
    from safetensors.torch import load_file, save_file

    cfg = CONFIGS["deepseek"]
    model = build_model(cfg)
    init_random_weights(model, seed=6)
    save_model(model, Tokenizer.tiny(cfg.vocab_size), tmp_path)
    per_expert = load_file(str(tmp_path / "model.safetensors"))
    fused = {k: v for k, v in per_expert.items() if ".experts." not in k}
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts"
        e = range(cfg.n_routed_experts)
        fused[f"{pre}.gate_up_proj"] = torch.stack([torch.cat(
            [per_expert[f"{pre}.{i}.gate_proj.weight"], per_expert[f"{pre}.{i}.up_proj.weight"]])
            for i in e])
        fused[f"{pre}.down_proj"] = torch.stack([per_expert[f"{pre}.{i}.down_proj.weight"]
                                                 for i in e])
    save_file(fused, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)[0].state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(loaded[name], p), name
