"""Rotary position embeddings: the frequencies of each RoPE variant (default, linear,
llama3, yarn) as transformers computes them, and the NeoX and interleaved (DeepSeek)
rotations."""

from __future__ import annotations

import math

import torch
from torch import nn

from .model_config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale of the config's RoPE variant.

    Default, linear, llama3 or yarn, as transformers computes them; fp32, on the CPU (also
    while a model is built on the meta device)."""
    dim = cfg.rope_dim
    base = cfg.rope_theta
    rs = cfg.rope_scaling
    kind = rs.get("rope_type", "default")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if kind == "default":
        return inv, 1.0
    factor = float(rs["factor"]) if rs.get("factor") is not None else None
    if kind == "linear":
        if factor is None:
            raise ValueError("rope_scaling of type 'linear' needs a 'factor'")
        return inv / factor, 1.0
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
        attn = (yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all
                else yarn_mscale(factor))
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


class RotaryEmbedding(nn.Module):
    """The cos and sin tables of rotary position embeddings for given positions."""

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
    """Rotate DeepSeek's interleaved pairs (x0, x1), (x2, x3) ...

    The output is laid out de-interleaved (evens then odds), exactly as transformers does,
    which keeps q.k."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
