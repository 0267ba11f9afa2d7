"""The Redis tier against a real redis-server (the `redis_server` fixture): round trips,
namespaces, poisoned and corrupted values, and the server dying and coming back."""

from __future__ import annotations

import pytest
import torch
from test_tiers import MACS, key, planted_values, random_pool, same_bytes

from kvheat.cache.hashing import NO_TENANT, Namespace
from kvheat.tiers.codec import BLAKE2B_VERSION, encode
from kvheat.tiers.redis_store import DIRECT_MIN_BYTES, RedisStore, connect

NS_A = Namespace.of("tenant:a")
NS_B = Namespace.of("tenant:b")
NS_T = Namespace.of("t")
NS_V = Namespace.of("tenant:v")

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
    items = [(key(b), blk) for b, blk in enumerate(blocks)]
    assert st.put_many(items, ns=NS_A) == [True] * 6
    got = st.get_many([key(b) for b in range(6)] + [key(77)], ns=NS_A)
    assert all(same_bytes(g, blk) for g, blk in zip(got[:6], blocks, strict=True))
    assert got[6] is None
    # Straight into output buffers (device blocks), and read-only views for copying from.
    outs = [torch.empty_like(blk) for blk in blocks] + [torch.empty_like(blocks[0])]
    got = st.get_many([key(b) for b in range(6)] + [key(77)], ns=NS_A, outs=outs)
    assert all(g is o and same_bytes(o, blk) for g, o, blk in zip(got, outs, blocks[:6]))
    assert got[6] is None
    views = st.get_many([key(b) for b in range(6)], ns=NS_A, readonly_ok=True)
    assert all(same_bytes(v, blk) for v, blk in zip(views, blocks, strict=True))
    owned = st.get(key(1), ns=NS_A)
    owned.view(torch.uint8).view(-1)[0] ^= 1  # a plain get returns a private, writable copy
    assert same_bytes(st.get(key(1), ns=NS_A), blocks[1])
    assert st.contains(key(2), ns=NS_A) and st.delete(key(2), ns=NS_A)
    assert st.get(key(2), ns=NS_A) is None
    assert st.used_bytes() == sum(st.entry_bytes(b, key(0)) for b in blocks[:5])
    # A new process sees what is in Redis (SCAN + header check), not only its own puts.
    fresh = make_store(redis_server, layout=layout)
    assert sorted(k for k, _ in fresh.stored()) == sorted(key(b) for b in range(6) if b != 2)
    assert same_bytes(fresh.get(key(4), ns=NS_A), blocks[4])


def test_redis_namespaces_isolate_tenants_and_models(redis_server) -> None:
    pool = random_pool("gqa", 2)
    a = make_store(redis_server, model="m1")
    a.put(key(1), pool.read_block(0), ns=NS_A)
    assert a.get(key(1), ns=NS_B) is None  # other tenant: other Redis key
    b = make_store(redis_server, model="m2")
    assert b.get(key(1), ns=NS_A) is None  # other model: other Redis key
    # Poisoning: tenant b's bytes copied under tenant a's Redis key are refused.
    a.put(key(2), pool.read_block(1), ns=NS_B)
    raw_b = a.client.get(a.rkey(key(2), NS_B))
    a.client.set(a.rkey(key(2), NS_A), raw_b)
    assert a.get(key(2), ns=NS_A) is None
    assert a.stats.corrupt_key == 1
    # A value for another block key under this key's name: refused too.
    a.client.set(a.rkey(key(3), NS_A), a.client.get(a.rkey(key(1), NS_A)))
    assert a.get(key(3), ns=NS_A) is None and a.stats.corrupt_key == 2
    assert same_bytes(a.get(key(1), ns=NS_A), pool.read_block(0))



@pytest.mark.parametrize("mac", MACS)
@pytest.mark.parametrize("big", [False, True], ids=["hiredis", "direct"])
def test_redis_never_serves_planted_values_and_reads_the_old_format(redis_server, mac: str,
                                                                    big: bool) -> None:
    """KV planted under the store's own names (the worst case: a leaked name scheme) with
    another tier key, a flipped byte, a changed version byte, the retired format: all
    misses, on the redis-py path and on direct reads into output tensors alike. A value
    this deployment wrote before BLAKE3 (format 2) is still served."""
    def store() -> RedisStore:
        st = RedisStore(connect(redis_server.url, timeout_s=0.2), 1 << 26, model="tiny",
                        secret="the deployment's own secret")
        st.mac = mac
        return st

    st = store()
    blk = big_chunks(1, seed=4)[0] if big else random_pool("gqa", 1).read_block(0)
    ns = st.ns(NS_V)
    planted = list(planted_values(blk, key(0), ns, st.mac_key))
    keys = [key(10 + i) for i in range(len(planted))]
    for what, k in zip(planted, keys, strict=True):
        st.client.set(st.rkey(k, NS_V), planted_values(blk, k, ns, st.mac_key)[what])
    st.client.set(st.rkey(key(1), NS_V),
                  encode(blk, key(1), ns, st.mac_key, BLAKE2B_VERSION))
    assert st.put(key(2), blk, ns=NS_V)
    fresh = store()  # a restart indexes what Redis holds, then reads it
    assert sorted(k for k, _ in fresh.stored()) == sorted([key(1), key(2), *keys[:-1]])
    outs = [torch.empty_like(blk) for _ in range(len(keys) + 2)]
    got = fresh.get_many([*keys, key(1), key(2)], ns=NS_V, outs=outs)
    assert [g is None for g in got] == [True] * len(keys) + [False, False]
    assert same_bytes(outs[-2], blk) and same_bytes(outs[-1], blk)
    s = fresh.stats
    assert (s.corrupt_checksum, s.corrupt_format, s.hits) == (4, 1, 2)


def test_redis_corrupted_value_is_a_counted_miss(redis_server) -> None:
    pool = random_pool("mla", 2)
    st = make_store(redis_server, layout="mla")
    st.put(key(5), pool.read_block(1))
    rk = st.rkey(key(5), NO_TENANT)
    size = st.client.strlen(rk)
    st.client.setrange(rk, size - 7, b"\x00\x11\x22")
    assert st.get(key(5)) is None and st.stats.corrupt_checksum == 1
    st.client.set(rk, b"garbage")
    assert st.get(key(5)) is None and st.stats.corrupt_torn + st.stats.corrupt_format == 1


def big_chunks(n: int, seed: int = 0) -> list[torch.Tensor]:
    """256-token GQA chunks of 512 KiB: above DIRECT_MIN_BYTES, so reads are direct."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, 2, 256, 2, 128), generator=g).half() for _ in range(n)]


@pytest.mark.parametrize("direct", [True, False])
def test_redis_large_chunks_direct_and_through_redis_py(redis_server, direct: bool) -> None:
    st = make_store(redis_server)
    st.direct_io = direct
    chunks = big_chunks(4)
    assert chunks[0].nbytes >= DIRECT_MIN_BYTES
    keys = [key(b) for b in range(4)]
    assert st.put_many(list(zip(keys, chunks, strict=True)), ns=NS_T) == [True] * 4
    # What one path wrote, the other reads (the same bytes on the wire).
    other = make_store(redis_server)
    other.direct_io = not direct
    outs = [torch.empty_like(c) for c in chunks] + [torch.empty_like(chunks[0])]
    for reader in (st, other):
        got = reader.get_many([*keys, key(99)], ns=NS_T, outs=outs)
        assert all(g is o and same_bytes(o, c) for g, o, c in zip(got, outs, chunks))
        assert got[4] is None
        fresh = reader.get_many(keys, ns=NS_T)
        assert all(same_bytes(g, c) for g, c in zip(fresh, chunks, strict=True))
        assert same_bytes(reader.get(key(2), ns=NS_T), chunks[2])
    # An output buffer of another shape is the caller's mistake: a clear error.
    with pytest.raises(ValueError, match="out has"):
        st.get_many(keys[:1], ns=NS_T, outs=[torch.empty(3, dtype=torch.float16)])
    assert same_bytes(st.get(key(1), ns=NS_T), chunks[1])  # the connection still works


def test_redis_direct_reads_reject_corrupt_and_foreign_values_and_stay_in_step(redis_server) -> None:
    st = make_store(redis_server)
    chunks = big_chunks(4, seed=1)
    keys = [key(b) for b in range(4)]
    assert all(st.put_many(list(zip(keys, chunks, strict=True))))
    rk = [st.rkey(k, NO_TENANT) for k in keys]
    size = st.client.strlen(rk[0])
    st.client.setrange(rk[0], size - 100, b"\xff\xfe")  # payload bit rot
    st.client.set(rk[1], b"x" * size)  # someone else's value under our key
    st.client.set(rk[2], st.client.get(rk[3]))  # another key's value: poisoning
    outs = [torch.empty_like(c) for c in chunks]
    got = st.get_many(keys, outs=outs)
    assert [g is None for g in got] == [True, True, True, False]
    assert same_bytes(outs[3], chunks[3])
    s = st.stats
    assert (s.corrupt_checksum, s.corrupt_format + s.corrupt_torn, s.corrupt_key) == (1, 1, 1)
    # Every reply byte was consumed: the next commands on the pooled connection are sane.
    assert same_bytes(st.get(key(3)), chunks[3])
    assert st.client.ping()


def test_redis_direct_io_server_dies(redis_server) -> None:
    st = make_store(redis_server)
    chunks = big_chunks(2, seed=2)
    assert all(st.put_many([(key(0), chunks[0]), (key(1), chunks[1])]))
    redis_server.stop()
    outs = [torch.empty_like(c) for c in chunks]
    assert st.get_many([key(0), key(1)], outs=outs) == [None, None]  # no exception
    assert st.down and st.stats.went_down == 1
    st.retry_at = 0.0
    assert st.put_many([(key(2), chunks[0])]) == [False]  # direct MSET: refused, no exception
    assert st.stats.io_errors == 2


def test_redis_down_then_back_with_backoff(redis_server) -> None:
    clock = Clock()
    pool = random_pool("gqa", 3)
    st = make_store(redis_server, clock=clock)
    assert st.put(key(0), pool.read_block(0))
    redis_server.stop()  # the server dies
    assert st.get(key(0)) is None  # a miss, not an exception
    assert st.down and st.stats.went_down == 1 and st.stats.io_errors == 1
    assert not st.reachable()
    assert not st.put(key(1), pool.read_block(1))  # skipped while backing off
    assert st.get_many([key(0), key(1)]) == [None, None]
    assert st.stats.skipped_down == 2 and st.stats.io_errors == 1
    clock.t += st.backoff_initial_s + 0.01
    assert st.get(key(0)) is None  # retried, still down: backoff doubles
    assert st.stats.io_errors == 2 and st._backoff == 2 * st.backoff_initial_s
    redis_server.start()  # back, empty (no persistence)
    clock.t += 10
    assert st.reachable()
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
    assert st.put_many(list(zip(keys, blocks, strict=True)), ns=NS_A) == [True] * 8
    nodes_used = {st.client.get_node_from_key(st.rkey(k, NS_A)).port for k in keys}
    assert len(nodes_used) >= 2
    got = st.get_many(keys, ns=NS_A)
    assert all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    assert st.get(key(3), ns=NS_B) is None
    # A batch of deletes over keys on several nodes: one call, split by slot.
    assert st.delete_many(keys[6:] + [key(99)], ns=NS_A) == 2
    assert st.get_many(keys[6:], ns=NS_A) == [None, None]
    assert st.put_many(list(zip(keys[6:], blocks[6:], strict=True)), ns=NS_A) == [True] * 2
    victim = next(n for n in redis_cluster if n.port in nodes_used)
    victim.stop()
    after = st.get_many(keys, ns=NS_A)  # no exception
    served = [g for g in after if g is not None]
    assert all(any(same_bytes(g, b) for b in blocks) for g in served)
    assert st.stats.io_errors >= 1 and st.stats.misses >= len(keys) - len(served)
