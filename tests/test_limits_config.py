"""The bounds on what outside data fills (issue 51) are operator config keys: each is
type- and range-checked with a clear error, reaches the structure it bounds in the real
router and server built from a config, and `kvheat serve` / `kvheat route` refuse
requests past `max_concurrent_requests` with 503 before reading their bodies (a real
uvicorn on a loopback port, clients that send headers and hang mid-body)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from click.testing import CliRunner
from conftest import free_port, wait_for

from kvheat.kvevents.publisher import PublisherConfig
from kvheat.kvevents.subscriber import MAX_QUEUE_BYTES, MAX_QUEUE_MESSAGES
from kvheat.router.cli import route_command
from kvheat.router.config import ReplicaSpec, RouterConfig, RouterConfigError
from kvheat.router.index import MAX_BLOCKS
from kvheat.server.concurrency import InFlight
from kvheat.server.config import ConfigError, ServerConfig, load_config

REPLICA = ReplicaSpec("http://127.0.0.1:9")  # nothing listens there: never reached
ROUTER_KEYS = ("max_in_flight", "max_in_flight_bytes", "max_concurrent_requests",
               "index_max_blocks", "event_queue_messages", "event_queue_bytes")
ADMIN = "adm-token-0123"


def router_config(**kw: Any) -> RouterConfig:
    return RouterConfig(replicas=[REPLICA], net_signals=False, **kw)


# ---- the router's keys -------------------------------------------------------------------
def test_router_defaults_are_the_structures_own() -> None:
    """The keys' defaults are the bounds the structures had (nothing changes unset)."""
    cfg = router_config()
    flight = InFlight()
    assert (cfg.max_in_flight, cfg.max_in_flight_bytes) == \
        (flight.max_requests, flight.max_bytes) == (8192, 1 << 30)
    assert cfg.index_max_blocks == MAX_BLOCKS == 2_097_152
    assert (cfg.event_queue_messages, cfg.event_queue_bytes) == \
        (MAX_QUEUE_MESSAGES, MAX_QUEUE_BYTES) == (4096, 64 << 20)
    assert cfg.max_concurrent_requests == cfg.max_in_flight + 1024  # unset: derived
    assert router_config(max_in_flight=20_000).max_concurrent_requests == 21_024


@pytest.mark.parametrize("key", ROUTER_KEYS)
def test_router_keys_are_type_and_range_checked(key: str) -> None:
    router_config(**{key: 1 << 30})  # accepted (every bound may be raised)
    wrongs = [("100", "a string"), (64.5, "a decimal number"), (True, "a boolean")]
    if key != "max_concurrent_requests":  # (unset: derived from max_in_flight)
        wrongs.append((None, "null"))
    for wrong, kind in wrongs:
        with pytest.raises(RouterConfigError) as e:
            router_config(**{key: wrong})
        assert str(e.value).startswith(f"{key} must be an integer"), str(e.value)
        assert f"not {kind}" in str(e.value)
    for bad in (0, -1):
        with pytest.raises(RouterConfigError, match=f"^{key} must be at least 1"):
            router_config(**{key: bad})


def test_router_bounds_that_contradict_each_other_are_refused() -> None:
    with pytest.raises(RouterConfigError, match="max_in_flight_bytes .* at least "
                                                "max_body_bytes"):
        router_config(max_in_flight_bytes=1 << 20, max_body_bytes=8 << 20)
    with pytest.raises(RouterConfigError, match="max_concurrent_requests .* at least "
                                                "max_in_flight"):
        router_config(max_in_flight=100, max_concurrent_requests=99)


def test_route_cli_refuses_a_bad_bound_in_one_line() -> None:
    r = CliRunner().invoke(route_command, ["--replica", REPLICA.url, "--no-net-signals",
                                           "--index-max-blocks", "0"])
    assert r.exit_code == 1
    assert "index_max_blocks must be at least 1" in r.output
    assert "Traceback" not in r.output
    # Both options reach the config (its cross-check names the values given).
    r = CliRunner().invoke(route_command, ["--replica", REPLICA.url, "--max-in-flight", "100",
                                           "--max-concurrent-requests", "50"])
    assert r.exit_code == 1
    assert "max_concurrent_requests (50) must be at least max_in_flight (100)" in r.output
    r = CliRunner().invoke(route_command, ["--replica", REPLICA.url, "--event-queue-bytes",
                                           "lots"])
    assert r.exit_code == 2 and "lots" in r.output  # click's own type check


def test_router_bounds_reach_their_structures() -> None:
    """The real router built from a config: each bound is the one its structure enforces
    (the in-flight gate, the open-request gate, the index, a vLLM replica's event inbox)."""
    from kvheat.router.app import KVHeatRouter

    vllm = ReplicaSpec("http://127.0.0.1:10", kind="vllm",
                       events=f"tcp://127.0.0.1:{free_port()}")
    cfg = RouterConfig(replicas=[REPLICA, vllm], net_signals=False, max_in_flight=7,
                       max_in_flight_bytes=9 << 20, max_concurrent_requests=11,
                       index_max_blocks=1234, event_queue_messages=5,
                       event_queue_bytes=3 << 20)
    router = KVHeatRouter(cfg)
    try:
        assert (router.in_flight.max_requests, router.in_flight.max_bytes) == (7, 9 << 20)
        assert router.concurrency.limit == 11
        assert router.index.max_blocks == 1234
        sub = router.replicas[vllm.url].events
        assert sub is not None
        assert (sub.inbox.max_messages, sub.inbox.max_bytes) == (5, 3 << 20)
    finally:
        router.registry.close()
        router.metrics.close()


# ---- the server's keys -------------------------------------------------------------------
def test_server_keys_are_type_and_range_checked(tmp_path: Path) -> None:
    default = {f.name: f.default for f in fields(PublisherConfig)}["buffer_bytes"]
    cfg = ServerConfig()
    assert cfg.kv_events_buffer_bytes == default == 256 << 20  # the publisher's own
    assert cfg.max_concurrent_requests == cfg.max_queued_requests + 1024  # unset: derived
    assert ServerConfig(max_queued_requests=4096).max_concurrent_requests == 5120
    assert ServerConfig(kv_events_buffer_bytes="1MiB").kv_events_buffer_bytes == 1 << 20
    wrong_values: list[tuple[str, Any]] = [
        ("max_concurrent_requests", "64"), ("max_concurrent_requests", 1.5),
        ("max_concurrent_requests", True), ("kv_events_buffer_bytes", 1.5),
        ("kv_events_buffer_bytes", None), ("kv_events_buffer_bytes", False)]
    for key, wrong in wrong_values:
        with pytest.raises(ConfigError, match=f"^{key} must be "):
            ServerConfig(**{key: wrong})
    with pytest.raises(ConfigError, match="kv_events_buffer_bytes"):
        ServerConfig(kv_events_buffer_bytes=-1)
    with pytest.raises(ConfigError, match="kv_events_buffer_bytes"):
        ServerConfig(kv_events_buffer_bytes="lots")
    with pytest.raises(ConfigError, match="max_concurrent_requests .* at least "
                                          "max_queued_requests"):
        ServerConfig(max_concurrent_requests=0)
    with pytest.raises(ConfigError, match="max_concurrent_requests .* at least "
                                          "max_queued_requests"):
        ServerConfig(max_queued_requests=300, max_concurrent_requests=200)
    p = tmp_path / "server.toml"
    p.write_text('max_concurrent_requests = 300\nmax_queued_requests = 200\n'
                 'kv_events_buffer_bytes = "32MiB"\n')
    cfg = load_config(p)
    assert (cfg.max_concurrent_requests, cfg.kv_events_buffer_bytes) == (300, 32 << 20)
    p.write_text('max_concurrent_requests = "300"\n')
    with pytest.raises(ConfigError, match=r"max_concurrent_requests must be an integer "
                                          r"\(or unset\), not a string"):
        load_config(p)


def _server(**kw: Any) -> Any:
    import torch

    from kvheat.server.app import KVHeatServer

    torch.set_num_threads(1)
    return KVHeatServer(ServerConfig(num_blocks=32, threads=1, admin_token=ADMIN,
                                     max_tokens_limit=4, **kw))


def test_server_bounds_reach_their_structures() -> None:
    server = _server(max_queued_requests=3, max_concurrent_requests=5,
                     kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                     kv_events_buffer_bytes="3MiB")
    try:
        assert server.concurrency.limit == 5
        assert server.events is not None
        assert server.events.publisher.config.buffer_bytes == 3 << 20
    finally:
        if server.events is not None:
            server.events.close()


# ---- 503 past the bound, against a real uvicorn ------------------------------------------
@contextmanager
def serving(app: Any, factory: Any = None) -> Iterator[int]:
    """`app` on a real uvicorn on a free loopback port (the server's own uvicorn.Server
    through `factory(host, port)` where it has one, as `kvheat serve` runs it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = factory("127.0.0.1", port) if factory is not None else uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                       access_log=False))
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        assert wait_for(lambda: uv.started or not th.is_alive(), 30) and uv.started
        yield port
    finally:
        uv.should_exit = True
        th.join(30)


@contextmanager
def uploads_hanging_mid_body(port: int, path: str, n: int = 2) -> Iterator[None]:
    """`n` admin clients that send a POST's headers and the first byte of a 4 KB body,
    then hang until the block ends."""
    held = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            held.append(s)
            s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                       f"\r\nAuthorization: Bearer {ADMIN}\r\nContent-Length: 4096\r\n\r\n{{"
                       ).encode())
        yield
    finally:
        for s in held:
            s.close()


def assert_refused(r: httpx.Response, t0: float) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "overloaded"
    assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    assert time.monotonic() - t0 < 5  # answered at once, not after a body or a timeout


def metric(port: int, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_serve_answers_503_past_max_concurrent_requests() -> None:
    """Before: no bound, every upload was read (and held) whatever the count."""
    server = _server(max_queued_requests=2, max_concurrent_requests=2)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with serving(None, lambda h, p: server.uvicorn(h, p, "warning")) as port:
        base = f"http://127.0.0.1:{port}"
        with uploads_hanging_mid_body(port, "/admin/pin"):
            assert wait_for(lambda: server.concurrency.active == 2, 10)
            t0 = time.monotonic()
            assert_refused(httpx.post(base + "/v1/completions", json={
                "model": "kvheat-tiny-llama", "prompt": "hi", "max_tokens": 1}), t0)
            assert_refused(httpx.get(base + "/v1/models"), time.monotonic())
            # Probes and scrapes still answer: they read no body.
            assert httpx.get(base + "/health").status_code == 200
            assert metric(port, "kvheat_concurrency_refused_total") == 2
            assert metric(port, 'kvheat_rejected_requests_total{status="503"}') == 2
        assert wait_for(lambda: server.concurrency.active == 0, 10)
        assert httpx.get(base + "/v1/models", headers=auth).status_code == 200


def test_route_answers_503_past_max_concurrent_requests() -> None:
    from kvheat.router.app import KVHeatRouter

    router = KVHeatRouter(router_config(max_in_flight=2, max_concurrent_requests=2,
                                        max_in_flight_bytes=8 << 20, admin_token=ADMIN))
    with serving(router.app) as port:
        base = f"http://127.0.0.1:{port}"
        # Two admin uploads hang mid-body: they hold no in-flight slot, only open requests.
        with uploads_hanging_mid_body(port, "/admin/replicas"):
            assert wait_for(lambda: router.concurrency.active == 2, 10)
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/completions", content=json.dumps(
                {"model": "m", "prompt": "hi"}), headers={"content-type": "application/json"})
            assert_refused(r, t0)
            assert router.in_flight.requests == 0  # refused before the in-flight gate
            assert httpx.get(base + "/health").status_code in (200, 503)  # not gated
            assert metric(port, "kvheat_router_concurrency_refused_total") == 1
            assert metric(port, "kvheat_router_refused_total") == 0
        assert wait_for(lambda: router.concurrency.active == 0, 10)
        r = httpx.get(base + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200


def test_serve_answers_503_past_max_in_flight_bytes() -> None:
    """The open requests' bodies are bounded in bytes too: two uploads that declare 4 KB
    each fill an 8 KiB budget (well under the count bound), the next request with a body
    gets 503 unread; a request without a body still passes."""
    server = _server(max_queued_requests=8, max_concurrent_requests=8, max_body_bytes="4KiB",
                     max_in_flight_bytes="8KiB")
    assert server.concurrency.max_bytes == 8192
    with serving(None, lambda h, p: server.uvicorn(h, p, "warning")) as port:
        base = f"http://127.0.0.1:{port}"
        with uploads_hanging_mid_body(port, "/admin/pin"):
            assert wait_for(lambda: server.concurrency.bytes == 8192, 10)
            assert server.concurrency.active == 2
            t0 = time.monotonic()
            assert_refused(httpx.post(base + "/v1/completions", json={
                "model": "kvheat-tiny-llama", "prompt": "hi", "max_tokens": 1}), t0)
            assert httpx.get(base + "/v1/models").status_code == 200  # no body: 0 bytes
            assert metric(port, "kvheat_concurrency_refused_total") == 1
        assert wait_for(lambda: server.concurrency.bytes == 0, 10)
        r = httpx.post(base + "/v1/completions", json={
            "model": "kvheat-tiny-llama", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_server_byte_budget_is_checked() -> None:
    assert ServerConfig().max_in_flight_bytes == 1 << 30
    for wrong in (1.5, None, True):
        with pytest.raises(ConfigError, match="^max_in_flight_bytes must be "):
            ServerConfig(max_in_flight_bytes=wrong)
    with pytest.raises(ConfigError, match=r"max_in_flight_bytes \(1024\) must be at least "
                                          r"max_body_bytes"):
        ServerConfig(max_in_flight_bytes=1024)
