"""The proxy path of `kvheat route`, on raw ASGI: one request to one replica with aiohttp,
its answer passed through unchanged (bytes in, bytes out: no re-encoding, no validation
layer), failures before the first byte reported so the caller can try another replica, a
death mid-stream turned into an error event and [DONE]."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from starlette.types import Receive, Send
from yarl import URL

from ..server.protocol import PREWARM_HEADER
from .index import PrefixIndex
from .metrics import RouterMetrics
from .replicas import Replica, ReplicaRegistry
from .routing import Decision, RouteRequest

log = logging.getLogger("kvheat.router")
_PASSED_BACK = ("retry-after", "cache-control")


class RouterError(Exception):
    """An OpenAI-style error the router answers itself."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = \
            status, message, type_, code, param

    def body(self) -> bytes:
        """The error as an OpenAI error body."""
        return json.dumps({"error": {"message": self.message, "type": self.type,
                                     "param": self.param, "code": self.code}}).encode()

    def headers(self) -> dict[str, str] | None:
        """The extra headers of the error's answer (WWW-Authenticate for a 401)."""
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else None


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send one whole HTTP answer on an ASGI `send`."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", b"%d" % len(body)), *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, e: RouterError) -> None:
    """Send `e` as the HTTP answer."""
    extra = [(k.lower().encode(), v.encode()) for k, v in (e.headers() or {}).items()]
    await send_bytes(send, e.status, e.body(), b"application/json", extra)


def sse_error(message: str, code: str) -> bytes:
    """An error as a stream's last server-sent events (the error, then [DONE])."""
    return (b"data: " + json.dumps({"error": {"message": message, "type": "server_error",
                                              "param": None, "code": code}}).encode()
            + b"\n\ndata: [DONE]\n\n")


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when the client went away before sending it."""
    chunks: list[bytes] = []
    n = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        c = msg.get("body", b"")
        n += len(c)
        if n > limit:
            raise RouterError(413, f"the request body is larger than the limit of {limit} "
                              "bytes", code="body_too_large")
        chunks.append(c)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Forwarder:
    """Sends requests to replicas and their answers to clients."""

    def __init__(self, registry: ReplicaRegistry, index: PrefixIndex,
                 metrics: RouterMetrics) -> None:
        self.registry = registry
        self.index = index
        self.metrics = metrics
        self.client: aiohttp.ClientSession | None = None  # set while the app runs
        self._next_id = 0
        self._urls: dict[tuple[str, str], URL] = {}

    def url(self, r: Replica, path: str) -> URL:
        """The URL of `path` on replica `r` (made once)."""
        u = self._urls.get((r.name, path))
        if u is None:
            u = self._urls[(r.name, path)] = URL(r.name + path)
        return u

    async def forward(self, send: Send, receive: Receive, r: Replica, rreq: RouteRequest,
                      d: Decision, path: str, headers: dict[str, str], content: bytes,
                      stream: bool, span: Any) -> int | None:
        """Send the request to `r` and its answer to the client.

        Returns the status answered, or None when `r` failed before answering (the caller
        tries another)."""
        assert self.client is not None
        rid = self._next_id = self._next_id + 1
        r.state.in_flight += 1
        self.registry.routed_to(r)
        r.pending[rid] = max(0.0, rreq.num_tokens - d.expected_hit_tokens)
        self.index.expect(r.name, rreq.keys, rreq.rank)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                r.state.in_flight -= 1
                r.pending.pop(rid, None)
                self.index.unexpect(r.name, rreq.keys, rreq.rank)

        t0 = time.perf_counter()
        try:
            resp = await self.client.post(self.url(r, path), data=content, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            release()
            self._failed(r, "connect")
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
                    self.registry.mark_failed(r)
                return None
            out = [(b"x-kvheat-replica", r.name.encode())]
            for k in _PASSED_BACK:
                v = resp.headers.get(k)
                if v is not None:
                    out.append((k.encode(), v.encode()))
            ctype = resp.headers.get("content-type", "application/json")
            if not stream or not ctype.startswith("text/event-stream"):
                try:
                    data = await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    release()
                    self._failed(r, "read")
                    return None
                finally:
                    resp.release()
                self._observe_first(r, t0)
                self._usage(r, data)
                release()
                await send_bytes(send, resp.status, data, ctype.encode(), out)
                return resp.status
            # A stream: its first bytes decide whether another replica may take it over.
            try:
                first = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                first = b""
            if not first:
                resp.close()
                release()
                self._failed(r, "stream_start")
                return None
            self._observe_first(r, t0)
            r.pending.pop(rid, None)  # its prefill is done
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", ctype.encode()), *out]})
            await self._relay(send, receive, r, resp, first)
            return resp.status
        except BaseException:
            with contextlib.suppress(Exception):
                resp.close()
            raise
        finally:
            release()

    def _failed(self, r: Replica, reason: str) -> None:
        self.registry.mark_failed(r)
        self.metrics.failovers.labels(reason).inc()

    async def _relay(self, send: Send, receive: Receive, r: Replica,
                     resp: aiohttp.ClientResponse, first: bytes) -> None:
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        tail = first[-4096:]
        try:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            while not gone.done():
                chunk = await resp.content.readany()
                if not chunk:
                    if b"[DONE]" not in tail:  # the replica closed without finishing
                        raise aiohttp.ClientPayloadError("stream closed before [DONE]")
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = (tail + chunk)[-8192:]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.metrics.of(r.name).stream_errors.inc()
            self.registry.mark_failed(r)
            log.warning("replica %s failed mid-stream (%s)", r.name, type(e).__name__)
            await send({"type": "http.response.body", "more_body": True, "body": sse_error(
                f"the replica serving this stream failed ({type(e).__name__}); retry the "
                "request", "replica_failed")})
        finally:
            gone.cancel()
            if resp.content.at_eof():
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()  # the client left (or the replica died): drop it
            self._usage(r, tail)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _observe_first(self, r: Replica, t0: float) -> None:
        with contextlib.suppress(Exception):
            self.metrics.of(r.name).ttft.observe(time.perf_counter() - t0)

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
            self.metrics.of(r.name).cached_tokens.inc(n)

    async def prewarm(self, r: Replica, model: str, tokens: list[int],
                      authorization: str, user: str | None = None,
                      extra: dict[str, Any] | None = None, mark: str | None = None) -> None:
        """Send a hot prefix to a replica that lacks it (max_tokens 1).

        The first real request there then finds it cached. It goes as the request's `user`
        (it picks the arm to warm), marked as a prewarm (`PREWARM_HEADER`: `mark`, the
        events secret's MAC of `tokens`), which a kvheat replica counts apart from its
        clients' requests; `extra`: body fields a vLLM replica needs to key it as the
        request (its tenant's `cache_salt`, the vouched tenant)."""
        if r.prewarming or self.client is None:
            return
        r.prewarming = True
        try:
            # Without an events secret ("1") a kvheat replica counts it as a client's.
            headers = {PREWARM_HEADER: mark or "1"}
            if authorization:
                headers["authorization"] = authorization
            body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": 1}
            if user is not None:
                body["user"] = user
            body.update(extra or {})
            async with self.client.post(self.url(r, "/v1/completions"), json=body,
                                        headers=headers) as resp:
                await resp.read()
            self.metrics.prewarms.labels(r.name).inc()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        finally:
            r.prewarming = False
