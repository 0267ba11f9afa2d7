"""The Redis tier against a real redis-server (the `redis_server` fixture): round trips,
namespaces, poisoned and corrupted values, and the server dying and coming back."""

from __future__ import annotations

import pytest
import torch
from test_tiers import key, random_pool, same_bytes

from kvheat.tiers.redis_store import RedisStore, connect

torch.set_num_threads(1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_store(server, model: str = "tiny", layout: str = "gqa", clock=None) -> RedisStore:
    kw = {"clock": clock} if clock is not None else {}
    return RedisStore(connect(server.url, timeout_s=0.2), 1 << 24, model=model, layout=layout,
                      **kw)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_redis_round_trip_pipelined(redis_server, layout: str) -> None:
    pool = random_pool(layout, 6)
    st = make_store(redis_server, layout=layout)
    blocks = [pool.read_block(b) for b in range(6)]
    assert st.put_many([key(b) for b in range(6)], blocks, salt="tenant:a") == 6
    got = st.get_many([key(b) for b in range(6)] + [key(77)], salt="tenant:a")
    assert all(same_bytes(g, blk) for g, blk in zip(got[:6], blocks, strict=True))
    assert got[6] is None
    assert st.contains(key(2), salt="tenant:a") and st.delete(key(2), salt="tenant:a")
    assert st.get(key(2), salt="tenant:a") is None
    assert st.used_bytes() == sum(st.entry_bytes(b, key(0)) for b in blocks[:5])
    # A new process sees what is in Redis (SCAN + header check), not only its own puts.
    fresh = make_store(redis_server, layout=layout)
    assert sorted(k for k, _ in fresh.stored()) == sorted(key(b) for b in range(6) if b != 2)
    assert same_bytes(fresh.get(key(4), salt="tenant:a"), blocks[4])


def test_redis_namespaces_isolate_tenants_and_models(redis_server) -> None:
    pool = random_pool("gqa", 2)
    a = make_store(redis_server, model="m1")
    a.put(key(1), pool.read_block(0), salt="tenant:a")
    assert a.get(key(1), salt="tenant:b") is None  # other tenant: other Redis key
    b = make_store(redis_server, model="m2")
    assert b.get(key(1), salt="tenant:a") is None  # other model: other Redis key
    # Poisoning: tenant b's bytes copied under tenant a's Redis key are refused.
    a.put(key(2), pool.read_block(1), salt="tenant:b")
    raw_b = a.client.get(a.rkey(key(2), "tenant:b"))
    a.client.set(a.rkey(key(2), "tenant:a"), raw_b)
    assert a.get(key(2), salt="tenant:a") is None
    assert a.stats.corrupt_key == 1
    # A value for another block key under this key's name: refused too.
    a.client.set(a.rkey(key(3), "tenant:a"), a.client.get(a.rkey(key(1), "tenant:a")))
    assert a.get(key(3), salt="tenant:a") is None and a.stats.corrupt_key == 2
    assert same_bytes(a.get(key(1), salt="tenant:a"), pool.read_block(0))


def test_redis_corrupted_value_is_a_counted_miss(redis_server) -> None:
    pool = random_pool("mla", 2)
    st = make_store(redis_server, layout="mla")
    st.put(key(5), pool.read_block(1))
    rk = st.rkey(key(5), None)
    size = st.client.strlen(rk)
    st.client.setrange(rk, size - 7, b"\x00\x11\x22")
    assert st.get(key(5)) is None and st.stats.corrupt_checksum == 1
    st.client.set(rk, b"garbage")
    assert st.get(key(5)) is None and st.stats.corrupt_torn + st.stats.corrupt_format == 1


def test_redis_down_then_back_with_backoff(redis_server) -> None:
    clock = Clock()
    pool = random_pool("gqa", 3)
    st = make_store(redis_server, clock=clock)
    assert st.put(key(0), pool.read_block(0))
    redis_server.stop()  # the server dies
    assert st.get(key(0)) is None  # a miss, not an exception
    assert st.down and st.stats.went_down == 1 and st.stats.io_errors == 1
    assert not st.available()
    assert not st.put(key(1), pool.read_block(1))  # skipped while backing off
    assert st.get_many([key(0), key(1)]) == [None, None]
    assert st.stats.skipped_down == 2 and st.stats.io_errors == 1
    clock.t += st.backoff_initial_s + 0.01
    assert st.get(key(0)) is None  # retried, still down: backoff doubles
    assert st.stats.io_errors == 2 and st._backoff == 2 * st.backoff_initial_s
    redis_server.start()  # back, empty (no persistence)
    clock.t += 10
    assert st.available()
    assert st.get(key(0)) is None  # answered: a plain miss now
    assert not st.down and st.stats.came_back == 1
    assert st.put(key(1), pool.read_block(1))
    assert same_bytes(st.get(key(1)), pool.read_block(1))


def test_redis_cluster_round_trip_and_node_loss(redis_cluster) -> None:
    """The same store over a 3-node Redis Cluster: keys spread over the nodes, bytes come
    back identical, and a dead node is a counted miss, not an exception."""
    pool = random_pool("gqa", 8)
    url = f"redis://127.0.0.1:{redis_cluster[0].port}/0"
    st = RedisStore(connect(url, cluster=True, timeout_s=0.5), 1 << 24, model="tiny")
    keys = [key(b) for b in range(8)]
    blocks = [pool.read_block(b) for b in range(8)]
    assert st.put_many(keys, blocks, salt="tenant:a") == 8
    nodes_used = {st.client.get_node_from_key(st.rkey(k, "tenant:a")).port for k in keys}
    assert len(nodes_used) >= 2
    got = st.get_many(keys, salt="tenant:a")
    assert all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    assert st.get(key(3), salt="tenant:b") is None
    victim = next(n for n in redis_cluster if n.port in nodes_used)
    victim.stop()
    after = st.get_many(keys, salt="tenant:a")  # no exception
    served = [g for g in after if g is not None]
    assert all(any(same_bytes(g, b) for b in blocks) for g in served)
    assert st.stats.io_errors >= 1 and st.stats.misses >= len(keys) - len(served)
