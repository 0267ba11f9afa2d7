"""The connector's configuration: `kv_connector_extra_config` read and type-checked
(`ConnectorConfig`), and what both halves take from vLLM's config (`ConnectorSetup`)."""

from __future__ import annotations

import logging
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_interface import MLAAttentionSpec

from ...cache.eviction import policy_names
from ...cache.tenancy import TENANT_SECRET_ENV, TenantVouch
from ...checks import check_value, parse_size
from ...tiers.spec import MODES, TierSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger, so these lines come out in its format and at its level.
log = logging.getLogger("vllm.kvheat_connector")


@dataclass(slots=True)
class ConnectorConfig:
    """The connector's settings, read from vLLM's `kv_connector_extra_config`.

    The tier keys of `kvheat serve` (sizes in bytes or as "64GiB", "500MB"; the host tier
    is sized in bytes here, as vLLM operators size offload buffers), each key exactly its
    type."""

    host_tier_size: int | str = 0
    disk_tier_dir: str | None = None
    disk_tier_size: int | str = 0
    redis_tier_url: str | None = None
    redis_tier_size: int | str = 0
    redis_cluster: bool = False
    redis_tier_shared: bool = True  # load blocks other replicas put in the Redis tier
    tier_secret: str | None = None  # keys every value's MAC; replicas sharing a tier: one
    tier_mode: str = "exclusive"  # or "write_through"
    policy: str = "kvheat"  # the tiers' eviction policy
    # Tenants of one group share KV, as in `kvheat serve`'s tenants: {tenant: group}.
    share_groups: dict[str, str] = field(default_factory=dict)
    # None: loads from disk or Redis run on loader threads while the request waits
    # (WAITING_FOR_REMOTE_KVS), loads from host memory before the step's forward;
    # true / false: every load one way.
    async_load: bool | None = None
    # Pass requests' hints (session, cancelled or finished, finish reason) to the tiers'
    # policy; false: never (every decision as without hints).
    request_hints: bool = True
    # Keys the MAC with which a trusted front (`kvheat route`, its `tenant_secret`) vouches
    # for `kv_transfer_params["tenant"]` (at least 16 bytes; None: $KVHEAT_TENANT_SECRET).
    # A tenant without a valid MAC is refused, so without a secret none is accepted.
    tenant_secret: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Read `kv_connector_extra_config`.

        A ValueError names an unknown key or a bad value."""
        extra = dict(extra or {})
        hints = typing.get_type_hints(cls)
        known = [f.name for f in fields(cls)]
        for k, v in extra.items():
            if k not in hints:
                raise ValueError(f"kv_connector_extra_config: unknown key {k!r} "
                                 f"(known: {', '.join(known)})")
            check_value(v, hints[k], k, "kv_connector_extra_config")
        cfg = cls(**extra)
        for k in ("host_tier_size", "disk_tier_size", "redis_tier_size"):
            setattr(cfg, k, parse_size(getattr(cfg, k), k))
        if cfg.tier_mode not in MODES:
            raise ValueError(f"kv_connector_extra_config: tier_mode must be one of {MODES}, "
                             f"not {cfg.tier_mode!r}")
        if cfg.policy not in policy_names():
            raise ValueError(f"kv_connector_extra_config: policy {cfg.policy!r} is not one "
                             f"of {', '.join(policy_names())}")
        try:
            cfg.tenant_vouch()
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: tenant_secret (or "
                             f"${TENANT_SECRET_ENV}): {e}") from None
        return cfg

    def tenant_vouch(self) -> TenantVouch | None:
        """The secret that checks vouched tenants (this key, else the environment)."""
        return TenantVouch.from_config(self.tenant_secret)

    def tier_spec(self, block_bytes: int) -> TierSpec:
        """The tiers, with the host tier's bytes in whole blocks of `block_bytes`."""
        assert isinstance(self.host_tier_size, int)
        assert isinstance(self.disk_tier_size, int)
        assert isinstance(self.redis_tier_size, int)
        host_blocks = self.host_tier_size // block_bytes
        if self.host_tier_size and not host_blocks:
            raise ValueError(f"host_tier_size {self.host_tier_size} is less than one block "
                             f"({block_bytes} bytes)")
        spec = TierSpec(host_blocks=host_blocks, disk_dir=self.disk_tier_dir,
                        disk_bytes=self.disk_tier_size, redis_url=self.redis_tier_url,
                        redis_bytes=self.redis_tier_size, redis_cluster=self.redis_cluster,
                        redis_shared=self.redis_tier_shared, secret=self.tier_secret,
                        mode=self.tier_mode, policy=self.policy)
        if not spec.enabled:
            raise ValueError("kv_connector_extra_config names no tier: give host_tier_size, "
                             "disk_tier_dir and disk_tier_size, or redis_tier_url and "
                             "redis_tier_size")
        return spec


@dataclass(frozen=True, slots=True)
class ConnectorSetup:
    """What both halves take from vLLM's config, checked once per process."""

    config: ConnectorConfig
    block_size: int  # vLLM's block, in tokens: the tiers' block
    layout: str  # "mla" or "gqa": how `VLLMDeviceBlocks` reads vLLM's KV tensors
    model_id: str  # the tiers' model name (their keys' namespace on disk and in Redis)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
                  ) -> ConnectorSetup:
        """Check what the connector supports and set vLLM's failure policy to recompute.

        One worker, one KV cache group, a tier of at least one block; vLLM's
        `kv_load_failure_policy` becomes "recompute"."""
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # KVConnectorBase_V1 refuses to start without one
        config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
            raise ValueError("KVHeatConnector runs with one worker (tensor and pipeline "
                             "parallel size 1)")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"KVHeatConnector needs one KV cache group, this model has "
                             f"{len(groups)} (hybrid attention is not supported)")
        kv_spec = groups[0].kv_cache_spec
        layout = "mla" if isinstance(kv_spec, MLAAttentionSpec) else "gqa"
        block_size = vllm_config.cache_config.block_size
        # What a layer's block takes times the layers: the tiers' block size (the worker
        # measures it from the tensors; here it sizes the host tier for the check).
        config.tier_spec(kv_spec.page_size_bytes * len(groups[0].layer_names))
        if not vllm_config.cache_config.enable_prefix_caching:
            log.warning("KVHeatConnector keys blocks by vLLM's block hashes, which vLLM "
                        "computes only with prefix caching on (--enable-prefix-caching): "
                        "without them nothing is saved or loaded")
        # The tiers are a cache: a block that fails to load is recomputed, never an error.
        if ktc.kv_load_failure_policy != "recompute":
            ktc.kv_load_failure_policy = "recompute"
        model = vllm_config.model_config
        return cls(config, block_size, layout, f"vllm:{model.model}@{model.revision or ''}")
