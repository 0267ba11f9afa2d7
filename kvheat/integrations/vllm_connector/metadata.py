"""What the connector's two halves tell each other through vLLM's per-step metadata: the
scheduler's plan for the step (`KVHeatConnectorMetadata`), the worker's report on it
(`KVHeatWorkerMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ...cache.hashing import BlockKey


@dataclass(slots=True)
class LoadJob:
    """Blocks of one request to load from the tiers into vLLM's device blocks."""

    req_id: str
    salt: str | None  # the tenant salt (the worker's tiers take it as a `Namespace`)
    first: int  # the request's block index of keys[0]
    keys: list[BlockKey]
    slots: list[int]  # vLLM's device blocks to fill, one per key
    background: bool  # on a loader thread (the request waits), else before the forward


@dataclass(slots=True)
class SaveJob:
    """Blocks that fill during the step, to copy out of vLLM's device blocks to the tiers."""

    salt: str | None  # the tenant salt (the worker's tiers take it as a `Namespace`)
    keys: list[BlockKey]
    parents: list[BlockKey | None]
    slots: list[int]


@dataclass(slots=True)
class FinishHint:
    """A request's end, for the tiers' policy (`TierManager.finish`)."""

    keys: list[BlockKey]  # its blocks' keys, prefix order
    session: str | None  # the scheduler's digest of its session
    outcome: str  # an `Outcome` value
    reason: str | None  # vLLM's finish reason


@dataclass
class KVHeatConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step: loads, saves and request hints."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Hints, applied before the step's loads and saves: sessions of requests new since
    # the last step (in order), then the ends of requests finished since.
    sessions: list[str] = field(default_factory=list)
    finished: list[FinishHint] = field(default_factory=list)


@dataclass
class KVHeatWorkerMetadata(KVConnectorWorkerMetadata):
    """The worker's report after a step: tier changes, failed loads, tiers down."""

    # (tier, key, stored): the worker's tiers took (True) or lost (False) a key, in order.
    changes: list[tuple[str, bytes, bool]] = field(default_factory=list)
    # (request id, block index): a load failed from this block on (vLLM recomputes it).
    failed: list[tuple[str, int]] = field(default_factory=list)
    # Tiers down now (Redis gone): the scheduler plans no loads from them meanwhile.
    down: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both reports in one (changes and failures in order, tiers down in either)."""
        assert isinstance(other, KVHeatWorkerMetadata)
        return KVHeatWorkerMetadata(self.changes + other.changes, self.failed + other.failed,
                                    sorted({*self.down, *other.down}))
