"""The hierarchy's counters (the server turns them into metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierCounters:
    """What the lower tiers have done so far, as counts the server turns into metrics."""

    # Every prompt, counted once by `record_prompt` (an engine: at its first admission,
    # with or without a lower-tier plan), as the device cache's stats count it: the
    # tokens served from the device and from lower tiers, never a token recomputed.
    # total_hit_rate is the cache's hit_rate (`kvheat.cache.hit_rate`).
    requests: int = 0
    query_tokens: int = 0
    device_hit_tokens: int = 0
    lower_hit_tokens: int = 0
    found_tokens: int = 0  # on lower tiers, contiguous after the device hit
    loaded_blocks: int = 0
    recompute_chosen_blocks: int = 0  # found below but recomputing was faster
    recompute_chosen_tokens: int = 0
    decisions_load: int = 0  # requests that loaded from a lower tier
    decisions_recompute: int = 0  # requests that found blocks below and recomputed them all
    decisions_partial: int = 0  # loaded a prefix of what was found, recomputed the rest
    load_failed: int = 0  # planned loads that came back missing or unverified
    shape_mismatch: int = 0
    orphans_dropped: int = 0  # lower-tier entries deleted because an ancestor left for good
    remeasure_loads: int = 0  # blocks loaded only to measure a tier judged too slow again
    est_load_s: float = 0.0  # estimated seconds of the loads done
    est_recompute_saved_s: float = 0.0  # estimated prefill seconds they replaced
    demotions: int = 0
    demote_refused: int = 0  # no tier took the block
    demote_dropped: int = 0  # the background queue was full
    dropped_bottom: int = 0  # evicted from the lowest tier
    prefetch_plans: int = 0
    prefetch_used: int = 0
    prefetch_replanned: int = 0
    worker_errors: int = 0
    # Bytes read from lower tiers to promote blocks, bytes written into device blocks from
    # them, and bytes read for plans dropped before use (request ended, flushed, device hit
    # grew meanwhile): read_bytes <= promoted_bytes + unused_read_bytes, each block read
    # at most once per promotion.
    read_bytes: int = 0
    promoted_bytes: int = 0
    unused_read_bytes: int = 0
    backlog_recomputes: int = 0  # plans cut short because the loaders' backlog made loading slower

