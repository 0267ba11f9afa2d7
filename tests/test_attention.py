"""Paged attention kernels against plain dense attention on random tensors, with
sequences scattered over non-contiguous pool blocks next to other sequences' blocks,
and the RoPE variants against transformers."""

from __future__ import annotations

import math

import pytest
import torch

from kvheat.engine import ModelConfig, attention
from kvheat.engine.attention import paged_gqa_attention, paged_mla_attention, softmax_scale
from kvheat.engine.attention_metadata import SeqSpan, build_metadata
from kvheat.engine.rotary import rope_inv_freq

torch.manual_seed(0)
BS = 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int,
                    scale: float) -> torch.Tensor:
    """Reference: q [L, H, D] at positions num_computed.., k/v [S, KVH, *] for all
    positions 0..S-1; explicit softmax, repeated kv heads."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    q_pos = torch.arange(num_computed, num_computed + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


# sequences: (num_computed, q_len, block table); blocks interleave and leave gaps
SEQS = [(0, 9, [6, 2, 11]), (5, 6, [3, 8, 0]), (12, 1, [1, 9, 4, 10]), (3, 1, [5]),
        (0, 1, [7])]


def _layout(seqs):
    spans, start = [], 0
    for nc, ql, table in seqs:
        spans.append(SeqSpan(start, ql, nc, torch.tensor(table)))
        start += ql
    return spans, start


def test_build_metadata_slots_and_split() -> None:
    spans, _ = _layout(SEQS)
    meta = build_metadata(spans, BS, torch.device("cpu"))
    # seq 1 writes positions 5..10 -> block 8 offsets 1..3, block 0 offsets 0..2
    assert meta.slot_mapping[9:15].tolist() == [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 0, 1, 2]
    assert meta.slot_mapping[15].item() == 10 * 4 + 0  # seq 2, position 12
    assert [s.q_start for s in meta.prefills] == [0, 9, 17]  # a first token is a prefill
    assert meta.decode_index.tolist() == [15, 16]
    assert meta.decode_context_lens.tolist() == [13, 4]
    assert meta.decode_block_tables.tolist() == [[1, 9, 4, 10], [5, 0, 0, 0]]
    assert meta.decode_mask is not None and meta.decode_mask[1, 0, 0].sum().item() == 4


@pytest.fixture(params=[128, 4], ids=["one-chunk", "chunks-of-4"])
def prefill_chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Prefills run in query chunks; 4 splits every test prefill into several."""
    monkeypatch.setattr(attention, "PREFILL_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_paged_gqa_matches_dense(heads: int, kv_heads: int, prefill_chunk: int) -> None:
    d, nblocks = 8, 12
    k_cache = torch.randn(nblocks, BS, kv_heads, d) * 50  # garbage everywhere first
    v_cache = torch.randn(nblocks, BS, kv_heads, d) * 50
    spans, total = _layout(SEQS)
    full_k, full_v = [], []
    for nc, ql, table in SEQS:  # each sequence's true K/V; its cached prefix goes in the pool
        kk, vv = torch.randn(nc + ql, kv_heads, d), torch.randn(nc + ql, kv_heads, d)
        for p in range(nc):
            k_cache[table[p // BS], p % BS] = kk[p]
            v_cache[table[p // BS], p % BS] = vv[p]
        full_k.append(kk)
        full_v.append(vv)
    q = torch.randn(total, heads, d)
    k_new = torch.cat([kk[nc:] for kk, (nc, _, _) in zip(full_k, SEQS)])
    v_new = torch.cat([vv[nc:] for vv, (nc, _, _) in zip(full_v, SEQS)])
    meta = build_metadata(spans, BS, torch.device("cpu"))
    scale = d ** -0.5
    out = paged_gqa_attention(q, k_new, v_new, k_cache, v_cache, meta, scale)
    for s, kk, vv in zip(spans, full_k, full_v):
        want = dense_attention(q[s.q_start:s.q_start + s.q_len], kk, vv, s.num_computed, scale)
        torch.testing.assert_close(out[s.q_start:s.q_start + s.q_len], want,
                                   rtol=1e-5, atol=1e-5)
        # The new tokens' K/V were written where the block table says.
        for j in range(s.q_len):
            p = s.num_computed + j
            assert torch.equal(k_cache[s.block_table[p // BS], p % BS], kk[p])


def test_paged_mla_absorbed_and_expanded_match_dense(prefill_chunk: int) -> None:
    heads, r, dr, dn, dv, nblocks = 3, 10, 4, 6, 5, 12
    w_kv_b = torch.randn(heads * (dn + dv), r) / math.sqrt(r)
    w = w_kv_b.view(heads, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]

    def expand(c: torch.Tensor):
        kv = (c @ w_kv_b.T).view(c.shape[0], heads, dn + dv)
        return kv[..., :dn], kv[..., dn:]

    spans, total = _layout(SEQS)
    latents = [torch.randn(nc + ql, r + dr) for nc, ql, _ in SEQS]
    q_nope, q_rope = torch.randn(total, heads, dn), torch.randn(total, heads, dr)
    new_latent = torch.cat([lat[nc:] for lat, (nc, _, _) in zip(latents, SEQS)])
    scale = 0.3
    results = []
    for absorb in (False, True):
        cache = torch.randn(nblocks, BS, r + dr) * 50
        for lat, (nc, _, table) in zip(latents, SEQS):
            for p in range(nc):
                cache[table[p // BS], p % BS] = lat[p]
        meta = build_metadata(spans, BS, torch.device("cpu"))
        results.append(paged_mla_attention(q_nope, q_rope, new_latent, cache, meta, scale, r,
                                           expand, w_uk, w_uv, absorb_prefill=absorb))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    for s, lat in zip(spans, latents):
        k_nope, v = expand(lat[:, :r])
        k = torch.cat([k_nope, lat[:, None, r:].expand(-1, heads, -1)], dim=-1)
        sl = slice(s.q_start, s.q_start + s.q_len)
        q = torch.cat([q_nope[sl], q_rope[sl]], dim=-1)
        want = dense_attention(q, k, v, s.num_computed, scale)
        torch.testing.assert_close(results[1][sl], want, rtol=1e-5, atol=1e-5)


ROPES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
     "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 256},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"] + str(len(r)))
def test_rope_frequencies_match_transformers(rope: dict) -> None:
    tr = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig(model_type="llama", hidden_size=128, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=64, rope_theta=50000.0,
                      max_position_embeddings=4096, rope_scaling=dict(rope))
    inv, attn = rope_inv_freq(cfg)
    hf_cfg = tr.LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64,
                            max_position_embeddings=4096,
                            rope_parameters={**rope, "rope_theta": 50000.0})
    if rope["rope_type"] == "default":
        want = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
        want_attn = 1.0
    else:
        want, want_attn = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(inv, want)
    assert attn == pytest.approx(want_attn)


def test_deepseek_yarn_softmax_scale() -> None:
    cfg = ModelConfig(model_type="deepseek_v3", hidden_size=32, num_attention_heads=2,
                      num_key_value_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=8, head_dim=4,
                      rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0,
                                    "original_max_position_embeddings": 64})
    m = 0.1 * math.log(40.0) + 1.0
    assert softmax_scale(cfg) == pytest.approx(12 ** -0.5 * m * m)
