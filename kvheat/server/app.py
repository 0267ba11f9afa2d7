"""The OpenAI-compatible HTTP server: `/v1/completions`, `/v1/chat/completions` (with
server-sent events when `stream` is true), `/v1/models`, `/health`, `/metrics`, and the
admin API under `/admin` (see admin.py).

Every request is checked before it reaches the engine: a missing or wrong API key is
401, an unknown model 404, bad fields, a prompt over the context length or bad token ids
400, a full queue 503. A client that goes away mid-request has its request aborted, and
its blocks are freed at once. Prompts are tokenized and checked in prompts.py, answers
shaped in responses.py, errors in errors.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..cache import make_policy
from ..engine import GREEDY_BELOW, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from ..engine.engine import ContextLengthExceeded, check_context_length
from ..engine.loader import load_model
from ..kvevents.secret import EventSecret
from .admin import admin_router
from .arms import ArmRouter, ArmStats, arm_user
from .concurrency import ConcurrencyLimit
from .config import ConfigError, ServerConfig, TenantConfig
from .errors import ApiError, add_error_handlers, error_response, finished_error
from .events import EventsCollector, ServerEvents
from .guard import RequestGuard
from .handle import Finished, RequestHandle
from .metrics import ServerMetrics, StallWatch
from .netsignals import NetSignalsCollector, url_endpoint
from .prompts import PromptEncoder
from .protocol import (
    PREWARM_HEADER,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from .responses import Reply, collect, first_item, json_response, stream
from .selfheal import SelfHealer
from .sessions import SESSION_HEADER, SessionIds
from .tracing import Tracing, end_span
from .worker import EngineWorker, RequestTooLarge

log = logging.getLogger("kvheat.server")
T = TypeVar("T")


class KVHeatServer:
    """The model, one engine per arm (sharing the weights), the engine loop and the app."""

    def __init__(self, config: ServerConfig, span_exporter: Any = None) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        arms = {a.name: a for a in config.arm_list}
        for a in arms.values():
            _check_policy(a.policy)
        try:
            model, tok, mcfg = load_model(config.model, config.family, seed=config.seed)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the model: {e}") from None
        self.tokenizer = tok
        self.model_config = mcfg
        self.max_model_len = mcfg.max_position_embeddings
        self.prompts = PromptEncoder(tok, mcfg.vocab_size, self.max_model_len)
        self.model_name = config.model_name
        self.created = int(time.time())
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="kvheat-tokenize")
        self.keys: dict[str, TenantConfig] = {k: t for t in config.tenants for k in t.api_keys}
        self.tenants: dict[str, TenantConfig] = {t.name: t for t in config.tenants}
        self.sessions = SessionIds(config.share_groups)  # the cache policy's session hints

        def engine_for(arm: str) -> LLMEngine:
            a = arms[arm]
            sched = SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_num_seqs=config.max_num_seqs,
                                    prefix_caching=a.prefix_caching)
            ecfg = EngineConfig(num_blocks=a.num_blocks or config.num_blocks,
                                block_size=config.block_size, policy=a.policy,
                                share_groups=config.share_groups, scheduler=sched,
                                seed=config.seed, tiers=config.arm_tiers(a))
            try:
                eng = LLMEngine(model, tok, ecfg)
            except (OSError, ValueError) as e:  # e.g. a disk tier folder it cannot write
                raise ConfigError(f"arm {arm!r}: cannot set up its engine: {e}") from None
            old = self._shared.pop(arm, None)
            if old is not None:
                old.close()
            if config.tiers.redis_url and config.tiers.redis_shared and eng.tiers is not None:
                from ..tiers.shared import SharedTierFeed

                self._shared[arm] = SharedTierFeed(eng.tiers)
            if self.events is not None:
                self.events.engine_built(arm, eng)
            return eng

        self._shared: dict[str, Any] = {}  # arm -> its SharedTierFeed
        self.events: ServerEvents | None = None
        if config.kv_events_endpoint:
            try:
                self.events = ServerEvents(config, [a.name for a in config.arm_list])
            except ValueError as e:  # e.g. the port is taken
                raise ConfigError(str(e)) from None
        # The events secret the router shares also marks its prewarms (None: nothing is one).
        try:
            self.prewarm_secret = EventSecret.from_config(config.kv_events_secret)
        except ValueError as e:
            raise ConfigError(f"kv_events_secret: {e}") from None
        self.metrics = ServerMetrics(config.tenant_labels())
        self.stalls = StallWatch(self.metrics.registry)  # event-loop lag, GC pauses
        self.router = ArmRouter(config.arm_list)
        self.arm_stats = ArmStats(self.router.names)
        self.tracing = Tracing(config.otlp_endpoint, span_exporter)
        try:
            self.worker = EngineWorker(engine_for, self.router.names, self.metrics,
                                       self.arm_stats, self.tracing,
                                       {t.name: t.quota_blocks for t in config.tenants},
                                       cores=config.engine_cores)
        except BaseException:
            if self.events is not None:  # its sockets hold their ports
                self.events.close()
            raise
        if self.events is not None:
            self.events.bind_worker(self.worker.call)
            self.metrics.registry.register(EventsCollector(self.events))
        self.net_signals: NetSignalsCollector | None = None
        if config.net_signals:  # read at scrape time, never on the engine thread
            redis = url_endpoint(config.tiers.redis_url or "", 6379)
            self.net_signals = NetSignalsCollector(
                lambda: [(*redis, "redis")] if redis else [], ebpf=config.net_signals_ebpf)
            self.metrics.registry.register(self.net_signals)
        self.healer: SelfHealer | None = None
        if config.self_heal != "off":
            worker = self.worker
            self.healer = SelfHealer(config, self.metrics, self.tracing.tracer,
                                     lambda: {a: e.tiers for a, e in list(worker.engines.items())},
                                     self.router.arm_for)
        self.draining = False
        assert config.max_concurrent_requests is not None  # set by the config's check
        assert isinstance(config.max_in_flight_bytes, int)
        assert isinstance(config.max_body_bytes, int)
        self.concurrency = ConcurrencyLimit(config.max_concurrent_requests, log,
                                            "the server's open HTTP requests",
                                            on_count=self._count_concurrency_refused,
                                            max_bytes=config.max_in_flight_bytes,
                                            body_limit=config.max_body_bytes)
        self.app = _build_app(self)

    # ---- lifecycle --------------------------------------------------------------------
    def freeze_startup_heap(self) -> None:
        """Freeze what start-up made, once, before the server serves.

        In a server process: compile the chat template (else the first chat request imports
        jinja2 and compiles it), then collect and freeze what start-up made (imports, the
        model, the tokenizer), which lives as long as the process. Frozen, it is left out of
        every later full collection; unfrozen, the first one came on the first request and
        scanned it all for about 160 ms holding the GIL, the engine thread stalled behind it
        (a first TTFT of 300 ms against 120 ms now, docs/cluster.md). vLLM freezes its
        engine core's heap the same way. Not for tests: what is frozen is not collected
        again."""
        with contextlib.suppress(Exception):  # a template that fails now fails per request
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], True)
        gc.collect()
        gc.freeze()

    def start(self) -> None:
        """Start the engine thread (and the self-healer)."""
        self.worker.start()
        if self.healer is not None:
            self.healer.start()

    def uvicorn(self, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> uvicorn.Server:
        """A uvicorn server for this app that drains on shutdown (see `begin_drain`)."""
        cfg = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                             access_log=False,
                             # A backstop only: the drain ends every request before it.
                             timeout_graceful_shutdown=math.ceil(self.config.drain_timeout_s + 5))
        return _DrainingServer(cfg, self)

    async def begin_drain(self) -> None:
        """Drain on shutdown (uvicorn no longer accepts connections).

        New requests get 503, requests in flight get `drain_timeout_s` to finish, then end
        with a 503 error (a stream: a final error event and [DONE])."""
        if self.draining:
            return
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.worker.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.worker.num_active:
            log.warning("drain deadline passed: ending %d request(s)", self.worker.num_active)
            self.worker.end_all("the server is shutting down; retry on another replica")

    def stop(self) -> None:
        """Stop the engine thread, the watchers and the event publisher."""
        self.stalls.stop()
        if self.healer is not None:
            self.healer.stop()
        self.worker.stop()
        if self.net_signals is not None:
            self.net_signals.close()  # its eBPF tracer, if it started one
        for feed in self._shared.values():
            feed.close()
        if self.events is not None:
            self.events.close()
        self.tracing.shutdown()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # ---- request checks ---------------------------------------------------------------
    def authenticate(self, request: Request) -> TenantConfig | None:
        """The caller's tenant; None when no tenants are configured (open API)."""
        return self.tenant_for(request.headers.get("authorization", ""))

    def tenant_for(self, authorization: str) -> TenantConfig | None:
        """The tenant of the request's API key (None when the API is open); a bad key is a 401."""
        if not self.keys:
            return None
        scheme, _, key = authorization.partition(" ")
        tenant = self.keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", code="invalid_api_key")
        return tenant

    def check_admin(self, authorization: str) -> None:
        """Raise an ApiError unless `authorization` carries the admin token.

        A 404 when the admin API is off, a 401 for a missing or wrong token."""
        token = self.config.admin_token
        if not token:
            raise ApiError(404, "the admin API is off (start the server with an admin token)",
                           code="admin_disabled")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            raise ApiError(401, "missing or invalid admin token", "authentication_error")

    def early_check(self, path: str, authorization: str) -> JSONResponse | None:
        """Before the body is read: the key (API or admin) the path needs."""
        try:
            if path.startswith("/v1/"):
                self.tenant_for(authorization)
            elif path.startswith("/admin/"):
                self.check_admin(authorization)
        except ApiError as e:
            self.count_rejected(e.status)
            return e.response()
        return None

    def body_too_large(self, declared: int) -> JSONResponse:
        """The 413 answer to a body that declares `declared` bytes, counted."""
        self.count_rejected(413)
        return error_response(413, f"the request body has {declared} bytes; this server's "
                              f"limit is {self.config.max_body_bytes}", code="body_too_large")

    def count_rejected(self, status: int) -> None:
        """Count a request refused with `status` (never failing)."""
        with contextlib.suppress(Exception):  # metrics never fail a request
            self.metrics.rejected.labels(str(status)).inc()

    def _count_concurrency_refused(self, n: int) -> None:
        self.count_rejected(503)
        with contextlib.suppress(Exception):
            self.metrics.concurrency_refused.inc(n)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenizing, checking token ids) off the event loop.

        So one big prompt never stalls /health or other requests."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def check_model(self, model: str) -> None:
        """Raise a 404 ApiError unless `model` is the one this server serves."""
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def sampling(self, body: SamplingFields, tenant: TenantConfig | None, n_prompt: int,
                 max_tokens: int | None) -> tuple[SamplingParams, dict[int, float]]:
        """The request's sampling params and logit bias, with the tenant's defaults, checked."""
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        ctx = self.max_model_len
        if max_tokens is None and tenant is not None:
            max_tokens = tenant.max_tokens
        limit = self.config.max_tokens_limit
        if max_tokens is None:  # at least 1: a prompt with no room left fails the check
            max_tokens = max(1, min(self.config.default_max_tokens, limit or ctx,
                                    ctx - n_prompt))
        try:  # the engine's own check, before the request is queued
            check_context_length(n_prompt, max_tokens, ctx)
        except ContextLengthExceeded as e:
            param = "messages" if e.param == "prompt" and \
                isinstance(body, ChatCompletionRequest) else e.param
            raise ApiError(400, str(e), param=param, code="context_length_exceeded") from None
        if limit is not None and max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of "
                           f"{limit}", param="max_tokens")
        temperature = body.temperature
        if temperature is None:
            temperature = tenant.temperature if tenant and tenant.temperature is not None else 1.0
        if temperature < GREEDY_BELOW:  # as vLLM: tiny temperatures overflow; use greedy
            temperature = 0.0
        top_p = body.top_p
        if top_p is None:
            top_p = tenant.top_p if tenant and tenant.top_p is not None else 1.0
        # A top_p that underflows float32 would drop every token in the engine's sampler;
        # any top_p this small keeps just the most likely token, as 1e-6 does.
        top_p = max(top_p, 1e-6)
        bias: dict[int, float] = dict(tenant.logit_bias) if tenant else {}
        for k, v in (body.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise ApiError(400, f"logit_bias keys are token ids, not {k!r}",
                               param="logit_bias") from None
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                    top_k=body.top_k or 0, seed=body.seed,
                                    ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return params, bias

    # ---- generation -------------------------------------------------------------------
    def session_of(self, request: Request, body: SamplingFields, tenant: TenantConfig | None,
                   messages: list[ChatMessage] | None = None) -> str | None:
        """The request's session for the cache policy (sessions.py).

        A bad X-Session-Id header is a 400."""
        return self.sessions.session_of(request.headers.get(SESSION_HEADER), body.user,
                                        tenant.name if tenant else None, messages)

    async def generate(self, request: Request, body: SamplingFields, prompt: list[int],
                       tenant: TenantConfig | None, kind: str,
                       max_tokens: int | None, session: str | None = None) -> Response:
        """Run a prompt on the engine and answer it, streamed or whole.

        A 503 when the server is draining or at capacity."""
        params, bias = self.sampling(body, tenant, len(prompt), max_tokens)
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica",
                           "server_error", code="shutting_down")
        if self.worker.num_active >= self.config.max_queued_requests:
            raise ApiError(503, "the server is at capacity; retry later", "server_error",
                           code="overloaded")
        arm = self.router.arm_for(arm_user(body.user, tenant.name if tenant else None))
        # Shed by the tenant's class (the operator's), never by the arm `user` picked.
        retry_after = self.healer.admit(tenant) if self.healer is not None else None
        if retry_after is not None:  # overloaded: this priority class is shed for now
            self.count_rejected(429)
            resp = error_response(429, "the server is overloaded and sheds this priority "
                                  "of traffic for now; retry later", "server_error",
                                  code="load_shed")
            resp.headers["Retry-After"] = str(retry_after)
            return resp
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        tenant_name = tenant.name if tenant else None
        span = self.tracing.start_request(
            "kvheat.request", {"kvheat.request_id": rid, "kvheat.arm": arm,
                               "kvheat.tenant": tenant_name or "none",
                               "kvheat.endpoint": kind, "kvheat.prompt_tokens": len(prompt)})
        handle = RequestHandle(asyncio.get_running_loop(), rid, arm, tenant_name, kind, span)
        # A router's prewarm only with its MAC of the prompt (the header is the client's
        # claim otherwise, and would hide its requests from the replica's counts).
        handle.prewarm = self.prewarm_secret is not None and \
            self.prewarm_secret.is_prewarm(prompt, request.headers.get(PREWARM_HEADER))
        handle.session = session
        try:
            await self.worker.submit(handle, prompt, params, bias)
        except RequestTooLarge as e:
            end_span(span)
            raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") \
                from None
        except ValueError as e:
            end_span(span)
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:
            end_span(span)
            raise ApiError(503, f"the engine is not available: {e}", "server_error") from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        reply = Reply(handle, kind, self.model_name, int(time.time()), body.stop_list(),
                      include_usage)
        if body.stream:
            # The status line waits for the first token: a request the engine ends before
            # it (one that cannot be scheduled) gets a real error status, not a 200 stream.
            first = await first_item(reply, request, self.worker)
            if isinstance(first, Finished) and first.error is not None:
                end_span(handle.span)
                return finished_error(first)
            return StreamingResponse(stream(reply, first, self.worker, self.tokenizer),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(reply, request, self.worker, self.tokenizer)


class _DrainingServer(uvicorn.Server):
    """uvicorn, but its shutdown drains the app's requests under a deadline first."""

    def __init__(self, config: uvicorn.Config, app: KVHeatServer) -> None:
        super().__init__(config)
        self.kvheat = app

    async def shutdown(self, sockets: Any = None) -> None:
        drain = asyncio.create_task(self.kvheat.begin_drain())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def _check_policy(name: str) -> None:
    try:
        pol = make_policy(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"unknown cache policy {name!r}: {e}") from None
    if pol.needs_future:
        raise ConfigError(f"policy {name!r} needs the future (an offline bound); it cannot serve")


def _build_app(server: KVHeatServer) -> FastAPI:
    """The FastAPI app: the OpenAI routes, /health, /kv_events, /metrics and the admin API."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start()
        server.stalls.start()
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="kvheat", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server on the kvheat KV cache.")
    body_limit = server.config.max_body_bytes
    assert isinstance(body_limit, int)  # ServerConfig parsed the size
    app.add_middleware(RequestGuard, max_body_bytes=body_limit,
                       early_check=server.early_check, too_large=server.body_too_large)
    # Outermost (added last): a request past the bound is refused before anything reads it.
    app.add_middleware(server.concurrency.wrap)

    add_error_handlers(app, server.count_rejected)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = server.authenticate(request)
        server.check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        session = server.session_of(request, body, tenant)
        prompt = await server.offload(server.prompts.completion, body.prompt)
        return await server.generate(request, body, prompt, tenant, "completions",
                                     body.max_tokens, session)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = server.authenticate(request)
        server.check_model(body.model)
        if body.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        session = server.session_of(request, body, tenant, body.messages)
        prompt = await server.offload(server.prompts.chat, body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await server.generate(request, body, prompt, tenant, "chat", max_tokens,
                                     session)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.authenticate(request)
        return json_response({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created,
            "owned_by": "kvheat", "max_model_len": server.max_model_len}]})

    @app.get("/health")
    async def health() -> Response:
        if not server.worker.alive:
            return error_response(503, "the engine loop is not running", "server_error")
        if server.draining:
            return error_response(503, "the server is shutting down", "server_error")
        return json_response({"status": "ok", "active_requests": server.worker.num_active})

    @app.get("/kv_events")
    async def kv_events() -> Response:
        """Where this server publishes its KV events (for routers that subscribe)."""
        if server.events is None:
            return error_response(404, "KV events are off (start the server with "
                                  "--kv-events-endpoint)", code="kv_events_disabled")
        return json_response(server.events.info())

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        # With a metrics token, /metrics needs it (and labels tenants by name); without
        # one it is open, and tenants are labelled by metrics_label or tenant-<i>.
        token = server.config.metrics_token
        if token:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                     token.encode()):
                server.count_rejected(401)
                return error_response(401, "missing or invalid metrics token (send "
                                      "'Authorization: Bearer TOKEN')",
                                      "authentication_error")
        return Response(generate_latest(server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    app.include_router(admin_router(server))
    return app
