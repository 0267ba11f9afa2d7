"""kvheat's tiers as vLLM's KV store: `KVHeatConnector`, a vLLM v1 KV connector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVHeatConnector",
      "kv_connector_module_path": "kvheat.integrations.vllm_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"host_tier_size": "8GiB"}}'

vLLM runs the scheduler and the model runner in two processes (its CPU build always uses
the multiprocessing executor), so the connector is two halves that talk only through
vLLM's per-step metadata (`metadata.py`), laid out as vLLM's own offloading connector:

- `worker.py`, the worker half: owns the tiers (`TierManager`) and vLLM's KV tensors
  (`VLLMDeviceBlocks`); each step it loads what the scheduler planned, copies out each
  block that became full, and reports back which keys its tiers took or lost.
- `scheduler.py`, the scheduler half: keeps a mirror of those keys (`mirror.py`,
  `TierMirror`) and answers vLLM's one question (how many tokens past the device's prefix
  can the tiers supply) from it, with no I/O. The mirror is exact for everything the
  worker did in earlier steps; a key lost since (a background eviction, Redis gone, a value
  failing its MAC) fails its load, and vLLM recomputes from that block
  (`get_block_ids_with_load_errors`; the connector sets `kv_load_failure_policy` to
  "recompute"). Never wrong KV.
  It sends the blocks the tiers take or lose as vLLM KV events (`events.py`).
- `config.py` reads `kv_connector_extra_config`; `metrics.py` puts tier hits, bytes,
  faults and loads against recomputes on vLLM's /metrics.

`KVHeatConnector` itself holds nothing but the half of its process and hands each of
vLLM's hooks to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConnectorConfig, ConnectorSetup
from .metadata import (
    FinishHint,
    KVHeatConnectorMetadata,
    KVHeatWorkerMetadata,
    LoadJob,
    SaveJob,
)
from .metrics import KVHeatConnectorStats, KVHeatPromMetrics
from .mirror import TierMirror
from .scheduler import KVHeatConnectorScheduler
from .worker import KVHeatConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "ConnectorConfig",
    "ConnectorSetup",
    "FinishHint",
    "KVHeatConnector",
    "KVHeatConnectorMetadata",
    "KVHeatConnectorScheduler",
    "KVHeatConnectorStats",
    "KVHeatConnectorWorker",
    "KVHeatPromMetrics",
    "KVHeatWorkerMetadata",
    "LoadJob",
    "SaveJob",
    "TierMirror",
]


class KVHeatConnector(KVConnectorBase_V1):
    """kvheat's tiers as vLLM's KV store: builds the half of its role and delegates to it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        setup = ConnectorSetup.from_vllm(vllm_config, kv_cache_config)
        self.connector_scheduler: KVHeatConnectorScheduler | None = None
        self.connector_worker: KVHeatConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVHeatConnectorScheduler(setup, vllm_config)
        else:
            self.connector_worker = KVHeatConnectorWorker(setup, kv_cache_config)

    @property
    def scheduler(self) -> KVHeatConnectorScheduler:
        """The scheduler half (in vLLM's scheduler process only)."""
        if self.connector_scheduler is None:
            raise RuntimeError("KVHeatConnector: a scheduler hook in the worker process")
        return self.connector_scheduler

    @property
    def worker(self) -> KVHeatConnectorWorker:
        """The worker half (in vLLM's model-runner process only)."""
        if self.connector_worker is None:
            raise RuntimeError("KVHeatConnector: a worker hook in the scheduler process")
        return self.connector_worker

    @property
    def requires_kv_delivery(self) -> bool:
        """No: a dropped save is a future miss, nothing more."""
        return False

    # ==== scheduler hooks =========================================================================
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past the device's prefix that the tiers hold (scheduler half)."""
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load into the blocks vLLM allocated (scheduler half)."""
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The planned load's tokens by tier (scheduler half)."""
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads, saves and hints for the worker (scheduler half)."""
        return self.scheduler.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the worker's report of the step (scheduler half)."""
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        """The tiers' KV events since the last call (scheduler half)."""
        return self.scheduler.take_events()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget a finished request, its blocks freed at once (scheduler half)."""
        return self.scheduler.request_finished(request)

    # ==== worker hooks ============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Open the tiers over vLLM's KV tensors (worker half)."""
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Apply the step's hints and start its loads (worker half)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHeatConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads complete before the forward (or the request waits for them)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing: whole blocks, all layers at once, in wait_for_save."""

    def wait_for_save(self) -> None:
        """Copy the step's full blocks out to the tiers (worker half)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHeatConnectorMetadata)
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                   set[str] | None]:
        """Requests whose background loads finished (worker half)."""
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks that failed to load, for vLLM to recompute (worker half)."""
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The worker's report of the step for the scheduler (worker half)."""
        return self.worker.build_connector_worker_meta()

    # ==== both processes ==========================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's half's counters since the last call."""
        if self.connector_worker is not None:
            return self.connector_worker.get_stats()
        return self.scheduler.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        """The stats vLLM carries from the halves to its metrics."""
        return KVHeatConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        """The connector's metrics on vLLM's /metrics."""
        return KVHeatPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Flush and close the tiers (worker half; nothing in the scheduler)."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
