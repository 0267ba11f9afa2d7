"""Prometheus metrics of the server, every one labelled by arm.

Each server owns its registry (two servers in one process, as in tests, do not clash).
Counters and histograms are updated by the engine thread when a request finishes;
gauges (queues, blocks, tier state) are refreshed by the engine thread a few times a
second, so a scrape never walks engine structures while they change.

Callers pass tenant names (or "none" / None for requests without a tenant); every tenant
label goes through `tenant_label`, which maps a name to the label the config allows
(`ServerConfig.tenant_labels`): /metrics may be open, and then it must not say who the
tenants are.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from ..cache.misses import PUBLIC_MISS_KINDS, public_misses

# Fault counters each lower-tier store keeps (`StoreStats`, and a disk store's own), and
# those of the hierarchy above them (`TierCounters`): each is a `kind` of
# kvheat_tier_faults_total / kvheat_tier_load_faults_total, with a Grafana panel and an
# alert rule in deploy/.
STORE_FAULTS = ("put_refused", "corrupt_checksum", "corrupt_key", "corrupt_torn",
                "corrupt_format", "io_errors", "skipped_down", "went_down", "full_events",
                "rejected_on_open")
HIERARCHY_FAULTS = ("load_failed", "shape_mismatch", "demote_refused", "demote_dropped",
                    "orphans_dropped", "worker_errors")

log = logging.getLogger("kvheat.server")

NO_TENANT = "none"  # the tenant label of requests without a tenant (no tenants configured)
UNKNOWN_TENANT = "unknown"  # a name the label map lacks (never a name itself)

# Latency buckets in seconds: a CPU engine's TTFT runs from milliseconds to seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
# Pause buckets in seconds: what a request sees as a stall starts at tens of milliseconds.
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, tenant_labels: Mapping[str, str] | None = None) -> None:
        """`tenant_labels`: tenant name -> its label value (`ServerConfig.tenant_labels`);
        a name not in it is labelled "unknown", never by itself."""
        self._tenant_labels = dict(tenant_labels or {})
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvheat_requests", "Requests finished, by outcome (stop, length, abort, error).",
            ["arm", "tenant", "endpoint", "finish_reason"], registry=r)
        self.rejected = Counter(
            "kvheat_rejected_requests", "Requests refused before reaching the engine, by HTTP status.",
            ["status"], registry=r)
        self.concurrency_refused = Counter(
            "kvheat_concurrency_refused", "Requests answered 503 before their body was read "
            "because max_concurrent_requests were open (also in kvheat_rejected_requests).",
            registry=r)
        self.prompt_tokens = Counter(
            "kvheat_prompt_tokens", "Prompt tokens of finished requests.", ["arm", "tenant"],
            registry=r)
        self.cached_tokens = Counter(
            "kvheat_cached_tokens", "Prompt tokens served from cache (any tier) instead of "
            "computed.", ["arm", "tenant"], registry=r)
        self.tier_hit_tokens = Counter(
            "kvheat_tier_hit_tokens", "Prompt tokens served from cache, by the tier that held "
            "them (when the engine has lower tiers); the tiers add up to "
            "kvheat_cached_tokens_total.", ["arm", "tier"], registry=r)
        self.generation_tokens = Counter(
            "kvheat_generation_tokens", "Generated tokens.", ["arm", "tenant"], registry=r)
        self.miss_tokens = Counter(
            "kvheat_prefix_miss_tokens", "Prompt tokens not served from cache, by cause "
            "(compulsory: never seen under this tenant's salt, capacity, sub_block).",
            ["arm", "tenant", "kind"], registry=r)
        self.hit_rate = Gauge(
            "kvheat_prefix_hit_rate", "Token-weighted prefix hit rate since start (the cache's "
            "own count).", ["arm"], registry=r)
        # What the heat policy learned (kvheat/heat/miniature.py): the half-life multiple
        # it follows, and each miniature candidate's hit tokens per sampled request.
        self.heat_multiple = Gauge(
            "kvheat_heat_multiple", "The half-life multiple (of the measured reuse gap) the "
            "heat policy follows, chosen by its miniature simulations.", ["arm"], registry=r)
        self.heat_candidate = Gauge(
            "kvheat_heat_candidate_hit_tokens", "Hit tokens per sampled request of each "
            "miniature candidate (an octave below and above the multiple; alt: the other "
            "protection mode at the multiple) since start.",
            ["arm", "candidate"], registry=r)
        self.heat_moves = Counter(
            "kvheat_heat_multiple_moves", "Moves of the half-life multiple the miniatures "
            "made.", ["arm"], registry=r)
        self.heat_protect = Gauge(
            "kvheat_heat_protect", "1 while the heat policy protects a stable subset "
            "(kvheat/heat/protect.py), switched on where its miniature serves more.", ["arm"],
            registry=r)
        self.heat_switches = Counter(
            "kvheat_heat_protect_switches", "Switches of protection the miniatures made.",
            ["arm"], registry=r)
        self.ttft = Histogram(
            "kvheat_time_to_first_token_seconds", "Time to first token.", ["arm", "tenant"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "kvheat_inter_token_latency_seconds", "Time between generated tokens.", ["arm"],
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "kvheat_e2e_request_latency_seconds", "Arrival to last token.", ["arm", "tenant"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Gauge(
            "kvheat_queue_length", "Sequences waiting and running in the engine.",
            ["arm", "queue"], registry=r)
        self.blocks = Gauge(
            "kvheat_blocks", "KV blocks per tier by state (device: used = referenced, cached = "
            "unreferenced but holding a prefix, free; lower tiers: used entries).",
            ["arm", "tier", "state"], registry=r)
        self.tenant_blocks = Gauge(
            "kvheat_tenant_blocks", "Device blocks held or cached per tenant (when the cache "
            "reports it).", ["arm", "tenant"], registry=r)
        self.evictions = Counter(
            "kvheat_evictions", "Blocks evicted, per tier.", ["arm", "tier"], registry=r)
        self.prewarm_requests = Counter(
            "kvheat_prewarm_requests", "A router's prewarms (the x-kvheat-prewarm header), "
            "served as any request and counted here instead of kvheat_requests.", ["arm"],
            registry=r)
        self.preemptions = Counter(
            "kvheat_preemptions", "Sequences preempted when the pool ran out, by the tenant "
            "of the preempted sequence (\"none\" without tenants).", ["arm", "tenant"],
            registry=r)
        self.tier_bytes = Counter(
            "kvheat_tier_bytes", "Bytes moved to (write) and from (read) a lower tier.",
            ["arm", "tier", "direction"], registry=r)
        self.tier_bandwidth = Gauge(
            "kvheat_tier_bandwidth_bytes_per_second", "Fitted transfer bandwidth of a tier.",
            ["arm", "tier", "direction"], registry=r)
        self.load_decisions = Counter(
            "kvheat_load_decisions", "Load-or-recompute decisions for blocks found on lower tiers.",
            ["arm", "decision"], registry=r)
        self.checksum_failures = Counter(
            "kvheat_checksum_failures", "Values read back from a tier that failed verification.",
            ["arm", "tier"], registry=r)
        self.tier_up = Gauge(
            "kvheat_tier_up", "1 when a lower tier (e.g. Redis) is reachable, else 0.",
            ["arm", "tier"], registry=r)
        self.tier_writable = Gauge(
            "kvheat_tier_writable", "1 while a lower tier takes writes; 0 while it refuses them "
            "(a full disk: demotion paused).", ["arm", "tier"], registry=r)
        self.tier_faults = Counter(
            "kvheat_tier_faults", "Faults a lower-tier store counted, by kind: put_refused (no "
            "room or down), corrupt_checksum/key/torn/format (values that failed a check: "
            "served as misses), io_errors, skipped_down, went_down, full_events (the file "
            "system said full), rejected_on_open (bad files dropped at start-up).",
            ["arm", "tier", "kind"], registry=r)
        self.tier_load_faults = Counter(
            "kvheat_tier_load_faults", "Faults of the tier hierarchy, by kind: load_failed "
            "(planned loads that came back missing or unverified, e.g. Redis lost them), "
            "shape_mismatch, demote_refused (no tier took a block), demote_dropped (the "
            "demotion queue was full), orphans_dropped, worker_errors.", ["arm", "kind"],
            registry=r)
        self.engine_failures = Counter(
            "kvheat_engine_failures", "Engine steps that raised (the arm's engine is rebuilt).",
            ["arm"], registry=r)
        self.internal_errors = Counter(
            "kvheat_internal_errors", "Errors in metrics, tracing or bookkeeping that were "
            "logged and skipped (serving went on), by where they happened.", ["where"],
            registry=r)
        # arm -> requests the self-healer adds to the waiting queue's series (the one the
        # HPA scales on): demand it refused, which the queue no longer shows.
        self.queue_boost: dict[str, float] = {}
        # Last seen values of monotone engine counters, to turn them into Counter increments.
        self._last: dict[tuple[str, ...], float] = {}

    def tenant_label(self, tenant: str | None) -> str:
        """The one place a tenant becomes a label value.

        None or "none" (no tenant; no configured tenant may be named so) -> "none", a name
        -> its configured label."""
        if tenant is None or tenant == NO_TENANT:
            return NO_TENANT
        return self._tenant_labels.get(tenant, UNKNOWN_TENANT)

    # ---- per request ------------------------------------------------------------------
    def observe_request(self, arm: str, tenant: str | None, endpoint: str, finish_reason: str,
                        prompt_tokens: int, cached_tokens: int, generated: int,
                        ttft: float | None, itls: list[float], e2e: float | None,
                        misses: Mapping[str, int] | None,
                        cached_by_tier: Mapping[str, int] | None = None) -> None:
        """Count a finished request: its outcome, tokens, misses and latencies."""
        tenant = self.tenant_label(tenant)
        self.requests.labels(arm, tenant, endpoint, finish_reason).inc()
        self.prompt_tokens.labels(arm, tenant).inc(prompt_tokens)
        self.cached_tokens.labels(arm, tenant).inc(cached_tokens)
        self.generation_tokens.labels(arm, tenant).inc(generated)
        if misses is not None:
            public = public_misses(dict(misses))
            for kind in PUBLIC_MISS_KINDS:
                self.miss_tokens.labels(arm, tenant, kind).inc(public[kind])
        for tier, n in (cached_by_tier or {}).items():
            if n > 0:
                self.tier_hit_tokens.labels(arm, tier).inc(n)
        if ttft is not None:
            self.ttft.labels(arm, tenant).observe(ttft)
        h = self.itl.labels(arm)
        for x in itls:
            h.observe(x)
        if e2e is not None:
            self.e2e.labels(arm, tenant).observe(e2e)

    def _advance(self, counter: Counter, labels: tuple[str, ...], value: float) -> None:
        """Raise a Counter to an engine's running total (a reset engine starts again).
        Never raises for a value that went down: that is a rebuilt engine, not an error."""
        key = (str(id(counter)), *labels)
        last = self._last.get(key, 0.0)
        if value > last:
            counter.labels(*labels).inc(value - last)
        elif value < last and value > 0:  # the engine was rebuilt: its totals restarted
            counter.labels(*labels).inc(value)
        self._last[key] = max(value, 0.0)

    # ---- refreshed from the engine thread ----------------------------------------------
    def refresh_arm(self, arm: str, engine: Any, tenants: Iterable[str] = ()) -> None:
        """Queues, blocks (and each of `tenants`' blocks), evictions, preemptions, tiers."""
        cache = engine.cache
        sched = engine.scheduler
        self.queue.labels(arm, "waiting").set(len(sched.waiting) + self.queue_boost.get(arm, 0.0))
        self.queue.labels(arm, "running").set(len(sched.running))
        n_free = cache.num_free
        n_used = cache.num_referenced
        self.blocks.labels(arm, "device", "used").set(n_used)
        self.blocks.labels(arm, "device", "free").set(n_free)
        self.blocks.labels(arm, "device", "cached").set(len(cache.blocks) - n_used - n_free)
        self.hit_rate.labels(arm).set(cache.stats.hit_rate)
        self._refresh_heat(arm, cache.policy.stats())
        self._advance(self.evictions, (arm, "device"), cache.stats.evicted_blocks)
        for tenant, n in engine.scheduler.preemptions_by_tenant.items():
            self._advance(self.preemptions, (arm, self.tenant_label(tenant)), n)
        self._refresh_tiers(arm, engine.tiers.stats() if engine.tiers is not None else {})
        for tenant in tenants:
            self.tenant_blocks.labels(arm, self.tenant_label(tenant)).set(
                cache.tenant_usage(tenant))

    def _refresh_heat(self, arm: str, st: Mapping[str, float]) -> None:
        """The heat policy's learned multiple (`KVHeat.stats`), where it has one."""
        if "reuse_mult" in st:
            self.heat_multiple.labels(arm).set(st["reuse_mult"])
        for name in ("lo", "hi", "alt"):
            v = st.get(f"mini_{name}_hit_tokens_per_request")
            if v is not None:
                self.heat_candidate.labels(arm, name).set(v)
        if "mini_moves" in st:
            self._advance(self.heat_moves, (arm,), st["mini_moves"])
        if "protect" in st:
            self.heat_protect.labels(arm).set(st["protect"])
        if "mini_switches" in st:
            self._advance(self.heat_switches, (arm,), st["mini_switches"])

    def _refresh_tiers(self, arm: str, st: Mapping[str, Any]) -> None:
        """Lower-tier figures from `TierManager.stats()`."""
        self._advance(self.load_decisions, (arm, "load"), st.get("decisions_load", 0))
        self._advance(self.load_decisions, (arm, "recompute"), st.get("decisions_recompute", 0))
        self._advance(self.load_decisions, (arm, "partial"), st.get("decisions_partial", 0))
        for kind in HIERARCHY_FAULTS:
            if kind in st:
                self._advance(self.tier_load_faults, (arm, kind), st[kind])
        for name, t in (st.get("tiers") or {}).items():
            tier = str(name).split(":", 1)[-1]
            self.blocks.labels(arm, tier, "used").set(t.get("entries", 0))
            self.tier_up.labels(arm, tier).set(1 if t.get("available", True) else 0)
            self._advance(self.evictions, (arm, tier), t.get("evictions", 0))
            self._advance(self.tier_bytes, (arm, tier, "write"), t.get("put_bytes", 0))
            self._advance(self.tier_bytes, (arm, tier, "read"), t.get("get_bytes", 0))
            self._advance(self.checksum_failures, (arm, tier), t.get("corrupt_checksum", 0))
            self.tier_writable.labels(arm, tier).set(1 if t.get("writable", True) else 0)
            for kind in STORE_FAULTS:
                if kind in t:
                    self._advance(self.tier_faults, (arm, tier, kind), t[kind])
            for direction, field_name in (("read", "read_bandwidth_Bps"),
                                          ("write", "write_bandwidth_Bps")):
                bw = t.get(field_name)
                if bw is not None:
                    self.tier_bandwidth.labels(arm, tier, direction).set(bw)


class _Pauses:
    """A histogram kept in plain numbers. A GC callback may run while its own thread holds a
    prometheus_client lock (a scrape allocating), so it must never take one; `observe`
    takes no lock and a scrape copies the numbers (at worst one pause late)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(STALL_BUCKETS) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(STALL_BUCKETS, seconds)] += 1
        self.total += seconds

    def family_sample(self) -> tuple[list[tuple[str, float]], float]:
        buckets, acc = [], 0
        for bound, n in zip((*STALL_BUCKETS, float("inf")), list(self.counts), strict=True):
            acc += n
            buckets.append(("+Inf" if bound == float("inf") else str(bound), float(acc)))
        return buckets, self.total


class StallWatch(Collector):
    """Pauses that hold every request at once, as Prometheus histograms.

    Read at scrape time:

    - kvheat_event_loop_lag_seconds: how late the event loop's watcher woke from a short
      sleep (a blocking call or CPU-heavy work on the loop, or the GIL held elsewhere);
    - kvheat_gc_pause_seconds{generation}: each garbage collection, by generation (from
      gc.callbacks; a full collection of a large heap holds the GIL for all threads).

    Labels are bounded (three generations). Neither part can stop serving: the GC callback
    swallows its own errors, and the watcher logs and ends on one (the loop goes on).
    gc.callbacks is process-wide: two servers in one process each count every collection.
    """

    INTERVAL_S = 0.05

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loop_lag = _Pauses()
        self.gc_pauses = [_Pauses() for _ in range(3)]
        self.errors = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop watched, once started
        self._gc_start = 0.0
        self._task: asyncio.Task[None] | None = None
        registry.register(self)

    # ---- GC pauses ---------------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                self._gc_start = time.perf_counter()
            elif self._gc_start:
                self.gc_pauses[min(int(info.get("generation", 2)), 2)].observe(
                    time.perf_counter() - self._gc_start)
                self._gc_start = 0.0
        except Exception:  # a collection must never fail because of us
            self.errors += 1

    # ---- event-loop lag ----------------------------------------------------------------
    def start(self) -> None:
        """On the event loop (the app's lifespan): hook the collector, start the watcher."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        self.loop = asyncio.get_running_loop()
        self._task = self.loop.create_task(self._watch(), name="kvheat-stall-watch")

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                t0 = loop.time()
                await asyncio.sleep(self.INTERVAL_S)
                self.loop_lag.observe(max(loop.time() - t0 - self.INTERVAL_S, 0.0))
        except asyncio.CancelledError:
            raise
        except Exception:
            self.errors += 1
            log.exception("the event-loop lag watcher failed; kvheat_event_loop_lag_seconds "
                          "stops here (serving goes on)")

    def stop(self) -> None:
        """Stop the loop watcher and remove the GC callback."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        """The event-loop lag and GC pause histograms."""
        lag = HistogramMetricFamily(
            "kvheat_event_loop_lag_seconds", "How late the event loop woke from a "
            f"{self.INTERVAL_S * 1000:.0f} ms sleep: time every request on the loop waited "
            "(blocking or CPU-heavy work on the loop, or the GIL held by another thread).")
        buckets, total = self.loop_lag.family_sample()
        lag.add_metric([], buckets, total)
        yield lag
        pauses = HistogramMetricFamily(
            "kvheat_gc_pause_seconds", "Python garbage collections by generation (gen 2: "
            "full collections, which scan the whole heap holding the GIL).",
            labels=["generation"])
        for g, h in enumerate(self.gc_pauses):
            buckets, total = h.family_sample()
            pauses.add_metric([str(g)], buckets, total)
        yield pauses
