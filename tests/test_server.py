"""End-to-end tests of `kvheat serve`: a real server (uvicorn on a free loopback port, in
this process so the tests can inspect its engines) driven by the official `openai` client
and raw HTTP; the built-in tiny model runs real forward passes."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvheat.engine.loader import Tokenizer
from kvheat.server.app import KVHeatServer
from kvheat.server.cli import arms_command
from kvheat.server.config import ArmConfig, ServerConfig, TenantConfig
from kvheat.tiers import TierSpec

MODEL = "kvheat-tiny-llama"
ADMIN = "admin-secret"
# A system prompt long enough to fill several 16-token blocks.
SYSTEM = ("You are a helpful assistant. Please answer the question below in one short "
          "paragraph. The cache keeps the keys and values of every token it has seen.")

torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket already bound to a free port, for uvicorn to listen on: a port only probed
    free can be taken by another connection's ephemeral port before uvicorn binds it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


@dataclass
class Served:
    server: KVHeatServer
    base: str
    uv: uvicorn.Server
    thread: threading.Thread
    exporter: InMemorySpanExporter

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0,
                             timeout=60)

    def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        return self.server.worker.call(fn).result(timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.base + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_metric(self, name: str, at_least: float, timeout_s: float = 5.0,
                    **labels: str) -> None:
        """Wait until /metrics shows `name` (summed over `labels`) at `at_least` or more:
        the engine thread refreshes the figures between steps."""
        deadline = time.monotonic() + timeout_s
        while self.metric(name, **labels) < at_least:
            assert time.monotonic() < deadline, f"{name}{labels} stayed below {at_least}"
            time.sleep(0.1)

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.server.worker.num_active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.worker.num_active == 0


def start(cfg: ServerConfig) -> Served:
    exporter = InMemorySpanExporter()
    server = KVHeatServer(cfg, span_exporter=exporter)
    sock = bound_socket()
    port = sock.getsockname()[1]
    uv = server.uvicorn("127.0.0.1", port, "warning")  # as `kvheat serve` runs it
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert th.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return Served(server, f"http://127.0.0.1:{port}", uv, th, exporter)


def stop(s: Served) -> None:
    s.uv.should_exit = True
    s.thread.join(timeout=30)


BIAS_TOKEN = Tokenizer.tiny().encode(" Paris", add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    cfg = ServerConfig(
        num_blocks=192, threads=1, max_num_seqs=8, admin_token=ADMIN, max_tokens_limit=64,
        tenants=[TenantConfig("acme", ["sk-acme"]), TenantConfig("globex", ["sk-globex"]),
                 TenantConfig("biased", ["sk-biased"], temperature=0.0,
                              logit_bias={BIAS_TOKEN: 100.0})],
        arms=[ArmConfig("lru", 50, "lru"), ArmConfig("heat", 50, "kvheat")])
    s = start(cfg)
    yield s
    stop(s)


def _pool_balanced(s: Served) -> None:
    """No request holds blocks; every engine's accounting checks out."""
    def check() -> None:
        for eng in s.server.worker.engines.values():
            assert not eng.requests
            assert not eng.scheduler.waiting and not eng.scheduler.running
            eng.check_accounting()
            assert eng.cache.num_referenced == 0
    s.on_engine_thread(check)


# ---- the OpenAI API ---------------------------------------------------------------------
def test_models_and_completion(served: Served) -> None:
    c = served.client("sk-acme")
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(Tokenizer.tiny().encode(SYSTEM))
    # Token-id prompts are accepted too, and give the same tokens at temperature 0.
    ids = Tokenizer.tiny().encode(SYSTEM)
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens_details.cached_tokens > 0  # same tenant, same arm


def test_chat_second_turn_hits_cache(served: Served) -> None:
    c = served.client("sk-acme")
    before = served.metric("kvheat_cached_tokens_total", tenant="tenant-0")
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How many days are in a week? (turn test)"}]
    r1 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                   user="chat-user-1")
    assert r1.object == "chat.completion" and r1.choices[0].message.role == "assistant"
    first_cached = r1.usage.prompt_tokens_details.cached_tokens
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And how many in two weeks?"}]
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                   user="chat-user-1")
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # At least the blocks of the first turn's prompt come from the cache.
    assert cached >= (r1.usage.prompt_tokens // 16) * 16 > 0
    assert cached > first_cached
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    served.wait_idle()
    after = served.metric("kvheat_cached_tokens_total", tenant="tenant-0")
    assert after - before >= cached
    assert served.metric("kvheat_prefix_miss_tokens_total", tenant="tenant-0", kind="compulsory") > 0


def test_streaming_matches_non_streaming(served: Served) -> None:
    c = served.client("sk-globex")
    msgs = [{"role": "user", "content": "Summarise the following conversation. " * 3}]
    kw: dict[str, Any] = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # Completions stream too.
    parts = list(c.completions.create(model=MODEL, prompt="What is the capital of France?",
                                      max_tokens=5, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}))
    assert parts[-1].choices[0].finish_reason == "length"


def test_tenants_do_not_share_blocks(served: Served) -> None:
    prompt = "Tenant isolation test: " + SYSTEM
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                              user="same-user")  # the same user: the same arm
    a1 = served.client("sk-acme").completions.create(**kw)
    a2 = served.client("sk-acme").completions.create(**kw)
    g1 = served.client("sk-globex").completions.create(**kw)
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens >= 32
    assert g1.usage.prompt_tokens_details.cached_tokens == 0  # salted apart
    served.wait_idle()
    # Cached only for acme: the admin API says so; /metrics (no key) never does.
    st = httpx.get(served.base + "/admin/stats",
                   headers={"Authorization": f"Bearer {ADMIN}"}).json()
    arm = served.server.router.arm_for("same-user")
    assert st["arms"][arm]["misses"]["globex"]["isolation"] >= 32
    assert 'kind="isolation"' not in httpx.get(served.base + "/metrics").text


def test_tenant_sampling_defaults(served: Served) -> None:
    # The "biased" tenant's defaults: temperature 0 and +100 on one token.
    r = served.client("sk-biased").completions.create(model=MODEL, prompt="Hello there",
                                                      max_tokens=4)
    assert r.choices[0].text == " Paris" * 4


def test_missing_or_wrong_key_is_401(served: Served) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(served.base + "/v1/completions", json=body).status_code == 401
    r = httpx.post(served.base + "/v1/completions", json=body,
                   headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        served.client("sk-nope").models.list()


# ---- bad input ---------------------------------------------------------------------------
BAD_BODIES: list[tuple[str, bytes | dict, int]] = [
    ("/v1/completions", b'{"model": "kvheat-tiny-llama", "prompt": ', 400),  # malformed JSON
    ("/v1/completions", b'{"model": "kvheat-tiny-llama", "prompt": "\xff\xfe\xfd"}', 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 60}, 200),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 5000, "max_tokens": 1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 4090, "max_tokens": 10}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [999999], "max_tokens": 1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [-1], "max_tokens": 1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400),
    ("/v1/completions", {"prompt": "hi"}, 400),
    ("/v1/completions", b"[1, 2, 3]", 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot",
                                                             "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                              "content": "x" * 20000}], "max_tokens": 4}, 400),
    # A lone surrogate, escaped in otherwise valid JSON.
    ("/v1/chat/completions", b'{"model": "kvheat-tiny-llama", "max_tokens": 2, "messages": '
     b'[{"role": "user", "content": "\\ud800 lone surrogate"}]}', None),
    ("/v1/completions", b'{"model": "kvheat-tiny-llama", "max_tokens": 2, '
     b'"prompt": "\\udfff"}', None),
    ("/v1/nowhere", {"x": 1}, 404),
]


def test_bad_input_is_4xx_and_server_keeps_serving(served: Served) -> None:
    headers = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}
    with httpx.Client(base_url=served.base, headers=headers, timeout=60) as http:
        for path, body, expected in BAD_BODIES:
            r = (http.post(path, content=body) if isinstance(body, bytes)
                 else http.post(path, json=body))
            if expected is None:  # either answer is fine; never a server error
                assert r.status_code in (200, 400), (path, body, r.status_code, r.text)
            else:
                assert r.status_code == expected, (path, body, r.status_code, r.text)
            if r.status_code >= 400:
                assert "message" in r.json()["error"]
        r = http.get("/v1/completions")
        assert r.status_code == 405
    ok = served.client("sk-acme").completions.create(model=MODEL, prompt="still here?",
                                                     max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    served.wait_idle()
    _pool_balanced(served)


def test_disconnect_mid_stream_frees_blocks(served: Served) -> None:
    before = served.metric("kvheat_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": SYSTEM * 3, "max_tokens": 64, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=served.base, timeout=60,
                      headers={"Authorization": "Bearer sk-acme"}) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(2)]
        assert got[0].startswith("data: ")
    # The connection is closed here, long before 64 tokens.
    served.wait_idle()
    deadline = time.monotonic() + 10
    while served.metric("kvheat_requests_total", finish_reason="abort") <= before:
        assert time.monotonic() < deadline, "the disconnect was not turned into an abort"
        time.sleep(0.05)
    _pool_balanced(served)
    ok = served.client("sk-acme").completions.create(model=MODEL, prompt="next", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_disconnect_while_waiting_for_a_full_response(served: Served) -> None:
    before = served.metric("kvheat_requests_total", finish_reason="abort")
    body = httpx.Request("POST", served.base + "/v1/completions",
                         json={"model": MODEL, "prompt": SYSTEM * 2, "max_tokens": 64,
                               "ignore_eos": True},
                         headers={"Authorization": "Bearer sk-acme"})
    host, port = served.base.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in body.headers.items())
    # Keep the engine thread busy meanwhile, so the request cannot finish before the
    # server notices the client is gone (on a quiet machine 64 tokens take ~0.2 s).
    busy = served.server.worker.call(lambda: time.sleep(0.5))
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + body.read())
        time.sleep(0.02)  # the request is queued; now the client goes away
    busy.result(timeout=10)
    deadline = time.monotonic() + 10
    while served.metric("kvheat_requests_total", finish_reason="abort") <= before:
        assert time.monotonic() < deadline, "the dropped request was not aborted"
        time.sleep(0.05)
    served.wait_idle()
    _pool_balanced(served)


def test_stop_string_ends_the_text(served: Served) -> None:
    c = served.client("sk-biased")  # always " Paris"
    r = c.completions.create(model=MODEL, prompt="Where?", max_tokens=8, stop=["is P"])
    assert r.choices[0].text == " Par"  # " Par|is P|aris"
    r = c.completions.create(model=MODEL, prompt="Where?", max_tokens=8, stop=[" Paris P"])
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL, prompt="Where?", max_tokens=8, stop="s P")
    assert r.choices[0].text == " Pari" and r.choices[0].finish_reason == "stop"
    served.wait_idle()
    _pool_balanced(served)


# ---- arms, metrics, tracing, admin -------------------------------------------------------
def test_arms_report_and_metric_labels(served: Served) -> None:
    c = served.client("sk-acme")
    arms_seen = set()
    for i in range(8):
        user = f"user-{i}"
        arms_seen.add(served.server.router.arm_for(user))
        c.completions.create(model=MODEL, prompt=f"{SYSTEM} #{i % 2}", max_tokens=2, user=user)
    assert arms_seen == {"lru", "heat"}
    served.wait_idle()
    r = httpx.get(served.base + "/admin/arms", headers={"Authorization": f"Bearer {ADMIN}"})
    rows = {row["arm"]: row for row in r.json()["arms"]}
    assert set(rows) == {"lru", "heat"}
    for row in rows.values():
        assert row["requests"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
        assert 0 <= row["hit_rate"] <= 1
    out = CliRunner().invoke(arms_command, ["--url", served.base, "--admin-token", ADMIN])
    assert out.exit_code == 0, out.output
    assert re.search(r"^heat\s+\d+\s+\d+\s+[\d.]+%", out.output, re.M)
    assert re.search(r"^lru\s+\d+\s+\d+\s+[\d.]+%", out.output, re.M)
    text = httpx.get(served.base + "/metrics").text
    for arm in ("lru", "heat"):
        assert f'kvheat_time_to_first_token_seconds_bucket{{arm="{arm}"' in text
        assert f'kvheat_blocks{{arm="{arm}",state="free",tier="device"}}' in text or \
            f'kvheat_blocks{{arm="{arm}",tier="device",state="free"}}' in text
        assert f'kvheat_queue_length{{arm="{arm}",queue="waiting"}}' in text
    assert served.metric("kvheat_inter_token_latency_seconds_count", arm="lru") > 0


def test_request_spans(served: Served) -> None:
    served.exporter.clear()
    served.client("sk-globex").completions.create(model=MODEL, prompt=SYSTEM, max_tokens=3,
                                                  extra_body={"ignore_eos": True})
    served.wait_idle()
    deadline = time.monotonic() + 5
    while not any(s.name == "kvheat.request" for s in served.exporter.get_finished_spans()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    spans = served.exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "kvheat.request")
    children = {s.name: s for s in spans if s.parent is not None
                and s.parent.span_id == root.context.span_id}
    assert {"prefix_match", "prefill", "decode"} <= set(children)
    pre, dec = children["prefill"], children["decode"]
    assert root.start_time <= pre.start_time <= pre.end_time <= dec.start_time <= dec.end_time
    assert dec.attributes["kvheat.generated_tokens"] == 3
    assert root.attributes["kvheat.tenant"] == "globex"


def test_admin_api(served: Served) -> None:
    url = served.base + "/admin"
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(url + "/stats").status_code == 401
    assert httpx.get(url + "/stats", headers={"Authorization": "Bearer sk-acme"}).status_code \
        == 401
    st = httpx.get(url + "/stats", headers=auth).json()
    assert set(st["arms"]) == {"lru", "heat"}
    assert st["arms"]["lru"]["blocks"]["total"] == 192
    assert set(st["arms"]["lru"]["tenants"]) == {"acme", "globex", "biased"}
    # Pin a prefix for globex, flush globex: the pinned prefix survives the flush.
    pin_text = "Pinned prefix for the admin test. " + SYSTEM
    r = httpx.post(url + "/pin", headers=auth, json={"tenant": "globex", "prompt": pin_text})
    assert r.status_code == 200, r.text
    pinned = r.json()["pinned_tokens"]
    assert set(pinned) == {"lru", "heat"} and min(pinned.values()) >= 32
    r = httpx.post(url + "/tenants/globex/flush", headers=auth)
    assert r.status_code == 200 and sum(r.json()["evicted_blocks"].values()) > 0
    c = served.client("sk-globex")
    hit = c.completions.create(model=MODEL, prompt=pin_text, max_tokens=1)
    assert hit.usage.prompt_tokens_details.cached_tokens >= min(pinned.values()) - 16
    r = httpx.post(url + "/unpin", headers=auth, json={"tenant": "globex", "prompt": pin_text})
    assert r.status_code == 200 and min(r.json()["unpinned"].values()) >= 32
    # Quotas at run time.
    r = httpx.put(url + "/tenants/acme/quota", headers=auth, json={"blocks": 50})
    assert r.status_code == 200 and r.json()["quota_blocks"] == 50
    st = httpx.get(url + "/stats", headers=auth).json()
    assert st["arms"]["heat"]["tenants"]["acme"]["quota"] == 50
    r = httpx.put(url + "/tenants/acme/quota", headers=auth, json={"blocks": None})
    assert r.status_code == 200
    assert httpx.put(url + "/tenants/acme/quota", headers=auth,
                     json={"blocks": -1}).status_code == 400
    assert httpx.post(url + "/tenants/nobody/flush", headers=auth).status_code == 404
    assert httpx.post(url + "/pin", headers=auth, json={"tenant": "acme"}).status_code == 400
    # The cluster's entropy, as `kvheat route` reports it: the kvheat arm takes the regime
    # at once, the LRU arm has none; a bad body is a 400 and changes nothing.
    r = httpx.put(url + "/cluster", headers=auth, json={"entropy_bits": 9.5})
    assert r.status_code == 200 and r.json()["regime"] == {"lru": None, "heat": "high"}
    st = httpx.get(url + "/stats", headers=auth).json()
    assert st["arms"]["heat"]["regime"]["mode"] == "high"
    assert st["arms"]["heat"]["regime"]["cluster_entropy_bits"] == 9.5
    assert "regime" not in st["arms"]["lru"]
    for bad in (b'{"entropy_bits": -1.0}', b'{"entropy_bits": NaN}', b"{}",
                b'{"entropy_bits": 1e9}', b'{"entropy_bits": "9"}', b"[9.5]", b"{"):
        r = httpx.put(url + "/cluster", content=bad,
                      headers={**auth, "Content-Type": "application/json"})
        assert r.status_code == 400, (bad, r.text)
    assert httpx.put(url + "/cluster", json={"entropy_bits": 1.0}).status_code == 401
    st = httpx.get(url + "/stats", headers=auth).json()
    assert st["arms"]["heat"]["regime"]["cluster_entropy_bits"] == 9.5


def test_quota_evicts_own_blocks_not_others() -> None:
    # LRU: the control below needs the flood to reach the other tenant's prefix.
    cfg = ServerConfig(num_blocks=40, threads=1, max_num_seqs=4, policy="lru",
                       tenants=[TenantConfig("small", ["sk-small"], quota_blocks=8),
                                TenantConfig("other", ["sk-other"])])
    s = start(cfg)
    try:
        cache = s.server.worker.engines["default"].cache
        other = s.client("sk-other")
        small = s.client("sk-small")
        keep = "Keep me cached: " + SYSTEM

        def flood(tag: str) -> None:
            for i in range(10):  # ~6 cached blocks each: more than the pool holds
                small.completions.create(model=MODEL, prompt=f"{tag} {i} flood " + SYSTEM * 2,
                                         max_tokens=1)
            s.wait_idle()

        first = other.completions.create(model=MODEL, prompt=keep, max_tokens=1)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        flood("a")
        # The pool was contended and "small", at its quota, evicted only its own blocks.
        assert s.on_engine_thread(lambda: cache.stats.evicted_blocks) > 0
        assert s.on_engine_thread(lambda: cache.tenant_usage("small")) > 8
        again = other.completions.create(model=MODEL, prompt=keep, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens >= 32
        # Control: without the quota the same flood evicts the other tenant's prefix.
        r = httpx.put(s.base + "/admin/tenants/small/quota", json={"blocks": None})
        assert r.status_code == 404  # no admin token on this server: the admin API is off
        s.on_engine_thread(lambda: cache.set_tenant_quota("small", None))
        flood("b")
        gone = other.completions.create(model=MODEL, prompt=keep, max_tokens=1)
        assert gone.usage.prompt_tokens_details.cached_tokens == 0
        # A request larger than the quota could never be admitted in a full pool: 400.
        s.on_engine_thread(lambda: cache.set_tenant_quota("small", 8))
        with pytest.raises(openai.BadRequestError, match="quota is 8 blocks"):
            small.completions.create(model=MODEL, prompt=SYSTEM * 8, max_tokens=1)
        ok = small.completions.create(model=MODEL, prompt="short", max_tokens=1)
        assert ok.usage.completion_tokens == 1
        assert s.metric("kvheat_engine_failures_total") == 0
    finally:
        stop(s)


def test_host_tier_serves_evicted_prefix() -> None:
    s = start(ServerConfig(num_blocks=24, tiers=TierSpec(host_blocks=64), threads=1,
                           max_num_seqs=4))
    try:
        c = s.client()
        keep = "Demote me to host memory. " + SYSTEM
        assert c.completions.create(model=MODEL, prompt=keep, max_tokens=1) \
            .usage.prompt_tokens_details.cached_tokens == 0
        for i in range(16):  # evicts `keep` from the 24-block device pool
            c.completions.create(model=MODEL, prompt=f"{i} other {i} " + SYSTEM, max_tokens=1)
        eng = s.server.worker.engines["default"]
        assert s.on_engine_thread(lambda: eng.cache.stats.evicted_blocks) > 0
        again = c.completions.create(model=MODEL, prompt=keep, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens >= 32
        s.wait_idle()
        s.wait_metric("kvheat_tier_hit_tokens_total", 16, tier="host")
        s.wait_metric("kvheat_blocks", 1, tier="host", state="used")  # gauges: refreshed
        assert s.metric("kvheat_tier_bytes_total", tier="host", direction="write") > 0
        # Once more: now on the device. The tiers' series add up to the cached tokens.
        third = c.completions.create(model=MODEL, prompt=keep, max_tokens=1)
        assert third.usage.prompt_tokens_details.cached_tokens >= 32
        s.wait_idle()
        s.wait_metric("kvheat_tier_hit_tokens_total", 32, tier="device")
        assert s.metric("kvheat_tier_hit_tokens_total") == s.metric("kvheat_cached_tokens_total")
    finally:
        stop(s)


def test_engine_failure_is_contained() -> None:
    s = start(ServerConfig(num_blocks=64, threads=1))
    try:
        eng = s.server.worker.engines["default"]

        def boom() -> list:
            raise RuntimeError("injected step failure")

        eng.step = boom  # type: ignore[method-assign]
        r = httpx.post(s.base + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                          "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"]
        assert s.server.worker.engines["default"] is not eng  # rebuilt
        ok = s.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        assert s.metric("kvheat_engine_failures_total") == 1
        assert httpx.get(s.base + "/health").json()["status"] == "ok"
    finally:
        stop(s)


def test_engine_rebuilt_under_a_frozen_heap_is_freed(tmp_path: Any) -> None:
    """An engine rebuilt after a failure leaves the frozen start-up heap: its tiers hold
    it in reference cycles, which a frozen heap never collects, so its KV pool would
    never be freed. The loop unfreezes, and freezes again once idle."""
    import gc
    import weakref

    s = start(ServerConfig(num_blocks=64, threads=1, tiers=TierSpec(
        host_blocks=64, disk_dir=str(tmp_path / "kv"), disk_bytes=16 << 20)))
    try:
        s.server.freeze_startup_heap()
        eng = s.server.worker.engines["default"]
        pool = weakref.ref(eng.kv_pool)

        def boom() -> list:
            raise RuntimeError("injected step failure")

        eng.step = boom  # type: ignore[method-assign]
        del eng
        r = httpx.post(s.base + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                          "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        deadline = time.monotonic() + 10
        while (pool() is not None or not gc.get_freeze_count()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool() is None, "the failed engine's KV pool is still alive"
        assert gc.get_freeze_count() > 0  # frozen again
        assert s.client().completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    finally:
        gc.unfreeze()
        stop(s)


# ---- fuzzing against the server's own OpenAPI schema -------------------------------------
# Whatever schemathesis generates, no answer is a 5xx, and the server serves afterwards.
# Bounded: a couple of dozen examples per operation, max_tokens capped at 8.
EXAMPLES = int(os.environ.get("KVHEAT_FUZZ_EXAMPLES", "20"))


def test_no_server_errors_on_generated_input() -> None:
    # Open API (no tenants) so generated bodies reach the engine; the admin token rides on
    # the same Authorization header, so the admin operations are fuzzed too.
    s = start(ServerConfig(num_blocks=256, threads=1, max_num_seqs=8, admin_token="fuzz",
                           max_tokens_limit=8))
    try:
        schema = pytest.importorskip("schemathesis").openapi.from_url(s.base + "/openapi.json")
        headers = {"Authorization": "Bearer fuzz"}
        failures: list[str] = []
        statuses: dict[str, set[int]] = {}
        samples: dict[tuple[str, int], str] = {}
        ops = [result.ok() for result in schema.get_all_operations()]
        # Admin operations last: what they fuzz (pins, quotas, flushes) must not decide
        # whether the generated completions find room in the pool.
        for op in sorted(ops, key=lambda o: "/admin" in o.label):
            _fuzz_operation(op, s.base, headers, statuses, failures, samples)()
        assert not failures, "\n".join(failures[:10])
        labels = set(statuses)
        assert "POST /v1/completions" in labels and "POST /v1/chat/completions" in labels
        # The fuzzer got past validation, not only 4xx everywhere.
        assert 200 in statuses["POST /v1/completions"] | statuses["POST /v1/chat/completions"], \
            (statuses, {k: v for k, v in samples.items() if "completions" in k[0]})
        ok = httpx.post(s.base + "/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": "alive?", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        stop(s)


def _fuzz_operation(op: Any, base: str, headers: dict[str, str], statuses: dict[str, set[int]],
                    failures: list[str], samples: dict[tuple[str, int], str]) -> Callable[[], None]:
    label = op.label

    @given(case=op.as_strategy(), real_model=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: Any, real_model: bool) -> None:
        # Half the bodies name the served model, so they get past the 404.
        if real_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        r = case.call(base_url=base, headers=headers, timeout=60)
        statuses.setdefault(label, set()).add(r.status_code)
        samples.setdefault((label, r.status_code), f"{r.text[:200]} body={case.body!r:.300}")
        if r.status_code >= 500:
            failures.append(f"{label}: {r.status_code} {r.text[:300]} body={case.body!r:.500}")

    # One well-formed body per completion endpoint runs first (the explicit phase), so the
    # check that the fuzz reached the engine does not hang on what the generator draws.
    if label in VALID_BODIES:
        run = example(case=op.Case(body=dict(VALID_BODIES[label]), media_type="application/json"),
                      real_model=True)(run)
    return run


VALID_BODIES: dict[str, dict[str, Any]] = {
    "POST /v1/completions": {"model": MODEL, "prompt": "Hello there", "max_tokens": 2},
    "POST /v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2},
}


# ---- the pieces on their own ---------------------------------------------------------------
def test_config_files(tmp_path: Any) -> None:
    from kvheat.server.config import ConfigError, load_config

    toml = tmp_path / "c.toml"
    toml.write_text('admin_token = "t"\nnum_blocks = 64\n[[tenants]]\nname = "a"\n'
                    'api_keys = ["k1"]\nquota_blocks = 8\nlogit_bias = { "13" = -5.5 }\n'
                    '[[arms]]\nname = "x"\nshare = 30\npolicy = "lru"\n'
                    '[[arms]]\nname = "y"\nshare = 70\npolicy = "kvheat"\n')
    cfg = load_config(toml, num_blocks=128)  # options override the file
    assert cfg.num_blocks == 128 and cfg.admin_token == "t"
    assert cfg.tenants[0].logit_bias == {13: -5.5} and cfg.tenants[0].quota_blocks == 8
    assert [(a.name, a.share) for a in cfg.arms] == [("x", 30), ("y", 70)]
    yml = tmp_path / "c.yaml"
    yml.write_text("tenants:\n  - name: b\n    api_keys: [k2]\n    temperature: 0.3\n")
    cfg = load_config(yml)
    assert cfg.tenants[0].temperature == 0.3 and cfg.arm_list[0].name == "default"
    bad = {
        "c1.toml": 'bogus = 1\n',
        "c2.toml": '[[arms]]\nname = "x"\nshare = 40\n',
        "c3.toml": '[[tenants]]\nname = "a"\napi_keys = ["k"]\n[[tenants]]\nname = "b"\n'
                   'api_keys = ["k"]\n',
        "c4.toml": '[[tenants]]\nname = "a"\napi_keys = ["k"]\nquota_blocks = 0\n',
        "c5.toml": 'num_blocks = [\n',
        "c6.txt": 'num_blocks = 1\n',
        "c7.yaml": "- just\n- a list\n",
    }
    for name, text in bad.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(ConfigError):
            load_config(p)
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="needs the future"):
        KVHeatServer(ServerConfig(policy="belady"))


def test_tier_config_sizes_and_arm_folders(tmp_path: Any) -> None:
    from kvheat.server.config import ConfigError, load_config, parse_size

    assert [parse_size(v, "x") for v in (0, 4096, "64GiB", "500 MB", "1.5k", "7")] == \
        [0, 4096, 64 << 30, 500_000_000, 1500, 7]
    for bad in ("-1", "ten GB", "5 parsecs", True, -3):
        with pytest.raises(ConfigError):
            parse_size(bad, "x")  # type: ignore[arg-type]
    toml = tmp_path / "t.toml"
    toml.write_text(f'disk_tier_dir = "{tmp_path / "kv"}"\ndisk_tier_bytes = "16MiB"\n'
                    '[[arms]]\nname = "lru"\nshare = 50\n'
                    '[[arms]]\nname = "heat"\nshare = 50\npolicy = "kvheat"\n')
    cfg = load_config(toml)
    assert cfg.tiers.disk_bytes == 16 << 20
    server = KVHeatServer(cfg)
    try:
        disks = {arm: eng.tiers.stores[0] for arm, eng in server.worker.engines.items()}
        assert {arm: d.root for arm, d in disks.items()} == \
            {arm: tmp_path / "kv" / arm for arm in ("lru", "heat")}
        assert all(d.capacity_bytes == 16 << 20 for d in disks.values())
    finally:
        server.stop()
    for text in ('disk_tier_dir = "/tmp/x"\n', 'redis_tier_bytes = "1GiB"\n',
                 'tier_mode = "inclusive"\n', '[[arms]]\nname = "../up"\nshare = 100\n'):
        toml.write_text(text)
        with pytest.raises(ConfigError):
            load_config(toml)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot set up"):
        KVHeatServer(ServerConfig(tiers=TierSpec(disk_dir=str(blocked), disk_bytes=1 << 20)))


def test_arm_routing_is_stable_and_proportional() -> None:
    import xxhash

    from kvheat.server.arms import ArmRouter, user_bucket

    assert user_bucket("alice") == xxhash.xxh64_intdigest(b"alice") % 100
    router = ArmRouter([ArmConfig("a", 10), ArmConfig("b", 90)])
    counts = {"a": 0, "b": 0}
    for i in range(4000):
        counts[router.arm_for(f"user-{i}")] += 1
    assert 300 < counts["a"] < 500  # 10% of 4000, within sampling noise
    assert all(router.arm_for("bob") == router.arm_for("bob") for _ in range(5))


def test_text_assembler_holds_partial_characters_and_stop_strings() -> None:
    from kvheat.server.detokenizer import TextAssembler

    tok = Tokenizer.tiny()
    euro = tok.encode("€", add_special_tokens=False)
    assert len(euro) > 1  # one byte-level token per byte
    ta = TextAssembler(tok, [])
    deltas = [ta.add(t) for t in euro]
    assert deltas[:-1] == [""] * (len(euro) - 1) and deltas[-1] == "€"
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    ta = TextAssembler(tok, ["s P"])
    out = [ta.add(paris) for _ in range(3)]
    assert "".join(out) + ta.flush() == " Pari" and ta.stopped
    ta = TextAssembler(tok, ["zzz"])
    text = "".join(ta.add(paris) for _ in range(2)) + ta.flush()
    assert text == " Paris Paris" and not ta.stopped


def test_miss_classifier_kinds() -> None:
    from kvheat.cache import CacheConfig, KVCacheManager
    from kvheat.cache.misses import MissClassifier

    mgr = KVCacheManager(CacheConfig(num_blocks=8, block_size=4))
    mc = MissClassifier(4, bits=16)
    prompt = list(range(10))  # 2 full blocks + 2 tokens

    def serve(rid: str, tenant: str | None) -> dict[str, int]:
        kinds = mc.prepare(mgr, prompt, tenant)
        req = mgr.make_request(rid, prompt, tenant)
        mgr.allocate(req)
        cached = req.num_cached_tokens
        mgr.free(req)
        return mc.classify(kinds, len(prompt), cached)

    assert serve("r1", "t1") == {"compulsory": 8, "capacity": 0, "sub_block": 2, "isolation": 0}
    assert serve("r2", "t1") == {"compulsory": 0, "capacity": 0, "sub_block": 2, "isolation": 0}
    assert serve("r3", "t2") == {"compulsory": 0, "capacity": 0, "sub_block": 2, "isolation": 8}
    mgr.flush_tenant("t1")
    assert serve("r4", "t1") == {"compulsory": 0, "capacity": 8, "sub_block": 2, "isolation": 0}


def test_serve_command_starts_and_rejects_bad_config(tmp_path: Any) -> None:
    import subprocess
    import sys

    from kvheat.server.cli import serve_command

    bad = tmp_path / "bad.toml"
    bad.write_text('[[arms]]\nname = "x"\nshare = 60\n')
    out = CliRunner().invoke(serve_command, ["--config", str(bad)])
    assert out.exit_code != 0 and "add up to 60, not 100" in out.output
    out = CliRunner().invoke(serve_command, ["--policy", "nope"])
    assert out.exit_code != 0 and "unknown cache policy" in out.output
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvheat.server.cli", "serve", "--port",
                             str(port), "--num-blocks", "64", "--threads", "1",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "kvheat serve did not come up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = openai.OpenAI(base_url=base + "/v1", api_key="x").completions.create(
            model=MODEL, prompt="hello", max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode in (0, -15)


def test_startup_heap_is_frozen_before_serving() -> None:
    """`kvheat serve` freezes what start-up made (the model, the tokenizer, the imports),
    so no full collection scans it again while holding the GIL; the first one used to
    come on the first request (bench/server/cold_start.py)."""
    import gc

    server = KVHeatServer(ServerConfig(num_blocks=64, threads=1))
    model = server.worker.engines["default"].runner.model

    def tracked() -> bool:
        return any(o is model for g in range(3) for o in gc.get_objects(generation=g))

    try:
        assert tracked()
        server.freeze_startup_heap()
        assert not tracked() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        server.stop()


def test_engine_thread_runs_on_the_given_cores() -> None:
    """`engine_cores` pins the engine thread (as vLLM binds its compute threads); the
    HTTP side keeps every CPU. Bad core lists are a config error."""
    import os

    from kvheat.server.config import ConfigError, parse_cores

    assert parse_cores("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ConfigError):
        parse_cores("zero")
    with pytest.raises(ConfigError):
        ServerConfig(engine_cores="4096")
    first = min(os.sched_getaffinity(0))
    s = start(ServerConfig(num_blocks=64, threads=1, engine_cores=str(first)))
    try:
        assert s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        pinned = s.on_engine_thread(lambda: os.sched_getaffinity(0))
        assert pinned == {first}
        assert os.sched_getaffinity(0) != {first} or os.cpu_count() == 1
    finally:
        stop(s)
