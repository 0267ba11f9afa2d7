"""What the server checks before it reads a request body (pure ASGI, in front of FastAPI).

FastAPI reads and parses the whole body before a handler runs, so a 30 MB body from a
caller without a key used to be read, parsed and only then refused. This middleware
answers first from what the headers say: a missing or wrong key (401), a declared size
over the limit (413). A body sent without a length (chunked) is counted as it arrives
and refused with 413 once past the limit, so no more than the limit is ever held.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# (scope's path, its Authorization header) -> an error response (an ASGI app) or None
EarlyCheck = Callable[[str, str], Any]


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the limit.

    An HTTPException, so FastAPI's body reading passes it on unchanged and the app answers
    413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of "
                              f"{limit} bytes")


class RequestGuard:
    """ASGI middleware: the early key check and the body size bound, before FastAPI reads it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, early_check: EarlyCheck,
                 too_large: Callable[[int], Any]) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.early_check = early_check
        self.too_large = too_large  # the 413 response (an ASGI app) for a declared size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        auth = length = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = v.decode("latin-1")
            elif k == b"content-length":
                length = v
        refusal = self.early_check(scope["path"], auth or "")
        if refusal is None and length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = None
            if declared is not None and declared > self.limit:
                refusal = self.too_large(declared)
        if refusal is not None:
            # Answer without reading the body; the server closes the connection after.
            await refusal(scope, receive, send)
            return
        received = 0
        limit = self.limit

        async def counted() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return msg

        await self.app(scope, counted, send)
