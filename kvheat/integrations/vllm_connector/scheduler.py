"""The connector's scheduler half (`KVHeatConnectorScheduler`), in vLLM's scheduler process:
answers vLLM's lookups from a mirror of the worker's tier keys, plans each step's loads and
saves, keys requests by tenant, and sends request hints and KV events on.

Keys are vLLM's block hashes (whole blocks only), chained under the tenant's salt
(`cache/hashing.tenant_salt` of `kv_transfer_params["tenant"]`): another tenant's keys
never match, and every value read back carries the salt in its MAC. The tenant is the
client's claim unless a trusted front vouches for it (`cache/tenancy.py`: `kvheat route`
adds a MAC under the `tenant_secret` both share); an unvouched tenant is refused (its KV
neither loaded nor saved), counted and logged. (vLLM 0.32 drops the OpenAI `user` field
before the engine, so it cannot key anything; a request's `cache_salt` is already part of
vLLM's block hashes, which is how `kvheat route` salts a vLLM replica's requests, with a
keyed salt nobody else can name.) Blocks the tiers take or lose go out as KV events
(`events.py`).

Request hints (kvheat/cache/hints.py) reach the tiers' eviction policy as they reach the
offload adapter's (`vllm_chunk.request_hints`): the session is
`kv_transfer_params["kvheat_session"]` (what `kvheat route` sets for a vLLM replica), keyed
here into a digest (never the client's string past it); the outcome and finish reason come
from vLLM's `Request` at `request_finished`. The hints travel to the worker in the step's
metadata: a request's session before its first loads and saves, its end with its keys. A
request with no session that was not cancelled sends nothing, so without hints every
decision is as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...cache.hashing import BlockKey, chain_key, root_key, tenant_salt
from ...cache.hints import Outcome, session_digest
from ...cache.tenancy import TENANT_PARAM, VOUCH_PARAM
from ..vllm_chunk import record_outcome, request_end, request_hints
from .config import ConnectorSetup, log
from .events import TierEvents
from .metadata import FinishHint, KVHeatConnectorMetadata, KVHeatWorkerMetadata, LoadJob, SaveJob
from .metrics import Counts, KVHeatConnectorStats
from .mirror import TierMirror

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# With a Redis tier shared by replicas, the worker learns of blocks the others put there
# between steps; a scheduler that heard nothing from it for this long (an idle server)
# has vLLM run one empty step before answering a lookup.
SHARED_SYNC_S = 0.25
# At most one log line per this many seconds about refused tenants (a client can send
# any number of them); the count is always on the metrics.
REFUSED_LOG_EVERY_S = 60.0
HIT_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


@dataclass(slots=True)
class _Tracked:
    """A live request as the scheduler half sees it."""

    request: Request
    salt: str | None
    usable: bool  # False: a malformed tenant; the tiers neither serve nor keep its blocks
    root: bytes
    keys: list[BlockKey] = field(default_factory=list)
    saved: int = 0  # its blocks below this are in the tiers, on their way, or were offered
    device_blocks: int = 0  # the device's prefix at its last lookup
    plan: list[str] = field(default_factory=list)  # tiers of the blocks found after it
    background: bool = False
    # A load of it failed: its next loads run before the forward. (vLLM 0.32 keeps a
    # request whose background load failed on its list of in-flight prefills, whose
    # reservations a background load must fit beside, its own included: waiting for one
    # again could wait forever.)
    sync_only: bool = False
    hints: ReqContext | None = None  # its hints' context (None: hints are off)
    session: str | None = None  # the digest of its session

    def keys_upto(self, n: int) -> list[BlockKey]:
        hashes = self.request.block_hashes
        keys = self.keys
        while len(keys) < n:
            keys.append(chain_key(self.root, hashes[len(keys)]))
        return keys


class KVHeatConnectorScheduler:
    """The scheduler half: vLLM's scheduler-side connector hooks.

    They answer from a `TierMirror` of the worker's tiers (no I/O)."""

    def __init__(self, setup: ConnectorSetup, vllm_config: VllmConfig) -> None:
        self.config = setup.config
        self.block_size = setup.block_size
        self.mirror = TierMirror()
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []
        self._counts = Counts()
        self._shared = bool(self.config.redis_tier_url) and self.config.redis_tier_shared
        self._synced_at = -float("inf")
        self._down: list[str] = []
        ev = vllm_config.kv_events_config
        # KV events of the tiers' blocks (None: events are off).
        self._events = TierEvents(self.block_size) \
            if ev is not None and ev.enable_kv_cache_events else None
        # Hints for the worker's next step (`KVHeatConnectorMetadata`), and the key of the
        # session digests (this process's: the digests live no longer than the tiers'
        # policy state does).
        self._started: list[str] = []
        self._finished: list[FinishHint] = []
        self._session_key = os.urandom(32)
        # Checks the MAC of a tenant named in kv_transfer_params (None: none is accepted).
        self._vouch = self.config.tenant_vouch()
        self._refused_logged_at = -float("inf")
        self._refused_unlogged = 0

    def _track(self, request: Request) -> _Tracked:
        t = self._tracked.get(request.request_id)
        if t is None:
            salt, usable = self._salt(request)
            t = self._tracked[request.request_id] = _Tracked(request, salt, usable,
                                                              root_key(salt))
            if usable and self.config.request_hints:
                # The offload adapter's reading of the request's hints (vllm_chunk.py).
                t.hints = ReqContext(request.request_id, request.kv_transfer_params,
                                     request.kv_hints)
                session = request_hints(t.hints).session
                if session is not None:
                    t.session = self._session_digest(t, session)
                    self._started.append(t.session)
        return t

    def _session_digest(self, t: _Tracked, session: str) -> str:
        """`session` keyed by this scheduler's secret, the tenant's salt and vLLM's cache
        salt (as kvheat's server keys its sessions: tenants naming the same session get
        different ones), so the client's string goes no further than here."""
        return session_digest(self._session_key, "vllm", t.salt or "",
                              t.request.cache_salt or "", session)

    def _salt(self, request: Request) -> tuple[str | None, bool]:
        """(salt, usable): the salt of the request's tenant, if a trusted front vouched
        for it (`cache/tenancy.py`); a tenant the client named itself is refused."""
        params = request.kv_transfer_params
        tenant = params.get(TENANT_PARAM) if isinstance(params, dict) else None
        if tenant is None:
            return None, True
        if not isinstance(tenant, str) or not tenant:
            self._refuse(request, "malformed", "kv_transfer_params.tenant must be a "
                         "non-empty string")
            return None, False
        assert isinstance(params, dict)
        if self._vouch is None or not self._vouch.vouched(tenant, request.cache_salt,
                                                          params.get(VOUCH_PARAM)):
            self._refuse(request, "unvouched", "its tenant carries no valid MAC of a "
                         "trusted front (kvheat route with this connector's tenant_secret)"
                         if self._vouch is not None else "a tenant is accepted only when "
                         "vouched for, and this connector has no tenant_secret")
            return None, False
        return tenant_salt(tenant, self.config.share_groups), True

    def _refuse(self, request: Request, reason: str, why: str) -> None:
        """Count a refused tenant; log it, at most once per REFUSED_LOG_EVERY_S."""
        self._counts.add("refused_tenant." + reason)
        now = time.monotonic()
        if now - self._refused_logged_at < REFUSED_LOG_EVERY_S:
            self._refused_unlogged += 1
            return
        log.warning("request %s: %s; its KV is neither loaded from nor saved to kvheat's "
                    "tiers (%d more refused since the last such line)", request.request_id,
                    why, self._refused_unlogged)
        self._refused_logged_at, self._refused_unlogged = now, 0

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the tiers hold right after the device's prefix, and whether they load async.

        Whole blocks, never the prompt's last token; they load while the request waits."""
        t = self._track(request)
        t.plan = []
        bs = self.block_size
        start = num_computed_tokens // bs
        t.device_blocks = start
        # Whole blocks, and never the whole prompt: vLLM computes at least its last token.
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if not t.usable or stop <= start:
            return 0, False
        if self._shared and time.monotonic() - self._synced_at > SHARED_SYNC_S:
            return None, False  # one empty step brings the worker's news first
        t.plan = self.mirror.run(t.keys_upto(stop), start, self._down)
        if not t.plan:
            return 0, False
        auto = any(x != "host" for x in t.plan)
        t.background = not t.sync_only and (auto if self.config.async_load is None
                                            else self.config.async_load)
        return len(t.plan) * bs, t.background

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the blocks vLLM allocated for what the tiers hold."""
        t = self._track(request)
        n = min(num_external_tokens // self.block_size, len(t.plan))
        start = t.device_blocks
        if n > 0:
            slots = blocks.get_block_ids()[0][start:start + n]
            self._loads.append(LoadJob(request.request_id, t.salt, start,
                                       t.keys[start:start + n], list(slots), t.background))
        if t.plan or num_external_tokens:
            stop = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
            self._counts.add("miss", max(0, stop - start - n))
        t.saved = max(t.saved, start + n)
        t.plan = []

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The external tokens of the request's planned load, by the tier they come from."""
        if num_external_tokens == 0:
            return {}
        job = next((j for j in reversed(self._loads) if j.req_id == request.request_id), None)
        if job is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        out: dict[CacheHitSource, int] = {}
        for key in job.keys:
            src = HIT_SOURCES.get(self.mirror.tier_of(key) or "",
                                  CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + self.block_size
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             kv_cache_manager: KVCacheManager | None
                             ) -> KVHeatConnectorMetadata:
        """The step's plan for the worker.

        The loads planned since the last step, the blocks that fill during this one (to
        save), and the hints gathered since."""
        meta = KVHeatConnectorMetadata(loads=self._loads, sessions=self._started,
                                       finished=self._finished)
        self._loads, self._started, self._finished = [], [], []
        bs = self.block_size
        state = scheduler_output.kv_connector_block_state
        spec = scheduler_output.scheduled_spec_decode_tokens
        saving: set[bytes] = set()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is None or not t.usable:
                continue
            r = t.request
            # Blocks full once this step has run (its KV is written in the forward).
            done = r.num_computed_tokens + n - len(spec.get(req_id, ()))
            full = min(done // bs, len(r.block_hashes))
            if full <= t.saved:
                continue
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is None:
                assert kv_cache_manager is not None
                ids = kv_cache_manager.get_block_ids(req_id)
            keys = t.keys_upto(full)
            job = SaveJob(t.salt, [], [], [])
            for i in range(t.saved, full):
                k = keys[i]
                if k in self.mirror or k in saving:
                    continue
                saving.add(k)
                job.keys.append(k)
                job.parents.append(keys[i - 1] if i else None)
                job.slots.append(ids[0][i])
                if self._events is not None:
                    self._events.saving(k, r, i)
            t.saved = full
            if job.keys:
                meta.saves.append(job)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the worker's report.

        Tier changes go to the mirror (and out as KV events); the tiers down and the failed
        loads are noted (their blocks are saved again once recomputed)."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVHeatWorkerMetadata):
            return
        self._synced_at = time.monotonic()
        self._down = meta.down
        for tier, key, stored in meta.changes:
            self.mirror.apply(tier, key, stored)
            if self._events is not None:
                self._events.apply(tier, key, stored)
        for req_id, block in meta.failed:
            t = self._tracked.get(req_id)
            if t is not None:  # its recomputed blocks are saved again
                t.saved = min(t.saved, block)
                t.sync_only = True

    def take_events(self) -> Iterable[Any]:
        """The KV events since the last call."""
        return self._events.take() if self._events is not None else []

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its end goes to the worker as a hint if it says anything."""
        t = self._tracked.pop(request.request_id, None)
        if t is not None and t.hints is not None:
            record_outcome(t.hints, *request_end(request))
            h = request_hints(t.hints)
            # A session or a cancel is a hint; a plain finish tells the policy nothing new.
            if t.session is not None or h.outcome is Outcome.CANCELLED:
                self._finished.append(FinishHint(t.keys, t.session, h.outcome.value, h.reason))
        return False, None  # every save was copied out in its step: free the blocks now

    def get_stats(self) -> KVHeatConnectorStats | None:
        """The scheduler's counters since the last call (misses, refused tenants)."""
        data: dict[str, int | float] = dict(self._counts.take())
        return KVHeatConnectorStats(data=data) if data else None
