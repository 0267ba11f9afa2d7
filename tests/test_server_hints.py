"""The server's hints to the cache policy, end to end through a real `kvheat serve` (uvicorn,
the official `openai` client and raw HTTP, real forward passes): the session from the
`X-Session-Id` header, the `user` field or the chat's own opening, keyed per tenant and
never shown; FINISHED with the finish reason, or CANCELLED when the client goes away; and
with the kvheat policy, a cancelled request's own blocks leave before a finished one's."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import httpx
import pytest
from test_server import MODEL, SYSTEM, Served, start, stop

from kvheat.cache import Node, Outcome, register_policy
from kvheat.cache import eviction as policy_registry
from kvheat.cache.classic import LRU
from kvheat.server.config import ArmConfig, ServerConfig, TenantConfig

RECORDING = "test-recording-hints"
TENANTS = [TenantConfig("acme", ["sk-acme"]), TenantConfig("globex", ["sk-globex"])]


class Recording(LRU):
    """LRU that writes down each request's end as the policy hears it."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[tuple[str | None, Outcome, str | None]] = []

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.finished.append((session, outcome, reason))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    # Registered for this module only: other tests list every registered policy.
    register_policy(RECORDING)(Recording)
    s = start(ServerConfig(num_blocks=128, threads=1, max_num_seqs=4, tenants=TENANTS,
                           arms=[ArmConfig("rec", 100, RECORDING)]))
    try:
        yield s
    finally:
        stop(s)
        policy_registry._REGISTRY.pop(RECORDING, None)


def ends(s: Served) -> list[tuple[str | None, Outcome, str | None]]:
    """The request ends the policy heard since the last call (taken on the engine thread)."""
    s.wait_idle()

    def take() -> list[tuple[str | None, Outcome, str | None]]:
        pol = s.server.worker.engines["rec"].cache.policy
        assert isinstance(pol, Recording)
        out, pol.finished = pol.finished, []
        return out

    return s.on_engine_thread(take)


def chat(s: Served, key: str, msgs: list[dict[str, str]], headers: dict[str, str] | None = None,
         **kw) -> httpx.Response:
    r = httpx.post(s.base + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}", **(headers or {})},
                   json={"model": MODEL, "messages": msgs, "max_tokens": 3,
                         "ignore_eos": True, "temperature": 0, **kw})
    return r


def conversation(topic: str, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"{topic}: question {t}"})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"answer {t}"})
    return msgs


def one_session(s: Served, key: str, msgs: list[dict[str, str]], **kw) -> str | None:
    r = chat(s, key, msgs, **kw)
    assert r.status_code == 200, r.text
    (session, outcome, reason), = ends(s)
    assert outcome is Outcome.FINISHED and reason == "length"
    return session


def test_sessions_from_the_header_the_user_and_the_chat_opening(served: Served) -> None:
    s = served
    ends(s)
    # No header, no user: the conversation's opening names it, turn after turn.
    t1 = one_session(s, "sk-acme", conversation("rivers", 1))
    t2 = one_session(s, "sk-acme", conversation("rivers", 3))
    other = one_session(s, "sk-acme", conversation("mountains", 2))
    assert t1 is not None and t1.startswith("chat:") and t1 == t2 and other != t1
    # The same opening from another tenant is another session.
    assert one_session(s, "sk-globex", conversation("rivers", 2)) not in (t1, None)
    # The user field names it, per tenant; the header wins over it.
    u = one_session(s, "sk-acme", conversation("rivers", 2), user="alice")
    assert u is not None and u.startswith("user:") and u != t1
    assert one_session(s, "sk-acme", conversation("lakes", 1), user="alice") == u
    assert one_session(s, "sk-globex", conversation("rivers", 2), user="alice") != u
    h = one_session(s, "sk-acme", conversation("rivers", 2), user="alice",
                    headers={"X-Session-Id": "agent-7/run:1"})
    assert h is not None and h.startswith("header:") and h not in (u, t1)
    assert one_session(s, "sk-acme", conversation("seas", 1),
                       headers={"X-Session-Id": "agent-7/run:1"}) == h
    # A completion with neither has no session; its end is still heard.
    r = httpx.post(s.base + "/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                   json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 2,
                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    assert ends(s) == [(None, Outcome.FINISHED, "length")]
    # Nothing shows a session: not the answer, not the metrics.
    text = httpx.get(s.base + "/metrics").text + r.text
    for sid in (t1, u, h):
        assert sid.split(":", 1)[1] not in text
    assert "agent-7" not in text and "alice" not in text


@pytest.mark.parametrize("value", ["", "x" * 257, "has space", "caf\u00e9", "a\tb", "a;b"])
def test_a_bad_session_header_is_a_clear_400(served: Served, value: str) -> None:
    r = httpx.post(served.base + "/v1/completions",
                   headers={"Authorization": "Bearer sk-acme",
                            "X-Session-Id": value.encode("utf-8")},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, (value, r.text)
    err = r.json()["error"]
    assert err["code"] == "invalid_session_id" and err["param"] == "X-Session-Id"
    assert "X-Session-Id" in err["message"]
    ok = chat(served, "sk-acme", conversation("after a 400", 1),
              headers={"X-Session-Id": "x" * 256})
    assert ok.status_code == 200
    ends(served)


def test_outcomes_and_finish_reasons(served: Served) -> None:
    s = served
    ends(s)
    # A client that leaves mid-stream: cancelled.
    body = {"model": MODEL, "prompt": SYSTEM * 2, "max_tokens": 64, "stream": True,
            "ignore_eos": True, "temperature": 0, "user": "bob"}
    with httpx.Client(base_url=s.base, timeout=60,
                      headers={"Authorization": "Bearer sk-acme"}) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    got: list[tuple[str | None, Outcome, str | None]] = []
    while not got:
        assert time.monotonic() < deadline, "the disconnect never reached the policy"
        got = ends(s)
    (session, outcome, reason), = got
    assert session is not None and session.startswith("user:")
    assert outcome is Outcome.CANCELLED and reason == "abort"
    # A stop string ends it on the server's side: the answer was delivered.
    r2 = httpx.post(s.base + "/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                    json={"model": MODEL, "prompt": "Where?", "max_tokens": 16,
                          "temperature": 0, "stop": [" "], "ignore_eos": True}, timeout=60)
    assert r2.status_code == 200
    fin = ends(s)
    assert len(fin) == 1 and fin[0][1] is Outcome.FINISHED
    assert fin[0][2] == ("stop" if r2.json()["choices"][0]["finish_reason"] == "stop"
                         else "length")


# ---- the kvheat policy demotes a cancelled request's own blocks --------------------------
def _cancel_mid_stream(base: str, body: dict, after: int = 1) -> None:
    """Stream a completion and close the connection after `after` events."""
    with httpx.Client(base_url=base, timeout=60,
                      headers={"Authorization": "Bearer none"}) as http, \
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        n = 0
        for line in resp.iter_lines():
            n += line.startswith("data: ")
            if n >= after:
                return
        raise AssertionError("the stream ended before the client left")


def test_a_cancelled_requests_suffix_leaves_before_a_finished_ones() -> None:
    """kvheat learns online what a request's end says (kvheat/heat/sessions.py): here
    sessions whose answer was delivered come back for another turn, and those whose client
    left never do. Then two requests over one shared head, each with a tail of its own: F
    finishes, then C is cancelled mid-stream, so C's blocks were released last (an LRU, or
    kvheat without hints, evicts F's first). With the hints, C's own blocks (its prompt's
    tail and what it decoded) leave first, and F's stay."""
    # A pool the warm-up overflows: kvheat weighs an end class against the age at which
    # it evicts, so it charges classes once it has evicted.
    s = start(ServerConfig(num_blocks=64, threads=1, max_num_seqs=4, policy="kvheat"))
    try:
        arm = s.server.router.names[0]
        base = {"model": MODEL, "ignore_eos": True, "temperature": 0}

        def post(body: dict) -> None:
            r = httpx.post(s.base + "/v1/completions", timeout=60, json={**base, **body},
                           headers={"Authorization": "Bearer none"})
            assert r.status_code == 200, r.text

        for i in range(24):  # 72 request ends: the classes' charges are learned by 64
            ask = f"{SYSTEM} Session {i} asks about the rivers of Europe, one by one. " * 2
            post({"prompt": ask, "max_tokens": 2, "user": f"back-{i}"})
            _cancel_mid_stream(s.base, {
                **base, "prompt": f"{SYSTEM} Session {i} asks, then goes away. " * 3,
                "max_tokens": 64, "user": f"gone-{i}"})
            post({"prompt": ask + " And the lakes?", "max_tokens": 2, "user": f"back-{i}"})
        s.wait_idle()
        assert s.on_engine_thread(lambda: s.server.worker.engines[arm].cache.stats.evicted_blocks)
        # A clean pool (the policy keeps what it learned): only F's and C's blocks follow.
        s.on_engine_thread(lambda: s.server.worker.engines[arm].flush_tenant(None))

        def cached() -> set[bytes]:
            return set(s.server.worker.engines[arm].cache.cached)

        head = SYSTEM * 2
        post({"prompt": head + " Finished: tell me about the rivers of Europe.",
              "max_tokens": 24, "user": "f"})
        s.wait_idle()
        after_f = s.on_engine_thread(cached)  # the head, F's tail and what F decoded
        _cancel_mid_stream(s.base, {**base, "prompt": head + " Cancelled: and the mountains?",
                                    "max_tokens": 64, "user": "c"}, after=20)
        s.wait_idle()
        c_own = s.on_engine_thread(cached) - after_f
        assert len(c_own) >= 2 and after_f

        def evict() -> tuple[set[bytes], set[bytes], object]:
            cache = s.server.worker.engines[arm].cache
            assert cache.num_referenced == 0
            cache.evict(len(c_own))
            left = set(cache.cached)
            book = getattr(cache.policy, "book", None)
            why = (book.classes, book.charge, book.ends, book.back) if book else None
            return after_f - left, c_own & left, why

        f_gone, c_left, stats = s.on_engine_thread(evict)
        assert not f_gone, f"a finished request's block went before the cancelled one's: {stats}"
        assert not c_left
    finally:
        stop(s)
