"""OpenAI responses: a request's token stream to one `chat.completion` or
`text_completion` body, or to server-sent events (chunks, an optional usage chunk,
`[DONE]`). Text is detokenized here, on the asyncio side; a stop string ends the
request in the engine (`abort(..., "stop")`), and a client that goes away aborts it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from .detokenizer import TextAssembler
from .errors import error_type, finished_error
from .handle import Finished, RequestHandle
from .tracing import end_span

if TYPE_CHECKING:
    from .worker import EngineWorker

DONE = b"data: [DONE]\n\n"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON answer of `obj`."""
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _openai_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _usage(fin: Finished) -> dict[str, Any]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


@dataclass(slots=True)
class Reply:
    """One request being answered, and the shape of its answer."""

    handle: RequestHandle
    kind: str  # "completions" or "chat"
    model: str
    created: int
    stops: list[str]
    include_usage: bool

    @property
    def chat(self) -> bool:
        """Whether the answer is a chat completion."""
        return self.kind == "chat"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.handle.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def body(self, text: str, reason: str, fin: Finished) -> dict[str, Any]:
        """The whole response of a request that did not stream."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": reason}
            out = self._envelope("chat.completion", [choice])
        else:
            out = self._envelope("text_completion", [{"index": 0, "text": text,
                                                      "logprobs": None,
                                                      "finish_reason": reason}])
        out["usage"] = _usage(fin)
        return out

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, delta: str | None, reason: str | None, role: bool = False) -> bytes:
        """One event of a stream: the assistant role, a text delta, or the finish reason.

        The role is chat's first event."""
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": delta} if delta else {})
            choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None,
                                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None,
                      "finish_reason": reason}
        return _sse(self._envelope(self._chunk_object, [choice]))

    def usage_chunk(self, fin: Finished) -> bytes:
        """The last event before [DONE] when the client asked for `include_usage`."""
        out = self._envelope(self._chunk_object, [])
        out["usage"] = _usage(fin)
        return _sse(out)


def error_event(fin: Finished) -> bytes:
    """An error after the stream's status line went out: a final event before [DONE]."""
    return _sse({"error": {"message": fin.error, "type": error_type(fin.status),
                          "param": None, "code": fin.code}})


async def watch_disconnect(request: Request, h: RequestHandle, worker: EngineWorker) -> None:
    """Abort a non-streaming request whose client went away (nothing cancels it)."""
    while h.finished is None:
        if await request.is_disconnected():
            worker.abort(h)
            return
        await asyncio.sleep(0.25)


async def first_item(reply: Reply, request: Request, worker: EngineWorker) -> int | Finished:
    """A stream's first token (or its end): its status line waits for it."""
    h = reply.handle
    watcher = asyncio.create_task(watch_disconnect(request, h, worker))
    try:
        return await h.next()
    except BaseException:  # cancelled: the client went away before the first token
        worker.abort(h)
        end_span(h.span)
        raise
    finally:
        watcher.cancel()


async def collect(reply: Reply, request: Request, worker: EngineWorker,
                  tokenizer: Any) -> Response:
    """The whole response of a request that does not stream."""
    h = reply.handle
    text = TextAssembler(tokenizer, reply.stops)
    watcher = asyncio.create_task(watch_disconnect(request, h, worker))
    try:
        while True:
            item = await h.next()
            if isinstance(item, Finished):
                break
            text.add(item)
            if text.stopped:
                worker.abort(h, "stop")
    finally:
        watcher.cancel()
        if h.finished is None:  # cancelled: the client went away
            worker.abort(h)
        end_span(h.span)
    fin = item
    if fin.error is not None:
        return finished_error(fin)
    text.flush()
    reason = "stop" if text.stopped else _openai_reason(fin.finish_reason)
    return json_response(reply.body(text.text, reason, fin))


async def stream(reply: Reply, first: int | Finished, worker: EngineWorker,
                 tokenizer: Any) -> AsyncIterator[bytes]:
    """The events of a streaming request, from its first token on."""
    h = reply.handle
    text = TextAssembler(tokenizer, reply.stops)
    try:
        if reply.chat:
            yield reply.chunk(None, None, role=True)
        item: int | Finished = first
        while True:
            if isinstance(item, Finished):
                break
            delta = text.add(item)
            if text.stopped:
                worker.abort(h, "stop")
            if delta:
                yield reply.chunk(delta, None)
            item = await h.next()
        if item.error is not None:
            yield error_event(item)
        else:
            tail = text.flush()
            if tail:
                yield reply.chunk(tail, None)
            reason = "stop" if text.stopped else _openai_reason(item.finish_reason)
            yield reply.chunk(None, reason)
            if reply.include_usage:
                yield reply.usage_chunk(item)
        yield DONE
    finally:
        if h.finished is None:  # the client disconnected mid-stream
            worker.abort(h)
        end_span(h.span)
