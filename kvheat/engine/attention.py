"""Paged attention over the device KV pool: the GQA (Llama) and MLA (DeepSeek) kernels.
The step's metadata (slots, block tables, masks) is built in attention_metadata.py;
RMSNorm and rotary embeddings are in norm.py and rotary.py.

A step runs a flat list of new tokens from several sequences. Each sequence has
`num_computed` tokens whose KV already lies in the pool (a cached prefix, or earlier
chunks and decode steps) and `q_len` new tokens at positions `num_computed ...`.
The new tokens' KV is first written into the pool slots the block tables name; then
each sequence attends to its own blocks only, gathered by block table (never the pool):

- a prefill with no cached prefix attends to its fresh K/V directly (causal);
- a prefill on top of a cached prefix gathers its blocks and masks causally with the
  query offset (query i sees keys 0 .. num_computed + i);
- decode tokens (q_len == 1) of many sequences run as one padded batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata, causal_offset_mask
from .model_config import ModelConfig
from .rotary import yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """The attention scale; DeepSeek's yarn folds mscale(factor, mscale_all_dim)^2 in."""
    if not cfg.is_mla:
        return cfg.head_dim ** -0.5
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):
        m = yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


PREFILL_CHUNK = 256  # query rows per attention call in a prefill on a cached prefix (CPU)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of L new tokens, on top of the earlier tokens whose keys lead k/v.

    q [H, L, D]; k/v [KVH, S, *] with KVH dividing H (grouped heads share a K/V head,
    no copy); prefix_mask: None when S == L (no earlier tokens), else bool [L, S] (query
    i sees keys up to S - L + i), or that mask as an additive bias. Returns [H, L, Dv].

    Inputs go to SDPA as 4-D [1, heads, len, dim]: with 3-D ones torch's CPU dispatch
    takes the math path (a masked score matrix, a safe softmax, ~2.3x slower), with 4-D
    its flash kernel, which also takes grouped K/V heads (`enable_gqa`) as they are. On
    CPU a prefix prefill runs in query chunks, each against the keys up to its last
    position only, so the masked-out triangle of a long suffix is not computed."""
    gqa = k.shape[0] != q.shape[0]
    dv = v.shape[-1]
    # The flash kernel wants one head dim for q, k and v (MLA: 192 vs 128 in DeepSeek-V3);
    # zero padding changes no dot product and no output column we keep.
    width = max(q.shape[-1], dv)
    q4, k4, v4 = (x[None] if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))[None]
                  for x in (q, k, v))
    if prefix_mask is None:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                           enable_gqa=gqa)
        return o[0, ..., :dv]
    n_new, n_ctx = q.shape[1], k.shape[1]
    if q.device.type != "cpu" or n_new <= PREFILL_CHUNK:
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=prefix_mask, scale=scale,
                                              enable_gqa=gqa)[0, ..., :dv]
    outs = []
    for first in range(0, n_new, PREFILL_CHUNK):
        n = min(PREFILL_CHUNK, n_new - first)
        end = n_ctx - n_new + first + n
        outs.append(F.scaled_dot_product_attention(
            q4[:, :, first:first + n], k4[:, :, :end], v4[:, :, :end],
            attn_mask=prefix_mask[first:first + n, :end], scale=scale, enable_gqa=gqa)[0])
    return torch.cat(outs, dim=1)[..., :dv]


def latent_attention(q: torch.Tensor, ctx: torch.Tensor, value_width: int, scale: float,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with one K/V head shared by all query heads: MLA in absorbed form.

    q [B, R, C] (heads x queries as rows), ctx [B, S, C] the cached latents (keys; their
    first `value_width` numbers are the values), mask bool broadcastable to [B, R, S].
    Returns [B, R, value_width]. Plain batched matmuls: SDPA on CPU takes its math path
    for this shape and first rescales a strided copy of the keys."""
    scores = torch.matmul(q, ctx.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(q.dtype), ctx[..., :value_width])


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` token rows of one sequence's blocks: cache [blocks, bs, ...]."""
    n = -(-length // cache.shape[1])
    g = cache.index_select(0, block_table[:n])
    return g.reshape(-1, *cache.shape[2:])[:length]


# ---- GQA (Llama family) ---------------------------------------------------------------------
# Prefills hand grouped K/V heads to SDPA's flash kernel as they are (see causal_attention);
# decodes fold a group's query heads into the query-length axis, which needs no copy
# since one decode query of every head sees the same keys.
def paged_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write the step's new K/V into the pool and attend over it (GQA).

    q [T, H, D], k/v [T, KVH, D] for the step's new tokens; k_cache/v_cache [num_blocks,
    block_size, KVH, D] of this layer. Returns the attention output [T, H, D]."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    heads = q.shape[1]
    for s in meta.prefills:
        sl = slice(s.q_start, s.q_start + s.q_len)
        if s.num_computed == 0:
            ks, vs = k[sl], v[sl]
        else:  # one index_select per cache, the only copy of the sequence's K/V
            ks = gather_blocks(k_cache, s.device_table, s.context_len).to(q.dtype)
            vs = gather_blocks(v_cache, s.device_table, s.context_len).to(q.dtype)
        o = causal_attention(q[sl].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                             scale, s.attention_bias(q.dtype))
        out[sl] = o.transpose(0, 1)
    if meta.num_decodes:
        out.index_copy_(0, meta.decode_index,
                        _gqa_decode(q, k_cache, v_cache, meta, scale).reshape(-1, heads, d))
    return out


def _gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The decode tokens' attention, [D, KVH, group, d]. Each decode reads its own blocks
    as one padded batch; a prefix shared by several decodes is read once for all of them
    and the two partial softmaxes are merged by their log-sum-exp."""
    n = meta.num_decodes
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kvh
    flat = meta.decode_block_tables.reshape(-1)  # index_select: ~5x faster than indexing
    # [D, blocks, bs, KVH, d] -> [D, KVH, S, d]: only these sequences' blocks.
    ks = k_cache.index_select(0, flat).view(n, -1, kvh, d).transpose(1, 2).to(q.dtype)
    vs = v_cache.index_select(0, flat).view(n, -1, kvh, d).transpose(1, 2).to(q.dtype)
    qd = q.index_select(0, meta.decode_index).view(n, kvh, group, d)
    out, lse = attention_with_lse(qd, ks, vs, meta.decode_bias(q.dtype), scale)
    for shared in meta.decode_shared:
        m = shared.rows.numel()
        kp = k_cache.index_select(0, shared.blocks).view(1, -1, kvh, d).transpose(1, 2)
        vp = v_cache.index_select(0, shared.blocks).view(1, -1, kvh, d).transpose(1, 2)
        # The group's queries as rows of one query block per KV head: [1, KVH, m*group, d].
        qg = qd.index_select(0, shared.rows).transpose(0, 1).reshape(1, kvh, m * group, d)
        op, lp = attention_with_lse(qg, kp.to(q.dtype), vp.to(q.dtype), None, scale)
        op = op.reshape(kvh, m, group, d).transpose(0, 1)
        lp = lp.reshape(kvh, m, group).transpose(0, 1).float()
        lo = lse.index_select(0, shared.rows).float()
        both = torch.logaddexp(lp, lo)
        merged = (op * (lp - both).exp()[..., None].to(op.dtype)
                  + out.index_select(0, shared.rows) * (lo - both).exp()[..., None].to(op.dtype))
        out.index_copy_(0, shared.rows, merged)
        lse.index_copy_(0, shared.rows, both.to(lse.dtype))
    return out


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias) v, and the rows' log-sum-exp.

    q [B, H, L, d], k/v [B, H, S, d]. On CPU torch's flash kernel returns both (the public
    SDPA drops the log-sum-exp); elsewhere plain matmuls."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = scores.logsumexp(-1)
    return torch.matmul((scores - lse[..., None]).exp().to(v.dtype), v), lse


# ---- MLA (DeepSeek family) ------------------------------------------------------------------
def write_latent(cache: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata) -> None:
    """cache [num_blocks, block_size, W]; latent [T, W] = [c_kv | k_rope]."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))


def paged_mla_attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, kv_lora_rank: int,
    expand_kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    w_uk: torch.Tensor, w_uv: torch.Tensor, absorb_prefill: bool = False,
) -> torch.Tensor:
    """Multi-head latent attention over the pool; returns [T, H, dv].

    q_nope [T, H, dn], q_rope [T, H, dr], latent [T, r + dr] (normalised c_kv then rotated
    k_rope) for the new tokens.

    Prefills expand the latent into per-head K/V (`expand_kv`: c_kv [S, r] -> k_nope
    [S, H, dn], v [S, H, dv]) since their queries are many. Decodes use the absorbed form:
    q_nope is folded through W_UK into the latent space, attention runs over the cached
    latent itself as one key/value head shared by all query heads (folded into the query
    axis, as for GQA), and W_UV maps the result back, so decode never expands the cache.
    w_uk [H, dn, r], w_uv [H, dv, r]."""
    write_latent(cache, latent, meta)
    n_tok, heads = q_nope.shape[0], q_nope.shape[1]
    out = q_nope.new_empty(n_tok, heads, w_uv.shape[1])
    r, dn, dv, dr = kv_lora_rank, w_uk.shape[1], w_uv.shape[1], q_rope.shape[-1]
    for s in meta.prefills:
        sl = slice(s.q_start, s.q_start + s.q_len)
        if s.num_computed == 0 and not absorb_prefill:
            ctx = latent[sl].to(q_nope.dtype)
        else:
            ctx = gather_blocks(cache, s.device_table, s.context_len).to(q_nope.dtype)
        # A few new tokens on a long cached prefix: expanding the whole prefix costs more
        # than attending in latent space (multiply-adds per head, up to constants).
        n_ctx = s.context_len
        expanded_cost = n_ctx * r * (dn + dv) + s.q_len * n_ctx * (dn + dr + dv)
        absorbed_cost = s.q_len * (r * (dn + dv) + n_ctx * (2 * r + dr))
        if absorb_prefill or (s.num_computed > 0 and absorbed_cost < expanded_cost):
            q_lat = torch.einsum("thd,hdr->htr", q_nope[sl], w_uk)
            q = torch.cat((q_lat, q_rope[sl].transpose(0, 1)), dim=-1)  # [H, L, r + dr]
            mask = s.prefix_mask
            if mask is None:  # absorb_prefill without a prefix
                mask = causal_offset_mask(s.q_len, s.num_computed, q.device)
            o = latent_attention(q, ctx, r, scale, mask)  # [H, L, r]
            out[sl] = torch.einsum("htr,hvr->thv", o, w_uv)
            continue
        k_nope, v = expand_kv(ctx[:, :r])  # [S, H, dn], [S, H, dv]
        k_rope = ctx[:, None, r:].expand(-1, heads, -1)
        k = torch.cat((k_nope, k_rope), dim=-1).transpose(0, 1)
        q = torch.cat((q_nope[sl], q_rope[sl]), dim=-1).transpose(0, 1)
        o = causal_attention(q, k, v.transpose(0, 1), scale, s.attention_bias(q.dtype))
        out[sl] = o.transpose(0, 1)
    if meta.num_decodes:
        n = meta.num_decodes
        ctx = cache.index_select(0, meta.decode_block_tables.reshape(-1))
        ctx = ctx.view(n, -1, cache.shape[-1]).to(q_nope.dtype)  # [D, S, r + dr]
        qn = q_nope.index_select(0, meta.decode_index)  # [D, H, dn]
        qr = q_rope.index_select(0, meta.decode_index)
        q = torch.cat((torch.einsum("bhd,hdr->bhr", qn, w_uk), qr), dim=-1)  # [D, H, r + dr]
        mask = None if meta.decode_mask is None else meta.decode_mask[:, 0]  # [D, 1, S]
        o = latent_attention(q, ctx, r, scale, mask)  # [D, H, r]
        out.index_copy_(0, meta.decode_index, torch.einsum("bhr,hvr->bhv", o, w_uv))
    return out
