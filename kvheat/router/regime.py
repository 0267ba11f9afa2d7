"""The cluster's entropy, for the replicas' eviction regime.

A router that keeps each prefix on one replica hands each replica a shard of the keys:
log2(replicas) bits fewer than the whole traffic. A kvheat replica reads its regime from
the entropy of the keys under its roots (docs/heat.md), so a replica of high-entropy
traffic reads as middling and stops charging first-seen blocks, which one cache of all
the traffic would charge. The router sees all the traffic: it measures the entropy one
cache of all of it would (the keys right under the roots, the heat policy's window) and
reports it to the replicas, whose regime then reads it (`KVHeat.set_cluster_entropy`).
docs/cluster.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..heat.entropy import EntropyTracker

# The heat policy's own entropy window (KVHeat's `entropy_half_life`), in depth-1 accesses:
# about one per request.
WINDOW = 1024.0


class ClusterEntropy:
    """Decayed entropy of each routed request's depth-1 key (the block right under its root).

    Keys are never forgotten by the tracker, so past `max_keys` a fresh one starts, and the
    old one answers until the fresh one has seen two windows of requests."""

    def __init__(self, window: float = WINDOW, max_keys: int = 1 << 18) -> None:
        self.window = window
        self.max_keys = max_keys
        self.live = EntropyTracker(half_life=window)
        self.answering = self.live

    def observe(self, keys: Sequence[bytes]) -> None:
        """Take one routed request's keys (its depth-1 key, when it has one)."""
        if len(keys) < 2:
            return  # no block under the root: nothing a replica's regime reads either
        live = self.live
        if len(live) >= self.max_keys:
            self.answering = live
            self.live = live = EntropyTracker(half_life=self.window)
        live.update(keys[1])
        if self.answering is not live and live.updates >= 2 * self.window:
            self.answering = live

    def bits(self) -> float | None:
        """The entropy in bits, as one cache of all the traffic reads it from its first request on.

        None before the first request with a depth-1 key. (A router that has just started
        reads few keys, so low; a replica never reads less than its own.)"""
        t = self.answering
        return t.bits() if t.updates else None
