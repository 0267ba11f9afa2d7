"""Bounded memory under any input (issue 51): every map and queue filled from outside data
stays at its bound when driven far past it, counts the overflow, and the process's RSS
stays flat. Real parts: the router's PrefixIndex fed real vLLM-shaped KVEventBatch
objects, a real ZMQ PUB socket in another process publishing real msgpack batches to a
real KVEventSubscriber, the shared tier's feed over a real redis-server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest
from conftest import free_port, wait_for

from kvheat.cache.hashing import block_keys, root_key
from kvheat.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
)
from kvheat.kvevents.subscriber import ResyncNeeded
from kvheat.router.index import MAX_SETS, PrefixIndex

MIB = 1 << 20
BS = 16
SALT = "tenant:acme"


def rss() -> int:
    """This process's resident set, in bytes (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def chain(first_hash: int, n: int, seed: int) -> tuple[BlockStored, list[int]]:
    """A vLLM store of `n` new blocks (a request's prompt): its own int hashes, token
    ids, the cache salt in the first block's extra keys, as vLLM sends them."""
    hashes = list(range(first_hash, first_hash + n))
    toks = [(seed * 7919 + i) % 32000 for i in range(n * BS)]
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[(SALT,)] + [None] * (n - 1)), toks


# ---- the router's vLLM alias map ---------------------------------------------------------
def test_the_vllm_alias_map_stays_flat_while_stores_and_removes_balance() -> None:
    """+141 MiB per 500k blocks while the index held none, before: removed blocks' aliases
    were never dropped."""
    ix = PrefixIndex()
    ix.add_replica("v", foreign_hashes=True)
    n, per = 500_000, 100
    ev, _ = chain(0, per, 0)
    ix.apply("v", KVEventBatch(ts=0, events=[ev, BlockRemoved(ev.block_hashes, "GPU")]))
    before = rss()
    for i in range(1, n // per):
        ev, _ = chain(i * per, per, i)
        ix.apply("v", KVEventBatch(ts=0, events=[ev]))
        ix.apply("v", KVEventBatch(ts=0, events=[BlockRemoved(ev.block_hashes, "GPU")]))
    grown = rss() - before
    assert len(ix) == 0
    assert grown < 20 * MIB, f"RSS grew {grown / MIB:.0f} MiB over {n} stored and removed blocks"
    assert ix.aliases_of("v") == 0


def test_an_alias_stays_while_another_tier_holds_its_block_and_goes_with_the_last() -> None:
    ix = PrefixIndex()
    ix.add_replica("v", foreign_hashes=True)
    ev, toks = chain(1, 4, 1)
    host = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks[:2 * BS],
                       block_size=BS, lora_id=None, medium="CPU", lora_name=None,
                       extra_keys=[(SALT,), None], locality="LOCAL", ownership="host")
    ix.apply("v", KVEventBatch(ts=0, events=[ev, host]))
    assert ix.aliases_of("v") == 4
    ix.apply("v", KVEventBatch(ts=0, events=[BlockRemoved([1, 2, 3, 4], "GPU")]))
    assert ix.aliases_of("v") == 2  # blocks 1 and 2 are still on the host tier
    keys = block_keys(toks, BS, root_key(SALT))[0]
    m = ix.match(keys, [BS] * 4, ["v"])[0]
    assert (m.device_blocks, m.local_blocks) == (0, 2)
    # A child stored again on the device still resolves its parent through the host copy.
    child = BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=toks[2 * BS:3 * BS],
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None)
    ix.apply("v", KVEventBatch(ts=0, events=[child]))
    assert ix.unresolved == 0 and ix.aliases_of("v") == 3
    ix.apply("v", KVEventBatch(ts=0, events=[
        BlockRemoved([1, 2], "CPU", locality="LOCAL", ownership="host")]))
    assert ix.aliases_of("v") == 1
    ix.apply("v", KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    assert ix.aliases_of("v") == 0
    ix.apply("v", KVEventBatch(ts=0, events=[ev]))
    ix.remove_replica("v")
    assert ix.aliases_of("v") == 0 and len(ix) == 0


def test_a_vllm_replica_past_the_bound_forgets_its_oldest_blocks() -> None:
    """Stores that are never removed (lost removals, a replica larger than the bound):
    the index keeps its newest `max_blocks` blocks, counts and logs the rest."""
    cap = 20_000
    ix = PrefixIndex(max_blocks=cap)
    ix.add_replica("v", foreign_hashes=True)
    per = 100
    for i in range(cap // per):  # up to the bound: nothing forgotten
        ix.apply("v", KVEventBatch(ts=0, events=[chain(i * per, per, i)[0]]))
    assert ix.aliases_of("v") == cap and ix.overflow.count == 0
    before = rss()
    total = 10 * cap
    for i in range(cap // per, total // per):
        ev, toks = chain(i * per, per, i)
        ix.apply("v", KVEventBatch(ts=0, events=[ev]))
        assert ix.aliases_of("v") == cap and len(ix) <= cap
    grown = rss() - before
    assert ix.overflow.count == total - cap
    assert grown < 20 * MIB, f"RSS grew {grown / MIB:.0f} MiB at the bound"
    # The newest prompt is still indexed whole; the oldest is gone.
    keys = block_keys(toks, BS, root_key(SALT))[0]
    assert ix.match(keys, [BS] * per, ["v"])[0].device_blocks == per
    old = block_keys(chain(0, per, 0)[1], BS, root_key(SALT))[0]
    assert ix.match(old, [BS] * per, ["v"])[0].device_blocks == 0


def test_a_kvheat_replica_past_the_bound_is_cleared_and_resynced() -> None:
    ix = PrefixIndex(max_blocks=1000)
    ix.add_replica("k")
    keys = [i.to_bytes(16, "big") for i in range(1001)]
    store = BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[],
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None)
    with pytest.raises(ResyncNeeded):
        ix.apply("k", KVEventBatch(ts=0, events=[store]))
    assert len(ix) == 0 and ix.blocks_of("k") == 0 and ix.overflow.count == 1


def test_tier_names_sets_and_ranks_from_events_are_bounded() -> None:
    ix = PrefixIndex()
    ix.add_replica("v", foreign_hashes=True)
    ix.add_replica("k")
    ev, toks = chain(1, 1, 1)
    # Every store under a tier name of its own: a set each, up to MAX_SETS.
    for i in range(2 * MAX_SETS):
        ix.apply("v", KVEventBatch(ts=0, events=[BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=toks, block_size=BS,
            lora_id=None, medium="STORAGE", lora_name=None, extra_keys=[(SALT,)],
            ownership=f"tier{i}")]))
    assert len(ix._held[ix.bit_of("v")]) == MAX_SETS
    assert ix.overflow.count == MAX_SETS
    # A tier name of megabytes is refused, not kept as a key.
    ix.apply("v", KVEventBatch(ts=0, events=[BlockStored(
        block_hashes=[2], parent_block_hash=None, token_ids=toks, block_size=BS,
        lora_id=None, medium="STORAGE", lora_name=None, extra_keys=[(SALT,)],
        ownership="x" * MIB)]))
    assert ix.overflow.count == MAX_SETS + 1
    # A kvheat replica's ranks (its arms) are units of their own: a few, never 65536.
    key = (1).to_bytes(16, "big")
    for rank in range(200):
        ix.apply("k", KVEventBatch(ts=0, events=[BlockStored(
            block_hashes=[key], parent_block_hash=None, token_ids=[], block_size=BS,
            lora_id=None, medium="GPU", lora_name=None)], data_parallel_rank=rank))
    assert len(ix._units["k"]) == 64
    assert ix.overflow.count == MAX_SETS + 1 + 136


# ---- the router's event receive queue ----------------------------------------------------
_PUBLISHER = textwrap.dedent("""
    import sys, time, zmq
    from kvheat.kvevents import BlockRemoved, KVEventBatch, encode_batch
    port, n, size = (int(a) for a in sys.argv[1:4])
    # A valid batch of about `size` bytes: one vLLM eviction of 32-byte block hashes.
    hashes = [i.to_bytes(32, "big") for i in range(max(1, size // 34))]
    payload = encode_batch(KVEventBatch(ts=time.time(), events=[
        BlockRemoved(block_hashes=hashes, medium="GPU")]))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # the publisher drops nothing: all of it reaches the router
    pub.bind(f"tcp://127.0.0.1:{port}")
    seq = 0
    for line in sys.stdin:  # "K": publish K batches, then say so
        for _ in range(int(line)):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload), copy=False)
            seq += 1
        print(len(payload), flush=True)
    pub.close(linger=1000)
""")


class Flood:
    """A publisher in its own process (its memory is not ours) and a subscriber here
    whose handler takes `handle_s` a batch."""

    def __init__(self, size: int, handle_s: float, **queue: int) -> None:
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(port), "0",
                                      str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        self.applied = 0
        self.handle_s = handle_s
        self.raise_resync = False
        self.sub = KVEventSubscriber("flood", f"tcp://127.0.0.1:{port}", None, self.on_batch,
                                     lambda name: None, **queue)

    def on_batch(self, name: str, batch: KVEventBatch) -> None:
        self.applied += 1
        time.sleep(self.handle_s)
        if self.raise_resync:
            raise ResyncNeeded("a bound of the handler's view")

    def publish(self, k: int) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{k}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.sub.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


def warm_up(fl: Flood) -> None:
    """Until the subscription carries batches (a SUB joins late) and one was applied."""
    deadline = time.monotonic() + 10
    while fl.applied == 0 and time.monotonic() < deadline:
        fl.publish(1)
        time.sleep(0.1)
    assert fl.applied, "no batch reached the subscriber"


def flood_and_drain(fl: Flood, n: int, watch: Callable[[], None], every_s: float) -> int:
    """Publish `n` batches from a thread, calling `watch` every `every_s` until each was
    applied or dropped and the inbox is empty (15 s at most); what `publish` returned."""
    done = threading.Event()
    got: list[int] = []

    def flood() -> None:
        got.append(fl.publish(n))
        done.set()

    st = fl.sub.stats
    sent = st.batches + n
    threading.Thread(target=flood, daemon=True).start()
    deadline = time.monotonic() + 15
    while (not done.is_set() or len(fl.sub.inbox) or st.batches + st.overflows < sent) \
            and time.monotonic() < deadline:
        watch()
        time.sleep(every_s)
    return got[0] if got else 0


def test_the_event_queue_is_bounded_in_bytes_and_resyncs_after_an_overflow() -> None:
    """1.3 GiB of valid 4 MiB batches took the router from 326 to 1,515 MiB before
    (RCVHWM 0): now the inbox holds at most its bytes, the rest is dropped, counted and
    followed by a resync."""
    cap = 16 * MIB
    fl = Flood(4 * MIB, 0.02, max_queue_bytes=cap)
    try:
        warm_up(fl)
        wait_for(lambda: len(fl.sub.inbox) == 0, 10)
        before = rss()
        peak_rss = peak_bytes = 0

        def watch() -> None:
            nonlocal peak_rss, peak_bytes
            peak_rss = max(peak_rss, rss())
            peak_bytes = max(peak_bytes, fl.sub.inbox.bytes)

        st = fl.sub.stats
        sent = st.batches + 150
        size = flood_and_drain(fl, 150, watch, 0.005)  # 600 MiB
        assert size > 4 * MIB - 1024
        grown = peak_rss - before
        assert grown < 50 * MIB, f"RSS grew {grown / MIB:.0f} MiB over 600 MiB of batches"
        assert peak_bytes <= cap
        assert st.overflows > 0 and st.batches + st.overflows >= sent
        # The dropped batches are a gap: no replay socket here, so a reset (the resync).
        assert wait_for(lambda: fl.sub.stats.resets >= 1, 5)
        assert fl.sub.alive
    finally:
        fl.close()


def test_the_event_queue_is_bounded_in_messages() -> None:
    fl = Flood(200, 0.001, max_queue_messages=50)
    try:
        warm_up(fl)
        peak = 0

        def watch() -> None:
            nonlocal peak
            peak = max(peak, len(fl.sub.inbox))

        st = fl.sub.stats
        sent = st.batches + 20_000
        flood_and_drain(fl, 20_000, watch, 0.001)
        assert peak <= 50
        assert st.overflows > 0 and st.batches + st.overflows >= sent
        assert wait_for(lambda: fl.sub.stats.resets >= 1, 5)
    finally:
        fl.close()


def test_a_handler_past_its_bound_asks_for_a_resync_not_an_error() -> None:
    fl = Flood(100, 0.0)
    try:
        warm_up(fl)
        fl.raise_resync = True
        n = fl.applied
        fl.publish(1)
        assert wait_for(lambda: fl.applied > n and fl.sub.stats.resets >= 1, 5)
        assert fl.sub.stats.handler_errors == 0 and fl.sub.alive
    finally:
        fl.close()


def test_the_routers_metrics_count_the_index_overflows() -> None:
    from kvheat.router.app import KVHeatRouter
    from kvheat.router.config import ReplicaSpec, RouterConfig

    router = KVHeatRouter(RouterConfig(replicas=[ReplicaSpec("http://127.0.0.1:9", "vllm")],
                                       net_signals=False))
    try:
        router.index.apply("http://127.0.0.1:9", KVEventBatch(ts=0, events=[BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[0] * BS, block_size=BS,
            lora_id=None, medium="STORAGE", lora_name=None, ownership="x" * 65)]))
        got = router.metrics.registry.get_sample_value("kvheat_router_index_overflows_total")
        assert got == 1.0
    finally:
        router.metrics.close()


# ---- the shared tier's peer keys (Redis pub/sub announcements) ----------------------------
def test_the_shared_tiers_peer_keys_stay_at_their_bound(redis_server, tmp_path) -> None:
    from test_tiers_hierarchy import build, make_pool

    from kvheat.tiers.redis_store import RedisStore, connect
    from kvheat.tiers.shared import MAX_KEY_BYTES, SharedTierFeed, encode_announcements

    per = make_pool("gqa", 1).bytes_per_block + 400
    red = RedisStore(connect(redis_server.url, timeout_s=0.5), 100 * per, model="tiny",
                     layout="gqa")
    tc, _pool = build("gqa", [red], tmp_path, device_blocks=8, async_io=False)
    cap = 5000
    feed = SharedTierFeed(tc.tiers, max_peer_keys=cap)
    client = connect(redis_server.url, timeout_s=2.0)
    try:
        time.sleep(0.3)  # subscribed

        def announce(first: int, n: int, klen: int = MAX_KEY_BYTES) -> None:
            client.publish(feed.channel, encode_announcements(b"o" * 8, [
                (1, i.to_bytes(klen, "big"), 16) for i in range(first, first + n)]))

        announce(0, cap)
        assert wait_for(lambda: len(feed) == cap)
        before = rss()
        n = 0
        for m in range(100):  # 100x the bound, 4096 keys a message
            announce(cap + n, 4096)
            n += 4096
            if m % 10 == 9:
                assert wait_for(lambda want=cap + n: feed.received >= want, 10)
                assert len(feed) == cap
        assert feed.peer_overflow.count == n
        grown = rss() - before
        assert grown < 20 * MIB, f"RSS grew {grown / MIB:.0f} MiB at the bound"
        # A key longer than any kvheat key is bad, not a peer entry of 255 bytes.
        bad = feed.bad
        announce(10**9, 10, klen=255)
        assert wait_for(lambda: feed.bad == bad + 10)
        assert not any(len(k) > MAX_KEY_BYTES for k in feed.peers)
    finally:
        feed.close()
        tc.close()


# ---- the router's requests in flight -----------------------------------------------------
def test_the_routers_requests_in_flight_are_bounded_in_bytes() -> None:
    """Clients that send most of a large body and then hang: before, every one was read
    and held (no bound on requests in flight); now past the byte budget they get 503."""
    import asyncio

    from kvheat.router.app import KVHeatRouter
    from kvheat.router.config import ReplicaSpec, RouterConfig
    from kvheat.server.concurrency import InFlight

    router = KVHeatRouter(RouterConfig(replicas=[ReplicaSpec("http://127.0.0.1:9")],
                                       net_signals=False))
    budget, body, clients = 64 * MIB, 4 * MIB, 160  # 640 MiB sent, at most 64 held
    router.in_flight = InFlight(max_bytes=budget, on_count=router.metrics.refused.inc)

    async def run() -> tuple[list[int], int, int]:
        hold = asyncio.Event()
        statuses: list[int] = []

        async def client() -> None:
            left = body // MIB - 1  # all but the last chunk

            async def receive() -> dict:
                nonlocal left
                if left:
                    left -= 1
                    return {"type": "http.request", "body": os.urandom(MIB), "more_body": True}
                await hold.wait()  # the client hangs, then leaves
                return {"type": "http.disconnect"}

            async def send(msg: dict) -> None:
                if msg["type"] == "http.response.start":
                    statuses.append(msg["status"])

            scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                     "headers": [(b"content-length", str(body).encode())]}
            await router.app(scope, receive, send)

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(0.5)
        held, peak = router.in_flight.requests, rss()
        hold.set()
        await asyncio.gather(*tasks)
        return statuses, held, peak

    before = rss()
    try:
        statuses, held, peak = asyncio.run(run())
    finally:
        router.metrics.close()
    assert held == budget // body
    assert statuses == [503] * (clients - held)
    assert router.metrics.registry.get_sample_value("kvheat_router_refused_total") == \
        clients - held
    assert router.in_flight.requests == 0 and router.in_flight.bytes == 0
    grown = peak - before
    assert grown < budget + 50 * MIB, f"RSS grew {grown / MIB:.0f} MiB"


def test_a_replay_with_a_hole_is_a_reset_not_a_view_with_a_hole() -> None:
    """A small receive queue means a long replay can lose batches at the publisher's
    ROUTER (it drops past its high-water mark): the subscriber sees the hole and resets,
    where before it applied what came and kept a view with blocks missing."""
    import zmq

    from kvheat.kvevents import encode_batch
    from kvheat.kvevents.schema import END_SEQ, SNAPSHOT_SEQ

    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, rport = free_port(), free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    router.bind(f"tcp://127.0.0.1:{rport}")
    payload = encode_batch(KVEventBatch(ts=0, events=[]))
    applied: list[int] = []
    asked: list[int] = []
    stop = threading.Event()

    def serve() -> None:  # the publisher's replay socket, with batch 2 lost on the way
        while not stop.is_set():
            if not router.poll(50):
                continue
            client, _, start_b = router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            asked.append(start)
            if start not in (0, SNAPSHOT_SEQ):
                for seq in (start, start + 2):
                    router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", b"", END_SEQ, b""))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    sub = KVEventSubscriber("hole", f"tcp://127.0.0.1:{port}",
                            f"tcp://127.0.0.1:{rport}",
                            lambda name, b: applied.append(sub.stats.last_seq),
                            lambda name: None)
    try:
        assert sub.wait_synced(5)
        resets = sub.stats.resets
        deadline = time.monotonic() + 5
        while not applied and time.monotonic() < deadline:  # until the SUB has joined
            pub.send_multipart((b"", (0).to_bytes(8, "big"), payload))
            time.sleep(0.05)
        assert applied == [0]
        pub.send_multipart((b"", (5).to_bytes(8, "big"), payload))  # 1 to 4 missed
        assert wait_for(lambda: 5 in applied)
        assert 1 in asked
        assert sub.stats.resets == resets + 1, "the replay's hole was not noticed"
        assert SNAPSHOT_SEQ in asked[asked.index(1):]  # then a snapshot was asked for
    finally:
        sub.close()
        stop.set()
        server.join(2)
        pub.close(0)
        router.close(0)
        ctx.term()


# ---- a kvheat replica's replay buffer ----------------------------------------------------
def test_the_publishers_replay_buffer_is_bounded_in_bytes() -> None:
    """10,000 batches were kept whatever their size (a resync of a large cache in
    operator mode is megabytes): now also at most `buffer_bytes`, the oldest let go."""
    from kvheat.kvevents import KVEventPublisher, PublisherConfig

    n_blocks = 20_000
    tokens = bytes(range(64))  # 16 token ids of 4 bytes
    keys = [i.to_bytes(16, "big") for i in range(n_blocks)]
    items = [(0, True, "device", k, keys[i - 1] if i else None, 16, tokens)
             for i, k in enumerate(keys)]
    cap = 8 * MIB
    pub = KVEventPublisher(PublisherConfig(endpoint="tcp://127.0.0.1:0", token_ids=True,
                                           buffer_bytes=cap), snapshot=lambda: items)
    try:
        def resyncs(n: int) -> None:
            for _ in range(n):
                done = pub.stats.resyncs
                pub.request_resync()
                assert wait_for(lambda d=done: pub.stats.resyncs > d, 10)

        resyncs(8)  # past the bound: a batch is about 1.4 MB
        before = rss()
        resyncs(60)  # 85 MB more through the buffer
        grown = rss() - before
        assert pub.buffer_bytes <= cap and pub.stats.trimmed > 50
        assert grown < 20 * MIB, f"RSS grew {grown / MIB:.0f} MiB"
    finally:
        pub.close()
