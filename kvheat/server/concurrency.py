"""The bound on the HTTP requests `kvheat serve` and `kvheat route` hold at once (pure ASGI,
outermost, before anything reads a body).

A request body is read whole (up to `max_body_bytes`) before it is answered, so without a
bound N slow uploads hold N bodies: memory grows with the clients, not with the work.
Past `limit` requests being received, handled or answered, a new one gets 503 at once,
its body unread and its connection closed (so the server does not read the rest of the
body either), and the refusal is counted (`on_count`) and logged at most once per
interval. Uvicorn's own `limit_concurrency` does the same but answers plain text, counts
idle keep-alive connections as load and cannot be counted; this one can.

Health checks and scrapes pass uncounted: they read no body, answer from memory, and are
needed most when the server is full (a liveness probe that fails under load restarts a
busy pod).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..checks.bounds import Overflow

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("kvheat.server")
# Requests held at once (reading, serving, streaming back), and their bodies' bytes (as
# declared: `declared_bytes`): the router's defaults for its proxied requests.
MAX_IN_FLIGHT = 8192
MAX_IN_FLIGHT_BYTES = 1 << 30
EXEMPT_PATHS = frozenset(("/health", "/metrics"))
_BODY = json.dumps({"error": {"message": "too many requests at once; retry later",
                              "type": "server_error", "param": None,
                              "code": "overloaded"}}).encode()
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_BODY)),
            (b"retry-after", b"1"), (b"connection", b"close")]


def declared_bytes(scope: Scope, body_limit: int) -> int:
    """The body bytes a request may bring, as it declares them.

    Its Content-Length; `body_limit` (the most the body guard lets through) when it is
    chunked or its length is not a number; 0 when it declares no body (HTTP/1.1: neither
    header)."""
    length: bytes | None = None
    chunked = False
    for k, v in scope["headers"]:
        if k == b"content-length":
            length = v
        elif k == b"transfer-encoding":
            chunked = True
    if length is not None and length.isdigit() and not chunked:
        return min(int(length), body_limit)
    return body_limit if chunked or length is not None else 0


class InFlight:
    """Requests held at once, bounded in count and in the body bytes they declare.

    The bytes are bounded unless `max_bytes` is None (`declared_bytes`): `admit` reserves a
    request's share or refuses it (counted in `overflow.count` and `on_count`, logged at
    most once per interval), `release` gives it back. The router holds its proxied requests
    in one (`max_in_flight`, `max_in_flight_bytes`); `ConcurrencyLimit` holds every request
    in one."""

    def __init__(self, max_requests: int = MAX_IN_FLIGHT,
                 max_bytes: int | None = MAX_IN_FLIGHT_BYTES,
                 on_count: Callable[[int], object] | None = None,
                 log: logging.Logger = log, what: str = "requests in flight (answered 503)"
                 ) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = self.bytes = 0
        self.overflow = Overflow(log, what, on_count=on_count)

    def admit(self, scope: Scope, body_limit: int) -> int | None:
        """The bytes reserved for this request, or None: refuse it (503)."""
        n = 0 if self.max_bytes is None else declared_bytes(scope, body_limit)
        if self.requests >= self.max_requests or \
                (self.max_bytes is not None and self.bytes + n > self.max_bytes):
            self.overflow(why=f"{self.requests} requests, {self.bytes} body bytes held")
            return None
        self.requests += 1
        self.bytes += n
        return n

    def release(self, n: int) -> None:
        """Give back one request's share (`n` declared bytes)."""
        self.requests -= 1
        self.bytes -= n


class ConcurrencyLimit:
    """At most `limit` HTTP requests at once and, with `max_bytes`, that many body bytes.

    The requests (`active`) and the bytes they declare (`bytes`) are held in one `InFlight`;
    `wrap(app)` is the ASGI app that enforces it in front of `app`. Refusals:
    `overflow.count`, `on_count(n)`."""

    def __init__(self, limit: int, log: logging.Logger, what: str,
                 on_count: Callable[[int], object] | None = None,
                 max_bytes: int | None = None, body_limit: int = 0) -> None:
        if limit < 1:
            raise ValueError("a concurrency limit admits at least one request")
        if max_bytes is not None and max_bytes < body_limit:
            raise ValueError("a byte budget below the largest body admits no large request")
        self.body_limit = body_limit
        self.held = InFlight(limit, max_bytes, on_count, log, f"{what} (answered 503)")

    @property
    def limit(self) -> int:
        """The most requests held at once."""
        return self.held.max_requests

    @property
    def max_bytes(self) -> int | None:
        """The most declared body bytes held at once (None: no bound)."""
        return self.held.max_bytes

    @property
    def active(self) -> int:
        """Requests held now."""
        return self.held.requests

    @property
    def bytes(self) -> int:
        """Declared body bytes held now."""
        return self.held.bytes

    @property
    def overflow(self) -> Overflow:
        """The refusals' counter."""
        return self.held.overflow

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` behind the limit: a request past it gets a 503 (health and metrics exempt)."""
        async def limited(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
                await app(scope, receive, send)
                return
            n = self.held.admit(scope, self.body_limit)
            if n is None:
                await send({"type": "http.response.start", "status": 503,
                            "headers": _HEADERS})
                await send({"type": "http.response.body", "body": _BODY})
                return
            try:
                await app(scope, receive, send)
            finally:
                self.held.release(n)

        return limited
