"""The connector's stats and metrics: counters each half keeps (`Counts`), the tiers'
counters read as increments (`TierCounters`), the stats vLLM carries from both processes
(`KVHeatConnectorStats`) and their Prometheus metrics on vLLM's /metrics
(`KVHeatPromMetrics`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class KVHeatConnectorStats(KVConnectorStats):
    """Counter increments since the last report.

    Flat: "loaded", "hits.host", ...; "used_bytes.<tier>" is a level (the latest wins)."""

    def reset(self) -> None:
        """Empty the stats."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Both in one: increments summed, levels the other's."""
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = v if k.startswith("used_bytes.") else out.get(k, 0) + v
        return KVHeatConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        """The stats as vLLM logs them."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """Whether there is nothing to report."""
        return not self.data


class Counts:
    """Named counters since the last `take`, safe from any thread."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self._lock = threading.Lock()  # loader threads count too

    def add(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name` (nothing when `n` is 0)."""
        if n:
            with self._lock:
                self.data[name] = self.data.get(name, 0) + n

    def take(self) -> dict[str, int]:
        """The counters, reset."""
        if not self.data:  # nothing counted: no lock (a count added now: the next take)
            return {}
        with self._lock:
            out, self.data = self.data, {}
        return out


# (our stats name, the TierManager's per-tier figure)
_TIER_STATS = (("hits", "hits"), ("hit_bytes", "get_bytes"), ("faults", "faults"),
               ("puts", "puts"))


class TierCounters:
    """The tiers' counters (`TierManager.stats()["tiers"]`) as increments between reads."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def read(self, tiers: object) -> dict[str, int]:
        """Increments of the tiers' counters since the last read, and their used bytes."""
        out: dict[str, int] = {}
        now: dict[str, int] = {}
        for name, st in (tiers.items() if isinstance(tiers, Mapping) else ()):
            tier = name.partition(":")[2] or name
            if not isinstance(st, Mapping):
                continue
            for ours, theirs in _TIER_STATS:
                v = st.get(theirs)
                if isinstance(v, int):
                    now[f"{ours}.{tier}"] = v
            used = st.get("used_bytes")
            if isinstance(used, int):
                out[f"used_bytes.{tier}"] = used
        for k, v in now.items():
            d = v - self._last.get(k, 0)
            if d > 0:
                out[k] = d
        self._last = now
        return out


# (stats key prefix, metric name, help, kind)
_TIER_METRICS = (
    ("hits", "kvheat_connector_tier_hits_total",
     "Blocks read back from a kvheat tier and verified (MAC, checksum)", "counter"),
    ("hit_bytes", "kvheat_connector_tier_hit_bytes_total",
     "Bytes read back from a kvheat tier and verified", "counter"),
    ("faults", "kvheat_connector_tier_faults_total",
     "Reads from a kvheat tier that failed (bad MAC or checksum, torn, I/O error, down)",
     "counter"),
    ("used_bytes", "kvheat_connector_tier_used_bytes", "Bytes a kvheat tier holds", "gauge"),
    ("puts", "kvheat_connector_tier_puts_total",
     "Blocks written into a kvheat tier (vLLM's saves, and demotions from the tier above)",
     "counter"),
)
# Stats of the hints the worker passed to its tiers' policy: request ends by outcome,
# "ended_session.<outcome>" those naming a session and "ended.<outcome>" the others (the
# metric's session label), and "hinted_entries", the tier entries they reached.
_ENDED = {"ended": "false", "ended_session": "true"}


class KVHeatPromMetrics(KVConnectorPromMetrics):
    """The connector's metrics on vLLM's own /metrics.

    They need vLLM's stats (no --disable-log-stats)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tier_labels = [*labelnames, "tier"]
        self._tier: dict[str, Any] = {}
        gauge: Any = self._gauge_cls  # vLLM's metric classes (typed as their union)
        for prefix, name, doc, kind in _TIER_METRICS:
            if kind == "gauge":
                self._tier[prefix] = gauge(name=name, documentation=doc,
                                           labelnames=tier_labels,
                                           multiprocess_mode="mostrecent")
            else:
                self._tier[prefix] = self._counter_cls(name=name, documentation=doc,
                                                       labelnames=tier_labels)
        self._loaded: Any = self._counter_cls(
            name="kvheat_connector_blocks_loaded_total",
            documentation="Blocks loaded from kvheat's tiers into vLLM's KV pool, by tier",
            labelnames=tier_labels)
        self._recomputed: Any = self._counter_cls(
            name="kvheat_connector_blocks_recomputed_total",
            documentation="Prompt blocks past the device's prefix that vLLM computed: not in "
                          "the tiers (miss) or failing their load (load_failed)",
            labelnames=[*labelnames, "reason"])
        self._ended: Any = self._counter_cls(
            name="kvheat_connector_hinted_ends_total",
            documentation="Request ends passed to kvheat's tier policy as hints, by outcome "
                          "and whether the request named a session (the session itself is "
                          "never shown)",
            labelnames=[*labelnames, "outcome", "session"])
        self._hinted: Any = self._counter_cls(
            name="kvheat_connector_hinted_entries_total",
            documentation="Tier entries of ended requests that kvheat's tier policy was told of",
            labelnames=labelnames)
        self._dropped: Any = self._counter_cls(
            name="kvheat_connector_report_dropped_total",
            documentation="Tier changes or failed loads the worker could not report to the "
                          "scheduler (its per-step report is bounded): the mirror may be "
                          "stale until the keys change again (a load then fails and is "
                          "recomputed)",
            labelnames=labelnames)
        self._refused: Any = self._counter_cls(
            name="kvheat_connector_refused_tenants_total",
            documentation="Requests whose kv_transfer_params named a tenant the connector "
                          "refused (no tier loads or saves): unvouched (no valid MAC of a "
                          "trusted front) or malformed",
            labelnames=[*labelnames, "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Count one report of `KVHeatConnectorStats` data on the engine's metrics."""
        values = self.per_engine_labelvalues.get(engine_idx)
        if values is None:
            return
        for key, v in transfer_stats_data.items():
            name, _, tier = key.partition(".")
            if name in self._tier and tier:
                m = self._tier[name].labels(*values, tier)
                if name == "used_bytes":
                    m.set(v)
                elif v > 0:
                    m.inc(v)
            elif name == "loaded" and tier and v > 0:
                self._loaded.labels(*values, tier).inc(v)
            elif name in ("miss", "load_failed") and v > 0:
                self._recomputed.labels(*values, name).inc(v)
            elif name in _ENDED and tier and v > 0:
                self._ended.labels(*values, tier, _ENDED[name]).inc(v)
            elif name == "hinted_entries" and v > 0:
                self._hinted.labels(*values).inc(v)
            elif name == "report_dropped" and v > 0:
                self._dropped.labels(*values).inc(v)
            elif name == "refused_tenant" and tier and v > 0:
                self._refused.labels(*values, tier).inc(v)
