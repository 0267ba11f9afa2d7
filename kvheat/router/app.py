"""`kvheat route`: an OpenAI-compatible front for N replicas with a global prefix index.

Per request: the prompt is tokenized and keyed as the replicas' caches key it (the same
tokenizer and chat template, the tenant's salt from its API key), the policy picks a
replica from the prefix index (fed by the replicas' KV events) and their loads, and the
request is proxied there with aiohttp, body and Authorization header unchanged (a vLLM
replica also gets the tenant's salt as `cache_salt`). A replica that cannot be reached,
or answers 5xx before sending anything, is replaced by the next choice; one that dies
mid-stream ends the stream with an error event and [DONE], never a hang (a silence
longer than `read_timeout_s` counts as death). Health checks take replicas out and back;
replicas join and leave through the admin API or DNS discovery. Every decision is counted
in Prometheus metrics and traced as an OpenTelemetry span.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..cache.hashing import block_keys, root_key, tokens_to_bytes
from ..kvevents import KVEventSubscriber
from ..server.tracing import Tracing, end_span
from .config import ReplicaSpec, RouterConfig
from .index import DEVICE, LOCAL_TIER, SHARED_TIER, PrefixIndex
from .policy import KVHeatRouting, NoReplica, ReplicaState, RouteRequest, RoutingPolicy
from .policy import make_policy as make_router

log = logging.getLogger("kvheat.router")
_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0)
_HOP_HEADERS = {"authorization", "content-type", "accept", "x-request-id", "openai-organization"}


class RouterError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = \
            status, message, type_, code, param

    def response(self) -> JSONResponse:
        return _error(self.status, self.message, self.type, self.code, self.param)


def _error(status: int, message: str, type_: str = "invalid_request_error",
           code: str | None = None, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def _sse_error(message: str, code: str) -> bytes:
    return (b"data: " + json.dumps({"error": {"message": message, "type": "server_error",
                                              "param": None, "code": code}}).encode()
            + b"\n\ndata: [DONE]\n\n")


@dataclass(slots=True)
class Replica:
    spec: ReplicaSpec
    state: ReplicaState
    block_size: int
    healthy: bool = False  # until the first health check passes
    failures: int = 0
    events: KVEventSubscriber | None = None
    pending: dict[int, float] = field(default_factory=dict)  # request -> expected prefill
    prewarming: bool = False
    routed: int = 0

    @property
    def name(self) -> str:
        return self.spec.url


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvheat_router_requests", "Requests answered, by endpoint and "
                                "HTTP status.", ["endpoint", "status"], registry=r)
        self.decisions = Counter("kvheat_router_decisions", "Routing decisions, by replica, "
                                 "mode (affinity, home, shard, balance, overload, ...) and "
                                 "entropy regime.", ["replica", "mode", "regime"], registry=r)
        self.decision_seconds = Histogram("kvheat_router_decision_seconds", "Time to key the "
                                          "prompt and choose a replica.", buckets=_LATENCY,
                                          registry=r)
        self.prompt_tokens = Counter("kvheat_router_prompt_tokens", "Prompt tokens routed.",
                                     ["replica"], registry=r)
        self.expected_hit_tokens = Counter("kvheat_router_expected_hit_tokens", "Prompt "
                                           "tokens the index expected cached where routed.",
                                           ["replica"], registry=r)
        self.cached_tokens = Counter("kvheat_router_cached_tokens", "Prompt tokens the "
                                     "replicas reported served from cache (usage).",
                                     ["replica"], registry=r)
        self.failovers = Counter("kvheat_router_failovers", "Requests moved to another "
                                 "replica, by reason.", ["reason"], registry=r)
        self.stream_errors = Counter("kvheat_router_stream_errors", "Streams ended with an "
                                     "error event because their replica failed mid-stream.",
                                     ["replica"], registry=r)
        self.ttft = Histogram("kvheat_router_time_to_first_byte_seconds", "From routing to "
                              "the replica's first response bytes.", ["replica"],
                              buckets=_LATENCY, registry=r)
        self.healthy = Gauge("kvheat_router_replica_healthy", "1 when the replica is in "
                             "rotation.", ["replica"], registry=r)
        self.in_flight = Gauge("kvheat_router_replica_in_flight", "Requests in flight.",
                               ["replica"], registry=r)
        self.index_blocks = Gauge("kvheat_router_index_blocks", "Blocks the index holds per "
                                  "replica and place.", ["replica", "place"], registry=r)
        self.event_batches = Gauge("kvheat_router_event_batches", "KV event batches "
                                   "received from the replica.", ["replica"], registry=r)
        self.event_resets = Gauge("kvheat_router_event_resets", "Times the replica's view "
                                  "was reset (lost events, restarts).", ["replica"], registry=r)
        self.prewarms = Counter("kvheat_router_prewarms", "Hot prefixes sent to replicas "
                                "that lacked them.", ["replica"], registry=r)


class KVHeatRouter:
    def __init__(self, config: RouterConfig, span_exporter: Any = None) -> None:
        self.config = config
        self.index = PrefixIndex()
        kw = {"overload_guard": True} if config.overload_guard and config.policy == "kvheat" \
            else {}
        self.policy: RoutingPolicy = make_router(config.policy, self.index, **kw)
        self.metrics = RouterMetrics()
        self.tracing = Tracing(config.otlp_endpoint, span_exporter, service_name="kvheat-router")
        self.replicas: dict[str, Replica] = {}
        self._tokenizer: Any = None
        self._template: Any = None
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="kvheat-route-tok")
        self._client: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._next_id = 0
        self._discovered_missing: dict[str, int] = {}
        self._roots: dict[str | None, bytes] = {}
        for spec in config.replicas:
            self._add(spec)
        self.app = self._build_app()

    # ---- replicas -------------------------------------------------------------------------
    def _add(self, spec: ReplicaSpec) -> Replica:
        if spec.url in self.replicas:
            return self.replicas[spec.url]
        r = Replica(spec, ReplicaState(spec.url, healthy=False),
                    spec.block_size or self.config.block_size)
        self.replicas[spec.url] = r
        self.index.add_replica(spec.url, foreign_hashes=spec.kind == "vllm")
        if spec.kind == "vllm" and spec.events:
            self._subscribe(r, spec.events, spec.replay)
        return r

    def _remove(self, url: str) -> bool:
        r = self.replicas.pop(url, None)
        if r is None:
            return False
        if r.events is not None:
            r.events.close(timeout_s=0.5)
        self.index.remove_replica(url)
        self.policy.forget_replica(url)
        for g in (self.metrics.healthy, self.metrics.in_flight, self.metrics.event_batches,
                  self.metrics.event_resets):
            with contextlib.suppress(KeyError):
                g.remove(url)
        return True

    def _subscribe(self, r: Replica, endpoint: str, replay: str | None) -> None:
        r.events = KVEventSubscriber(r.name, endpoint, replay, self.index.apply,
                                     self.index.clear_replica)

    async def _discover_events(self, r: Replica) -> None:
        """Ask a kvheat replica where it publishes (GET /kv_events) and subscribe."""
        if r.events is not None or r.spec.kind != "kvheat" or self._client is None:
            return
        try:
            async with self._client.get(r.name + "/kv_events",
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status != 200:
                    return
                info = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return
        host = r.spec.host
        ep = f"tcp://{host}:{info['port']}" if info.get("port") else info.get("endpoint")
        rp = f"tcp://{host}:{info['replay_port']}" if info.get("replay_port") else None
        if r.spec.block_size is None and info.get("block_size"):
            r.block_size = int(info["block_size"])
        if ep:
            self._subscribe(r, ep, rp)

    async def _health_loop(self) -> None:
        while True:
            try:
                if self.config.discover:
                    await self._discover()
                await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
                self._refresh_gauges()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one bad check
                log.exception("health check round")
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, r: Replica) -> None:
        assert self._client is not None
        try:
            async with self._client.get(r.name + "/health", timeout=aiohttp.ClientTimeout(
                    total=max(0.5, self.config.health_interval_s))) as resp:
                ok = resp.status == 200
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            r.failures = 0
            if not r.healthy:
                log.info("replica %s is in rotation", r.name)
            r.healthy = r.state.healthy = True
            await self._discover_events(r)
        else:
            r.failures += 1
            if r.healthy and r.failures >= self.config.health_failures:
                log.warning("replica %s failed %d health checks: out of rotation", r.name,
                            r.failures)
                r.healthy = r.state.healthy = False

    def _mark_failed(self, r: Replica) -> None:
        """A request could not reach `r`: out of rotation until a health check passes."""
        r.failures = max(r.failures, self.config.health_failures)
        r.healthy = r.state.healthy = False

    async def _discover(self) -> None:
        host, port = self.config.discover.rsplit(":", 1)  # type: ignore[union-attr]
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError:
            return
        urls = {f"http://{'[' + a[4][0] + ']' if ':' in a[4][0] else a[4][0]}:{port}"
                for a in infos}
        for u in urls:
            self._discovered_missing.pop(u, None)
            if u not in self.replicas:
                log.info("replica %s joined (DNS)", u)
                self._add(ReplicaSpec(u))
        for u in list(self.replicas):
            if u not in urls and u not in {s.url for s in self.config.replicas}:
                n = self._discovered_missing.get(u, 0) + 1
                self._discovered_missing[u] = n
                if n >= self.config.health_failures:
                    log.info("replica %s left (DNS)", u)
                    self._remove(u)

    def _refresh_gauges(self) -> None:
        m = self.metrics
        for r in self.replicas.values():
            m.healthy.labels(r.name).set(1 if r.healthy else 0)
            m.in_flight.labels(r.name).set(r.state.in_flight)
            for place, label in ((DEVICE, "device"), (LOCAL_TIER, "local"),
                                 (SHARED_TIER, "shared")):
                m.index_blocks.labels(r.name, label).set(self.index.blocks_of(r.name, place))
            if r.events is not None:
                m.event_batches.labels(r.name).set(r.events.stats.batches)
                m.event_resets.labels(r.name).set(r.events.stats.resets)

    # ---- keys -----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from ..engine.loader import Tokenizer, _jinja_env, tiny_config

            cfg = self.config
            tok = Tokenizer.from_dir(cfg.model) if cfg.model else \
                Tokenizer.tiny(tiny_config(cfg.family).vocab_size)
            # The replicas' chat template, compiled once (the engine compiles it per call).
            self._template = _jinja_env().from_string(tok.chat_template) \
                if tok.chat_template else None
            self._tokenizer = tok
        return self._tokenizer

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """What `Tokenizer.apply_chat_template(messages, True)` gives, from the compiled
        template (the tests check they agree)."""
        tok = self.tokenizer
        if self._template is None:
            return tok.apply_chat_template(messages, True)
        text = self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
        return tok.encode(text, add_special_tokens=False)

    def tenant_of(self, authorization: str) -> tuple[str | None, bool]:
        """(tenant, known): the tenant of the request's API key; without a tenant map the
        API is open (None, True)."""
        if not self.config.tenants:
            return None, True
        scheme, _, key = authorization.partition(" ")
        t = self.config.tenants.get(key.strip()) if scheme.lower() == "bearer" else None
        return t, t is not None

    def salt_of(self, tenant: str | None) -> str | None:
        return None if tenant is None else "tenant:" + tenant

    def prompt_tokens(self, body: dict[str, Any], endpoint: str) -> list[int] | None:
        """The prompt as the replicas tokenize it, or None when the body is not one the
        router can key (the replica then answers it, with its own 400 if it is bad)."""
        tok = self.tokenizer
        try:
            if endpoint == "chat":
                msgs = []
                for m in body["messages"]:
                    c = m.get("content")
                    text = c if isinstance(c, str) else "".join(
                        p.get("text", "") for p in c) if isinstance(c, list) else ""
                    role = m["role"]
                    if not isinstance(role, str) or not isinstance(text, str):
                        return None
                    msgs.append({"role": "system" if role == "developer" else role,
                                 "content": text})
                return self.chat_tokens(msgs)
            p = body["prompt"]
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str):
                return tok.encode(p)
            if isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in p):
                tokens_to_bytes(p)  # range check
                return list(p)
        except (KeyError, TypeError, AttributeError, ValueError):
            return None
        except Exception:  # a tokenizer or template error: the replica will say what
            return None
        return None

    def route_request(self, tokens: list[int] | None, tenant: str | None,
                      block_size: int) -> RouteRequest:
        if not tokens:
            return RouteRequest([], [], 0)
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = root_key(self.salt_of(tenant))
        keys, _ = block_keys(tokens, block_size, root)
        return RouteRequest(keys, [block_size] * len(keys), len(tokens))

    # ---- proxying -------------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str) -> Response:
        t_start = time.perf_counter()
        auth = request.headers.get("authorization", "")
        tenant, known = self.tenant_of(auth)
        if not known:
            raise RouterError(401, "missing or invalid API key (send 'Authorization: Bearer "
                              "KEY')", "authentication_error", "invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise RouterError(413, f"the request body has {length} bytes; the limit is "
                              f"{self.config.max_body_bytes}", code="body_too_large")
        body_bytes = await _read_body(request, self.config.max_body_bytes)
        try:
            body = json.loads(body_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RouterError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the body must be a JSON object")
        stream = body.get("stream") is True
        needs_keys = self.config.policy in ("kvheat", "prefix-hash", "sglang-like")
        tokens = None
        if needs_keys:
            # A short prompt is keyed here (a thread hop costs more than it); a long one off
            # the event loop, so it never stalls other requests.
            tokens = self.prompt_tokens(body, endpoint) if len(body_bytes) < 16384 else \
                await asyncio.get_running_loop().run_in_executor(
                    self._cpu, self.prompt_tokens, body, endpoint)
        span = self.tracing.start_request("kvheat.route", {
            "kvheat.endpoint": endpoint, "kvheat.tenant": tenant or "none",
            "kvheat.prompt_tokens": len(tokens) if tokens else 0, "kvheat.stream": stream})
        tried: set[str] = set()
        try:
            for attempt in range(self.config.max_attempts):
                t0 = time.perf_counter()
                choice = self._choose(tokens, tenant, tried)
                if choice is None:
                    break
                r, rreq, decision = choice
                t1 = time.perf_counter()
                if attempt == 0:
                    self.maybe_prewarm(rreq, body, tokens, auth, r)
                self._record_decision(span, r, rreq, decision, t_start if attempt == 0 else t0,
                                      t1, attempt)
                tried.add(r.name)
                result = await self._forward(request, r, rreq, decision, endpoint, body,
                                             body_bytes, stream, tenant, tokens, span)
                if result is not None:
                    self.metrics.requests.labels(endpoint, str(result.status_code)).inc()
                    return result
            self.metrics.requests.labels(endpoint, "503").inc()
            return _error(503, "no replica could take the request; retry later",
                          "server_error", "no_replica")
        finally:
            if not stream:
                end_span(span)

    def _choose(self, tokens: list[int] | None, tenant: str | None,
                exclude: set[str]) -> tuple[Replica, RouteRequest, Any] | None:
        reps = [r for r in self.replicas.values() if r.healthy and r.name not in exclude]
        if not reps:
            return None
        # Replicas of one block size share the keys (the usual case: one size).
        bs = reps[0].block_size
        reps = [r for r in reps if r.block_size == bs] or reps
        rreq = self.route_request(tokens, tenant, bs)
        for r in reps:
            r.state.pending_prefill = sum(r.pending.values())
        try:
            d = self.policy.choose(rreq, [r.state for r in reps])
        except NoReplica:
            return None
        r = reps[d.replica]
        self.policy.routed(rreq, r.name, d.expected_hit_tokens)
        return r, rreq, d

    def _record_decision(self, span: Any, r: Replica, rreq: RouteRequest, d: Any, t0: float,
                         t1: float, attempt: int) -> None:
        m = self.metrics
        with contextlib.suppress(Exception):  # metrics and traces never fail a request
            m.decisions.labels(r.name, d.mode, d.regime or "-").inc()
            m.decision_seconds.observe(t1 - t0)
            m.prompt_tokens.labels(r.name).inc(rreq.num_tokens)
            m.expected_hit_tokens.labels(r.name).inc(d.expected_hit_tokens)
            self.tracing.child(span, "route.decide", t0, t1, {
                "kvheat.replica": r.name, "kvheat.mode": d.mode, "kvheat.regime": d.regime,
                "kvheat.expected_hit_tokens": d.expected_hit_tokens,
                "kvheat.prompt_tokens": rreq.num_tokens, "kvheat.attempt": attempt,
                "kvheat.candidates": len(d.scores)})

    async def _forward(self, request: Request, r: Replica, rreq: RouteRequest, d: Any,
                       endpoint: str, body: dict[str, Any], body_bytes: bytes, stream: bool,
                       tenant: str | None, tokens: list[int] | None,
                       span: Any) -> Response | None:
        """Send the request to `r`. None: `r` failed before answering (try another)."""
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS}
        headers["content-type"] = "application/json"
        with contextlib.suppress(Exception):
            TraceContextTextMapPropagator().inject(headers, trace.set_span_in_context(span))
        content = body_bytes
        if r.spec.kind == "vllm" and tenant is not None:
            content = json.dumps({**body, "cache_salt": self.salt_of(tenant)}).encode()
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        rid = self._next_id = self._next_id + 1
        r.state.in_flight += 1
        r.routed += 1
        r.pending[rid] = max(0.0, rreq.num_tokens - d.expected_hit_tokens)
        self.index.expect(r.name, rreq.keys)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                r.state.in_flight -= 1
                r.pending.pop(rid, None)
                self.index.unexpect(r.name, rreq.keys)

        t0 = time.perf_counter()
        try:
            resp = await self._client.post(r.name + path, data=content, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            release()
            self._mark_failed(r)
            self.metrics.failovers.labels("connect").inc()
            log.warning("replica %s unreachable (%s): trying another", r.name,
                        type(e).__name__)
            return None
        except BaseException:
            release()
            raise
        try:
            if resp.status >= 500:
                resp.release()
                release()
                self.metrics.failovers.labels(f"status_{resp.status}").inc()
                if resp.status != 503:
                    self._mark_failed(r)
                return None
            out_headers = {"x-kvheat-replica": r.name}
            for k in ("retry-after", "cache-control"):
                if k in resp.headers:
                    out_headers[k] = resp.headers[k]
            ctype = resp.headers.get("content-type", "application/json")
            if not stream or not ctype.startswith("text/event-stream"):
                try:
                    data = await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    release()
                    self._mark_failed(r)
                    self.metrics.failovers.labels("read").inc()
                    return None
                finally:
                    resp.release()
                self._observe_first(r, t0)
                self._usage(r, data)
                release()
                if stream:
                    end_span(span)
                return Response(data, status_code=resp.status, media_type=ctype,
                                headers=out_headers)
            # A stream: its first bytes decide whether another replica may take it over.
            try:
                first = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                first = b""
            if not first:
                resp.close()
                release()
                self._mark_failed(r)
                self.metrics.failovers.labels("stream_start").inc()
                return None
            self._observe_first(r, t0)
            r.pending.pop(rid, None)  # its prefill is done
            return StreamingResponse(self._relay(r, resp, first, release, span),
                                     status_code=resp.status,
                                     media_type="text/event-stream", headers=out_headers)
        except BaseException:
            release()
            with contextlib.suppress(Exception):
                resp.close()
            raise

    async def _relay(self, r: Replica, resp: aiohttp.ClientResponse, first: bytes,
                     release: Any, span: Any) -> AsyncIterator[bytes]:
        tail = b""
        try:
            yield first
            tail = first[-4096:]
            while True:
                chunk = await resp.content.readany()
                if not chunk:
                    break
                yield chunk
                tail = (tail + chunk)[-8192:]
            if b"[DONE]" not in tail:  # the replica closed the stream without finishing it
                raise aiohttp.ClientPayloadError("stream closed before [DONE]")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.metrics.stream_errors.labels(r.name).inc()
            self._mark_failed(r)
            log.warning("replica %s failed mid-stream (%s)", r.name, type(e).__name__)
            yield _sse_error(f"the replica serving this stream failed ({type(e).__name__}); "
                             "retry the request", "replica_failed")
        finally:
            release()
            with contextlib.suppress(Exception):
                resp.close()
            self._usage(r, tail)
            end_span(span)

    def _observe_first(self, r: Replica, t0: float) -> None:
        with contextlib.suppress(Exception):
            self.metrics.ttft.labels(r.name).observe(time.perf_counter() - t0)

    def _usage(self, r: Replica, data: bytes) -> None:
        """Count the cached tokens the replica reported (usage.prompt_tokens_details)."""
        i = data.rfind(b'"cached_tokens"')
        if i < 0:
            return
        j = i + len(b'"cached_tokens"')
        digits = data[j:j + 24].lstrip(b": ")
        n = 0
        for c in digits:
            if 48 <= c <= 57:
                n = n * 10 + c - 48
            else:
                break
        with contextlib.suppress(Exception):
            self.metrics.cached_tokens.labels(r.name).inc(n)

    async def _prewarm(self, r: Replica, body: dict[str, Any], tokens: list[int],
                       authorization: str) -> None:
        """Send a hot prefix to a replica that lacks it (max_tokens 1), so the first real
        request there finds it cached."""
        if r.prewarming or self._client is None:
            return
        r.prewarming = True
        try:
            headers = {"authorization": authorization} if authorization else {}
            async with self._client.post(r.name + "/v1/completions", json={
                    "model": body.get("model", ""), "prompt": tokens, "max_tokens": 1},
                    headers=headers) as resp:
                await resp.read()
            self.metrics.prewarms.labels(r.name).inc()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        finally:
            r.prewarming = False

    def maybe_prewarm(self, rreq: RouteRequest, body: dict[str, Any], tokens: list[int] | None,
                      authorization: str, chosen: Replica) -> None:
        pol = self.policy
        if not self.config.prewarm or not tokens or not isinstance(pol, KVHeatRouting):
            return
        block_size = chosen.block_size
        reps = [r for r in self.replicas.values() if r.healthy and r.block_size == block_size]
        head = pol.hot_head(rreq, len(reps))
        if head == 0:
            return
        matches = self.index.match(rreq.keys[:head], rreq.block_tokens[:head],
                                   [r.name for r in reps])
        for r, m in zip(reps, matches):
            if r is not chosen and m.device_blocks < head and not r.prewarming:
                t = asyncio.ensure_future(self._prewarm(r, body, tokens[:head * block_size],
                                                        authorization))
                self._tasks = [x for x in self._tasks if not x.done()] + [t]

    # ---- the app --------------------------------------------------------------------------
    def check_admin(self, authorization: str) -> None:
        token = self.config.admin_token
        if not token:
            raise RouterError(404, "the admin API is off (start the router with an admin "
                              "token)", code="admin_disabled")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            raise RouterError(401, "missing or invalid admin token", "authentication_error")

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            cfg = self.config
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                              sock_read=cfg.read_timeout_s),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
            await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
            self._tasks.append(asyncio.create_task(self._health_loop()))
            try:
                yield
            finally:
                for t in self._tasks:
                    t.cancel()
                for t in self._tasks:
                    with contextlib.suppress(BaseException):
                        await t
                await self._client.close()
                for r in self.replicas.values():
                    if r.events is not None:
                        r.events.close(timeout_s=0.5)
                self.tracing.shutdown()
                self._cpu.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="kvheat route", version="0.1.0", lifespan=lifespan,
                      description="Cache-aware router for kvheat (and vLLM) replicas.")

        @app.exception_handler(RouterError)
        async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
            with contextlib.suppress(Exception):
                self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
            return exc.response()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.handle(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(request, "completions")

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            assert self._client is not None
            for r in [r for r in self.replicas.values() if r.healthy]:
                try:
                    async with self._client.get(r.name + "/v1/models", headers={
                            k: v for k, v in request.headers.items() if k == "authorization"},
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
            self._refresh_gauges()
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/admin/replicas")
        async def list_replicas(request: Request) -> Response:
            self.check_admin(request.headers.get("authorization", ""))
            return JSONResponse({"replicas": [self.describe(r) for r in self.replicas.values()],
                                 "policy": self.policy.name})

        @app.post("/admin/replicas")
        async def add_replica(request: Request) -> Response:
            self.check_admin(request.headers.get("authorization", ""))
            try:
                data = await request.json()
                spec = ReplicaSpec(**data) if isinstance(data, dict) else None
            except (ValueError, TypeError) as e:
                raise RouterError(400, f"a replica is {{\"url\", \"kind\", \"events\", "
                                  f"\"replay\", \"block_size\"}}: {e}") from None
            if spec is None:
                raise RouterError(400, "the body must be a JSON object")
            r = self._add(spec)
            await self._check(r)
            return JSONResponse(self.describe(r), status_code=201)

        @app.delete("/admin/replicas")
        async def remove_replica(request: Request, url: str) -> Response:
            self.check_admin(request.headers.get("authorization", ""))
            if not self._remove(url.rstrip("/")):
                raise RouterError(404, f"no replica {url!r}", code="unknown_replica")
            return JSONResponse({"removed": url})

        return app

    def describe(self, r: Replica) -> dict[str, Any]:
        ev = r.events.stats if r.events is not None else None
        return {"url": r.name, "kind": r.spec.kind, "healthy": r.healthy,
                "in_flight": r.state.in_flight, "routed": r.routed,
                "block_size": r.block_size,
                "index_blocks": {"device": self.index.blocks_of(r.name, DEVICE),
                                 "local": self.index.blocks_of(r.name, LOCAL_TIER),
                                 "shared": self.index.blocks_of(r.name, SHARED_TIER)},
                "events": None if ev is None else {"batches": ev.batches, "gaps": ev.gaps,
                                                   "resets": ev.resets, "bad": ev.bad}}


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    n = 0
    async for c in request.stream():
        n += len(c)
        if n > limit:
            raise RouterError(413, f"the request body is larger than the limit of {limit} "
                              "bytes", code="body_too_large")
        chunks.append(c)
    return b"".join(chunks)

