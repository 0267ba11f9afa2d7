"""What passes between the engine thread and a request's handler: a `RequestHandle`
(an asyncio queue the engine thread fills) carries the request's token ids, then one
`Finished`."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Finished:
    """The last item of a request's stream."""

    finish_reason: str  # stop, length, abort, error
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None
    status: int = 500  # the HTTP status of an error
    code: str | None = None  # OpenAI's error code, when there is one
    retry_after_s: int | None = None  # with a 503: when the request could fit again


class RequestHandle:
    """The asyncio side of one request: token ids, then one `Finished`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str, arm: str,
                 tenant: str | None, endpoint: str, span: Any = None) -> None:
        self.loop = loop
        self.request_id = request_id
        self.arm = arm
        self.tenant = tenant
        self.endpoint = endpoint
        self.span = span
        self.prewarm = False  # a router's prewarm: counted apart from clients' requests
        self.session: str | None = None  # the cache policy's session hint (sessions.py)
        self.queue: asyncio.Queue[int | Finished] = asyncio.Queue()
        self.finished: Finished | None = None

    def push(self, item: int | Finished) -> None:  # engine thread
        """Hand a token id or the `Finished` to the request's loop (from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def next(self) -> int | Finished:
        """The next token id, or the `Finished` that ends the request."""
        item = await self.queue.get()
        if isinstance(item, Finished):
            self.finished = item
        return item
