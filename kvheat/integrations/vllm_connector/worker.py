"""The connector's worker half (`KVHeatConnectorWorker`), in vLLM's model-runner process:
owns the tiers (`TierManager`: host memory, disk, Redis under kvheat's heat policy) and
vLLM's KV tensors (`VLLMDeviceBlocks`).

Each step it applies the scheduler's request hints (`TierManager.begin` / `finish`), loads
what the scheduler planned into the planned device blocks (host memory: before the forward;
disk or Redis: on a loader thread while the request waits in WAITING_FOR_REMOTE_KVS),
copies out each block that became full during the step, and reports back which keys its
tiers took or lost, which loads failed and which tiers are down.
"""

from __future__ import annotations

import threading
import time
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Generic, TypeVar

from ...cache.hashing import Namespace
from ...checks.bounds import Overflow
from ...tiers.manager import TierManager
from ...tiers.shared import SharedTierFeed, decode_announcements
from ..vllm_blocks import VLLMDeviceBlocks
from .config import ConnectorSetup, log
from .metadata import KVHeatConnectorMetadata, KVHeatWorkerMetadata, LoadJob
from .metrics import Counts, KVHeatConnectorStats, TierCounters

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

# How often the worker reads its tiers' counters for the metrics.
STATS_EVERY_S = 1.0
_ANNOUNCED_PUT = 1  # tiers/shared.py's record op for a key put (2: deleted)
# What one step's report to the scheduler carries at most (tier changes, failed loads). A
# change dropped leaves the scheduler's mirror stale: a planned load then fails and is
# recomputed, or a held block is not offered; never wrong KV.
MAX_REPORT_ITEMS = 1 << 16
MAX_REPORT_BYTES = 16 << 20

T = TypeVar("T")


class Outbox(Generic[T]):
    """Items for the next step's report, bounded in entries and bytes; overflow counted.

    Filled from any thread (tier listeners, loader threads), taken whole once a step."""

    def __init__(self, size: Callable[[T], int], overflow: Overflow,
                 max_items: int = MAX_REPORT_ITEMS, max_bytes: int = MAX_REPORT_BYTES) -> None:
        self.size = size
        self.overflow = overflow
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: list[T] = []  # at most max_items (`put` checks)
        self._lock = threading.Lock()

    def put(self, item: T) -> None:
        """Queue `item` for the next report, or count it dropped when it does not fit."""
        n = self.size(item)
        with self._lock:
            if len(self._items) < self.max_items and self.bytes + n <= self.max_bytes:
                self._items.append(item)
                self.bytes += n
                return
        self.overflow()

    def take(self) -> list[T]:
        """Everything queued, oldest first; the outbox is empty after."""
        if not self._items:  # a step with nothing to report takes no lock (an item put
            return []        # meanwhile goes with the next step's report)
        with self._lock:
            out, self._items, self.bytes = self._items, [], 0
        return out



class _PeerFeed(SharedTierFeed):
    """The shared Redis tier's feed (other replicas' keys, loadable here), which also
    passes each of their announcements on as a tier change, for the scheduler's mirror."""

    def __init__(self, tiers: TierManager,
                 on_change: typing.Callable[[str, bytes, bytes | None, int, bool], None]
                 ) -> None:
        self._on_change = on_change
        super().__init__(tiers)

    def _apply(self, data: bytes) -> None:
        super()._apply(data)
        try:
            writer, items = decode_announcements(data)
        except ValueError:
            return
        if writer != self.writer:
            for op, key, tokens in items:
                self._on_change(self.store.name, key, None, tokens, op == _ANNOUNCED_PUT)


class KVHeatConnectorWorker:
    """The worker half: vLLM's worker-side connector hooks.

    It loads and saves through a `TierManager` over vLLM's KV tensors."""

    def __init__(self, setup: ConnectorSetup, kv_cache_config: KVCacheConfig) -> None:
        self.config = setup.config
        self.block_size = setup.block_size
        self.layout = setup.layout
        self.model_id = setup.model_id
        self._kv_cache_config = kv_cache_config  # its num_blocks: vLLM's device blocks
        self.device: VLLMDeviceBlocks | None = None
        self.tiers: TierManager | None = None
        self._counts = Counts()
        dropped = Overflow(log, "KVHeatConnector's report to the scheduler (tier changes or "
                           "failed loads dropped)",
                           on_count=lambda n: self._counts.add("report_dropped", n))
        # (64: a tuple and its fields, beside the key's bytes)
        self._changes: Outbox[tuple[str, bytes, bool]] = Outbox(
            lambda c: 64 + len(c[1]), dropped)
        self._failed: Outbox[tuple[str, int]] = Outbox(lambda f: 64 + len(f[0]), dropped)
        self._invalid: set[int] = set()
        self._lock = threading.Lock()
        self._done_loading: set[str] = set()
        self._done_invalid: dict[str, list[int]] = {}
        self._loaders: ThreadPoolExecutor | None = None
        self._feed: _PeerFeed | None = None
        self._stats_at = time.monotonic()
        self._tier_counters = TierCounters()
        self._down_sent: list[str] = []  # the tiers down in the last report sent

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Open the tiers over vLLM's KV tensors, sized in its blocks."""
        self.device = dev = VLLMDeviceBlocks(kv_caches, self._kv_cache_config.num_blocks,
                                             self.block_size, self.layout)
        spec = self.config.tier_spec(dev.bytes_per_block)
        self.tiers = TierManager(spec, block_bytes=dev.bytes_per_block,
                                 block_tokens=self.block_size, model=self.model_id,
                                 layout=dev.describe())
        self.tiers.index_listeners.append(self._on_tier_change)
        self._feed = _PeerFeed(self.tiers, self._on_tier_change) \
            if spec.redis_url and spec.redis_shared else None
        self._loaders = ThreadPoolExecutor(max(1, spec.load_workers),
                                           thread_name_prefix="kvheat-vllm-load")
        log.info("KVHeatConnector: %d layers, %d-token blocks of %d bytes (%s), tiers %s",
                 dev.num_layers, self.block_size, dev.bytes_per_block, dev.describe(),
                 ", ".join(n for n, on in (("host", spec.host_blocks), ("disk", spec.disk_dir),
                                           ("redis", spec.redis_url)) if on))

    def _on_tier_change(self, tier: str, key: bytes, parent: bytes | None, tokens: int,
                        stored: bool) -> None:
        self._changes.put((tier, key, stored))  # any thread; sent with the next step

    def start_load_kv(self, meta: KVHeatConnectorMetadata) -> None:
        """Apply the step's hints, then start its loads (on loader threads, or now)."""
        if meta.sessions or meta.finished:
            self._apply_hints(meta)  # before this step's loads and saves
        for job in meta.loads:
            if job.background:
                assert self._loaders is not None
                self._loaders.submit(self._load_background, job)
            else:
                self._invalid.update(self._load(job))

    def _apply_hints(self, meta: KVHeatConnectorMetadata) -> None:
        tiers = self.tiers
        if tiers is None:
            return
        try:
            for session in meta.sessions:
                tiers.begin(session)
            for f in meta.finished:
                told = tiers.finish(f.keys, f.session, f.outcome, f.reason)
                self._counts.add(("ended_session." if f.session is not None else "ended.")
                                 + f.outcome)
                self._counts.add("hinted_entries", told)
        except Exception:  # a hint is never worth the engine
            log.exception("KVHeatConnector: passing request hints to the tiers failed")

    def _load(self, job: LoadJob) -> list[int]:
        """Load `job`; the device blocks that did not load (vLLM recomputes from there)."""
        tiers, device = self.tiers, self.device
        loaded = 0
        try:
            assert tiers is not None and device is not None
            plan = tiers.lookup(Namespace.of(job.salt), job.keys, 0)
            if plan.keys:
                with device.writing_back():
                    loaded = tiers.load(plan, job.slots[:len(plan.keys)], device)
            for tier in plan.tier_names[:loaded]:
                self._counts.add("loaded." + tier)
        except Exception:  # a tier's bug must cost a recompute, never the engine
            log.exception("KVHeatConnector: loading %d blocks for %s failed", len(job.keys),
                          job.req_id)
        failed = job.slots[loaded:]
        if failed:
            self._counts.add("load_failed", len(failed))
            self._failed.put((job.req_id, job.first + loaded))
        return failed

    def _load_background(self, job: LoadJob) -> None:
        failed = self._load(job)
        with self._lock:
            self._done_loading.add(job.req_id)
            if failed:
                self._done_invalid[job.req_id] = failed

    def wait_for_save(self, meta: KVHeatConnectorMetadata) -> None:
        """Copy the step's full blocks out to the tiers (whole blocks, all layers)."""
        tiers, device = self.tiers, self.device
        for job in meta.saves:
            try:
                assert tiers is not None and device is not None
                self._counts.add("offered", len(job.keys))
                tiers.save(Namespace.of(job.salt), job.keys, job.parents, job.slots, device)
            except Exception:
                log.exception("KVHeatConnector: saving %d blocks failed", len(job.keys))

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(None, requests whose background loads finished since the last call)."""
        if not self._done_loading:  # none finished (one finishing now: the next step's)
            return None, None
        with self._lock:
            done, self._done_loading = self._done_loading, set()
            # Failed blocks are reported in the same step as their request's finish.
            for req_id in done:
                self._invalid.update(self._done_invalid.pop(req_id, ()))
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The device blocks that failed to load since the last call."""
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVHeatWorkerMetadata | None:
        """The step's report for the scheduler: tier changes, failed loads, tiers down.

        None when there is nothing new (no change, no failure, the same tiers down) and
        no Redis tier is shared: a decode step then sends the scheduler nothing. With a
        shared tier it is sent every step, even empty: it is also the scheduler's news
        that the worker has been heard from (see the scheduler's SHARED_SYNC_S)."""
        changes = self._changes.take()
        failed = self._failed.take()
        down = [h.name for h in self.tiers.health() if not h.up] \
            if self.tiers is not None else []
        if not changes and not failed and down == self._down_sent and self._feed is None:
            return None
        self._down_sent = down
        return KVHeatWorkerMetadata(changes, failed, down)

    def get_stats(self) -> KVHeatConnectorStats | None:
        """The worker's counters since the last call.

        The tiers' own are read at most once per STATS_EVERY_S."""
        data: dict[str, int | float] = dict(self._counts.take())
        if self.tiers is not None and time.monotonic() - self._stats_at >= STATS_EVERY_S:
            self._stats_at = time.monotonic()
            data.update(self._tier_counters.read(self.tiers.stats().get("tiers")))
        return KVHeatConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        """Stop the loaders and the shared feed, flush the tiers and close them."""
        if self._loaders is not None:
            self._loaders.shutdown(wait=True)
        if self._feed is not None:
            self._feed.close()
        if self.tiers is not None:
            try:
                self.tiers.flush(timeout_s=5.0)
            finally:
                self.tiers.close()
