"""DeepSeek-V2/V3-style decoder: multi-head latent attention (MLA) and a mixture of
experts (shared experts plus top-k routed experts; the first `first_k_dense_replace`
layers dense).

MLA caches, per token and layer, only the normalised compressed latent c_kv
(kv_lora_rank numbers) and the rotated rope key (qk_rope_head_dim numbers); per-head keys
and values are recomputed from c_kv by `kv_b_proj` at prefill, and never at decode, which
runs in the absorbed form (see `attention.paged_mla_attention`).

Parameter names follow the Hugging Face checkpoints (per-expert
`mlp.experts.N.gate_proj.weight`, `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import paged_mla_attention, softmax_scale
from .attention_metadata import AttentionMetadata
from .kv_pool import DeviceKVPool
from .llama import CausalLM, GatedMLP
from .model_config import ModelConfig
from .norm import RMSNorm
from .rotary import apply_rope, apply_rope_interleaved


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA) layer over the paged KV pool."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.r, self.dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.dn, self.dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        qk = self.dn + self.dr
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * qk, bias=False)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r + self.dr, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, self.heads * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.heads * self.dv, h, bias=cfg.o_bias)
        self.rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        self.scale = softmax_scale(cfg)
        self.absorb_prefill = False  # True: prefills also run absorbed (for checks)

    def expand_kv(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [S, r] -> k_nope [S, H, dn], v [S, H, dv]."""
        kv = self.kv_b_proj(c_kv).view(c_kv.shape[0], self.heads, self.dn + self.dv)
        return kv[..., :self.dn], kv[..., self.dn:]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, r] and W_UV [H, dv, r], views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.heads, self.dn + self.dv, self.r)
        return w[:, :self.dn], w[:, self.dn:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, pool: DeviceKVPool) -> torch.Tensor:
        """Attention of the step's tokens `x`; writes their latents into the pool."""
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, self.heads, self.dn + self.dr)
        q_nope, q_rope = q[..., :self.dn], q[..., self.dn:]
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(ckv[:, :self.r])
        k_rope = ckv[:, None, self.r:]
        q_rope, k_rope = self.rope(q_rope, cos, sin), self.rope(k_rope, cos, sin)
        latent = torch.cat((c_kv, k_rope[:, 0]), dim=-1)
        w_uk, w_uv = self.absorbed_weights()
        o = paged_mla_attention(q_nope, q_rope, latent, pool.mla_layer(self.layer),
                                meta, self.scale, self.r, self.expand_kv, w_uk, w_uv,
                                self.absorb_prefill)
        return self.o_proj(o.reshape(t, self.heads * self.dv))


class MoEGate(nn.Module):
    """The router: top-k experts per token and their weights (fp32)."""

    e_score_correction_bias: torch.Tensor  # a buffer, registered for noaux_tc only

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.n_experts = cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.method, self.scoring = cfg.topk_method, cfg.scoring_func
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        if self.method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {self.method!r}")
        if self.scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"unsupported scoring_func {self.scoring!r}")
        if self.n_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        if self.method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def _group_mask(self, choice: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, idx, 1.0).bool()
        return mask[:, :, None].expand(-1, -1, self.n_experts // self.n_group).reshape(
            choice.shape[0], -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts and their weights, as DeepSeek's router picks them."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(-1)
        per_group = self.n_experts // self.n_group
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
            choice = choice.masked_fill(~self._group_mask(choice, group_scores), float("-inf"))
            idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
        elif self.method == "group_limited_greedy":
            group_scores = scores.view(-1, self.n_group, per_group).max(-1).values
            masked = scores.masked_fill(~self._group_mask(scores, group_scores), 0.0)
            weights, idx = torch.topk(masked, k=self.top_k, dim=-1, sorted=False)
        else:
            weights, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.method == "noaux_tc":
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * self.scaling
        elif self.top_k > 1 and self.norm_topk_prob:  # DeepSeek-V2: normalise or scale
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.scaling
        return idx, weights


class MoE(nn.Module):
    """DeepSeek's mixture of experts: routed experts, plus shared ones when the config has them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = MoEGate(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
            for _ in range(cfg.n_routed_experts))
        self.shared_experts = (GatedMLP(cfg.hidden_size,
                                        cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        cfg.hidden_act) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run each token through its chosen experts (and the shared ones) and mix their outputs."""
        idx, weights = self.gate(x)
        out = torch.zeros_like(x)
        # Group the (token, slot) pairs by expert so each expert runs once on its tokens.
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // idx.shape[1]
        w_of = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            y = self.experts[e](x[tok]) * w_of[start:start + n, None]
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    """One DeepSeek decoder layer: MLA, then a dense MLP or a mixture of experts."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, pool: DeviceKVPool) -> torch.Tensor:
        """The layer's output for the step's tokens `x` (pre-norm residual blocks)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekForCausalLM(CausalLM):
    """A DeepSeek (V2/V3 family) causal LM over the paged KV pool."""

    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.is_mla:
            raise ValueError(f"{cfg.model_type} is not a DeepSeek config; use LlamaForCausalLM")
        super().__init__(cfg, [DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])

    def set_absorb_prefill(self, on: bool) -> None:
        """Run prefills in MLA's absorbed form too (`on`), or expanded (the default)."""
        for m in self.modules():
            if isinstance(m, MLAttention):
                m.absorb_prefill = on
