"""KV events (kvheat.kvevents) over real ZMQ sockets: vLLM 0.32's wire schema both ways,
a subscriber's view equal to the cache's after stores, evictions, flushes, rollbacks and
tier moves, a full queue that drops and counts without blocking and then resyncs, late
subscribers caught up by replay or snapshot, token ids only in operator mode, and
`kvheat serve` publishing the very keys the router computes from a prompt."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq
from conftest import vllm_events_index, wait_for
from test_tiers_hierarchy import build, make_pool, prompts

from kvheat.cache import CacheConfig, KVCacheManager, OutOfBlocks
from kvheat.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    PublisherConfig,
    attach,
    decode_batch,
    encode_batch,
    snapshot_items,
)
from kvheat.kvevents.schema import SNAPSHOT_SEQ
from kvheat.tiers import HostStore

torch.set_num_threads(1)


class View:
    """What a subscriber believes each place holds, from the events alone."""

    def __init__(self) -> None:
        self.places: dict[tuple[str | None, str | None], set] = {}
        self.batches: list[KVEventBatch] = []
        self.resets = 0

    def on_batch(self, name: str, b: KVEventBatch) -> None:
        self.batches.append(b)
        for e in b.events:
            if isinstance(e, BlockStored):
                self.places.setdefault((e.medium, e.ownership), set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.places.setdefault((e.medium, e.ownership), set()).difference_update(
                    e.block_hashes)
            else:
                self.places.clear()

    def on_reset(self, name: str) -> None:
        self.resets += 1
        self.places.clear()

    def device(self) -> set:
        return self.places.get(("GPU", None), set())


def publisher(mgr: KVCacheManager, tiers=None, **kw) -> KVEventPublisher:
    cfg = PublisherConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", **kw)
    pub = KVEventPublisher(cfg, snapshot=lambda: snapshot_items(mgr, tiers, 0, cfg.token_ids))
    attach(pub, mgr, tiers)
    return pub


def published(pub: KVEventPublisher, keys) -> set[bytes]:
    """The cache's keys as its events carry them (keyed by the events secret)."""
    return {pub.secret.event_key(k) for k in keys}


def subscribe(pub: KVEventPublisher, view: View) -> KVEventSubscriber:
    sub = KVEventSubscriber("r", pub.endpoint, pub.replay_endpoint, view.on_batch, view.on_reset)
    assert sub.wait_synced(10)
    return sub


def churn(mgr: KVCacheManager, n: int = 40, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)
    for i in range(n):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        r = mgr.make_request(f"c{seed}-{i}", toks, tenant=rng.choice(["a", "b"]))
        mgr.allocate(r)
        if rng.random() < 0.3:
            mgr.append_tokens(r, [1, 2, 3, 4, 5])
        mgr.free(r)
    mgr.flush_tenant("a")


def test_schema_is_vllms_layout() -> None:
    b = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[b"\x01" * 16], parent_block_hash=None, token_ids=[],
                    block_size=16, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[b"\x01" * 16], medium="CPU", ownership="host"),
        AllBlocksCleared()], data_parallel_rank=0)
    raw = msgspec.msgpack.decode(encode_batch(b))
    assert raw[0] == 1.5 and raw[2] == 0  # an array: [ts, events, data_parallel_rank]
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [b"\x01" * 16],
                         "parent_block_hash": None, "token_ids": [], "block_size": 16,
                         "lora_id": None, "medium": "GPU", "lora_name": None}
    assert raw[1][1]["type"] == "BlockRemoved" and raw[1][2] == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(b)) == b
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
    # A newer vLLM's extra fields are ignored, not an error.
    future = msgspec.msgpack.encode([2.0, [{"type": "AllBlocksCleared", "new_field": 3}]])
    assert isinstance(decode_batch(future).events[0], AllBlocksCleared)


@pytest.mark.vllm
def test_vllm_decodes_ours_and_we_decode_vllms() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    ours = KVEventBatch(ts=3.0, events=[
        BlockStored(block_hashes=[b"\x02" * 16, b"\x03" * 16], parent_block_hash=b"\x01" * 16,
                    token_ids=[5] * 32, block_size=16, lora_id=None, medium="CPU",
                    lora_name=None, locality="LOCAL", ownership="host"),
        BlockRemoved(block_hashes=[b"\x02" * 16], medium="STORAGE", locality="REMOTE"),
        AllBlocksCleared()], data_parallel_rank=1)
    theirs = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(encode_batch(ours))
    assert isinstance(theirs.events[0], kv.BlockStored)
    assert theirs.events[0].block_hashes == [b"\x02" * 16, b"\x03" * 16]
    assert theirs.events[0].ownership == "host" and theirs.events[1].locality == "REMOTE"
    assert theirs.data_parallel_rank == 1
    vb = kv.KVEventBatch(ts=4.0, events=[
        kv.BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(32)),
                       block_size=16, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[("tenant:acme",), None]),
        kv.BlockRemoved(block_hashes=[8], medium="GPU"), kv.AllBlocksCleared()])
    back = decode_batch(msgspec.msgpack.Encoder().encode(vb))
    assert back.events[0].block_hashes == [7, 8] and back.events[0].token_ids == list(range(32))
    assert back.events[0].extra_keys == [("tenant:acme",), None]
    assert isinstance(back.events[1], BlockRemoved) and isinstance(back.events[2], AllBlocksCleared)


def test_subscriber_view_follows_the_cache() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=24, block_size=4))
    pub = publisher(mgr)
    view = View()
    sub = subscribe(pub, view)
    try:
        churn(mgr)
        # A rolled-back allocate (a tenant at its quota) and a discard take keys back too.
        hold = mgr.make_request("hold", list(range(100, 180)), tenant="h")  # 20 of 24 blocks
        mgr.allocate(hold)
        mgr.evict(100)
        o = mgr.make_request("o", list(range(200, 208)), tenant="o")  # 2 cached, 2 free
        mgr.allocate(o)
        mgr.free(o)
        mgr.set_tenant_quota("q", 2)
        r = mgr.make_request("q", list(range(300, 316)), tenant="q")
        stored_before = len(mgr.cached)
        with pytest.raises(OutOfBlocks):  # takes the 2 free blocks, then may evict none
            mgr.allocate(r)
        assert len(mgr.cached) == stored_before
        mgr.free(hold)
        r = mgr.make_request("d", [9] * 12, tenant="d")
        mgr.allocate(r)
        mgr.discard(r, 1)
        mgr.free(r)
        assert wait_for(lambda: view.device() == published(pub, mgr.cached))
        stored = [e for b in view.batches for e in b.events if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) > len(stored)  # chains coalesced
        assert all(e.token_ids == [] for e in stored)  # keys only by default
        assert pub.stats.dropped == 0 and sub.stats.gaps == 0
    finally:
        sub.close()
        pub.close()


def test_operator_mode_carries_the_blocks_tokens() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=8, block_size=4))
    pub = publisher(mgr, token_ids=True)
    view = View()
    sub = subscribe(pub, view)
    try:
        r = mgr.make_request("r", [10, 11, 12, 13, 14, 15, 16, 17, 18], tenant="t")
        mgr.allocate(r)
        assert wait_for(lambda: view.device() == published(pub, mgr.cached))
        st = [e for b in view.batches for e in b.events if isinstance(e, BlockStored)]
        assert st[-1].block_hashes == [pub.secret.event_key(k) for k in r.keys] and st[-1].token_ids == list(range(10, 18))
        assert st[-1].block_size == 4 and st[-1].parent_block_hash is None
    finally:
        sub.close()
        pub.close()


def test_a_full_queue_drops_counts_and_resyncs() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=64, block_size=4))
    pub = publisher(mgr, max_queue_size=5, interval_s=0.5)
    view = View()
    sub = subscribe(pub, view)
    try:
        for i in range(30):  # far more events than the queue holds, between two drains
            r = mgr.make_request(f"r{i}", [i] * 8)
            mgr.allocate(r)
            mgr.free(r)
        assert pub.stats.dropped > 0
        # The next drain sends AllBlocksCleared and a snapshot: the view is whole again.
        # (a generous bound: two publisher intervals and a snapshot, on a loaded machine)
        assert wait_for(lambda: pub.stats.resyncs >= 2 and view.device() == published(pub, mgr.cached),
                        timeout_s=30.0)
    finally:
        sub.close()
        pub.close()


def test_late_subscribers_catch_up_by_replay_or_snapshot() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=32, block_size=4))
    pub = publisher(mgr, buffer_steps=100_000)
    try:
        churn(mgr, 20, seed=1)
        assert wait_for(lambda: pub.queued == 0 and pub.stats.batches > 0)
        time.sleep(0.05)
        view = View()
        sub = subscribe(pub, view)  # everything is still in the replay buffer
        assert wait_for(lambda: view.device() == published(pub, mgr.cached))
        assert sub.stats.replayed > 0
        sub.close()
    finally:
        pub.close()
    mgr2 = KVCacheManager(CacheConfig(num_blocks=32, block_size=4))
    pub2 = publisher(mgr2, buffer_steps=1)  # the buffer forgot: a snapshot is asked for
    try:
        churn(mgr2, 20, seed=2)
        time.sleep(0.1)
        view = View()
        sub = subscribe(pub2, view)
        assert wait_for(lambda: view.device() == published(pub2, mgr2.cached) and len(view.device()) > 0)
        assert pub2.stats.replays >= 2  # the replay from 0 and the snapshot request
        sub.close()
    finally:
        pub2.close()


def test_a_replay_request_for_the_snapshot_sequence_is_answered_like_vllm() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=8, block_size=4))
    pub = publisher(mgr)
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint)
    try:
        d.send_multipart((b"", SNAPSHOT_SEQ.to_bytes(8, "big")))
        assert d.poll(5000)
        frames = d.recv_multipart()
        assert frames[2] == (-1).to_bytes(8, "big", signed=True)  # END_SEQ, as vLLM's
        d.send_multipart((b"", b"junk"))  # malformed: ignored, the publisher carries on
        assert wait_for(lambda: pub.stats.resyncs == 1 and pub.stats.replays == 1)
        assert pub.stats.errors == 0
    finally:
        d.close(linger=0)
        pub.close()


def test_tier_moves_are_published_with_their_place(tmp_path) -> None:
    per = make_pool("gqa", 1).bytes_per_block
    host = HostStore(6 * per, per)
    tc, pool = build("gqa", [host], tmp_path, device_blocks=4, async_io=False)
    pub = publisher(tc.mgr, tc.tiers)
    view = View()
    sub = subscribe(pub, view)
    try:
        for p in prompts(3, 2, seed=4):  # 6 blocks over a 4-block device: 2+ go to host
            r = tc.mgr.make_request(f"p{len(view.batches)}-{p[0]}", p)
            tc.allocate(r)
            tc.mgr.free(r)
        first = tc.mgr.make_request("again", prompts(3, 2, seed=4)[0])
        tc.allocate(first)  # promoted back from host (exclusive: it leaves the host)
        tc.mgr.free(first)

        def same() -> bool:
            return view.device() == published(pub, tc.mgr.cached) and \
                view.places.get(("CPU", "host"), set()) == published(pub, tc.tiers.lower.indexes[0].entries)
        assert wait_for(same)
        assert tc.tiers.lower.hit_blocks[0] > 0 and tc.tiers.counters.demotions > 0
    finally:
        sub.close()
        pub.close()
        tc.close()


def test_the_engine_thread_never_waits_on_the_socket() -> None:
    """A publisher whose thread is stuck (no drain for a long time) costs the recording
    thread an append: nothing blocks, everything past the bound is counted."""
    mgr = KVCacheManager(CacheConfig(num_blocks=64, block_size=4))
    pub = publisher(mgr, max_queue_size=100, interval_s=1.0)
    try:
        for i in range(500):
            r = mgr.make_request(f"r{i}", list(range(12 * i, 12 * i + 12)))
            mgr.allocate(r)
            mgr.free(r)
        assert pub.queued <= 100 and pub.stats.dropped > 0
    finally:
        pub.close()


@pytest.mark.vllm
def test_vllms_own_publisher_feeds_the_router_index() -> None:
    """vLLM's ZmqEventPublisher (PUB + replay) publishing what its block pool would for a
    salted request: our subscriber takes it, and the index places it under the keys
    kvheat computes for that tenant's tokens (vLLM's hashes are its own)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    from kvheat.cache.hashing import block_keys, root_key

    with vllm_events_index(kv) as (pub, ix):
        toks = list(range(100, 164))
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None,
                           token_ids=toks[:32], block_size=16, lora_id=None, medium="GPU",
                           lora_name=None, extra_keys=[("tenant:acme",), None]),
            kv.BlockStored(block_hashes=[b"h3", b"h4"], parent_block_hash=b"h2",
                           token_ids=toks[32:], block_size=16, lora_id=None, medium="GPU",
                           lora_name=None)]))
        want, _ = block_keys(toks, 16, root_key("tenant:acme"))
        assert wait_for(lambda: ix.match(want, [16] * 4, ["v"])[0].device_blocks == 4)
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockRemoved(block_hashes=[b"h3"], medium="GPU")]))
        assert wait_for(lambda: ix.match(want, [16] * 4, ["v"])[0].device_blocks == 2)
