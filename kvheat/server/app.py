"""The OpenAI-compatible HTTP server: `/v1/completions`, `/v1/chat/completions` (with
server-sent events when `stream` is true), `/v1/models`, `/health`, `/metrics`, and the
admin API under `/admin` (see admin.py).

Every request is checked before it reaches the engine: a missing or wrong API key is
401, an unknown model 404, bad fields, a prompt over the context length or bad token ids
400, a full queue 503. A client that goes away mid-request has its request aborted, and
its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache import make_policy
from ..engine.engine import EngineConfig, SamplingParams
from ..engine.loader import load_model
from ..engine.scheduler import SchedulerConfig
from .arms import ArmRouter, ArmStats
from .config import ConfigError, ServerConfig, TenantConfig
from .events import EventsCollector, ServerEvents
from .guard import RequestGuard
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .tracing import Tracing, end_span
from .worker import EngineWorker, Finished, RequestHandle, RequestTooLarge, ServingEngine

log = logging.getLogger("kvheat.server")
T = TypeVar("T")
_GREEDY_BELOW = 1e-5


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


class TextAssembler:
    """Generated token ids to text deltas, incrementally as vLLM's detokenizer and
    transformers' `TextStreamer` do: each step decodes only a short window (the tokens
    since the last emitted text, after a few tokens of context for tokenizers that
    render a token differently at the start), and text that ends inside a multi-byte
    character (U+FFFD) is held back until the character is complete. A character still
    incomplete when the request ends is dropped, never sent as U+FFFD: a client that
    resends the history must get the same tokens back. Also holds back text that could
    still become a stop string, and ends the text at a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context already in text
        self.read_offset = 0
        self.text = ""
        self.sent = 0  # characters handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""  # nothing new yet, or a character split across tokens: wait
        start = len(self.text)
        self.text += window[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stops:
            i = self.text.find(s, max(0, min(self.sent, start) - len(s)))
            if i >= 0:
                self.stopped = True
                self.text = self.text[:i]
                return self._take(len(self.text))
        return self._take(len(self.text) - self.hold)

    def flush(self) -> str:
        """The rest of the text, once the request is over (without an incomplete
        character at the end)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out


@dataclass(slots=True)
class _Job:
    handle: RequestHandle
    kind: str  # "completions" or "chat"
    model: str
    created: int
    stops: list[str]
    include_usage: bool


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
        self.model_name = config.model_name
        self.created = int(time.time())
        self.max_token_bytes = _max_token_bytes(tok)
        self.prompt_byte_limit = 2 * self.max_token_bytes * self.max_model_len
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="kvheat-tokenize")
        self.keys: dict[str, TenantConfig] = {k: t for t in config.tenants for k in t.api_keys}
        self.tenants: dict[str, TenantConfig] = {t.name: t for t in config.tenants}

        def engine_for(arm: str) -> ServingEngine:
            a = arms[arm]
            sched = SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_num_seqs=config.max_num_seqs,
                                    prefix_caching=a.prefix_caching)
            ecfg = EngineConfig(num_blocks=a.num_blocks or config.num_blocks,
                                block_size=config.block_size, policy=a.policy,
                                scheduler=sched, seed=config.seed, tiers=config.arm_tiers(a))
            try:
                eng = ServingEngine(model, tok, ecfg)
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
        self.metrics = ServerMetrics()
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
        self.draining = False
        self.app = self._build_app()

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def uvicorn(self, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> uvicorn.Server:
        """A uvicorn server for this app that drains on shutdown (see `begin_drain`)."""
        cfg = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                             access_log=False,
                             # A backstop only: the drain ends every request before it.
                             timeout_graceful_shutdown=self.config.drain_timeout_s + 5)
        return _DrainingServer(cfg, self)

    async def begin_drain(self) -> None:
        """Shutdown started (uvicorn no longer accepts connections): new requests get 503,
        requests in flight get `drain_timeout_s` to finish, then end with a 503 error
        (a stream: a final error event and [DONE])."""
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
        self.worker.stop()
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
        if not self.keys:
            return None
        scheme, _, key = authorization.partition(" ")
        tenant = self.keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", code="invalid_api_key")
        return tenant

    def check_admin(self, authorization: str) -> None:
        token = self.config.admin_token
        if not token:
            raise ApiError(404, "the admin API is off (start the server with an admin token)",
                           code="admin_disabled")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            raise ApiError(401, "missing or invalid admin token", "authentication_error")

    def _early_check(self, path: str, authorization: str) -> JSONResponse | None:
        """Before the body is read: the key (API or admin) the path needs."""
        try:
            if path.startswith("/v1/"):
                self.tenant_for(authorization)
            elif path.startswith("/admin/"):
                self.check_admin(authorization)
        except ApiError as e:
            self._count_rejected(e.status)
            return e.response()
        return None

    def _body_too_large(self, declared: int) -> JSONResponse:
        self._count_rejected(413)
        return error_response(413, f"the request body has {declared} bytes; this server's "
                              f"limit is {self.config.max_body_bytes}", code="body_too_large")

    def _count_rejected(self, status: int) -> None:
        with contextlib.suppress(Exception):  # metrics never fail a request
            self.metrics.rejected.labels(str(status)).inc()

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenizing, checking token ids) off the event loop, so one big
        prompt never stalls /health or other requests."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def check_text_size(self, n_bytes: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: no token of
        this vocabulary spans more than `max_token_bytes` bytes (x2: text a tokenizer's
        normalizer drops)."""
        if n_bytes > self.prompt_byte_limit:
            raise ApiError(400, f"the {param} has {n_bytes} bytes; at most "
                           f"{self.max_token_bytes} bytes per token, it cannot fit this "
                           f"model's context length of {self.max_model_len} tokens",
                           param=param, code="context_length_exceeded")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def encode(self, text: str) -> list[int]:
        self.check_text_size(len(text.encode("utf-8", "surrogatepass")), "prompt")
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # e.g. lone surrogates the tokenizer cannot take
            raise ApiError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None

    def chat_prompt(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in messages]
        self.check_text_size(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                 for m in msgs), "messages")
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt)
        except Exception as e:  # template errors and untokenizable text
            raise ApiError(400, f"the messages cannot be rendered: {e}", param="messages") \
                from None

    def completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:  # the tokenizer would make it <bos> alone: refuse, as []
                raise ApiError(400, "the prompt is empty", param="prompt")
            ids = self.encode(prompt)
        elif prompt and isinstance(prompt[0], int):
            ids = list(prompt)
        else:
            ids = list(prompt[0])
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary of {vocab}",
                           param="prompt")
        return ids

    def sampling(self, body: SamplingFields, tenant: TenantConfig | None, n_prompt: int,
                 max_tokens: int | None) -> tuple[SamplingParams, dict[int, float]]:
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        ctx = self.max_model_len
        if n_prompt >= ctx:
            raise ApiError(400, f"the prompt has {n_prompt} tokens; this model's context "
                           f"length is {ctx}", param="messages" if hasattr(body, "messages")
                           else "prompt", code="context_length_exceeded")
        if max_tokens is None and tenant is not None:
            max_tokens = tenant.max_tokens
        limit = self.config.max_tokens_limit
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, limit or ctx, ctx - n_prompt)
        if limit is not None and max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of "
                           f"{limit}", param="max_tokens")
        if n_prompt + max_tokens > ctx:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) plus max_tokens "
                           f"({max_tokens}) exceeds the context length of {ctx}",
                           param="max_tokens", code="context_length_exceeded")
        temperature = body.temperature
        if temperature is None:
            temperature = tenant.temperature if tenant and tenant.temperature is not None else 1.0
        if temperature < _GREEDY_BELOW:  # as vLLM: tiny temperatures overflow; use greedy
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
    async def generate(self, request: Request, body: SamplingFields, prompt: list[int],
                       tenant: TenantConfig | None, kind: str,
                       max_tokens: int | None) -> Response:
        params, bias = self.sampling(body, tenant, len(prompt), max_tokens)
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica",
                           "server_error", code="shutting_down")
        if self.worker.num_active >= self.config.max_queued_requests:
            raise ApiError(503, "the server is at capacity; retry later", "server_error",
                           code="overloaded")
        user = body.user or (tenant.name if tenant else "anonymous")
        arm = self.router.arm_for(user)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        tenant_name = tenant.name if tenant else None
        span = self.tracing.start_request(
            "kvheat.request", {"kvheat.request_id": rid, "kvheat.arm": arm,
                               "kvheat.tenant": tenant_name or "none",
                               "kvheat.endpoint": kind, "kvheat.prompt_tokens": len(prompt)})
        handle = RequestHandle(asyncio.get_running_loop(), rid, arm, tenant_name, kind, span)
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
        job = _Job(handle, kind, self.model_name, int(time.time()), body.stop_list(),
                   include_usage)
        if body.stream:
            # The status line waits for the first token: a request the engine ends before
            # it (one that cannot be scheduled) gets a real error status, not a 200 stream.
            first = await self._first(job, request)
            if isinstance(first, Finished) and first.error is not None:
                end_span(handle.span)
                return _finished_error(first)
            return StreamingResponse(self._stream(job, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(job, request)

    async def _first(self, job: _Job, request: Request) -> int | Finished:
        h = job.handle
        watcher = asyncio.create_task(self._watch_disconnect(request, h))
        try:
            return await h.next()
        except BaseException:  # cancelled: the client went away before the first token
            self.worker.abort(h)
            end_span(h.span)
            raise
        finally:
            watcher.cancel()

    async def _watch_disconnect(self, request: Request, h: RequestHandle) -> None:
        """Abort a non-streaming request whose client went away (nothing cancels it)."""
        while h.finished is None:
            if await request.is_disconnected():
                self.worker.abort(h)
                return
            await asyncio.sleep(0.25)

    async def _collect(self, job: _Job, request: Request) -> Response:
        h = job.handle
        text = TextAssembler(self.tokenizer, job.stops)
        watcher = asyncio.create_task(self._watch_disconnect(request, h))
        try:
            while True:
                item = await h.next()
                if isinstance(item, Finished):
                    break
                text.add(item)
                if text.stopped:
                    self.worker.abort(h, "stop")
        finally:
            watcher.cancel()
            if h.finished is None:  # cancelled: the client went away
                self.worker.abort(h)
            end_span(h.span)
        fin = item
        if fin.error is not None:
            return _finished_error(fin)
        text.flush()
        out = text.text
        reason = "stop" if text.stopped else _openai_reason(fin.finish_reason)
        if job.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": out},
                                      "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return _json({"id": h.request_id, "object": obj, "created": job.created,
                      "model": job.model, "choices": [choice], "usage": _usage(fin)})

    async def _stream(self, job: _Job, first: int | Finished) -> AsyncIterator[bytes]:
        h = job.handle
        text = TextAssembler(self.tokenizer, job.stops)
        chat = job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None, role: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": delta} if delta else {})
                choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None,
                                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None,
                          "finish_reason": reason}
            return _sse({"id": h.request_id, "object": obj, "created": job.created,
                         "model": job.model, "choices": [choice]})

        try:
            if chat:
                yield chunk(None, None, role=True)
            item: int | Finished = first
            while True:
                if isinstance(item, Finished):
                    break
                delta = text.add(item)
                if text.stopped:
                    self.worker.abort(h, "stop")
                if delta:
                    yield chunk(delta, None)
                item = await h.next()
            if item.error is not None:
                yield _sse({"error": {"message": item.error, "type": _error_type(item.status),
                                      "param": None, "code": item.code}})
            else:
                tail = text.flush()
                if tail:
                    yield chunk(tail, None)
                reason = "stop" if text.stopped else _openai_reason(item.finish_reason)
                yield chunk(None, reason)
                if job.include_usage:
                    yield _sse({"id": h.request_id, "object": obj, "created": job.created,
                                "model": job.model, "choices": [], "usage": _usage(item)})
            yield b"data: [DONE]\n\n"
        finally:
            if h.finished is None:  # the client disconnected mid-stream
                self.worker.abort(h)
            end_span(h.span)

    # ---- the app ----------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self.start()
            try:
                yield
            finally:
                self.stop()

        app = FastAPI(title="kvheat", version="0.1.0", lifespan=lifespan,
                      description="OpenAI-compatible server on the kvheat KV cache.")
        app.add_middleware(RequestGuard, max_body_bytes=self.config.max_body_bytes,
                           early_check=self._early_check, too_large=self._body_too_large)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
            self._count_rejected(exc.status)
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
            self._count_rejected(400)
            errs = exc.errors()
            parts = []
            for e in errs[:5]:
                loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
                if e.get("type") == "json_invalid":
                    parts.append(f"the body is not valid JSON (at character {loc}): "
                                 f"{e.get('ctx', {}).get('error', e.get('msg', ''))}")
                else:
                    parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
            param = None
            if errs and errs[0].get("type") != "json_invalid":  # its loc is a char offset
                loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
                param = loc[0] if loc else None
            return error_response(400, "; ".join(parts) or "invalid request", param=param)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            self._count_rejected(exc.status_code)
            return error_response(exc.status_code, str(exc.detail),
                                  "invalid_request_error" if exc.status_code < 500
                                  else "server_error")

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            tenant = self.authenticate(request)
            self.check_model(body.model)
            if body.echo:
                raise ApiError(400, "echo is not supported", param="echo")
            prompt = await self.offload(self.completion_prompt, body.prompt)
            return await self.generate(request, body, prompt, tenant, "completions",
                                       body.max_tokens)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            tenant = self.authenticate(request)
            self.check_model(body.model)
            if body.logprobs:
                raise ApiError(400, "logprobs are not supported", param="logprobs")
            prompt = await self.offload(self.chat_prompt, body.messages)
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await self.generate(request, body, prompt, tenant, "chat", max_tokens)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            self.authenticate(request)
            return _json({"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "kvheat", "max_model_len": self.max_model_len}]})

        @app.get("/health")
        async def health() -> Response:
            if not self.worker.alive:
                return error_response(503, "the engine loop is not running", "server_error")
            if self.draining:
                return error_response(503, "the server is shutting down", "server_error")
            return _json({"status": "ok", "active_requests": self.worker.num_active})

        @app.get("/kv_events")
        async def kv_events() -> Response:
            """Where this server publishes its KV events (for routers that subscribe)."""
            if self.events is None:
                return error_response(404, "KV events are off (start the server with "
                                      "--kv-events-endpoint)", code="kv_events_disabled")
            return _json(self.events.info())

        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        from .admin import admin_router

        app.include_router(admin_router(self))
        return app


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


def _max_token_bytes(tok: Any) -> int:
    """The most UTF-8 bytes one token of the vocabulary decodes to (at least 4)."""
    try:
        n = int(tok.vocab_size)
        return max(4, max(len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
                          for i in range(n)))
    except Exception:  # a tokenizer without these: a generous bound
        return 64


def _check_policy(name: str) -> None:
    with contextlib.suppress(ImportError):
        import kvheat.heat  # noqa: F401  (registers the heat policies)
    try:
        pol = make_policy(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"unknown cache policy {name!r}: {e}") from None
    if getattr(pol, "needs_future", False):
        raise ConfigError(f"policy {name!r} needs the future (an offline bound); it cannot serve")


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def _finished_error(fin: Finished) -> JSONResponse:
    """The answer to a request the engine ended with an error."""
    resp = error_response(fin.status, fin.error or "the request failed", _error_type(fin.status),
                          "max_tokens" if fin.code == "context_length_exceeded" else None,
                          fin.code)
    if fin.retry_after_s is not None:
        resp.headers["Retry-After"] = str(fin.retry_after_s)
    return resp


def _openai_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _usage(fin: Finished) -> dict[str, Any]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"
