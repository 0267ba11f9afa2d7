"""The fleet parts under a hostile probe: KV events that leak no prompt to anyone without
the events secret, a router subscription that no batch can stop, an index that keeps each
replica arm's blocks apart, replicas forgotten when they die, snapshot floods rate-limited,
and a router admin API that answers a bad replica with 400. Real ZMQ sockets, real
servers with the tiny model, real routers on uvicorn."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq
from conftest import wait_for
from test_router_e2e import EVENTS_SECRET, start_router, stop_router
from test_server import MODEL, SYSTEM, _free_port, start, stop

from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.cache.hashing import block_keys, root_key, tenant_salt
from kvheat.kvevents import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    PublisherConfig,
    attach,
    encode_batch,
    snapshot_items,
)
from kvheat.kvevents import subscriber as subscriber_module
from kvheat.kvevents.schema import END_SEQ, SNAPSHOT_SEQ
from kvheat.kvevents.secret import EventSecret
from kvheat.router.config import ReplicaSpec, RouterConfig
from kvheat.router.index import PrefixIndex
from kvheat.server.config import ArmConfig, ServerConfig, TenantConfig

ADMIN = "probe-admin"
TENANTS = [TenantConfig("acme", ["sk-acme"]), TenantConfig("bank", ["sk-bank"])]


def _collect(sock: zmq.Socket, timeout_ms: int) -> list[list[bytes]]:
    got = []
    while sock.poll(timeout_ms):
        got.append(sock.recv_multipart())
        timeout_ms = 200
    return got


def _pin_prompt(pin: int) -> str:
    return SYSTEM + f" My card's PIN is {pin:04d}. Remind me of it politely."


# ---- 1. no prompt recovery through KV events -----------------------------------------------
def test_an_attacker_without_the_secret_recovers_no_prompt_from_the_events() -> None:
    """Tenant B sends a prompt with a PIN. An attacker reaches both event sockets with a
    plain DEALER / SUB, reads /metrics, and hashes every PIN offline. With the events
    secret set: the sockets say nothing to it, /metrics names no tenant, and even the
    keys a legitimate subscriber sees match no offline guess."""
    s = start(ServerConfig(num_blocks=128, threads=1, max_num_seqs=4, tenants=TENANTS,
                           kv_events_endpoint="tcp://127.0.0.1:0",
                           kv_events_replay_endpoint="tcp://127.0.0.1:0",
                           kv_events_secret=EVENTS_SECRET))
    ctx = zmq.Context()
    try:
        info = httpx.get(s.base + "/kv_events").json()
        assert info["authenticated"] is True
        pin = 4721
        r = httpx.post(s.base + "/v1/completions", headers={"Authorization": "Bearer sk-bank"},
                       json={"model": MODEL, "prompt": _pin_prompt(pin), "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200
        # The attacker: no credentials.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{info['replay_port']}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        dealer.send_multipart((b"", SNAPSHOT_SEQ.to_bytes(8, "big")))
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{info['port']}")
        assert _collect(dealer, 1500) == [] and _collect(sub, 500) == []
        assert "bank" not in httpx.get(s.base + "/metrics").text
        # A legitimate subscriber (it holds the secret) sees the keys ...
        seen: set[bytes] = set()

        def on_batch(_: str, b: KVEventBatch) -> None:
            for e in b.events:
                if isinstance(e, BlockStored):
                    seen.update(e.block_hashes)

        legit = KVEventSubscriber("r", f"tcp://127.0.0.1:{info['port']}",
                                  f"tcp://127.0.0.1:{info['replay_port']}", on_batch,
                                  lambda _: None, secret=EventSecret(EVENTS_SECRET))
        try:
            assert wait_for(lambda: len(seen) > 0, 10)
        finally:
            legit.close()
        # ... and none of them is what hashing a guess without the secret gives.
        tok = s.server.tokenizer
        root = root_key(tenant_salt("bank", {}))
        guesses = set()
        for guess in range(10_000):
            keys, _ = block_keys(tok.encode(_pin_prompt(guess)), 16, root)
            guesses.update(keys)
        assert not seen & guesses
        # The secret's holder does find the prompt's keys (the router keys prompts so).
        ek = EventSecret(EVENTS_SECRET).event_key
        keys, _ = block_keys(tok.encode(_pin_prompt(pin)), 16, root)
        assert {ek(k) for k in keys} <= seen
    finally:
        ctx.destroy(linger=0)
        stop(s)


def test_without_a_secret_events_are_keyed_for_the_process_alone() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=8, block_size=4))
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:0"),
                           snapshot=lambda: snapshot_items(mgr))
    try:
        assert not pub.secret.configured and not pub.authenticated
        other = EventSecret.resolve(None)
        r = mgr.make_request("r", list(range(8)), tenant="t")
        mgr.allocate(r)
        k = r.keys[0]
        assert pub.secret.event_key(k) != other.event_key(k) != k
    finally:
        pub.close()


# ---- 4. one bad batch never blinds the router ------------------------------------------------
class _FakePublisher:
    """A hostile publisher: raw PUB + ROUTER sockets sending whatever the test says."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.seq = 0

    @property
    def endpoints(self) -> tuple[str, str]:
        return (self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    def answer_replays(self) -> None:
        while self.router.poll(0):
            client, _, _start = self.router.recv_multipart()
            self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    def send(self, payload: bytes) -> None:
        self.answer_replays()
        self.pub.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _stored(keys: list[bytes], rank: int = 0) -> bytes:
    return encode_batch(KVEventBatch(ts=time.time(), data_parallel_rank=rank, events=[
        BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16,
                    lora_id=None, medium="GPU", lora_name=None)]))


def _nested(depth: int) -> bytes:
    """A BlockStored whose extra_keys nest `depth` arrays deep (msgpack by hand: an
    encoder would recurse)."""
    enc = msgspec.msgpack.Encoder()
    marker = enc.encode("MARK")
    raw = enc.encode([time.time(), [{
        "type": "BlockStored", "block_hashes": [b"\x07" * 16], "parent_block_hash": None,
        "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [["MARK"]]}], 0])
    return raw.replace(marker, b"\x91" * depth + marker)


def test_a_hostile_batch_is_contained_and_the_subscription_lives_on(monkeypatch) -> None:
    fake = _FakePublisher()
    ix = PrefixIndex()
    ix.add_replica("r")
    ep, rp = fake.endpoints
    sub = KVEventSubscriber("r", ep, rp, ix.apply, ix.clear_replica, replay_timeout_s=0.5,
                            restart_backoff_s=0.05)
    try:
        fake.answer_replays()
        assert wait_for(lambda: (fake.answer_replays(), sub.wait_synced(0))[1], 10)
        time.sleep(0.3)  # the SUB joins
        k1, k2, k3 = (bytes([i]) * 16 for i in (1, 2, 3))
        fake.send(_stored([k1]))
        assert wait_for(lambda: ix.blocks_of("r") == 1)
        fake.send(_nested(1000))  # RecursionError on today's main: the thread died
        fake.send(b"\x00" * 100)  # not msgpack
        fake.send(_stored([k1], rank=1 << 40))  # the index refuses it: a handler error
        fake.send(_stored([b"short"]))  # not a kvheat key
        fake.send(_stored([k2]))
        assert wait_for(lambda: sub.stats.bad == 2 and sub.stats.handler_errors == 2)
        assert wait_for(lambda: ix.match([k2], [16], ["r"])[0].device_blocks == 1)
        # Any other failure inside the thread: counted, and subscribed again.
        calls = {"n": 0}
        real = subscriber_module.decode_batch

        def flaky(payload: bytes) -> KVEventBatch:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return real(payload)

        monkeypatch.setattr(subscriber_module, "decode_batch", flaky)
        fake.send(_stored([k3]))
        assert wait_for(lambda: sub.stats.restarts == 1)
        time.sleep(0.5)
        for _ in range(20):  # the new SUB joins; the restart reset the view
            fake.send(_stored([k3]))
            if ix.match([k3], [16], ["r"])[0].device_blocks == 1:
                break
            time.sleep(0.1)
        assert ix.match([k3], [16], ["r"])[0].device_blocks == 1
        assert sub.alive
    finally:
        sub.close()
        fake.close()


def test_snapshot_floods_are_rate_limited() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=16, block_size=4))
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:0",
                                           replay_endpoint="tcp://127.0.0.1:0"),
                           snapshot=lambda: snapshot_items(mgr))
    attach(pub, mgr)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint)
    try:
        t0 = time.monotonic()
        for _ in range(300):
            d.send_multipart((b"", SNAPSHOT_SEQ.to_bytes(8, "big")))
        assert wait_for(lambda: pub.stats.snapshot_asks == 300, 10)
        elapsed = time.monotonic() - t0
        time.sleep(0.1)
        # One at once, then at most one a second: about 718 in 4 s on today's main.
        assert 1 <= pub.stats.resyncs <= 2 + elapsed / pub.config.snapshot_min_interval_s
    finally:
        ctx.destroy(linger=0)
        pub.close()


# ---- 10. the index keeps each arm apart --------------------------------------------------
def test_one_arm_evicting_leaves_the_other_arms_copy() -> None:
    ix = PrefixIndex()
    ix.add_replica("x")
    k = b"\x05" * 16
    for rank in (0, 1):
        ix.apply("x", msgspec.msgpack.Decoder(KVEventBatch).decode(_stored([k], rank)))
    ix.apply("x", KVEventBatch(ts=0.0, data_parallel_rank=1, events=[
        BlockRemoved(block_hashes=[k], medium="GPU")]))
    assert ix.match([k], [16], ["x"], rank=0)[0].device_blocks == 1
    assert ix.match([k], [16], ["x"], rank=1)[0].device_blocks == 0
    assert ix.blocks_of("x") == 1
    # A foreign (vLLM) replica's ranks are one unit: the key stays while a rank holds it.
    ix.add_replica("v", foreign_hashes=True)
    toks = list(range(16))
    for rank in (0, 1):
        ix.apply("v", KVEventBatch(ts=0.0, data_parallel_rank=rank, events=[BlockStored(
            block_hashes=[b"h%d" % rank], parent_block_hash=None, token_ids=toks,
            block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
    ix.apply("v", KVEventBatch(ts=0.0, data_parallel_rank=1, events=[
        BlockRemoved(block_hashes=[b"h1"], medium="GPU")]))
    want, _ = block_keys(toks, 16, root_key(None))
    assert ix.match(want, [16], ["v"], rank=1)[0].device_blocks == 1


def test_a_resync_keeps_the_eviction_memory() -> None:
    ix = PrefixIndex()
    ix.add_replica("x")
    k = b"\x09" * 16
    ix.stored("x", [k])
    ix.removed("x", [k])
    assert ix.match([k], [16], ["x"])[0].recent_blocks == 1
    ix.apply("x", KVEventBatch(ts=0.0, events=[], data_parallel_rank=0))
    from kvheat.kvevents import AllBlocksCleared
    ix.apply("x", KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert ix.match([k], [16], ["x"])[0].recent_blocks == 1


# ---- the router: dead replicas, admin inputs, exact arms, prewarm ----------------------------
def test_a_replica_out_of_rotation_leaves_the_index() -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(dead)], health_interval_s=0.2,
                                   connect_timeout_s=0.5))
    try:
        r = rt.router.replicas[dead]
        r.healthy = r.state.healthy = True
        rt.router.index.stored(dead, [b"\x01" * 16, b"\x02" * 16])
        assert rt.router.index.blocks_of(dead) == 2
        assert wait_for(lambda: not r.healthy, 10)
        assert rt.router.index.blocks_of(dead) == 0
    finally:
        stop_router(rt)


@pytest.mark.parametrize("body", [{"url": 5}, {"url": None}, {"url": "http://h:1",
                                                               "block_size": 1.5},
                                  {"url": "http://h:1", "block_size": "16"},
                                  {"url": "http://h:1", "kind": ["kvheat"]},
                                  {"url": "http://h:1", "events": 7}, {"nope": 1}, [], "x"])
def test_the_router_admin_api_answers_a_bad_replica_with_400(body) -> None:
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(f"http://127.0.0.1:{_free_port()}")],
                                   admin_token=ADMIN, health_interval_s=5.0))
    try:
        r = httpx.post(rt.base + "/admin/replicas", json=body,
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400, r.text
        assert len(rt.router.replicas) == 1
    finally:
        stop_router(rt)


def _replica(arms: list[ArmConfig]) -> ServerConfig:
    return ServerConfig(num_blocks=256, threads=1, max_num_seqs=4, arms=arms,
                        kv_events_endpoint="tcp://127.0.0.1:0",
                        kv_events_replay_endpoint="tcp://127.0.0.1:0",
                        kv_events_secret=EVENTS_SECRET, admin_token=ADMIN)


def _arm_rows(base: str) -> dict[str, dict]:
    st = httpx.get(base + "/admin/arms", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return {row["arm"]: row for row in st["arms"]}


def test_the_router_finds_affinity_for_exact_arms_and_prewarms_the_users_arm() -> None:
    """Two replicas, each with a block arm and an exact arm (by user). The router keys each
    request as the user's arm does: repeated prompts of an exact-arm user go where they are
    cached (affinity), and a hot prompt of a block-arm user is prewarmed in that user's
    arm on the other replica; the replicas count exactly the requests sent."""
    arms = [ArmConfig("blk", 50, prefix_caching="block"),
            ArmConfig("ex", 50, prefix_caching="exact")]
    reps = [start(_replica(arms)) for _ in range(2)]
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(s.base) for s in reps],
                                   health_interval_s=0.2, events_secret=EVENTS_SECRET))
    try:
        assert wait_for(lambda: all(r.healthy and r.events is not None and r.arms is not None
                                    for r in rt.router.replicas.values()), 20)
        router_arms = next(iter(rt.router.replicas.values())).arms
        assert router_arms is not None
        exact_user = next(f"u{i}" for i in range(200) if router_arms.rank_for(f"u{i}") == 1)
        block_user = next(f"u{i}" for i in range(200) if router_arms.rank_for(f"u{i}") == 0)
        sent = 0
        served_by = []
        cached = []
        for _ in range(4):
            prompt = SYSTEM + " Tell me about exact caching, please, in detail."
            r = httpx.post(rt.base + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 2, "user": exact_user})
            sent += 1
            assert r.status_code == 200
            served_by.append(r.headers["x-kvheat-replica"])
            cached.append(r.json()["usage"].get("prompt_tokens_details", {})
                          .get("cached_tokens", 0))
            time.sleep(0.3)  # the events arrive
        assert len(set(served_by)) == 1 and all(c > 0 for c in cached[1:])
        assert rt.metric("kvheat_router_decisions_total", mode="affinity") >= 3
        # A hot head of a block-arm user: prewarmed on the other replica, in the blk arm.
        for i in range(6):
            r = httpx.post(rt.base + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": SYSTEM + f" question {i} about blocks",
                "max_tokens": 1, "user": block_user})
            sent += 1
            assert r.status_code == 200
            time.sleep(0.2)
        # The router prewarmed the hot head on the other replica, in the user's arm (blk),
        # never in the exact arm; the replicas count the clients' requests only.
        assert rt.metric("kvheat_router_prewarms_total") >= 1
        rows = [_arm_rows(s.base) for s in reps]
        assert sum(r["blk"]["prewarm_requests"] for r in rows) >= 1
        assert all(r["ex"]["prewarm_requests"] == 0 for r in rows)
        assert sum(r[a]["requests"] for r in rows for a in ("blk", "ex")) == sent
    finally:
        stop_router(rt)
        for s in reps:
            stop(s)


# ---- events that do not arrive are said out loud (a vLLM publisher that connects) -----------
def test_a_replica_whose_events_never_arrive_is_named(caplog) -> None:
    """A replica that answers but whose publisher never reaches the router (here: events=
    an address nobody binds, as when vLLM is given a connect address): after the grace
    time a warning names it with the bind hint, the metric and /admin/replicas say so, and
    with --require-events routing stays by load."""
    s = start(ServerConfig(num_blocks=128, threads=1, max_num_seqs=4))
    silent = f"tcp://127.0.0.1:{_free_port()}"
    rt = start_router(RouterConfig(
        replicas=[ReplicaSpec(s.base, kind="vllm", events=silent)], admin_token=ADMIN,
        health_interval_s=0.2, events_grace_s=0.5, require_events=True))
    try:
        assert wait_for(lambda: rt.router.replicas[s.base].healthy, 10)
        with caplog.at_level("WARNING", logger="kvheat.router"):
            for _ in range(2):
                r = httpx.post(rt.base + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": SYSTEM, "max_tokens": 1})
                assert r.status_code == 200
            assert wait_for(lambda: any("published no KV event batch" in m
                                        for m in caplog.messages), 10)
        msg = next(m for m in caplog.messages if "published no KV event batch" in m)
        assert s.base in msg and silent in msg and "tcp://*:PORT" in msg
        assert rt.metric("kvheat_router_replica_events_flowing", replica=s.base) == 0
        assert rt.metric("kvheat_router_blind_routes_total") == 2
        d = httpx.get(rt.base + "/admin/replicas",
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()["replicas"][0]
        assert d["events_flowing"] is False
    finally:
        stop_router(rt)
        stop(s)
