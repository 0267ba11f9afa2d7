"""Sampling: what a request asks for (`SamplingParams`) and the sampler that turns one step's
logits into one token per request.

Greedy at temperature 0 (and below `GREEDY_BELOW`), else temperature / top-k / top-p
from a `torch.Generator` seeded per request, so a run is reproducible. `logit_bias` (a
tenant's defaults, OpenAI's `logit_bias`) is added to the logits first, greedy or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Temperatures below this sample greedily: dividing the logits by them overflows (as vLLM).
GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How a request's tokens are drawn: length, temperature, top-p/top-k, seed, stops, bias."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: derived from the engine seed and the request number
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")


class RequestSampler:
    """One request's sampling state.

    Its params, its generator (None when greedy) and its logit bias as index / value tensors
    on the logits' device."""

    __slots__ = ("params", "generator", "bias_ids", "bias_values")

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device,
                 seed: int) -> None:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                             f"of {vocab_size}")
        self.params = params
        self.generator = (torch.Generator(device=device).manual_seed(seed)
                          if params.temperature > 0 else None)
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if params.logit_bias:
            self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64,
                                         device=device)
            self.bias_values = torch.tensor(list(params.logit_bias.values()),
                                            dtype=torch.float32, device=device)


def sample(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    """One token for each row of `logits` [rows, vocab], row i by `samplers[i]`.

    Adds the logit biases in place: `logits` must be the caller's own copy."""
    for i, s in enumerate(samplers):
        if s.bias_ids is not None:
            assert s.bias_values is not None
            logits[i].index_add_(0, s.bias_ids, s.bias_values.to(logits.dtype))
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, s in enumerate(samplers):
        p = s.params
        if p.temperature < GREEDY_BELOW:
            out.append(int(greedy[i]))
            continue
        row = logits[i].float() / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, idx = torch.sort(probs, descending=True)
            # keep the smallest set whose mass reaches top_p (the first token always)
            drop = sp.cumsum(0) - sp >= p.top_p
            drop[0] = False  # a top_p below float32's smallest value must keep one token
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sp)
        out.append(int(torch.multinomial(probs, 1, generator=s.generator).item()))
    return out
