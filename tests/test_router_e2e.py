"""`kvheat route` end to end: real `kvheat serve` replicas (in this process, and one as a
subprocess that is killed), their KV events over real ZMQ, the router on uvicorn, driven by
the official `openai` client and raw HTTP. The built-in tiny model runs real forward
passes, so outputs through the router are compared token for token with direct calls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import wait_for as poll_until
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_server import MODEL, SYSTEM, Served, _free_port, bound_socket, start, stop

from kvheat.heat import Regime
from kvheat.router.app import KVHeatRouter
from kvheat.router.config import ReplicaSpec, RouterConfig
from kvheat.server.config import ServerConfig, TenantConfig

torch.set_num_threads(1)
ADMIN = "router-admin"
TENANTS = [TenantConfig("acme", ["sk-acme"]), TenantConfig("globex", ["sk-globex"])]


@dataclass
class Routed:
    router: KVHeatRouter
    base: str
    uv: uvicorn.Server
    thread: threading.Thread
    exporter: InMemorySpanExporter

    def client(self, key: str = "sk-acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0,
                             timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.base + "/metrics").text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                    all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_router(cfg: RouterConfig) -> Routed:
    exporter = InMemorySpanExporter()
    router = KVHeatRouter(cfg, span_exporter=exporter)
    sock = bound_socket()  # bound before uvicorn starts: a probed port can be taken
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(router.app, host="127.0.0.1", port=port,
                                       log_level="warning"))
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert th.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    return Routed(router, f"http://127.0.0.1:{port}", uv, th, exporter)


def wait_for(cond, timeout_s: float = 20.0) -> bool:
    return poll_until(cond, timeout_s, 0.05)


REPLICA_ADMIN = "replica-admin"  # the router reports the cluster's entropy with it
EVENTS_SECRET = "events-secret-of-the-test-cluster"  # keys and authenticates KV events


def replica_config() -> ServerConfig:
    return ServerConfig(num_blocks=256, threads=1, max_num_seqs=8, tenants=TENANTS,
                        admin_token=REPLICA_ADMIN,
                        kv_events_endpoint="tcp://127.0.0.1:0",
                        kv_events_replay_endpoint="tcp://127.0.0.1:0",
                        kv_events_secret=EVENTS_SECRET)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[Served], Routed]]:
    reps = [start(replica_config()) for _ in range(3)]
    cfg = RouterConfig(replicas=[ReplicaSpec(s.base) for s in reps],
                       tenants={k: t.name for t in TENANTS for k in t.api_keys},
                       admin_token=ADMIN, replica_admin_token=REPLICA_ADMIN,
                       health_interval_s=0.2, events_secret=EVENTS_SECRET)
    rt = start_router(cfg)
    assert wait_for(lambda: all(r.healthy and r.events is not None
                                for r in rt.router.replicas.values()))
    yield reps, rt
    stop_router(rt)
    for s in reps:
        stop(s)


def stop_router(rt: Routed) -> None:
    rt.uv.should_exit = True
    rt.thread.join(timeout=30)


def chat(client: openai.OpenAI, messages: list[dict[str, str]], stream: bool = False,
         max_tokens: int = 8) -> tuple[str, Any]:
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        r = raw.parse()
        return r.choices[0].message.content or "", (raw.headers.get("x-kvheat-replica"),
                                                    r.usage)
    text, usage = "", None
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}) as resp:
        replica = resp.headers.get("x-kvheat-replica")
        for chunk in resp.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
    return text, (replica, usage)


def test_conversations_stick_and_outputs_match_direct_calls(cluster) -> None:
    reps, rt = cluster
    by_base = {s.base: s for s in reps}
    homes: dict[int, set[str]] = {}
    expected0 = rt.metric("kvheat_router_expected_hit_tokens_total")
    cached0 = rt.metric("kvheat_router_cached_tokens_total")
    for turn in range(3):
        for conv in range(4):
            msgs = [{"role": "system", "content": SYSTEM}]
            for t in range(turn + 1):
                msgs.append({"role": "user", "content": f"conversation {conv}, question {t}"})
                if t < turn:
                    msgs.append({"role": "assistant", "content": f"answer {t}"})
            text, (replica, usage) = chat(rt.client(), msgs, stream=turn == 1)
            if turn:  # a first turn caches only the shared head (its tail is a partial
                homes.setdefault(conv, set()).add(replica)  # block): it may land anywhere
            # The same request straight to the replica that served it: the same tokens.
            direct, _ = chat(by_base[replica].client("sk-acme"), msgs)
            assert text == direct
            if turn:
                assert usage.prompt_tokens_details.cached_tokens > 0
    assert all(len(h) == 1 for h in homes.values()), homes  # each conversation stayed
    assert len(set().union(*homes.values())) >= 2  # and they did not all go to one replica
    # The index, built from events, expected about what the replicas then reported.
    exp = rt.metric("kvheat_router_expected_hit_tokens_total") - expected0
    got = rt.metric("kvheat_router_cached_tokens_total") - cached0
    assert exp > 0 and abs(exp - got) <= 0.2 * got, (exp, got)


def test_tenant_keys_pass_through_and_never_share(cluster) -> None:
    reps, rt = cluster
    msgs = [{"role": "system", "content": SYSTEM + " tenants"}, {"role": "user", "content": "hi"}]
    chat(rt.client("sk-acme"), msgs)
    _, (replica, usage) = chat(rt.client("sk-acme"), msgs)
    assert usage.prompt_tokens_details.cached_tokens > 0
    _, (_, usage2) = chat(rt.client("sk-globex"), msgs)  # same prompt, other tenant
    assert usage2.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.AuthenticationError):
        rt.client("sk-nobody").chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)


def test_bad_requests_get_clear_errors(cluster) -> None:
    _, rt = cluster
    h = {"Authorization": "Bearer sk-acme", "content-type": "application/json"}
    r = httpx.post(rt.base + "/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(rt.base + "/v1/chat/completions", content=b"[1, 2]", headers=h)
    assert r.status_code == 400
    r = httpx.post(rt.base + "/v1/completions", content=b"x" * (9 << 20), headers=h)
    assert r.status_code == 413
    # What only a replica can judge is judged there, its answer passed through.
    r = httpx.post(rt.base + "/v1/chat/completions", headers=h, json={
        "model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(rt.base + "/v1/completions", headers=h, json={
        "model": MODEL, "prompt": [1, 2], "max_tokens": 0})
    assert r.status_code == 400
    assert httpx.get(rt.base + "/v1/models", headers=h).json()["data"][0]["id"] == MODEL


def test_each_decision_is_traced_and_counted(cluster) -> None:
    _, rt = cluster
    rt.exporter.clear()
    before = rt.metric("kvheat_router_decisions_total")
    chat(rt.client(), [{"role": "user", "content": "trace me"}])
    assert rt.metric("kvheat_router_decisions_total") == before + 1
    assert wait_for(lambda: any(s.name == "kvheat.route" for s in rt.exporter.get_finished_spans()))
    spans = {s.name: s for s in rt.exporter.get_finished_spans()}
    d = spans["route.decide"]
    assert d.parent is not None and d.parent.span_id == spans["kvheat.route"].context.span_id
    assert d.attributes["kvheat.replica"].startswith("http://")
    assert d.attributes["kvheat.mode"] in ("affinity", "home", "shard", "balance", "overload")
    text = httpx.get(rt.base + "/metrics").text
    for name in ("kvheat_router_replica_healthy", "kvheat_router_index_blocks",
                 "kvheat_router_decision_seconds_bucket", "kvheat_router_event_batches"):
        assert name in text


def test_replicas_leave_and_join_through_the_admin_api(cluster) -> None:
    reps, rt = cluster
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(rt.base + "/admin/replicas").status_code == 401
    gone = reps[0].base
    assert httpx.delete(rt.base + "/admin/replicas", params={"url": gone},
                        headers=auth).status_code == 200
    for i in range(6):
        _, (replica, _) = chat(rt.client(), [{"role": "user", "content": f"left {i}"}])
        assert replica != gone
    r = httpx.post(rt.base + "/admin/replicas", json={"url": gone}, headers=auth)
    assert r.status_code == 201 and r.json()["healthy"]
    listed = httpx.get(rt.base + "/admin/replicas", headers=auth).json()["replicas"]
    assert {x["url"] for x in listed} == {s.base for s in reps}
    assert httpx.post(rt.base + "/admin/replicas", json={"url": "ftp://x"},
                      headers=auth).status_code == 400
    assert wait_for(lambda: rt.router.replicas[gone].events is not None)


def test_a_client_that_leaves_mid_stream_frees_its_replica(cluster) -> None:
    reps, rt = cluster
    body = {"model": MODEL, "prompt": SYSTEM + " a client that leaves", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", rt.base + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer sk-acme"}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 2:
                break
    assert wait_for(lambda: all(x.state.in_flight == 0 and not x.pending
                                for x in rt.router.replicas.values()))
    for s in reps:  # the replica's request ends too (the router dropped its connection)
        s.wait_idle()


def _leave_mid_stream(rt: Routed, key: str, msgs: list[dict[str, str]]) -> None:
    body = {"model": MODEL, "messages": msgs, "max_tokens": 64, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", rt.base + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 1:
                break


def _two_turns(rt: Routed, key: str, opening: str, stream_first: bool, leave: bool,
               results: list[tuple[str, list[dict[str, str]], str]]) -> None:
    """A two-turn conversation through the router; with `leave`, the second turn is first
    asked and abandoned midway, then asked again."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening}]
    text, _ = chat(rt.client(key), msgs, stream=stream_first)
    results.append((key, list(msgs), text))
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    if leave:
        _leave_mid_stream(rt, key, msgs)
    results.append((key, msgs, chat(rt.client(key), msgs, stream=not stream_first)[0]))


def test_tenants_streams_cancels_and_admin_actions_together(cluster) -> None:
    """Three rounds of six concurrent two-turn conversations from two tenants, streamed and
    not, a third of them leaving a stream midway and asking again, while the admin API
    takes a replica out and puts it back: every answer is the one a replica gives
    directly (greedy), nothing fails, and every replica ends the round idle."""
    from concurrent.futures import ThreadPoolExecutor

    reps, rt = cluster
    auth = {"Authorization": f"Bearer {ADMIN}"}
    for rnd in range(3):
        results: list[tuple[str, list[dict[str, str]], str]] = []
        out = reps[rnd % 3].base
        with ThreadPoolExecutor(6) as pool:
            done = [pool.submit(_two_turns, rt, ("sk-acme", "sk-globex")[i % 2],
                                f"round {rnd}, conversation {i}", i % 2 == 0, i % 3 == 2,
                                results) for i in range(6)]
            assert httpx.delete(rt.base + "/admin/replicas", params={"url": out},
                                headers=auth).status_code == 200
            time.sleep(0.2)
            assert httpx.post(rt.base + "/admin/replicas", json={"url": out},
                              headers=auth).status_code == 201
            for f in done:
                f.result(timeout=120)  # raises what the conversation raised
        assert len(results) == 12 and all(text for _, _, text in results)
        back = rt.router.replicas[out]
        assert wait_for(lambda back=back: back.events is not None)
        assert wait_for(lambda: all(x.state.in_flight == 0 and not x.pending
                                    for x in rt.router.replicas.values()))
        for s in reps:
            s.wait_idle()
        direct = reps[(rnd + 1) % 3]
        for key, msgs, text in results:  # the same request to a replica, no router between
            assert chat(direct.client(key), msgs)[0] == text, (rnd, msgs)
    # Meanwhile the router reported the cluster's entropy to every replica, the one taken
    # out and put back included.
    bits = rt.router.cluster.bits()
    assert bits is not None
    for s in reps:
        assert wait_for(lambda s=s: httpx.get(
            s.base + "/admin/stats", headers={"Authorization": f"Bearer {REPLICA_ADMIN}"}
        ).json()["arms"]["default"]["regime"]["cluster_entropy_bits"] == round(
            rt.router.cluster.bits() or 0.0, 4))


def _spawn_replica() -> tuple[subprocess.Popen[bytes], str]:
    port, ev, rp = _free_port(), _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvheat.server.cli", "serve", "--port", str(port),
         "--num-blocks", "256", "--threads", "1", "--log-level", "warning",
         "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}",
         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}",
         "--kv-events-secret", EVENTS_SECRET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "replica did not start"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)


def test_a_replica_killed_mid_stream(cluster) -> None:
    """SIGKILL the replica serving a stream: the client gets an error event and [DONE]
    (no hang); the next request for that prefix fails over before any byte is sent; the
    health check then takes the replica out."""
    reps, _ = cluster
    proc, base = _spawn_replica()
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(base), ReplicaSpec(reps[1].base)],
                                   health_interval_s=5.0, read_timeout_s=10.0,
                                   events_secret=EVENTS_SECRET))
    try:
        assert wait_for(lambda: all(r.healthy and r.events is not None
                                    for r in rt.router.replicas.values()))
        prompt = SYSTEM + " a long story about caches"
        # Warm the prefix on the doomed replica directly: the index learns it from events.
        httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                   "max_tokens": 1}, timeout=30)
        assert wait_for(lambda: rt.router.index.blocks_of(base) > 0)
        body = {"model": MODEL, "prompt": prompt + " go", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        lines: list[str] = []
        t0 = time.monotonic()
        with httpx.stream("POST", rt.base + "/v1/completions", json=body, timeout=30) as r:
            assert r.headers["x-kvheat-replica"] == base
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    os.kill(proc.pid, signal.SIGKILL)
        assert time.monotonic() - t0 < 25
        data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "error" in data[-1] and data[-1]["error"]["code"] == "replica_failed"
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        # The router still believes nothing, or has marked it: either way this is served.
        r = httpx.post(rt.base + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": prompt + " again", "max_tokens": 4},
            headers={"Authorization": "Bearer sk-acme"})  # the doomed replica has no tenants
        assert r.status_code == 200 and r.headers["x-kvheat-replica"] == reps[1].base
        assert not rt.router.replicas[base].healthy
        assert rt.metric("kvheat_router_stream_errors_total") >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        stop_router(rt)


def test_no_healthy_replica_is_a_503_not_a_hang() -> None:
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(f"http://127.0.0.1:{_free_port()}")],
                                   health_interval_s=0.2, connect_timeout_s=0.5))
    try:
        r = httpx.post(rt.base + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        assert httpx.get(rt.base + "/health").status_code == 503
    finally:
        stop_router(rt)


def test_the_router_reports_the_cluster_entropy_to_replicas_that_take_it() -> None:
    # One replica with the admin API (the router holds its token) takes the whole traffic's
    # entropy for its eviction regime; one without keeps its own, and still serves.
    took = start(ServerConfig(num_blocks=256, threads=1, max_num_seqs=8, admin_token="rep"))
    kept = start(ServerConfig(num_blocks=256, threads=1, max_num_seqs=8))
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(took.base), ReplicaSpec(kept.base)],
                                   replica_admin_token="rep", health_interval_s=0.2))
    try:
        assert wait_for(lambda: all(r.healthy for r in rt.router.replicas.values()))
        c = rt.client()
        outs = {}
        for i in range(8):
            prompt = f"Document {i} of the cluster test. " + SYSTEM
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
            outs[prompt] = r.choices[0].text
        bits = rt.router.cluster.bits()
        assert bits is not None and bits > 1.0  # eight distinct depth-1 keys

        def regime(s: Served) -> dict:
            st = httpx.get(s.base + "/admin/stats", headers={"Authorization": "Bearer rep"})
            return st.json()["arms"]["default"]["regime"]

        assert wait_for(lambda: regime(took)["cluster_entropy_bits"] == round(bits, 4))
        assert regime(took)["mode"] == Regime().classify(bits)
        assert wait_for(lambda: rt.router.replicas[kept.base].report_failed)
        assert not rt.router.replicas[took.base].report_failed
        assert rt.metric("kvheat_router_cluster_entropy_bits") == pytest.approx(bits)
        # Both still in rotation, and the same greedy answers as direct calls.
        assert all(r.healthy for r in rt.router.replicas.values())
        direct = openai.OpenAI(base_url=kept.base + "/v1", api_key="x", max_retries=0)
        for prompt, text in outs.items():
            d = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                          temperature=0)
            assert d.choices[0].text == text
    finally:
        stop_router(rt)
        stop(took)
        stop(kept)
