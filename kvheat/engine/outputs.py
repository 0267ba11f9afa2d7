"""What the engine hands back: each sampled token (`TokenOutput`), a finished request with
its timings (`RequestOutput`, `RequestMetrics`), and the engine's own counters
(`EngineStats`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import ScheduledItem, Seq


@dataclass(slots=True)
class TokenOutput:
    """One generated token of a request, as the engine streams it."""

    request_id: str
    token_id: int
    index: int  # 0 for the first generated token
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished


@dataclass(slots=True)
class RequestMetrics:
    """One request's timings and the prompt tokens its cache served."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    # Prompt tokens whose KV came from the prefix cache (any tier; never the last prompt
    # token, run again for its logits), as its first admission found them; and the same by
    # tier. `admitted`: it was admitted, so the cache's hit rate counts its prompt.
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    admitted: bool = False
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token (None before it)."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(slots=True)
class RequestOutput:
    """A finished request: its prompt, its output tokens, why it ended, its metrics."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    text: str | None = None



@dataclass(slots=True)
class EngineStats:
    """The engine's counters: steps and their time, tokens run, preemptions, failures."""

    steps: int = 0
    step_seconds: float = 0.0  # whole steps: scheduling, forward pass, sampling
    schedule_seconds: float = 0.0  # the scheduler with the block cache's bookkeeping
    other_seconds: float = 0.0  # batch building, sampling, finishing (frees blocks)
    forward_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    preemptions: int = 0
    failed_steps: int = 0  # forward passes that raised (their requests ended with "error")
    unschedulable: int = 0  # requests that could never get their blocks (ended with "error")
    # For "KV memory saved": blocks the running sequences hold, summed over steps, as
    # logical references and as distinct physical blocks.
    logical_blocks: int = 0
    physical_blocks: int = 0

    def count_memory(self, running: Iterable[Seq], num_referenced: int) -> None:
        """Once per step that runs: the blocks the running sequences hold."""
        self.steps += 1
        self.logical_blocks += sum(len(s.cache_req.blocks) for s in running
                                   if s.cache_req is not None)
        self.physical_blocks += num_referenced

    def count_tokens(self, items: Iterable[ScheduledItem]) -> None:
        """Count a step's items as prefill or decode tokens."""
        for it in items:  # decode: one token after the whole prompt's KV
            if it.num_computed >= it.seq.num_prompt_tokens and len(it.token_ids) == 1:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += len(it.token_ids)

    @property
    def kv_memory_saved(self) -> float:
        """The share of logical blocks that sharing saved (1 - physical / logical)."""
        return 1.0 - self.physical_blocks / self.logical_blocks if self.logical_blocks else 0.0

