"""RMSNorm, as every decoder here uses it (and as transformers computes it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, as transformers computes it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised by its root mean square, then scaled."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel: the same numbers as the steps below in one pass
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As transformers: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
