"""`kvheat route` passes the session hint on: the `X-Session-Id` header (and the `user`
field, in the body it forwards unchanged) reach the replica's cache policy, a session's
turns stay on one replica (cache-aware routing keeps a conversation where its prefix is),
and a bad header is the replica's clear 400, passed through."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence

import httpx
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
from kvheat.cache import policy as policy_registry
from kvheat.cache.policies import LRU
from kvheat.router.config import ReplicaSpec, RouterConfig
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
