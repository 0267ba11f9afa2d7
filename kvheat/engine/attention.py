"""Paged attention over the device KV pool, and the pieces every decoder shares
(RMSNorm, rotary embeddings).

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

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel: the same numbers as the steps below in one pass
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As transformers: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# ---- rotary embeddings -------------------------------------------------------------------
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale of the config's RoPE variant
    (default, linear, llama3, yarn), as transformers computes them; fp32, on the CPU
    (also while a model is built on the meta device)."""
    dim = cfg.rope_dim
    base = cfg.rope_theta
    rs = cfg.rope_scaling
    kind = rs.get("rope_type", "default")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if kind == "default":
        return inv, 1.0
    factor = float(rs["factor"]) if rs.get("factor") is not None else None
    if kind == "linear":
        return inv / factor, 1.0  # type: ignore[operator]
    if kind == "llama3":
        assert factor is not None
        lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    orig = float(rs["original_max_position_embeddings"])
    if factor is None:
        factor = cfg.max_position_embeddings / orig
    attn = rs.get("attention_factor")
    if attn is None:
        ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all
                else _yarn_mscale(factor))
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def softmax_scale(cfg: ModelConfig) -> float:
    """The attention scale; DeepSeek's yarn folds mscale(factor, mscale_all_dim)^2 in."""
    if not cfg.is_mla:
        return cfg.head_dim ** -0.5
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):
        m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round it.
        self.inv_freq, self.attention_scaling = rope_inv_freq(cfg)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [tokens, dim] (both halves repeated, as rotate_half wants)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim]; cos/sin [tokens, dim]. NeoX (half-split) layout."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved pairs (x0, x1), (x2, x3) ...; the output is laid out
    de-interleaved (evens then odds), exactly as transformers does, which keeps q.k."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---- batch metadata ------------------------------------------------------------------------
@dataclass(slots=True)
class SeqSpan:
    q_start: int  # offset of the sequence's first new token in the flat token list
    q_len: int
    num_computed: int  # KV already in the pool before this step
    # blocks covering num_computed + q_len tokens; a list from the caller, made an int64
    # tensor on the pool's device by build_metadata for the prefills that read it
    block_table: torch.Tensor | list[int]
    # bool [q_len, context_len] for a prefill on a cached prefix, built once per step by
    # build_metadata and shared by all layers (None: no prefix, plain causal)
    prefix_mask: torch.Tensor | None = None
    prefix_bias: torch.Tensor | None = None  # the mask as 0 / -inf of the model's dtype

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """prefix_mask as an additive bias, made on the first layer and reused by the
        others (SDPA converts a bool mask on every call)."""
        if self.prefix_mask is None:
            return None
        if self.prefix_bias is None or self.prefix_bias.dtype != dtype:
            self.prefix_bias = torch.zeros(self.prefix_mask.shape, dtype=dtype,
                                           device=self.prefix_mask.device)
            self.prefix_bias.masked_fill_(~self.prefix_mask, float("-inf"))
        return self.prefix_bias

    @property
    def context_len(self) -> int:
        return self.num_computed + self.q_len


@dataclass(slots=True)
class SharedPrefix:
    """Decode sequences whose block tables begin with the same blocks (a shared system
    prompt, one conversation's turns): the prefix's K/V is gathered once and all their
    queries attend to it in one call, instead of once per sequence."""
    rows: torch.Tensor  # int64 [m]: rows of these sequences in the decode batch
    blocks: torch.Tensor  # int64 [P]: the shared blocks, in order


# A shared prefix is attended separately when it saves re-reading at least this many
# tokens' K/V; below that the extra call and the merge cost more than they save.
MIN_SHARED_TOKENS_SAVED = 128


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's KV goes, and which pool blocks each sequence reads."""
    block_size: int
    slot_mapping: torch.Tensor  # int64 [tokens]: block_id * block_size + offset
    prefills: list[SeqSpan]  # sequences with q_len > 1, or a first token with no context
    decode_index: torch.Tensor  # int64 [D]: flat index of each decode token
    # int64 [D, max_blocks], padded with block 0: the blocks each decode reads itself,
    # i.e. after the prefix it shares with others (decode_shared), all of them otherwise
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor  # int64 [D]
    # bool [D, 1, 1, max_blocks * block_size]: keys of decode_block_tables each decode
    # sees (None: every key)
    decode_mask: torch.Tensor | None
    decode_shared: list[SharedPrefix] = field(default_factory=list)
    _decode_bias: torch.Tensor | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.decode_index.numel())

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """decode_mask as an additive 0 / -inf bias, made once per step and dtype."""
        if self.decode_mask is None:
            return None
        if self._decode_bias is None or self._decode_bias.dtype != dtype:
            self._decode_bias = torch.zeros(self.decode_mask.shape, dtype=dtype,
                                            device=self.decode_mask.device)
            self._decode_bias.masked_fill_(~self.decode_mask, float("-inf"))
        return self._decode_bias


def build_metadata(spans: list[SeqSpan], block_size: int, device: torch.device,
                   share_prefixes: bool = False) -> AttentionMetadata:
    """Slot mapping and per-path views of a step. Plain Python arithmetic: a decode step
    is many one-token sequences, for which tensor ops per sequence cost more than the
    step's attention. `share_prefixes`: find decodes whose tables start alike
    (`SharedPrefix`); only the GQA decode path reads them."""
    slots: list[int] = []
    prefills: list[SeqSpan] = []
    decodes: list[tuple[SeqSpan, list[int]]] = []
    bs = block_size
    for s in spans:
        table = s.block_table.tolist() if isinstance(s.block_table, torch.Tensor) \
            else list(s.block_table)
        start = s.num_computed
        if s.q_len == 1:
            slots.append(table[start // bs] * bs + start % bs)
        else:
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, s.context_len))
        if s.q_len == 1 and s.num_computed > 0:
            decodes.append((s, table[:-(-s.context_len // bs)]))
        else:
            s.block_table = torch.tensor(table, dtype=torch.int64, device=device)
            if s.num_computed > 0:
                s.prefix_mask = _causal_offset_mask(s.q_len, s.num_computed, device)
            prefills.append(s)
    if len(set(slots)) != len(slots):
        raise ValueError("two new tokens of this batch would write the same KV slot")
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    if not decodes:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return AttentionMetadata(bs, slot_mapping, prefills, empty,
                                 torch.zeros(0, 1, dtype=torch.int64, device=device), empty, None)
    shared, skip = _shared_prefixes(decodes, bs) if share_prefixes else ([], [0] * len(decodes))
    own = [t[k:] for (_, t), k in zip(decodes, skip, strict=True)]
    max_blocks = max(len(t) for t in own)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in own], dtype=torch.int64)
    lens = [s.context_len for s, _ in decodes]
    own_lens = torch.tensor([n - k * bs for n, k in zip(lens, skip, strict=True)],
                            dtype=torch.int64)
    mask = None
    if int(own_lens.min()) != max_blocks * bs:
        keys = torch.arange(max_blocks * bs)
        mask = (keys[None, :] < own_lens[:, None])[:, None, None, :].to(device)
    index = torch.tensor([s.q_start for s, _ in decodes], dtype=torch.int64, device=device)
    groups = [SharedPrefix(torch.tensor(rows, dtype=torch.int64, device=device),
                           torch.tensor(blocks, dtype=torch.int64, device=device))
              for rows, blocks in shared]
    return AttentionMetadata(bs, slot_mapping, prefills, index, tables.to(device),
                             torch.tensor(lens, dtype=torch.int64, device=device), mask,
                             groups)


def _shared_prefixes(decodes: list[tuple[SeqSpan, list[int]]], bs: int
                     ) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Group decodes by their first block; each group shares its tables' longest common
    run of leading blocks that lie wholly before every member's new token. Returns the
    groups worth a call of their own (rows, blocks) and, per decode, how many leading
    blocks its group covers (0 outside one)."""
    by_first: dict[int, list[int]] = {}
    for row, (_, table) in enumerate(decodes):
        by_first.setdefault(table[0], []).append(row)
    skip = [0] * len(decodes)
    groups: list[tuple[list[int], list[int]]] = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        tables = [decodes[r][1] for r in rows]
        limit = min((decodes[r][0].context_len - 1) // bs for r in rows)
        first = tables[0]
        n = limit
        for t in tables[1:]:
            if t[:n] != first[:n]:  # a slice compare runs in C; scan only where it fails
                n = next(i for i in range(n) if t[i] != first[i])
        if n * bs * (len(rows) - 1) < MIN_SHARED_TOKENS_SAVED:
            continue
        groups.append((rows, first[:n]))
        for r in rows:
            skip[r] = n
    return groups, skip


def _causal_offset_mask(q_len: int, num_computed: int, device: torch.device,
                        first: int = 0) -> torch.Tensor:
    """bool [q_len, num_computed + first + q_len]: new token `first + i` (at position
    num_computed + first + i) sees keys up to its own position."""
    end = num_computed + first + q_len
    q_pos = torch.arange(num_computed + first, end, device=device)
    return torch.arange(end, device=device)[None, :] <= q_pos[:, None]


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
    """q [T, H, D], k/v [T, KVH, D] for the step's new tokens; k_cache/v_cache
    [num_blocks, block_size, KVH, D] of this layer. Writes k/v into the pool, returns
    the attention output [T, H, D]."""
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
            ks = gather_blocks(k_cache, s.block_table, s.context_len).to(q.dtype)
            vs = gather_blocks(v_cache, s.block_table, s.context_len).to(q.dtype)
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
    """softmax(q k^T * scale + bias) v and the rows' log-sum-exp, q [B, H, L, d],
    k/v [B, H, S, d]. On CPU torch's flash kernel returns both (the public SDPA drops the
    log-sum-exp); elsewhere plain matmuls."""
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
    """Multi-head latent attention over the pool. q_nope [T, H, dn], q_rope [T, H, dr],
    latent [T, r + dr] (normalised c_kv then rotated k_rope) for the new tokens.
    Returns [T, H, dv].

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
            ctx = gather_blocks(cache, s.block_table, s.context_len).to(q_nope.dtype)
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
                mask = _causal_offset_mask(s.q_len, s.num_computed, q.device)
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
