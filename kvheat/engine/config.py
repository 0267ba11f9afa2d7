"""The engine's settings: `SchedulerConfig` (the batch each step builds) and `EngineConfig`
(the KV pool, the eviction policy, preemption and the lower KV tiers). The model's own
settings are `ModelConfig`, in model_config.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import check_fields
from ..tiers.spec import TierSpec
from .load_classes import LOAD_CLASSES, ClassWeight, default_class_weights


@dataclass(slots=True)
class SchedulerConfig:
    """How the scheduler batches: token and sequence limits, prefix caching, preemption."""

    max_num_batched_tokens: int = 256  # tokens per step, decode and prefill together
    max_num_seqs: int = 16  # running sequences at once
    prefix_caching: str = "block"  # "block": any cached prefix; "exact": whole prompt only; "off"
    # A preempted sequence's blocks are freed and recomputed on resume; the full ones stay
    # cached, or go down to the host tier when evicted and load back (no swap space, as
    # in vLLM v1).
    preemption: str = "recompute"
    # Load classes by estimated work (prompt + max new tokens, in tokens): the design
    # classes by latency, and on one engine latency grows with work.
    short_max_tokens: int = 128
    long_min_tokens: int = 1024
    class_weights: dict[str, ClassWeight] = field(default_factory=default_class_weights)
    # Aging guard: a request waiting (or still in prefill) this long goes first, and while
    # it cannot get its blocks no younger request is admitted.
    aging_s: float = 5.0
    # Lower tiers: a request arriving with fewer than this many ahead of it in the queue
    # starts its disk / Redis loads at once (its plan pins those entries until it runs).
    prefetch_queue_depth: int = 16
    # Tell the cache policy what the engine knows of each request: its session, the blocks
    # of requests waiting in the queue, and how it ended (answered or cancelled, and the
    # finish reason). Off: the policy sees none of it (as before hints existed).
    cache_hints: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "scheduler")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.prefetch_queue_depth < 0:
            raise ValueError("prefetch_queue_depth must be >= 0")
        if self.prefix_caching not in ("block", "exact", "off"):
            raise ValueError(f"prefix_caching must be block, exact or off, not {self.prefix_caching!r}")
        if self.preemption == "swap":
            raise ValueError("preemption='swap' was removed: a preempted sequence's full "
                             "blocks stay cached, or go down to the host tier "
                             "(host_tier_blocks) and load back from it")
        if self.preemption != "recompute":
            raise ValueError(f"preemption must be recompute, not {self.preemption!r}")
        if set(self.class_weights) != set(LOAD_CLASSES):
            raise ValueError(f"class_weights needs exactly the classes {LOAD_CLASSES}")
        if not 0 < self.short_max_tokens < self.long_min_tokens:
            raise ValueError("need 0 < short_max_tokens < long_min_tokens")


@dataclass(slots=True)
class EngineConfig:
    """The engine's KV pool, block size, eviction policy, scheduler and lower tiers."""

    num_blocks: int | None = 512  # device KV blocks; or size the pool by kv_memory_bytes
    kv_memory_bytes: int | None = None
    block_size: int = 16
    policy: str = "kvheat"  # eviction policy of the block cache (kvheat.heat's scale-free heat)
    # tenant -> share group: tenants of one group reuse each other's blocks (CacheConfig).
    share_groups: dict[str, str] = field(default_factory=dict)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Lower KV tiers under the device cache (kvheat.tiers.TierSpec): host memory, local
    # disk (survives a restart), Redis (shared by replicas).
    tiers: TierSpec = field(default_factory=TierSpec)
    # Names the KV on disk and in Redis: None: a fingerprint of the weights, so KV of other
    # weights is never served.
    model_id: str | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "engine")
        if self.num_blocks is None and self.kv_memory_bytes is None:
            raise ValueError("give num_blocks or kv_memory_bytes")
        if (self.num_blocks is not None and self.num_blocks < 1) or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
