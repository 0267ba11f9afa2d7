"""The device KV pool: layouts, sizes from a memory budget, and moving one block (all
layers) out and back in, as the lower tiers do."""

from __future__ import annotations

import pytest
import torch

from kvheat.engine import ModelConfig, tiny_config
from kvheat.engine.kv_pool import DeviceKVPool

GQA = ModelConfig(model_type="llama", num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, hidden_size=32)
MLA = ModelConfig(model_type="deepseek_v3", num_hidden_layers=2, num_attention_heads=4,
                  hidden_size=32, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                  v_head_dim=8, head_dim=4)


def test_gqa_layout_and_sizes() -> None:
    pool = DeviceKVPool.for_model(GQA, num_blocks=5, block_size=4)
    assert pool.layout == "gqa"
    assert pool.kv.shape == (3, 2, 5, 4, 2, 8)
    assert pool.bytes_per_token == 3 * 2 * 2 * 8 * 4
    assert pool.bytes_per_block == pool.bytes_per_token * 4
    assert pool.total_bytes == pool.bytes_per_block * 5
    k, v = pool.gqa_layer(1)
    assert k.shape == v.shape == (5, 4, 2, 8)
    k.fill_(1.0)
    assert pool.kv[1, 0].sum().item() == k.numel() and pool.kv[1, 1].sum().item() == 0


def test_mla_layout_holds_latent_and_rope_key_only() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = DeviceKVPool.for_model(MLA, num_blocks=6, block_size=16, dtype=dtype)
        size = torch.empty((), dtype=dtype).element_size()
        assert pool.layout == "mla"
        assert pool.kv.shape == (2, 6, 16, 16 + 4)
        assert pool.bytes_per_token == 2 * (16 + 4) * size
        assert pool.total_bytes == pool.bytes_per_token * 6 * 16
    # The tiny DeepSeek default: 576 numbers (512 latent + 64 rope) per token and layer.
    cfg = tiny_config("deepseek")
    pool = DeviceKVPool.for_model(cfg, 2, 16)
    assert pool.bytes_per_token == cfg.num_hidden_layers * 576 * 4


def test_from_memory_budget() -> None:
    per_block = DeviceKVPool.block_bytes(GQA, 16, torch.float32)
    pool = DeviceKVPool.from_memory_budget(GQA, per_block * 7 + per_block // 2, 16)
    assert pool.num_blocks == 7 and pool.bytes_per_block == per_block
    assert pool.total_bytes <= per_block * 7 + per_block // 2
    half = DeviceKVPool.from_memory_budget(GQA, per_block * 7, 16, dtype=torch.bfloat16)
    assert half.num_blocks == 14
    with pytest.raises(ValueError, match="holds no block"):
        DeviceKVPool.from_memory_budget(GQA, per_block - 1, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_block_round_trip_as_tensor_and_bytes(cfg: ModelConfig, dtype: torch.dtype) -> None:
    pool = DeviceKVPool.for_model(cfg, num_blocks=4, block_size=4, dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    before = pool.kv.clone()
    t = pool.read_block(2)
    raw = pool.read_block_bytes(2)
    assert t.is_contiguous() and len(raw) == pool.bytes_per_block
    assert t.numel() * t.element_size() == pool.bytes_per_block
    pool.write_block(0, t)  # block 0 now holds block 2's KV in every layer
    assert torch.equal(pool.read_block(0), t)
    pool.write_block(1, raw)
    assert torch.equal(pool.read_block(1), t)
    # Other blocks untouched.
    assert torch.equal(pool.read_block(3), before[:, :, 3] if pool.layout == "gqa"
                       else before[:, 3])
    pool.copy_block(3, 2)
    assert torch.equal(pool.read_block(2), pool.read_block(3))


def test_bad_block_data_raises_and_changes_nothing() -> None:
    pool = DeviceKVPool.for_model(GQA, num_blocks=3, block_size=4)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    before = pool.kv.clone()
    good = pool.read_block(1)
    with pytest.raises(ValueError):
        pool.write_block(0, good[:, :, :2])
    with pytest.raises(ValueError):
        pool.write_block(0, pool.read_block_bytes(1)[:-4])
    with pytest.raises(TypeError):
        pool.write_block(0, [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        pool.write_block(3, good)
    with pytest.raises(IndexError):
        pool.read_block(-1)
    assert torch.equal(pool.kv, before)
    with pytest.raises(ValueError):
        DeviceKVPool("paged", 1, 1, 1, (1,))
