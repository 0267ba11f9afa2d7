"""The benches' load client: streaming requests to an OpenAI-compatible server, and
multi-turn conversations driven by concurrent workers.

`stream_turn` sends one streaming request (chat or completions) and returns a `Reply`:
TTFT, text, the server's usage counts, and how it failed if it did. `run_conversations`
runs `Conversation`s on `workers` concurrent workers, each turn's prompt holding the
history so far. Where the benches differ, a parameter says how:

- a turn's history answer is the model's own reply (`UserTurn.answer` None: a real chat,
  bench/server/load.py and chat.py) or a fixed text (bench/cluster/real.py: every router
  then sees the same prompts, whatever a replica generated);
- `LoadSpec`: the request body (`model`, `max_tokens`, `ignore_eos`), a client timeout
  past which a turn counts as hung, whether the first event with a finish reason counts
  as the first token (`ttft_on_finish`), whether a stream without `[DONE]` is an error
  (`require_done`), and whether a failed turn ends its conversation (`stop_on_error`);
- one HTTP client shared by the workers (`http`) or one per worker;
- conversations from a list (a shared queue), or drawn by each worker until a deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


class SSEDecoder:
    """The `data:` payloads of an SSE stream fed as text chunks, split on line feeds only:
    a JSON line may carry U+2028 or U+0085 raw, which str.splitlines (and httpx's
    iter_lines) would cut in two."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, chunk: str) -> list[str]:
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        return [line.rstrip("\r")[5:].lstrip(" ") for line in lines
                if line.startswith("data:")]

    def close(self) -> list[str]:
        rest, self._buf = self._buf, ""
        return [rest[5:].lstrip(" ")] if rest.startswith("data:") else []


@dataclass
class Reply:
    """One streamed answer. `start` is `time.perf_counter()` at the send."""

    start: float
    ttft: float | None = None
    e2e: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status_code: int | None = None
    error: str | None = None  # non-200, an error event, a transport error, or hung
    stream_error: bool = False  # the error came as an event in the stream
    transport_error: str | None = None  # the exception's type name
    hung: bool = False  # no end within the client timeout
    done: bool = False  # `data: [DONE]` arrived
    cancelled: bool = False  # closed by this client after `cancel_after` events
    replica: str | None = None  # as kvheat route reports it (x-kvheat-replica)
    conv: int = 0  # set by run_conversations
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None for an answer of one token or none)."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def status(self) -> str:
        return "hung" if self.hung else "ok" if self.error is None else "error"

    @property
    def end(self) -> float:
        return self.start + self.e2e


async def stream_turn(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None, timeout_s: float | None = None,
                      ttft_on_finish: bool = False, require_done: bool = False,
                      cancel_after: int | None = None) -> Reply:
    """POST `body` with `"stream": true` to `url` and read the stream. TTFT is the time to
    the first non-empty text (`ttft_on_finish`: or to the first event with a finish
    reason); `cancel_after` closes the connection at that many `data:` events."""
    res = Reply(time.perf_counter())
    parts: list[str] = []

    async def read() -> None:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            res.status_code = r.status_code
            res.replica = r.headers.get("x-kvheat-replica")
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            dec, events = SSEDecoder(), 0
            async for chunk in r.aiter_text():
                for data in dec.feed(chunk):
                    events += 1
                    if cancel_after is not None and events >= cancel_after:
                        res.cancelled = True
                        return  # closes the connection mid-stream
                    if data == "[DONE]":
                        res.done = True
                        continue
                    ev = json.loads(data)
                    if "error" in ev:
                        res.error, res.stream_error = str(ev["error"])[:200], True
                        return
                    if ev.get("usage"):
                        u = ev["usage"]
                        res.prompt_tokens = int(u.get("prompt_tokens", 0))
                        res.completion_tokens = int(u.get("completion_tokens", 0))
                        res.cached_tokens = int(
                            (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    for ch in ev.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") or ch.get("text")
                        if piece or (ttft_on_finish and ch.get("finish_reason")):
                            if res.ttft is None:
                                res.ttft = time.perf_counter() - res.start
                            parts.append(piece or "")
            if require_done and not res.done:
                res.error = "the stream ended without [DONE]"

    try:
        if timeout_s is None:
            await read()
        else:
            await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        res.hung, res.error = True, f"no answer in {timeout_s} s"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.transport_error = type(e).__name__
        res.error = f"{type(e).__name__}: {e}"[:200]
    res.e2e = time.perf_counter() - res.start
    res.text = "".join(parts)
    return res


# ---- conversations -----------------------------------------------------------------------------
@dataclass
class UserTurn:
    content: str
    answer: str | None = None  # the history's answer to this turn; None: the model's reply


@dataclass
class Conversation:
    """A system prompt, then user turns (`turns` may be a generator: drawn turn by turn)."""

    id: int
    system: str
    turns: Iterable[UserTurn]
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)  # extra request fields (e.g. `user`)


@dataclass
class LoadSpec:
    model: str
    max_tokens: int
    ignore_eos: bool = True
    timeout_s: float | None = None  # a turn with no end past it counts as hung
    ttft_on_finish: bool = False
    require_done: bool = False
    stop_on_error: bool = False  # a failed turn ends its conversation (a new one starts)
    path: str = "/v1/chat/completions"


def from_list(convs: Sequence[Conversation]) -> Callable[[int], Conversation | None]:
    """One queue of conversations that every worker takes from, in order."""
    queue = deque(convs)
    return lambda _worker: queue.popleft() if queue else None


async def run_conversations(base: str, next_conversation: Callable[[int], Conversation | None],
                            workers: int, spec: LoadSpec, http: httpx.AsyncClient | None = None,
                            deadline: float | None = None,
                            on_reply: Callable[[Reply], None] | None = None) -> list[Reply]:
    """Run conversations on `workers` concurrent workers until `next_conversation(worker)`
    returns None (or, with `deadline`, a `time.perf_counter()` time, until it passes: no
    turn starts after it). `http`: one client for all workers; without it each worker
    opens its own (timeout: the spec's plus 5 s). Returns the replies in the order they
    ended."""
    replies: list[Reply] = []

    def before_deadline() -> bool:
        return deadline is None or time.perf_counter() < deadline

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        while before_deadline():
            conv = next_conversation(w)
            if conv is None:
                return
            msgs = [{"role": "system", "content": conv.system}]
            it = iter(conv.turns)
            t = 0
            while before_deadline():
                turn = next(it, None)
                if turn is None:
                    break
                msgs.append({"role": "user", "content": turn.content})
                body = {"model": spec.model, "messages": list(msgs),
                        "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
                        **({"ignore_eos": True} if spec.ignore_eos else {}),
                        "stream_options": {"include_usage": True}, **conv.body}
                r = await stream_turn(client, base + spec.path, body, conv.headers or None,
                                      spec.timeout_s, spec.ttft_on_finish, spec.require_done)
                r.conv, r.turn = conv.id, t
                replies.append(r)
                if on_reply is not None:
                    on_reply(r)
                if not r.ok and spec.stop_on_error:
                    break
                msgs.append({"role": "assistant",
                             "content": r.text if turn.answer is None else turn.answer})
                t += 1
            else:
                return  # the deadline passed

    async def own_client(w: int) -> None:
        timeout = httpx.Timeout(None if spec.timeout_s is None else spec.timeout_s + 5)
        async with httpx.AsyncClient(timeout=timeout) as client:
            await worker(w, client)

    if http is not None:
        await asyncio.gather(*(worker(w, http) for w in range(workers)))
    else:
        await asyncio.gather(*(own_client(w) for w in range(workers)))
    return replies


def run_timed(base: str, convs: Sequence[Conversation], workers: int, spec: LoadSpec,
              on_reply: Callable[[Reply], None] | None = None) -> tuple[list[Reply], float]:
    """`run_conversations` over `convs` from a fresh event loop: the replies, their `start`
    in seconds from the load's start, and the wall time."""
    async def go() -> tuple[list[Reply], float]:
        t0 = time.perf_counter()
        replies = await run_conversations(base, from_list(convs), workers, spec,
                                          on_reply=on_reply)
        wall = time.perf_counter() - t0
        for r in replies:
            r.start -= t0
        return replies, wall

    return asyncio.run(go())


def metric_sums(text: str, names: dict[str, str]) -> dict[str, float]:
    """Prometheus text: each metric of `names` (metric name -> key) summed over its labels."""
    out = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        for name, key in names.items():
            if line.startswith(name + "{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def served(urls: Sequence[str]) -> list[dict[str, float]]:
    """What each server reports it served: requests, prompt tokens and cached tokens (all
    zero for a server that does not answer)."""
    names = {"kvheat_requests_total": "requests", "kvheat_prompt_tokens_total": "prompt_tokens",
             "kvheat_cached_tokens_total": "cached_tokens"}
    out = []
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            out.append({"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            continue
        out.append(metric_sums(text, names))
    return out
