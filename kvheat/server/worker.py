"""The engine loop: one background thread owns every arm's `LLMEngine`.

HTTP handlers run on the asyncio loop and never touch an engine. They send commands
(add a request, abort one, an admin operation) to the engine thread, which runs them
between steps, steps every arm that has work (round-robin, one step each), and hands each
new token to its request's asyncio queue with `call_soon_threadsafe`. A finished or
aborted request is released from its engine there, and its metrics, arm statistics and
trace spans are recorded. An engine whose step raises is replaced by a fresh one (its
in-flight requests end with an error), so one bad step does not take the server down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from ..cache.hints import Outcome
from ..cache.misses import MISS_KINDS, MissClassifier
from ..doctor.replay import RecentKeys
from ..engine import LLMEngine, SamplingParams, TokenOutput
from .arms import ArmStats
from .handle import Finished, RequestHandle
from .metrics import ServerMetrics
from .tracing import Tracing

log = logging.getLogger("kvheat.server")
T = TypeVar("T")


class RequestTooLarge(ValueError):
    """The request can never fit this arm's KV pool (pool, quota or pinned prefixes).

    A 400 with code `context_length_exceeded`."""


@dataclass(slots=True)
class _Active:
    handle: RequestHandle
    arm: str
    prompt_tokens: int
    miss_kinds: list[str]
    match_start: float
    match_end: float
    predicted_hit_tokens: int
    prompt: list[int]
    max_tokens: int
    finish_override: str | None = None


class EngineWorker:
    """The engine thread: runs each arm's engine and hands results to the requests' loops."""

    def __init__(self, engine_factory: Callable[[str], LLMEngine], arms: Sequence[str],
                 metrics: ServerMetrics, arm_stats: ArmStats, tracing: Tracing,
                 tenant_quotas: dict[str, int | None] | None = None,
                 refresh_s: float = 0.25, cores: Sequence[int] | None = None) -> None:
        self.engine_factory = engine_factory
        self.cores = set(cores) if cores else None  # the engine thread's CPUs
        self.arms = list(arms)
        self.metrics = metrics
        self.arm_stats = arm_stats
        self.tracing = tracing
        self.tenant_quotas = dict(tenant_quotas or {})
        self.refresh_s = refresh_s
        self.engines: dict[str, LLMEngine] = {}
        self.classifiers: dict[str, MissClassifier] = {}
        for arm in self.arms:
            self.engines[arm] = self._new_engine(arm)
            self.classifiers[arm] = MissClassifier(self.engines[arm].cache.block_size)
        self.active: dict[str, _Active] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] \
            = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # the loop itself died (a bug)
        self._refreeze = False  # an engine left the frozen start-up heap: freeze it again
        self._logged: dict[str, float] = {}  # where -> when a side error was last logged
        # arm -> tenant -> miss class -> tokens, isolation included (engine thread; shown
        # by the admin API only: it says which prompts other tenants sent)
        self.misses: dict[str, dict[str, dict[str, int]]] = {}
        # arm -> the last admitted prompts as block keys (admin API only: GET
        # /admin/recent-keys, for `kvheat doctor`'s capacity replay); engine thread
        self.recent: dict[str, RecentKeys] = {arm: RecentKeys() for arm in self.arms}

    def _new_engine(self, arm: str) -> LLMEngine:
        eng = self.engine_factory(arm)
        for tenant, quota in self.tenant_quotas.items():
            if quota is not None:
                eng.set_tenant_quota(tenant, quota)
        return eng

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvheat-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread and close the engines."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        for eng in self.engines.values():
            _close(eng)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def num_active(self) -> int:
        """Requests in the engines now."""
        return len(self.active)

    # ---- commands (any thread) --------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread, between steps."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the engine loop is not running"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def acall(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the engine thread, awaited."""
        return await asyncio.wrap_future(self.call(fn))

    async def submit(self, handle: RequestHandle, prompt: list[int], params: SamplingParams,
                     logit_bias: dict[int, float] | None = None) -> None:
        """Queue a request on its arm's engine. Bad input raises ValueError (nothing queued)."""
        await self.acall(lambda: self._add(handle, prompt, params, logit_bias))

    def abort(self, handle: RequestHandle, reason: str = "abort") -> None:
        """End a request early (client gone, or a stop string matched); fire and forget."""
        if handle.finished is None and self.alive:
            self.call(lambda: self._abort(handle.request_id, reason))

    # ---- engine thread ----------------------------------------------------------------
    def _add(self, handle: RequestHandle, prompt: list[int], params: SamplingParams,
             logit_bias: dict[int, float] | None) -> None:
        eng = self.engines[handle.arm]
        rid = handle.request_id
        if logit_bias:  # a sampling parameter: the engine checks the ids against its vocabulary
            params = replace(params, logit_bias=dict(logit_bias))
        too_large = eng.scheduler.never_fits(prompt, params.max_tokens, handle.tenant)
        if too_large is not None:
            raise RequestTooLarge(too_large)
        eng.add_request(prompt, params, tenant=handle.tenant, session=handle.session,
                        request_id=rid)
        t0 = time.perf_counter()
        kinds = eng.scheduler.miss_kinds(self.classifiers[handle.arm], prompt, handle.tenant)
        t1 = time.perf_counter()
        predicted = 0
        for k in kinds:
            if k != "cached":
                break
            predicted += eng.cache.block_size
        self.active[rid] = _Active(handle, handle.arm, len(prompt), kinds, t0, t1, predicted,
                                   prompt, params.max_tokens)

    def end_all(self, message: str) -> None:
        """End every request in flight with a 503 (shutdown past its drain deadline)."""
        if self.alive:
            self.call(lambda: self._end_all(message))

    def _end_all(self, message: str) -> None:
        for rid, a in list(self.active.items()):
            eng = self.engines[a.arm]
            if rid in eng.requests:
                eng.abort(rid)
            a.finish_override = "abort"
            self._complete(a, Finished("abort", 0, 0, 0, error=message, status=503,
                                       code="shutting_down", retry_after_s=1))

    def _abort(self, rid: str, reason: str) -> None:
        a = self.active.get(rid)
        if a is None:
            return  # finished meanwhile
        eng = self.engines[a.arm]
        if rid in eng.requests:
            # A stop string matched: the answer was delivered, as when the model stops
            # (the cache policy sees it so); else the client went away: cancelled.
            eng.abort(rid, reason, Outcome.FINISHED if reason == "stop" else Outcome.CANCELLED)
        a.finish_override = reason
        self._complete(a)

    def _complete(self, a: _Active, error: Finished | None = None) -> None:
        """Release a finished (or aborted) request, record it, and answer it. Whatever
        the recording does, the request gets its `Finished` (and the loop goes on)."""
        eng = self.engines[a.arm]
        rid = a.handle.request_id
        self.active.pop(rid, None)
        held = eng.requests.get(rid)
        full = held.seq.full_req if held is not None else None  # its keys, hashed already
        try:
            out = eng.release(rid)
        except Exception as e:  # not finished in the engine: a bug, but answer the client
            self._side_error("release", e)
            a.handle.push(Finished("error", a.prompt_tokens, 0, 0,
                                   error=f"the request could not be released: {e}"))
            return
        m = out.metrics
        reason = a.finish_override or out.finish_reason or "abort"
        # As the cache counted it at admission (0 if never admitted): one count for the
        # response, the metrics, the arms' report and the cache's hit rate.
        cached = m.num_cached_tokens if m.admitted else 0
        if m.admitted and full is not None:  # the prompt's full blocks, as the cache keys them
            n = a.prompt_tokens // eng.cache.block_size
            self._guard("recent-keys", lambda: self.recent[a.arm].add(m.arrival, full.keys[:n]))
        self._guard("metrics", lambda: self._record(a, eng, out, reason, cached))
        self._guard("tracing", lambda: self.tracing.request_done(
            a.handle.span, out, a.arm, reason, a.prompt_tokens, cached,
            (a.match_start, a.match_end, a.predicted_hit_tokens), eng.tiers is not None))
        fin = Finished(reason, a.prompt_tokens, cached, len(out.output_token_ids))
        if error is not None:
            fin.error, fin.status, fin.code = error.error, error.status, error.code
            fin.retry_after_s = error.retry_after_s
        elif reason == "error":  # the engine could not schedule it (nothing else ends so)
            _explain_unschedulable(fin, eng, a)
        a.handle.push(fin)

    def _record(self, a: _Active, eng: LLMEngine, out: Any, reason: str,
                cached: int) -> None:
        m = out.metrics
        tenant = a.handle.tenant or "none"
        misses = (self.classifiers[a.arm].classify(a.miss_kinds, a.prompt_tokens, cached)
                  if m.admitted else None)
        by_tier = m.cached_by_tier if eng.tiers is not None and m.admitted else None
        e2e = (m.finished - m.arrival) if m.finished is not None else None
        if misses is not None:  # all classes, isolation too: for the admin API only
            per = self.misses.setdefault(a.arm, {}).setdefault(tenant, dict.fromkeys(MISS_KINDS, 0))
            for kind, n in misses.items():
                per[kind] += n
        if a.handle.prewarm:
            self.metrics.prewarm_requests.labels(a.arm).inc()
        else:
            self.metrics.observe_request(a.arm, tenant, a.handle.endpoint, reason,
                                         a.prompt_tokens, cached, len(out.output_token_ids),
                                         m.ttft, m.inter_token_latencies, e2e, misses, by_tier)
        if m.admitted:  # every prompt the cache's hit rate counts, and only those
            self.arm_stats.record(a.arm, m.ttft, a.prompt_tokens, cached,
                                  a.handle.prewarm)

    # ---- side work that must never stop serving ---------------------------------------
    def _guard(self, where: str, fn: Callable[[], Any]) -> None:
        """Run metrics, tracing or logging work; an error there is logged and counted,
        never raised into the engine loop."""
        try:
            fn()
        except Exception as e:
            self._side_error(where, e)

    def _side_error(self, where: str, exc: BaseException) -> None:
        now = time.monotonic()
        # At most one traceback per place every 60 s: a broken exporter must not flood logs.
        if now - self._logged.get(where, float("-inf")) >= 60.0:
            self._logged[where] = now
            with contextlib.suppress(Exception):
                log.error("%s failed (serving goes on): %r", where, exc, exc_info=exc)
        with contextlib.suppress(Exception):
            self.metrics.internal_errors.labels(where).inc()

    def _dispatch(self, arm: str, outs: list[TokenOutput]) -> None:
        for o in outs:
            a = self.active.get(o.request_id)
            if a is None:
                continue
            a.handle.push(o.token_id)
            if o.finished:
                self._complete(a)

    def _engine_failed(self, arm: str, exc: BaseException) -> None:
        self._guard("logging", lambda: log.error("the engine of arm %s failed; rebuilding it",
                                                 arm, exc_info=exc))
        self._guard("metrics", lambda: self.metrics.engine_failures.labels(arm).inc())
        _close(self.engines[arm])  # its tier threads; a disk tier's KV is found again below
        self.engines[arm] = self._new_engine(arm)  # before anyone hears of the failure
        if gc.get_freeze_count():
            # The old engine was frozen with the start-up heap (`freeze_startup_heap`) and
            # its tiers and KV events hold it in reference cycles: unfrozen, a collection
            # frees its KV pool. The loop freezes the heap again when it is next idle.
            gc.unfreeze()
            self._refreeze = True
        for rid, a in list(self.active.items()):
            if a.arm != arm:
                continue
            del self.active[rid]
            a.handle.push(Finished("error", a.prompt_tokens, 0, 0,
                                   error=f"the engine failed: {type(exc).__name__}"))

    def _drain_commands(self, stopped: bool = False) -> None:
        """Run the commands sent so far; once the loop has stopped, refuse them."""
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            if stopped:
                fut.set_exception(RuntimeError("the engine loop stopped"))
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, which answers 4xx or 5xx
                fut.set_exception(e)

    def refresh_gauges(self) -> None:
        """Refresh every arm's gauges from its engine."""
        for arm, eng in self.engines.items():
            self._guard("gauges", partial(self.metrics.refresh_arm, arm, eng, self.tenant_quotas))

    def _run(self) -> None:
        last_refresh = 0.0
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # this thread only (Linux: tid 0 = caller)
        try:
            while not self._stop:
                self._drain_commands()
                busy = False
                for arm in self.arms:
                    eng = self.engines[arm]
                    if not eng.has_unfinished:
                        continue
                    busy = True
                    try:
                        outs = eng.step()
                    except Exception as e:
                        self._engine_failed(arm, e)
                        continue
                    self._dispatch(arm, outs)
                    for rid in eng.pop_ended():  # ended without a token: answer them too
                        a = self.active.get(rid)
                        if a is not None:
                            self._complete(a)
                now = time.monotonic()
                if now - last_refresh >= self.refresh_s:
                    self.refresh_gauges()
                    last_refresh = now
                if not busy:
                    if self._refreeze:
                        self._refreeze = False
                        gc.collect()
                        gc.freeze()
                    self._wake.wait(self.refresh_s)
                    self._wake.clear()
        except BaseException as e:  # a bug in the loop: report unhealthy, fail everyone
            log.exception("the engine loop died")
            self.failure = e
        finally:
            for a in list(self.active.values()):
                a.handle.push(Finished("error", a.prompt_tokens, 0, 0,
                                       error="the server is shutting down", status=503,
                                       code="shutting_down", retry_after_s=1))
            self.active.clear()
            self._drain_commands(stopped=True)  # answer commands that will never run


def _explain_unschedulable(fin: Finished, eng: LLMEngine, a: _Active) -> None:
    why = eng.scheduler.never_fits(a.prompt, a.max_tokens, a.handle.tenant)
    if why is not None:  # e.g. prefixes pinned after it arrived
        fin.error, fin.status, fin.code = why, 400, "context_length_exceeded"
    else:
        fin.error = ("the KV pool cannot hold this request now (blocks are held by "
                     "pinned prefixes or cached under quotas); retry later")
        fin.status, fin.code, fin.retry_after_s = 503, "kv_pool_exhausted", 1


def _close(engine: LLMEngine) -> None:
    try:
        engine.close()
    except Exception:  # shutting one engine down must not stop the others
        log.exception("closing an engine failed")
