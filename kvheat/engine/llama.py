"""Llama-style decoder (Llama, Qwen2, Qwen3, Mistral without sliding window): RoPE,
RMSNorm, SwiGLU, grouped-query attention, Qwen2's q/k/v bias, Qwen3's per-head q/k norm.

Parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj...`),
so a `model.safetensors` loads by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import paged_gqa_attention, softmax_scale
from .attention_metadata import AttentionMetadata
from .kv_pool import DeviceKVPool
from .linear import PackedGemm, fused_projection, make_gemm, project
from .model_config import ModelConfig
from .norm import RMSNorm
from .rotary import RotaryEmbedding, apply_rope

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function of a config's `hidden_act` name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act)
        self.gate_up: PackedGemm | None = None
        self.down: PackedGemm | None = None

    def pack(self) -> None:
        """Pack the projections for the CPU's GEMM, where packing applies."""
        self.gate_up = make_gemm([self.gate_proj, self.up_proj])
        self.down = make_gemm([self.down_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x))."""
        gate, up = fused_projection(x, self.gate_up, [self.gate_proj, self.up_proj])
        return project(self.act(gate) * up, self.down, self.down_proj)


class LlamaAttention(nn.Module):
    """Llama-family attention (GQA, RoPE, optional q/k norms) over the paged KV pool."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = softmax_scale(cfg)
        self.qkv: PackedGemm | None = None
        self.out: PackedGemm | None = None

    def pack(self) -> None:
        """Pack the projections for the CPU's GEMM, where packing applies."""
        self.qkv = make_gemm([self.q_proj, self.k_proj, self.v_proj])
        self.out = make_gemm([self.o_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, pool: DeviceKVPool) -> torch.Tensor:
        """Attention of the step's tokens `x`; writes their K/V into the pool."""
        t = x.shape[0]
        q, k, v = fused_projection(x, self.qkv, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = pool.gqa_layer(self.layer)
        o = paged_gqa_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return project(o.reshape(t, -1), self.out, self.o_proj)


class LlamaDecoderLayer(nn.Module):
    """One Llama-family decoder layer: attention, then a gated MLP."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, pool: DeviceKVPool) -> torch.Tensor:
        """The layer's output for the step's tokens `x` (pre-norm residual blocks)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """embed -> layers -> final norm; the part named `model.` in HF checkpoints."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, pool: DeviceKVPool) -> torch.Tensor:
        """The final hidden states of the step's tokens: embedded, through every layer, normed."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta, pool)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder plus its LM head.

    `forward` returns final hidden states of all new tokens, `compute_logits` projects the
    rows the caller picks."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, layers)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head: PackedGemm | None = None
        self.tie_weights()

    def pack_weights(self) -> None:
        """Prepack the projections for the CPU's GEMM (kvheat.engine.linear).

        Call again after the weights change. A no-op where packing does not apply."""
        for m in self.modules():
            if isinstance(m, (LlamaAttention, GatedMLP)):
                m.pack()
        self.head = make_gemm([self.lm_head])

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so.

        Again after any re-materialisation, which unties."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, pool: DeviceKVPool) -> torch.Tensor:
        """The final hidden states of the step's new tokens."""
        return self.model(input_ids, positions, meta, pool)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits of the hidden-state rows `hidden`."""
        return project(hidden, self.head, self.lm_head).float()


class LlamaForCausalLM(CausalLM):
    """A Llama-family causal LM (Llama, Mistral, Qwen2/3) over the paged KV pool."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.is_mla:
            raise ValueError(f"{cfg.model_type} is a DeepSeek config; use DeepseekForCausalLM")
        super().__init__(cfg, [LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
