"""`kvheat route`: an OpenAI-compatible front for N replicas with a global prefix index.

Per request: the prompt is tokenized and keyed as the replicas' caches key it (the same
tokenizer and chat template, the tenant's salt from its API key; `keys.py`), the policy
picks a replica from the prefix index (fed by the replicas' KV events) and their loads,
and the request is proxied there with aiohttp, body and Authorization header unchanged (a
vLLM replica also gets the tenant's salt, keyed, as `cache_salt`, the tenant vouched for
and the client's session, keyed, in `kv_transfer_params`, and none of the client's own
claims to a tenant or a priority: `hints.py`, kvheat/cache/tenancy.py; `proxy.py`). A
replica that cannot be reached, or answers 5xx before sending anything, is replaced by the
next choice; one that dies mid-stream ends the stream with an error event and [DONE],
never a hang (a silence longer than `read_timeout_s` counts as death). Health checks take
replicas out and back; replicas join and leave through the admin API or DNS discovery
(`replicas.py`). Every decision is counted in Prometheus metrics and traced as an
OpenTelemetry span.

The two proxied endpoints are served on raw ASGI (the router's own cost per request is
what it adds to every call); the rest (health, metrics, models, admin) is a FastAPI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Scope

from ..kvevents.secret import EventSecret
from ..server.concurrency import ConcurrencyLimit, InFlight
from ..server.netsignals import url_endpoint
from ..server.tracing import Tracing, end_span
from .config import ReplicaSpec, RouterConfig, RouterConfigError
from .hints import SessionHints, vllm_body
from .index import PrefixIndex
from .keys import PromptKeys
from .metrics import RouterMetrics
from .proxy import Forwarder, Receive, RouterError, Send, read_body, send_error
from .regime import ClusterEntropy
from .replicas import Replica, ReplicaRegistry
from .routing import (
    Decision,
    KVHeatRouting,
    NoReplica,
    RouteRequest,
    RoutingPolicy,
    make_routing_policy,
)

log = logging.getLogger("kvheat.router")

# Request headers passed to the replica (the rest are this hop's); x-session-id: the
# session hint of a kvheat replica's cache policy (kvheat/server/sessions.py; a vLLM
# replica gets it in the body instead: hints.py).
_HOP_HEADERS = frozenset({b"authorization", b"content-type", b"accept", b"x-request-id",
                          b"openai-organization", b"x-session-id"})
_PROXIED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_KEYED = ("kvheat", "prefix-hash", "sglang-like")  # policies that read the prompt's keys
_json = msgspec.json.Decoder()


def _error(status: int, message: str, type_: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": None,
                                   "code": code}}, status_code=status, headers=headers)


class KVHeatRouter:
    """The router: keys each prompt, chooses a replica from the prefix index and proxies to it."""

    def __init__(self, config: RouterConfig, span_exporter: Any = None) -> None:
        self.config = config
        # The replicas' events secret: keys are matched in its published form, and kvheat
        # replicas' event sockets are CURVE (kvheat/kvevents/secret.py).
        self.secret = EventSecret.from_config(config.events_secret)
        keyer = self.secret.event_key if self.secret is not None else None
        self.index = PrefixIndex(config.ghost_factor, keyer=keyer,
                                 max_blocks=config.index_max_blocks)
        kw: dict[str, object] = {"overload_guard": config.overload_guard,
                                 "shard_choices": config.shard_choices} \
            if config.policy == "kvheat" else {}
        self.policy: RoutingPolicy = make_routing_policy(config.policy, self.index, **kw)
        self.metrics = RouterMetrics()
        self.in_flight = InFlight(config.max_in_flight, config.max_in_flight_bytes,
                                  on_count=self.metrics.refused.inc, log=log,
                                  what="the router's requests in flight (answered 503)")
        assert config.max_concurrent_requests is not None  # set by the config's check
        self.concurrency = ConcurrencyLimit(config.max_concurrent_requests, log,
                                            "the router's open HTTP requests",
                                            on_count=self.metrics.concurrency_refused.inc)
        self.tracing = Tracing(config.otlp_endpoint, span_exporter, service_name="kvheat-router")
        self.keys = PromptKeys(config, keyer)
        if config.tenants and not self.keys.tenancy.configured and \
                any(r.kind == "vllm" for r in config.replicas):
            log.warning("no tenant secret (tenant_secret, $KVHEAT_TENANT_SECRET): vLLM "
                        "replicas' cache salts are keyed by a key drawn now (a restart "
                        "starts their tenants' caches afresh) and their KVHeatConnector "
                        "is told no tenant")
        self.sessions = SessionHints(config.share_groups, config.session_secret)
        self.registry = ReplicaRegistry(config, self.index, self.policy, self.metrics,
                                        self.secret)
        self.replicas: dict[str, Replica] = self.registry.replicas
        self.forwarder = Forwarder(self.registry, self.index, self.metrics)
        if config.net_signals:
            self.metrics.watch_network(lambda: [
                (*ep, "replica") for url in list(self.replicas)
                if (ep := url_endpoint(url, 443 if url.startswith("https") else 80))],
                ebpf=config.net_signals_ebpf)
        self.cluster = ClusterEntropy()
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="kvheat-route-tok")
        self._tasks: list[asyncio.Task[Any]] = []
        self._propagator = TraceContextTextMapPropagator()
        self.api = self._build_api()
        self.app = self.concurrency.wrap(self._build_app())

    # ---- one proxied request --------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send,
                     endpoint: str) -> None:
        """Answer one OpenAI request on `endpoint`: route it, or refuse it when at capacity."""
        held = self.in_flight.admit(scope, self.config.max_body_bytes)
        try:
            if held is None:
                raise RouterError(503, "the router is at capacity; retry later",
                                  "server_error", "overloaded")
            status = await self._route(scope, receive, send, endpoint)
        except RouterError as e:
            await send_error(send, e)
            status = e.status
        finally:
            if held is not None:
                self.in_flight.release(held)
        if status:
            self.metrics.answered(endpoint, status)

    async def _route(self, scope: Scope, receive: Receive, send: Send,
                     endpoint: str) -> int:
        """Answer one request; the status sent (0: the client left first)."""
        t_start = time.perf_counter()
        cfg = self.config
        auth, length = "", b""
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            if k in _HOP_HEADERS:
                headers[k.decode()] = v.decode("latin-1")
            elif k == b"content-length":
                length = v
        headers["content-type"] = "application/json"
        auth = headers.get("authorization", "")
        tenant, known = self.keys.tenant_of(auth)
        if not known:
            raise RouterError(401, "missing or invalid API key (send 'Authorization: Bearer "
                              "KEY')", "authentication_error", "invalid_api_key")
        if length.isdigit() and int(length) > cfg.max_body_bytes:
            raise RouterError(413, f"the request body has {length.decode()} bytes; the limit "
                              f"is {cfg.max_body_bytes}", code="body_too_large")
        body_bytes = await read_body(receive, cfg.max_body_bytes)
        if body_bytes is None:
            return 0
        try:
            body = _json.decode(body_bytes)
        except msgspec.DecodeError as e:
            raise RouterError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the body must be a JSON object")
        stream = body.get("stream") is True
        user = body.get("user") if isinstance(body.get("user"), str) else None
        session_header = headers.get("x-session-id")
        self.sessions.check_header(session_header)
        session, digested = None, False  # a vLLM replica's session hint, once needed
        tokens = None
        if cfg.policy in _KEYED:
            # A short prompt is keyed here (a thread hop costs more than it); a long one off
            # the event loop, so it never stalls other requests.
            tokens = self.keys.prompt_tokens(body, endpoint) if len(body_bytes) < 16384 else \
                await asyncio.get_running_loop().run_in_executor(
                    self._cpu, self.keys.prompt_tokens, body, endpoint)
        span = self.tracing.start_request("kvheat.route", {
            "kvheat.endpoint": endpoint, "kvheat.tenant": tenant or "none",
            "kvheat.prompt_tokens": len(tokens) if tokens else 0, "kvheat.stream": stream})
        if self.tracing.enabled:
            with contextlib.suppress(Exception):
                self._propagator.inject(headers, trace.set_span_in_context(span))
        tried: set[str] = set()
        try:
            for attempt in range(cfg.max_attempts):
                t0 = time.perf_counter()
                choice = self._choose(tokens, tenant, user, tried)
                if choice is None:
                    break
                r, rreq, decision = choice
                t1 = time.perf_counter()
                if attempt == 0:
                    self.cluster.observe(rreq.keys)
                    self.maybe_prewarm(rreq, body, tokens, auth, r, user, tenant)
                self._record_decision(span, r, rreq, decision, t_start if attempt == 0 else t0,
                                      t1, attempt)
                tried.add(r.name)
                content, to = body_bytes, headers
                if r.spec.kind == "vllm":
                    if not digested:
                        session = self.sessions.session_of(session_header, user, tenant)
                        digested = True
                    cache_salt, vouched = self.keys.vllm_tenant(tenant)
                    content = vllm_body(body, body_bytes, cache_salt, session, vouched)
                    if session_header is not None:  # vLLM ignores it: the digest is enough
                        to = {k: v for k, v in headers.items() if k != "x-session-id"}
                status = await self.forwarder.forward(send, receive, r, rreq, decision,
                                                      _PATHS[endpoint], to, content,
                                                      stream, span)
                if status is not None:
                    return status
            raise RouterError(503, "no replica could take the request; retry later",
                              "server_error", "no_replica")
        finally:
            end_span(span)

    def _choose(self, tokens: list[int] | None, tenant: str | None, user: str | None,
                exclude: set[str]) -> tuple[Replica, RouteRequest, Decision] | None:
        reps = [r for r in self.replicas.values() if r.healthy and r.name not in exclude]
        if not reps:
            return None
        # Replicas of one block size and arm layout share the keys (the usual case: one).
        bs, arms = reps[0].block_size, reps[0].arms
        reps = [r for r in reps if r.block_size == bs and r.arms == arms] or reps
        # vLLM replicas' keys are rooted at the keyed cache_salt the router gives them (a
        # kvheat replica keys its own; once its /kv_events is read its arms set it apart).
        vllm = any(r.spec.kind == "vllm" for r in reps)
        rreq = self.keys.route_request(tokens, tenant, bs, user, arms, vllm)
        if self.config.require_events and rreq.keys and not self.registry.events_ready():
            # Not every replica's events arrive yet: its cache is unknown, so by load alone
            # (no keys), never toward the replicas whose events happen to flow.
            self.metrics.blind_routes.inc()
            rreq = RouteRequest([], [], rreq.num_tokens, rreq.rank)
        for r in reps:
            r.state.pending_prefill = sum(r.pending.values())
        try:
            d = self.policy.choose(rreq, [r.state for r in reps])
        except NoReplica:
            return None
        r = reps[d.replica]
        self.policy.routed(rreq, r.name, d.expected_hit_tokens)
        return r, rreq, d

    def _record_decision(self, span: Any, r: Replica, rreq: RouteRequest, d: Decision,
                         t0: float, t1: float, attempt: int) -> None:
        m = self.metrics
        with contextlib.suppress(Exception):  # metrics and traces never fail a request
            m.decision(r.name, d.mode, d.regime or "-").inc()
            m.decision_seconds.observe(t1 - t0)
            rm = m.of(r.name)
            rm.prompt_tokens.inc(rreq.num_tokens)
            rm.expected_hit_tokens.inc(d.expected_hit_tokens)
            self.tracing.child(span, "route.decide", t0, t1, {
                "kvheat.replica": r.name, "kvheat.mode": d.mode, "kvheat.regime": d.regime,
                "kvheat.expected_hit_tokens": d.expected_hit_tokens,
                "kvheat.prompt_tokens": rreq.num_tokens, "kvheat.attempt": attempt,
                "kvheat.candidates": len(d.scores)})

    def maybe_prewarm(self, rreq: RouteRequest, body: dict[str, Any], tokens: list[int] | None,
                      authorization: str, chosen: Replica, user: str | None = None,
                      tenant: str | None = None) -> None:
        """Send the request's hot head to the replicas that lack it on their devices.

        In the arm the request's user reaches (an "exact" arm matches whole prompts only: a
        head would never be reused there, so none is sent); to vLLM replicas under the
        tenant's keyed salt, as the request itself (never into the unsalted namespace every
        direct client shares)."""
        pol = self.policy
        if not self.config.prewarm or not tokens or not isinstance(pol, KVHeatRouting):
            return
        arms = chosen.arms
        if arms is not None and arms.modes[rreq.rank] != "block":
            return
        block_size = chosen.block_size
        reps = [r for r in self.replicas.values()
                if r.healthy and r.block_size == block_size and r.arms == arms]
        head = pol.hot_head(rreq, len(reps))
        if head == 0:
            return
        matches = self.index.match(rreq.keys[:head], rreq.block_tokens[:head],
                                   [r.name for r in reps], rreq.rank)
        targets = [r for r, m in zip(reps, matches)
                   if r is not chosen and m.device_blocks < head and not r.prewarming]
        if not targets:
            return
        # Once for every replica warmed: the head, its mark and the tenant's fields.
        model = str(body.get("model", ""))
        vllm: dict[str, Any] = {}  # what a vLLM replica's prewarm carries of the tenant
        if tenant is not None:
            cache_salt, vouched = self.keys.vllm_tenant(tenant)
            vllm = {"cache_salt": cache_salt} if vouched is None else \
                {"cache_salt": cache_salt, "kv_transfer_params": vouched}
        head_tokens = tokens[:head * block_size]
        mark = self.secret.prewarm_mark(head_tokens) if self.secret else None
        for r in targets:
            t = asyncio.ensure_future(self.forwarder.prewarm(
                r, model, head_tokens, authorization, user,
                vllm if r.spec.kind == "vllm" else None, mark))
            self._tasks = [x for x in self._tasks if not x.done()] + [t]

    # ---- the app --------------------------------------------------------------------------
    def check_admin(self, authorization: str) -> None:
        """Raise a RouterError unless `authorization` carries the admin token.

        A 404 when the admin API is off, a 401 for a missing or wrong token."""
        token = self.config.admin_token
        if not token:
            raise RouterError(404, "the admin API is off (start the router with an admin "
                              "token)", code="admin_disabled")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            raise RouterError(401, "missing or invalid admin token", "authentication_error")

    def _build_app(self) -> Any:
        api, handle = self.api, self.handle

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                endpoint = _PROXIED.get(scope["path"])
                if endpoint is not None:
                    await handle(scope, receive, send, endpoint)
                    return
            await api(scope, receive, send)

        return app

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        cfg = self.config
        client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                          sock_read=cfg.read_timeout_s),
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
            auto_decompress=False, skip_auto_headers=("User-Agent",))
        self.registry.client = self.forwarder.client = client
        await self.registry.check_all()
        self._tasks.append(asyncio.create_task(self.registry.health_loop()))
        if cfg.replica_admin_token:
            self._tasks.append(asyncio.create_task(self._report_loop()))
        try:
            yield
        finally:
            for t in self._tasks:
                t.cancel()
            for t in self._tasks:
                with contextlib.suppress(BaseException):
                    await t
            await client.close()
            self.registry.close()
            self.metrics.close()
            self.tracing.shutdown()
            self._cpu.shutdown(wait=False, cancel_futures=True)

    async def _report_loop(self) -> None:
        """Every health interval: the whole traffic's entropy to each kvheat replica in
        rotation, for its eviction regime (kvheat/router/regime.py). A replica that does
        not take it keeps its own regime; nothing here touches routing or health."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            bits = self.cluster.bits()
            if bits is None:
                continue
            try:
                self.metrics.cluster_entropy.set(bits)
                reps = [r for r in self.replicas.values()
                        if r.healthy and r.spec.kind == "kvheat"]
                await asyncio.gather(*(self.registry.report_entropy(
                    r, bits, self.config.replica_admin_token or "") for r in reps))
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one bad report
                log.exception("cluster entropy report")

    def _build_api(self) -> FastAPI:
        app = FastAPI(title="kvheat route", version="0.1.0", lifespan=self._lifespan,
                      description="Cache-aware router for kvheat (and vLLM) replicas; "
                      "POST /v1/chat/completions and /v1/completions are proxied.")
        reg = self.registry

        @app.exception_handler(RouterError)
        async def _router_error(request: Request, exc: RouterError) -> Response:
            with contextlib.suppress(Exception):
                self.metrics.answered(request.url.path, exc.status)
            return Response(exc.body(), status_code=exc.status, headers=exc.headers(),
                            media_type="application/json")

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            assert reg.client is not None
            auth = {k: v for k, v in request.headers.items() if k == "authorization"}
            for r in [r for r in self.replicas.values() if r.healthy]:
                try:
                    async with reg.client.get(r.name + "/v1/models", headers=auth,
                                              timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                        data = await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue
                return Response(data, status_code=resp.status,
                                media_type=resp.headers.get("content-type"))
            return _error(503, "no replica is healthy", "server_error", "no_replica")

        @app.get("/health")
        async def health() -> Response:
            n = sum(1 for r in self.replicas.values() if r.healthy)
            if n == 0:
                return _error(503, "no replica is healthy", "server_error", "no_replica")
            return JSONResponse({"status": "ok", "healthy_replicas": n,
                                 "replicas": len(self.replicas)})

        @app.get("/metrics")
        async def metrics() -> Response:
            reg.refresh_gauges()
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/admin/replicas")
        async def list_replicas(request: Request) -> Response:
            self.check_admin(request.headers.get("authorization", ""))
            return JSONResponse({"replicas": [reg.describe(r) for r in self.replicas.values()],
                                 "policy": self.policy.name})

        @app.post("/admin/replicas")
        async def add_replica(request: Request) -> Response:
            self.check_admin(request.headers.get("authorization", ""))
            try:
                data = await request.json()
                spec = ReplicaSpec(**data) if isinstance(data, dict) else None
            except (RouterConfigError, ValueError, TypeError, AttributeError) as e:
                raise RouterError(400, f"a replica is {{\"url\", \"kind\", \"events\", "
                                  f"\"replay\", \"block_size\"}}: {e}") from None
            if spec is None:
                raise RouterError(400, "the body must be a JSON object")
            r = reg.add(spec)
            await reg.check(r)
            return JSONResponse(reg.describe(r), status_code=201)

        @app.delete("/admin/replicas")
        async def remove_replica(request: Request, url: str) -> Response:
            self.check_admin(request.headers.get("authorization", ""))
            if not reg.remove(url.rstrip("/")):
                raise RouterError(404, f"no replica {url!r}", code="unknown_replica")
            return JSONResponse({"removed": url})

        return app
