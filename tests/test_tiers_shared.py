"""One Redis tier shared by two replicas (kvheat.tiers.shared) against a real redis-server
and a real 3-node Redis Cluster: a block one replica demoted is loaded by the other, with
its bytes checked; the writer's eviction withdraws it; tenants stay apart; a stale peer
entry is a counted miss, never wrong KV; bad announcements are ignored."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import wait_for
from test_tiers_hierarchy import BS, Engine, build, make_pool, prompts

from kvheat.tiers.redis_store import RedisStore, connect
from kvheat.tiers.shared import SharedTierFeed, decode_announcements, encode_announcements

torch.set_num_threads(1)


def replica(url: str, tmp_path: Path, cluster: bool = False, redis_blocks: int = 1000,
            device_blocks: int = 8) -> tuple:
    per = make_pool("gqa", 1).bytes_per_block + 400
    red = RedisStore(connect(url, cluster=cluster, timeout_s=0.5), redis_blocks * per,
                     model="tiny", layout="gqa")
    tc, pool = build("gqa", [red], tmp_path, device_blocks=device_blocks, async_io=False)
    feed = SharedTierFeed(tc.tiers)
    return tc, pool, feed


def _check_sharing(url: str, tmp_path: Path, cluster: bool) -> None:
    a_tc, a_pool, a_feed = replica(url, tmp_path / "a", cluster)
    b_tc, b_pool, b_feed = replica(url, tmp_path / "b", cluster)
    try:
        time.sleep(0.3)  # both subscribed
        a, b = Engine(a_tc, a_pool), Engine(b_tc, b_pool)
        ps = prompts(4, 4, seed=1)  # 16 blocks through an 8-block device: A demotes
        for p in ps:
            assert a.run(p, tenant="t1") == 0
        demoted = set(a_tc.tiers.lower.indexes[0].entries)
        assert demoted
        assert wait_for(lambda: demoted <= set(b_feed.peers))
        # B has never seen these prompts: what A put in Redis is loaded, bytes checked.
        got = b.run(ps[0], tenant="t1")
        assert got == 4 * BS
        assert b_tc.tiers.lower.hit_blocks[0] == 4 and b_tc.tiers.counters.load_failed == 0
        # Shared: B's load does not take A's entry away from A (or from Redis).
        assert demoted <= set(a_tc.tiers.lower.indexes[0].entries)
        # Another tenant's request never matches those keys.
        assert b.run(ps[1], tenant="t2") == 0
    finally:
        for f in (a_feed, b_feed):
            f.close()
        a_tc.close()
        b_tc.close()


def test_a_block_demoted_by_one_replica_is_loaded_by_another(redis_server, tmp_path) -> None:
    _check_sharing(redis_server.url, tmp_path, cluster=False)


def test_sharing_over_a_redis_cluster(redis_cluster, tmp_path) -> None:
    _check_sharing(f"redis://127.0.0.1:{redis_cluster[0].port}/0", tmp_path, cluster=True)


def test_writer_eviction_withdraws_and_stale_entries_are_counted_misses(redis_server,
                                                                        tmp_path) -> None:
    a_tc, a_pool, a_feed = replica(redis_server.url, tmp_path / "a", redis_blocks=8)
    b_tc, b_pool, b_feed = replica(redis_server.url, tmp_path / "b")
    try:
        time.sleep(0.3)
        a = Engine(a_tc, a_pool)
        first = prompts(3, 4, seed=2)
        for p in first:
            a.run(p)
        assert wait_for(lambda: len(b_feed) > 0)
        before = set(b_feed.peers)
        for p in prompts(6, 4, seed=3):  # A's 8-block Redis budget evicts the first ones
            a.run(p)
        gone = before - set(a_tc.tiers.lower.indexes[0].entries)
        assert gone
        assert wait_for(lambda: not (gone & set(b_feed.peers)))
        # A stale peer entry (deleted from Redis behind the announcements' back): a
        # counted miss, recomputed.
        key = next(iter(b_feed.peers))
        a_tc.tiers.stores[0].client.delete(*a_tc.tiers.stores[0].client.keys(a_tc.tiers.stores[0].prefix + "*"))
        b_feed.peers.clear()
        b_feed.peers[key] = BS
        fails = b_tc.tiers.counters.load_failed
        req = b_tc.mgr.make_request("x", [0] * (4 * BS))
        req.keys[0] = key  # a request whose first block is that stale key
        b_tc.allocate(req)
        assert req.num_cached_tokens == 0 and b_tc.tiers.counters.load_failed == fails + 1
        assert key not in b_feed.peers
        b_tc.mgr.free(req)
    finally:
        for f in (a_feed, b_feed):
            f.close()
        a_tc.close()
        b_tc.close()


def test_announcements_round_trip_and_garbage_is_ignored(redis_server, tmp_path) -> None:
    items = [(1, b"k" * 16, 16), (2, b"\x00" * 16, 0), (1, b"x", 7)]
    w, back = decode_announcements(encode_announcements(b"w" * 8, items))
    assert w == b"w" * 8 and back == items
    for bad in (b"", b"short", b"w" * 8 + b"\x01\x00", b"w" * 8 + b"\x09\x00\x00\x00\x10\x01k"):
        with pytest.raises(ValueError):
            decode_announcements(bad)
    tc, pool, feed = replica(redis_server.url, tmp_path)
    try:
        time.sleep(0.3)
        tc.tiers.stores[0].client.publish(feed.channel, b"not an announcement")
        tc.tiers.stores[0].client.publish(feed.channel, encode_announcements(b"o" * 8, [(1, b"q" * 16, 16)]))
        assert wait_for(lambda: b"q" * 16 in feed.peers)
        assert feed.bad == 1
    finally:
        feed.close()
        tc.close()
