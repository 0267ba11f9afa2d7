"""A vLLM KV connector that does nothing: the fair baseline for a connector's cost.

vLLM changes more than the hooks' calls when any KV connector is configured (on the CPU
build its automatic OpenMP binding reserves one more core for the connector: on a 2-core
machine the compute then gets both cores instead of one; see docs/vllm.md, "What a KV
connector changes in vLLM itself"). A server with this connector has every such change and
no cache, so a connector's row against it shows only what the connector does.

    --kv-transfer-config '{"kv_connector": "NoopConnector", "kv_role": "kv_both",
      "kv_connector_module_path": "bench.vllm.noop_connector"}'

(with the repository root on the server's PYTHONPATH).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class NoopConnector(KVConnectorBase_V1):
    """Finds nothing, loads nothing, saves nothing."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """No external tokens, ever."""
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Nothing to plan."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """An empty plan."""
        return KVConnectorMetadata()
