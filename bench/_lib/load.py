"""bench/cluster.py's load: multi-turn, multi-tenant conversations over shared system
prompts, driven by concurrent streaming clients, and what each replica reports it served."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_procs import MODEL, TENANTS, Replica  # noqa: E402

# System prompts are shared across tenants (as a framework's default prompt is): the same
# text, but each tenant's KV is salted apart, so text alone says nothing about what a
# replica holds for a given tenant.
SYSTEM_PROMPTS = [
    "You are a support assistant. Answer about orders, refunds and shipping in two "
    "sentences. Orders ship within two days; refunds take five days. " * 3,
    "You are a coding helper. Answer with short Python snippets only. Keep every function "
    "under ten lines and name variables clearly. " * 3,
    "You are a travel guide. Paris is the capital of France; Rome of Italy; Madrid of "
    "Spain. Answer in one short paragraph. " * 3,
    "You summarise meetings. Keep decisions, owners and dates; drop small talk. Answer as "
    "a bullet list of at most five items. " * 3,
]
QUESTIONS = ["What should I do next?", "Can you explain that again, more briefly?",
             "What is the most important point?", "Give me an example.",
             "How long will it take?", "Is there anything I forgot?"]



# ---- the load --------------------------------------------------------------------------------
@dataclass
class Turn:
    conv: int
    turn: int
    tenant: str
    messages: list[dict[str, str]]


def workload(n_conv: int, turns: int, seed: int) -> list[list[Turn]]:
    """Conversations of `turns` turns; the history holds fixed assistant answers, so a
    prompt never depends on what a replica generated (and every router sees the same)."""
    rng = random.Random(seed)
    convs = []
    names = list(TENANTS)
    for c in range(n_conv):
        tenant = names[c % len(names)]
        sysp = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
        msgs = [{"role": "system", "content": sysp}]
        conv = []
        for t in range(turns):
            q = f"[{c}] {rng.choice(QUESTIONS)} " + " ".join(
                rng.choice(QUESTIONS) for _ in range(rng.randint(1, 3)))
            msgs = msgs + [{"role": "user", "content": q}]
            conv.append(Turn(c, t, tenant, list(msgs)))
            msgs = msgs + [{"role": "assistant", "content": f"Answer {t} to conversation {c}: "
                            + rng.choice(QUESTIONS)}]
        convs.append(conv)
    return convs


def fresh_prompts(n: int) -> list[list[Turn]]:
    """One-turn requests on prompts nobody has sent before (a restarted replica has no
    cache, so only new prefixes show where a router places fresh work)."""
    return [[Turn(10_000 + i, 0, "acme", [
        {"role": "system", "content": f"Session {i}: you are a new assistant with new rules. "
                                      * 4},
        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])] for i in range(n)]


@dataclass
class Result:
    conv: int
    turn: int
    start: float
    end: float
    ttft: float | None = None
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    status: str = "ok"  # ok, error, hung
    replica: str | None = None  # as kvheat route reports it (x-kvheat-replica)


async def one_request(http: httpx.AsyncClient, base: str, t: Turn, max_tokens: int,
                      timeout_s: float, t0: float) -> Result:
    res = Result(t.conv, t.turn, time.perf_counter() - t0, 0.0)
    body = {"model": MODEL, "messages": t.messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {TENANTS[t.tenant]}"}
    start = time.perf_counter()

    async def go() -> None:
        async with http.stream("POST", base + "/v1/chat/completions", json=body,
                               headers=headers) as r:
            res.replica = r.headers.get("x-kvheat-replica")
            if r.status_code != 200:
                await r.aread()
                res.status = "error"
                return
            buf = b""
            done = False
            async for chunk in r.aiter_bytes():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        res.status = "error"
                        continue
                    if d.get("usage"):
                        u = d["usage"]
                        res.prompt_tokens = u["prompt_tokens"]
                        res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0) or 0
                    for c in d.get("choices", []):
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            if res.ttft is None:
                                res.ttft = time.perf_counter() - start
                            res.text += piece
            if not done:
                res.status = "error"

    try:
        await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        res.status = "hung"
    except (httpx.HTTPError, json.JSONDecodeError):
        res.status = "error"
    res.end = time.perf_counter() - t0
    return res


async def run_load(base: str, convs: list[list[Turn]], clients: int, max_tokens: int,
                   timeout_s: float, on_progress: Any = None) -> tuple[list[Result], float]:
    queue: asyncio.Queue[list[Turn]] = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    results: list[Result] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + 5)) as http:
            while not queue.empty():
                conv = queue.get_nowait()
                for t in conv:
                    r = await one_request(http, base, t, max_tokens, timeout_s, t0)
                    results.append(r)
                    if on_progress is not None:
                        on_progress(len(results))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.perf_counter() - t0


def replica_load(replicas: list[Replica]) -> list[dict[str, float]]:
    out = []
    for r in replicas:
        try:
            text = httpx.get(r.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            out.append({"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            continue
        m = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
        for line in text.splitlines():
            for name, key in (("kvheat_requests_total", "requests"),
                              ("kvheat_prompt_tokens_total", "prompt_tokens"),
                              ("kvheat_cached_tokens_total", "cached_tokens")):
                if line.startswith(name + "{"):
                    m[key] += float(line.rsplit(" ", 1)[1])
        out.append(m)
    return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def max_over_mean(xs: list[float]) -> float | None:
    m = sum(xs) / len(xs) if xs else 0
    return max(xs) / m if m else None
