"""`kvheat route` passes the session hint on: to a kvheat replica, the `X-Session-Id` header
(and the `user` field, in the body it forwards unchanged) reach the replica's cache policy,
a session's turns stay on one replica (cache-aware routing keeps a conversation where its
prefix is), and a bad header is the clear 400 a kvheat server answers. A vLLM replica gets
the session, keyed, in the body's `kv_transfer_params` (`vllm_body` here; delivered to a
real vLLM's KVHeatConnector in tests/test_vllm_connector.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence

import httpx
import msgspec
import pytest
from test_router_e2e import (
    ADMIN,
    EVENTS_SECRET,
    REPLICA_ADMIN,
    TENANTS,
    replica_config,
    start_router,
    stop_router,
    wait_for,
)
from test_server import MODEL, SYSTEM, Served, start, stop

from kvheat.cache import Node, Outcome, register_policy
from kvheat.cache import eviction as policy_registry
from kvheat.cache.classic import LRU
from kvheat.router.config import ReplicaSpec, RouterConfig, RouterConfigError
from kvheat.router.hints import SESSION_PARAM, SessionHints, vllm_body
from kvheat.router.proxy import RouterError
from kvheat.server.config import ArmConfig

RECORDING = "test-recording-route-hints"


class Recording(LRU):
    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[str | None] = []

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        self.sessions.append(session)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[Served], object]]:
    register_policy(RECORDING)(Recording)  # for this module only
    reps = [start(dataclasses.replace(replica_config(), arms=[ArmConfig("rec", 100, RECORDING)]))
            for _ in range(2)]
    rt = start_router(RouterConfig(
        replicas=[ReplicaSpec(s.base) for s in reps],
        tenants={k: t.name for t in TENANTS for k in t.api_keys}, admin_token=ADMIN,
        replica_admin_token=REPLICA_ADMIN, health_interval_s=0.2, events_secret=EVENTS_SECRET))
    try:
        assert wait_for(lambda: all(r.healthy and r.events is not None
                                    for r in rt.router.replicas.values()))
        yield reps, rt
    finally:
        stop_router(rt)
        for s in reps:
            stop(s)
        policy_registry._REGISTRY.pop(RECORDING, None)


def heard(s: Served) -> list[str | None]:
    s.wait_idle()

    def take() -> list[str | None]:
        pol = s.server.worker.engines["rec"].cache.policy
        assert isinstance(pol, Recording)
        out, pol.sessions = pol.sessions, []
        return out

    return s.on_engine_thread(take)


def test_the_session_header_reaches_the_replica_and_the_session_stays(cluster) -> None:
    reps, rt = cluster
    for s in reps:
        heard(s)
    served_by: dict[str, set[str]] = {}
    for turn in range(3):
        for name in ("agent-a", "agent-b", "agent-c"):
            msgs = [{"role": "system", "content": SYSTEM}]
            for t in range(turn + 1):
                msgs.append({"role": "user", "content": f"{name}: step {t}"})
                if t < turn:
                    msgs.append({"role": "assistant", "content": f"done {t}"})
            r = httpx.post(rt.base + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": msgs, "max_tokens": 2, "ignore_eos": True},
                headers={"Authorization": "Bearer sk-acme", "X-Session-Id": name})
            assert r.status_code == 200, r.text
            if turn:  # a first turn shares only the head: it may land anywhere
                served_by.setdefault(name, set()).add(r.headers["x-kvheat-replica"])
    assert all(len(v) == 1 for v in served_by.values()), served_by
    # (a None is a router's prewarm of the shared head: a request of no session)
    per_replica = [Counter(x for x in heard(s) if x is not None) for s in reps]
    assert sum(sum(c.values()) for c in per_replica) == 9
    assert all(x.startswith("header:") for c in per_replica for x in c)
    # Each replica keys sessions with its own secret; the two later turns of each session
    # went to one replica, which heard them as one session.
    assert sum(1 for c in per_replica for n in c.values() if n >= 2) == 3


def test_a_bad_session_header_is_the_replicas_400(cluster) -> None:
    _, rt = cluster
    r = httpx.post(rt.base + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                   headers={"Authorization": "Bearer sk-acme", "X-Session-Id": "a b"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"


# ---- the body a vLLM replica gets ----------------------------------------------------------------
def _sent(body: dict, cache_salt: str | None, session: str | None) -> dict:
    return msgspec.json.decode(vllm_body(body, msgspec.json.encode(body), cache_salt, session))


def test_a_vllm_body_carries_the_session_beside_the_clients_params() -> None:
    raw = b'{"model":"m","prompt":"hi"}'
    body = msgspec.json.decode(raw)
    assert vllm_body(body, raw, None, None) is raw  # nothing to add: the bytes unchanged
    assert _sent(body, "tenant:acme", "header:ab12") == {
        "model": "m", "prompt": "hi", "cache_salt": "tenant:acme",
        "kv_transfer_params": {SESSION_PARAM: "header:ab12"}}
    # The client's own parameters stay, but not a tenant (the client's claim: only the
    # router's vouched one goes, tests/test_trust.py), and a session it named itself wins.
    mine = {**body, "kv_transfer_params": {"tenant": "acme", "do_remote_decode": False}}
    assert _sent(mine, None, "header:ab12")["kv_transfer_params"] == {
        "do_remote_decode": False, SESSION_PARAM: "header:ab12"}
    named = {**body, "kv_transfer_params": {SESSION_PARAM: "theirs"}}
    assert _sent(named, None, "header:ab12")["kv_transfer_params"] == {SESSION_PARAM: "theirs"}
    # Not an object: left for vLLM to refuse; null: as if absent.
    assert _sent({**body, "kv_transfer_params": ["x"]}, None, "s")["kv_transfer_params"] == ["x"]
    assert _sent({**body, "kv_transfer_params": None}, None, "s")["kv_transfer_params"] == {
        SESSION_PARAM: "s"}


def test_session_digests_are_keyed_by_tenant_and_secret_and_check_the_header() -> None:
    a = SessionHints({}, "s" * 16)
    b = SessionHints({}, "s" * 16)
    d = a.session_of("agent-1", None, "acme")
    assert d is not None and "agent-1" not in d and d.startswith("header:")
    assert d == b.session_of("agent-1", None, "acme")  # one secret: one digest
    assert d != a.session_of("agent-1", None, "globex")
    assert d != SessionHints({}, "t" * 16).session_of("agent-1", None, "acme")
    assert d != SessionHints({}).session_of("agent-1", None, "acme")  # a drawn key
    assert a.session_of(None, "u", None) == b.session_of(None, "u", None) != \
        a.session_of("u", None, None)
    assert a.session_of(None, None, "acme") is None  # none given: none sent
    with pytest.raises(RouterError) as e:
        SessionHints.check_header("a b")
    assert e.value.status == 400 and e.value.code == "invalid_session_id"
    SessionHints.check_header(None)
    with pytest.raises(RouterConfigError, match="session_secret"):
        RouterConfig(replicas=[ReplicaSpec("http://r:1")], session_secret="short")
