"""The tier hierarchy around the real KVCacheManager and DeviceKVPool: demotion and
promotion of real KV bytes through host, disk and Redis, exclusive and write-through
placement, prefetch, load-or-recompute, and faults in the middle of a replay.

A small engine stand-in checks every served block: the KV of a block is a fixed function
of its key (`truth`), the "prefill" writes it into blocks past `num_cached_tokens`, and
every block below `num_cached_tokens` must already hold exactly those bytes."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from test_tiers import LAYOUTS
from tierstack import Stack

from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.cache.hashing import NO_TENANT
from kvheat.engine.kv_pool import DeviceKVPool
from kvheat.tiers import DiskStore, HostStore, KVStore, TierSpec
from kvheat.tiers.redis_store import RedisStore, connect

torch.set_num_threads(1)
BS = 16


def make_pool(layout: str, num_blocks: int) -> DeviceKVPool:
    lay, layers, _bs, shape, dtype = LAYOUTS[layout]
    return DeviceKVPool(lay, layers, num_blocks, BS, shape, dtype)


def truth(pool: DeviceKVPool, key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") % (2**62))
    shape = pool.block_view(0).shape
    return torch.randn(shape, generator=g).to(pool.dtype)


class Engine:
    """Runs requests through a Stack and checks every cached block it is given."""

    def __init__(self, tc: Stack, pool: DeviceKVPool) -> None:
        self.tc, self.pool = tc, pool
        self.n = 0
        self.served_tokens = 0

    def run(self, tokens: list[int], tenant: str | None = None, prefetch: bool = False) -> int:
        mgr = self.tc.mgr
        self.n += 1
        req = mgr.make_request(f"r{self.n}", tokens, tenant=tenant)
        if prefetch:
            self.tc.prefetch(req)
        self.tc.allocate(req)
        cached = req.num_cached_tokens
        for i, b in enumerate(req.blocks):
            full = i < len(req.keys)
            if (i + 1) * BS <= cached:
                assert full
                want = truth(self.pool, req.keys[i])
                got = self.pool.block_view(b.block_id)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                    f"wrong KV served for block {i} of request {req.request_id}"
            elif full:
                self.pool.write_block(b.block_id, truth(self.pool, req.keys[i]))
        mgr.free(req)
        self.served_tokens += cached
        return cached


def prompts(n: int, blocks: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(50_000) for _ in range(shared * BS)]
    return [head + [rng.randrange(50_000) for _ in range((blocks - shared) * BS)]
            for _ in range(n)]


def build(layout: str, tiers: list[KVStore] | None, tmp_path: Path, device_blocks: int = 8,
          host_blocks: int = 6, disk_blocks: int = 1000, **cfg) -> tuple[Stack, DeviceKVPool]:
    pool = make_pool(layout, device_blocks)
    mgr = KVCacheManager(CacheConfig(device_blocks, BS))
    if tiers is None:
        tiers = [HostStore(host_blocks * pool.bytes_per_block, pool.bytes_per_block),
                 DiskStore(tmp_path / "disk", disk_blocks * (pool.bytes_per_block + 200),
                           fsync=False)]
    cfg.setdefault("calibrate", False)
    speed = cfg.pop("prefill_tokens_per_s", None)
    return Stack(mgr, pool, tiers, TierSpec(**cfg), prefill_tokens_per_s=speed), pool


@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("async_io", [False, True])
def test_blocks_round_trip_through_host_and_disk(layout: str, async_io: bool,
                                                 tmp_path: Path) -> None:
    tc, pool = build(layout, None, tmp_path, async_io=async_io)
    eng = Engine(tc, pool)
    ps = prompts(6, 4)  # 24 blocks of working set over an 8-block device, 6-block host
    for p in ps:
        assert eng.run(p) == 0
    tc.tiers.flush()
    c = tc.tiers.counters
    assert c.demotions > 0 and tc.tiers.lower.demotions[1] > 0  # reached disk
    for p in reversed(ps):  # all come back from device, host or disk; bytes checked
        assert eng.run(p) == 4 * BS
        tc.tiers.flush()
    assert tc.tiers.lower.hit_blocks[0] > 0 and tc.tiers.lower.hit_blocks[1] > 0
    assert c.load_failed == 0
    assert c.device_hit_tokens + c.lower_hit_tokens == 6 * 4 * BS
    # Exclusive: no key is on two lower tiers.
    assert not set(tc.tiers.lower.indexes[0].entries) & set(tc.tiers.lower.indexes[1].entries)
    tc.close()


def test_write_through_keeps_lower_copies(tmp_path: Path) -> None:
    tc, pool = build("gqa", None, tmp_path, async_io=False, mode="write_through",
                     host_blocks=40)
    eng = Engine(tc, pool)
    ps = prompts(4, 4)
    for p in ps:
        eng.run(p)
    for p in ps:
        assert eng.run(p) == 4 * BS
    # Promoted blocks keep their copies on both lower tiers.
    assert len(tc.tiers.lower.indexes[0]) == len(tc.tiers.lower.indexes[1]) == 16
    st = tc.tiers.stats()
    assert st["tiers"]["1:disk"]["puts"] == 16  # each block written to disk once


def test_lower_tier_eviction_follows_the_policy(tmp_path: Path) -> None:
    """LRU on the host tier: a block hit again stays; the coldest goes down to disk."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, device_blocks=4, host_blocks=4)
    eng = Engine(tc, pool)
    a, b, c, d = prompts(4, 4)
    eng.run(a)
    eng.run(b)  # a (4 blocks) demoted to host
    eng.run(c)  # b demoted to host; host full: a goes to disk
    host_keys = set(tc.tiers.lower.indexes[0].entries)
    disk_keys = set(tc.tiers.lower.indexes[1].entries)
    ka = set(tc.mgr.make_request("x", a).keys)
    kb = set(tc.mgr.make_request("y", b).keys)
    assert kb == host_keys and ka == disk_keys
    assert tc.tiers.lower.indexes[0].policy.name == "lru"


def test_prefetch_starts_loads_before_allocate(tmp_path: Path) -> None:
    tc, pool = build("mla", None, tmp_path, async_io=True, host_blocks=1)
    eng = Engine(tc, pool)
    ps = prompts(5, 4)
    for p in ps:
        eng.run(p)
    tc.tiers.flush()
    assert eng.run(ps[0], prefetch=True) == 4 * BS
    assert tc.tiers.counters.prefetch_plans == 1 and tc.tiers.counters.prefetch_used == 1
    # A prefetch that is never allocated releases its pins.
    req = tc.mgr.make_request("never", ps[1])
    assert tc.prefetch(req) == 4 * BS
    assert any(e.ref_cnt for idx in tc.tiers.lower.indexes for e in idx.entries.values())
    tc.tiers.cancel("never")
    assert not any(e.ref_cnt for idx in tc.tiers.lower.indexes for e in idx.entries.values())
    tc.close()


def test_load_or_recompute_follows_measured_speeds(tmp_path: Path) -> None:
    speed = {"v": 1e12}  # a prefill faster than any tier: always recompute
    tc, pool = build("gqa", None, tmp_path, async_io=False,
                     prefill_tokens_per_s=lambda: speed["v"], calibrate=True)
    for st in tc.tiers.stores:
        assert st.read_model.fit() is not None  # measured at start
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    assert eng.run(ps[0]) == 0
    assert tc.tiers.counters.decisions_recompute == 1 and tc.tiers.counters.recompute_chosen_tokens == 4 * BS
    speed["v"] = 1.0  # one token a second: loading wins
    assert eng.run(ps[1]) == 4 * BS
    assert tc.tiers.counters.decisions_load == 1
    assert 0 < tc.tiers.counters.est_load_s < tc.tiers.counters.est_recompute_saved_s
    stats = json.loads(json.dumps(tc.tiers.stats()))  # plain data, ready for an exporter
    assert stats["tiers"]["1:disk"]["read_bandwidth_Bps"] > 0
    assert stats["decisions_load"] == 1 and stats["decisions_recompute"] == 1


def test_decision_picks_the_profitable_prefix(tmp_path: Path) -> None:
    """Host fast, disk slow: with a prefill speed between them, host blocks load and the
    disk blocks behind them are recomputed."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, prefill_tokens_per_s=1000.0)
    bb = tc.tiers.block_bytes
    host, disk = tc.tiers.stores
    host.read_model.samples.clear()
    disk.read_model.samples.clear()
    host.read_model.record(bb, 1e-6)  # 1 µs a block: far faster than 16 ms recompute
    disk.read_model.record(bb, 1.0)  # 1 s a block: far slower
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    # LRU, tail-first: the device keeps ps[4:], the host the 6 latest demoted blocks
    # (ps[3] and the first two of ps[2]), disk the rest.
    loc = [[next((t for t, idx in enumerate(tc.tiers.lower.indexes) if k in idx.entries), None)
            for k in tc.mgr.make_request("q", p).keys] for p in ps]
    assert loc[2] == [0, 0, 1, 1] and loc[0] == [1, 1, 1, 1]
    assert eng.run(ps[2]) == 2 * BS  # host prefix loaded, disk tail recomputed
    assert tc.tiers.counters.decisions_partial == 1 and tc.tiers.counters.recompute_chosen_blocks == 2
    assert eng.run(ps[0]) == 0  # all on disk: recompute everything
    assert tc.tiers.counters.decisions_recompute == 1 and tc.tiers.counters.recompute_chosen_blocks == 6
    assert tc.tiers.lower.hit_blocks == [2, 0]
    # A tier judged too slow gets no reads; after `remeasure_s` without one, a single
    # block is loaded anyway so its estimate can follow the tier getting faster.
    assert loc[1] == [1, 1, 1, 1] and tc.tiers.counters.remeasure_loads == 0
    tc.tiers.cost.remeasure_s = 0.0
    assert eng.run(ps[1]) == BS  # checked against the KV the stand-in wrote
    assert tc.tiers.counters.remeasure_loads == 1 and len(disk.read_model.samples) == 2


def test_a_memory_tier_judged_slow_is_remeasured_on_its_whole_run(tmp_path: Path) -> None:
    """A host fit spoilt by a slow spell: after `remeasure_s` without a read, the next plan
    loads its whole host run (samples of the sizes loads read), the disk still one block."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, prefill_tokens_per_s=1000.0)
    bb = tc.tiers.block_bytes
    host, disk = tc.tiers.stores
    for st in (host, disk):
        st.read_model.reset()
        st.read_model.record(bb, 1.0)  # 1 s a block: far slower than 16 ms recompute
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    tc.tiers.cost.remeasure_s = 0.0
    assert eng.run(ps[2]) == 2 * BS  # [host, host, disk, disk]: the host run, no disk
    assert tc.tiers.counters.remeasure_loads == 1 and len(host.read_model.samples) == 2
    assert host.read_model.samples[-1][0] == 2 * bb  # one call for both blocks
    assert eng.run(ps[0]) == BS  # all on disk: one block
    assert tc.tiers.counters.remeasure_loads == 2
    tc.close()


def test_read_models_price_the_reads_loads_make(tmp_path: Path) -> None:
    """The host tier is read in one batched call per load: its fitted latency is paid
    once per load, not per block (disk: once per block). Calibration reads it that way,
    with its warm-up round dropped, and blocks moved down to the disk are not timed."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, calibrate=True,
                     prefill_tokens_per_s=1e12)  # recompute all: nothing loaded, untimed
    host, disk = tc.tiers.stores
    assert host.batched_reads and not disk.batched_reads
    assert len(host.read_model.samples) == 2 * 3  # one get_many per size and round
    assert len(disk.read_model.samples) == 5 * 3  # one get per block
    bb = tc.tiers.block_bytes
    for st in (host, disk):
        st.read_model.reset()
        st.read_model.record(bb, 30e-6)  # 10 us latency + 20 us a block, fitted
        st.read_model.record(4 * bb, 90e-6)
    assert tc.tiers.estimate_load_s(0, 4) == pytest.approx(10e-6 + 4 * 20e-6)
    assert tc.tiers.estimate_load_s(1, 4) == pytest.approx(4 * (10e-6 + 20e-6))
    gets = host.stats.gets
    eng = Engine(tc, pool)
    for p in prompts(6, 4):  # 24 blocks through 8 device and 6 host slots: moves to disk
        eng.run(p)
    assert host.stats.gets > gets and tc.tiers.lower.evictions[0] > 0
    assert len(host.read_model.samples) == 2  # moved out (taken), none timed
    tc.close()


def test_fault_corrupt_disk_file_mid_replay(tmp_path: Path) -> None:
    tc, pool = build("gqa", None, tmp_path, async_io=False, host_blocks=1)
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    disk: DiskStore = tc.tiers.stores[1]  # type: ignore[assignment]
    keys = tc.mgr.make_request("x", ps[0]).keys
    assert all(k in tc.tiers.lower.indexes[1].entries for k in keys)
    path = disk._path(disk._name(keys[2], disk.ns(NO_TENANT)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert eng.run(ps[0]) == 2 * BS  # loads blocks 0-1, block 2 fails, rest recomputed
    assert tc.tiers.counters.load_failed == 1
    assert disk.stats.corrupt_checksum == 1
    assert eng.run(ps[0]) == 4 * BS  # all on device now, recomputed bytes correct


def test_fault_disk_cap_stops_demotion_without_errors(tmp_path: Path) -> None:
    tc, pool = build("gqa", None, tmp_path, async_io=True, host_blocks=2, disk_blocks=3)
    eng = Engine(tc, pool)
    ps = prompts(10, 4)
    for p in ps:
        eng.run(p)
    tc.tiers.flush()
    disk = tc.tiers.stores[1]
    assert disk.used_bytes() <= disk.capacity_bytes
    assert len(tc.tiers.lower.indexes[1]) == 3 and tc.tiers.counters.dropped_bottom > 0
    assert tc.tiers.counters.worker_errors == 0
    for p in ps:
        eng.run(p)  # whatever is served is checked; nothing raises


def test_fault_restart_serves_only_verified_disk_blocks(tmp_path: Path) -> None:
    tc, pool = build("mla", None, tmp_path, async_io=True, host_blocks=1)
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    tc.close()
    disk_dir = tmp_path / "disk"
    files = sorted(disk_dir.glob("*.kv"))
    assert len(files) >= 8
    with open(files[0], "r+b") as f:  # one torn file
        f.truncate(100)
    # "Restart": a fresh manager, device pool, host and disk over the same directory.
    pool2 = make_pool("mla", 8)
    mgr2 = KVCacheManager(CacheConfig(8, BS))
    disk2 = DiskStore(disk_dir, 1000 * (pool2.bytes_per_block + 200), fsync=False)
    assert disk2.rejected_on_open == 1
    host2 = HostStore(pool2.bytes_per_block, pool2.bytes_per_block)
    tc2 = Stack(mgr2, pool2, [host2, disk2], TierSpec(async_io=False, calibrate=False))
    assert len(tc2.tiers.lower.indexes[1]) == len(files) - 1
    eng2 = Engine(tc2, pool2)
    served = sum(eng2.run(p) for p in ps)
    assert served > 0 and tc2.tiers.counters.load_failed == 0


def test_tenants_never_share_lower_tier_blocks(tmp_path: Path) -> None:
    tc, pool = build("gqa", None, tmp_path, async_io=False, device_blocks=4)
    eng = Engine(tc, pool)
    p = prompts(1, 4)[0]
    filler = prompts(3, 4, seed=1)
    eng.run(p, tenant="a")
    for f in filler:
        eng.run(f, tenant="a")
    assert eng.run(p, tenant="b") == 0  # tenant b's keys differ: no lower-tier hit
    for f in filler:
        eng.run(f, tenant="a")
    assert eng.run(p, tenant="a") == 4 * BS


def test_fault_redis_killed_mid_replay(redis_server, tmp_path: Path) -> None:
    pool = make_pool("gqa", 8)
    host = HostStore(2 * pool.bytes_per_block, pool.bytes_per_block)
    red = RedisStore(connect(redis_server.url, timeout_s=0.2), 1 << 24, backoff_initial_s=0.05)
    tc, pool = build("gqa", [host, red], tmp_path, async_io=True)
    eng = Engine(tc, pool)
    ps = prompts(8, 4)
    for p in ps:
        eng.run(p)
    tc.tiers.flush()
    assert len(tc.tiers.lower.indexes[1]) > 0
    assert eng.run(ps[0]) == 4 * BS  # from Redis
    redis_server.stop()
    for p in ps[1:]:
        eng.run(p)  # Redis gone: misses and recomputes, no exception, KV checked
    tc.tiers.flush()
    assert red.stats.went_down >= 1 and red.down
    assert tc.tiers.counters.worker_errors == 0
    redis_server.start()
    deadline = time.monotonic() + 10
    while not red.reachable() and time.monotonic() < deadline:  # the backoff runs out
        time.sleep(0.01)
    for p in ps:
        eng.run(p)
        tc.tiers.flush()
    assert red.stats.came_back >= 1
    tc.close()


def test_refused_host_put_goes_down_with_a_private_copy(tmp_path: Path) -> None:
    """One-layer MLA: a device block view is contiguous. When the host cannot take a block
    (its only slot is pinned by a prefetch), the block goes to disk through the queue; the
    queued bytes must be a copy, not the device block that is reused at once."""
    pool = DeviceKVPool("mla", 1, 4, BS, (24,), torch.bfloat16)
    assert pool.block_view(0).is_contiguous()
    mgr = KVCacheManager(CacheConfig(4, BS))
    host = HostStore(pool.bytes_per_block, pool.bytes_per_block)
    disk = DiskStore(tmp_path / "disk", 1 << 20, fsync=False)
    tc = Stack(mgr, pool, [host, disk], TierSpec(async_io=True, calibrate=False))
    eng = Engine(tc, pool)
    a, b, c = prompts(3, 4)
    eng.run(a)
    eng.run(b)
    tc.tiers.flush()
    pending = mgr.make_request("pending", a)
    assert tc.prefetch(pending) == 4 * BS  # pins a's first block, the host's only entry
    eng.run(c)  # b's blocks: host refuses (pinned), so they go to disk via the queue
    tc.tiers.flush()
    tc.tiers.cancel("pending")
    assert tc.tiers.counters.demote_dropped == 0
    assert all(k in tc.tiers.lower.indexes[1].entries for k in mgr.make_request("q", b).keys)
    assert eng.run(b) == 4 * BS  # Engine checks every loaded byte
    tc.close()


def test_allocating_a_head_of_a_prefetched_request(tmp_path: Path) -> None:
    """The scheduler prefetches the whole prompt, then allocates a head of it (chunked
    prefill): only the blocks of the head are loaded, the rest stay below, unpinned."""
    tc, pool = build("gqa", None, tmp_path, async_io=True)
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    tc.tiers.flush()
    mgr = tc.mgr
    full = mgr.make_request("head", ps[0])
    assert tc.prefetch(full) == 4 * BS
    head = mgr.make_request("head", ps[0][:2 * BS + 5])  # same id, two full blocks + 5
    tc.allocate(head)
    assert head.num_cached_tokens == 2 * BS
    for i in range(2):
        want = truth(pool, full.keys[i])
        assert torch.equal(pool.block_view(head.blocks[i].block_id).view(torch.uint8),
                           want.view(torch.uint8))
    assert not any(e.ref_cnt for idx in tc.tiers.lower.indexes for e in idx.entries.values())
    assert all(any(k in idx.entries for idx in tc.tiers.lower.indexes) for k in full.keys[2:])
    mgr.free(head)
    tc.close()


# ---- prefix links below: no unreachable entries, leaf-first at the bottom ----------------
def unreachable(tc: Stack, key_lists: list[list[bytes]]) -> list[bytes]:
    """Lower-tier entries of these prompts that no prefix match can reach: an earlier key of
    their prompt is held by no tier nor the device (worked out from the prompts' own keys,
    not from the hierarchy's links)."""
    def held(k: bytes) -> bool:
        return k in tc.mgr.cached or any(k in idx.entries for idx in tc.tiers.lower.indexes)

    out = []
    for keys in key_lists:
        broken = False
        for k in keys:
            if broken and any(k in idx.entries for idx in tc.tiers.lower.indexes):
                out.append(k)
            broken = broken or not held(k)
    return out


def touch_below(tc: Stack, tokens: list[int], rid: str) -> None:
    """Plan a prompt's lower-tier loads and drop the plan: its entries count as used, the
    parent released before its child (so, on LRU, the child ends hotter)."""
    assert tc.prefetch(tc.mgr.make_request(rid, tokens)) > 0
    tc.tiers.cancel(rid)


def test_parent_dropped_at_bottom_takes_children_along(tmp_path: Path) -> None:
    """A parent on the bottom tier (disk) whose child sits on the host: when the disk holds
    no leaf and must make room, the parent goes and its host child with it (a match would
    stop at the parent: the child could never be served), its bytes freed."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, device_blocks=4, host_blocks=3,
                     disk_blocks=1)
    eng = Engine(tc, pool)
    host = tc.tiers.stores[0]
    a = prompts(1, 2)[0]
    b = prompts(1, 4, seed=2)[0]
    c, d, e = prompts(3, 1, seed=1)
    ka = tc.mgr.make_request("ka", a).keys
    eng.run(a)
    eng.run(b)  # a's blocks go to the host, child first
    assert set(tc.tiers.lower.indexes[0].entries) == set(ka)
    touch_below(tc, a, "t1")  # host LRU now: a0 (parent) colder than a1
    eng.run(c)
    eng.run(d)  # the host makes room: a0 to disk, a1 stays on the host
    assert list(tc.tiers.lower.indexes[1].entries) == [ka[0]] and ka[1] in tc.tiers.lower.indexes[0].entries
    assert tc.tiers.lower.indexes[1].get(ka[0]).num_children == 1  # type: ignore[union-attr]
    touch_below(tc, a, "t2")  # a1 hot on the host: the host's next victim is one of b's
    used = host.used_bytes()
    eng.run(e)  # a b block comes down to a full disk holding only a0, a parent
    c_ = tc.tiers.counters
    assert c_.dropped_bottom == 1 and ka[0] not in tc.tiers.lower.indexes[1].entries
    assert c_.orphans_dropped == 1 and tc.tiers.stats()["orphans_dropped"] == 1
    assert ka[1] not in tc.tiers.lower.indexes[0].entries and not host.contains(ka[1], NO_TENANT)
    assert host.used_bytes() == used - pool.bytes_per_block  # one came in, a b block and a1 left
    all_keys = [tc.mgr.make_request("k", p).keys for p in (a, b, c, d, e)]
    assert unreachable(tc, all_keys) == []
    assert eng.run(a) == 0  # nothing of a is left; recomputed and checked
    tc.close()


def test_refused_demotion_takes_children_along(tmp_path: Path) -> None:
    """The device evicts a parent whose child is on the (only) lower tier, which cannot
    take it (its one slot is pinned by a prefetch): the child goes, even while pinned."""
    pool = make_pool("gqa", 4)
    mgr = KVCacheManager(CacheConfig(4, BS))
    host = HostStore(pool.bytes_per_block, pool.bytes_per_block)
    tc = Stack(mgr, pool, [host], TierSpec(async_io=False, calibrate=False))
    eng = Engine(tc, pool)
    a, b = prompts(2, 2)
    c, d = prompts(2, 1, seed=1)
    ka = mgr.make_request("ka", a).keys
    eng.run(a)
    eng.run(b)
    eng.run(c)  # device full: a1, the coldest leaf, goes to the host
    assert list(tc.tiers.lower.indexes[0].entries) == [ka[1]]
    pending = mgr.make_request("pending", a)
    assert tc.prefetch(pending) == BS  # a0 on the device, a1 planned from the host: pinned
    eng.run(d)  # a0 leaves the device; the host's only slot is pinned: refused
    assert tc.tiers.counters.demote_refused == 1
    assert tc.tiers.counters.orphans_dropped == 1
    tc.tiers.cancel("pending")
    assert len(tc.tiers.lower.indexes[0]) == 0 and host.used_bytes() == 0
    assert not any(e.ref_cnt for e in tc.tiers.lower.indexes[0].entries.values())
    assert eng.run(a) == 0
    tc.close()


def test_promoted_parent_keeps_children_reachable(tmp_path: Path) -> None:
    """Exclusive mode: loading a parent moves it to the device and out of its tier; its
    children below are still reachable through the device copy, so nothing is dropped."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, device_blocks=4, host_blocks=2)
    eng = Engine(tc, pool)
    a, b = prompts(2, 4)
    ka = tc.mgr.make_request("ka", a).keys
    eng.run(a)
    eng.run(b)  # a: two blocks on the host, two on disk
    assert all(any(k in idx.entries for idx in tc.tiers.lower.indexes) for k in ka)
    assert eng.run(a[:BS + 3]) == BS  # only a0 is loaded: it leaves its tier
    assert not any(ka[0] in idx.entries for idx in tc.tiers.lower.indexes) and ka[0] in tc.mgr.cached
    assert tc.tiers.counters.orphans_dropped == 0
    assert all(any(k in idx.entries for idx in tc.tiers.lower.indexes) for k in ka[1:])
    assert eng.run(a) == 4 * BS  # a0 on the device, a1..a3 loaded from below
    assert tc.tiers.counters.orphans_dropped == 0 and tc.tiers.counters.load_failed == 0
    tc.close()


def test_bottom_tier_evicts_leaves_first(tmp_path: Path) -> None:
    """On the bottom tier LRU alone would drop a0 (the coldest) and strand a1; a0 is
    parked while a1 is held, a1 goes first, and once a0 is a leaf again it rejoins at the
    cold end: the next victim. Leaves keep the policy's order among themselves."""
    pool = make_pool("gqa", 4)
    mgr = KVCacheManager(CacheConfig(4, BS))
    host = HostStore(3 * pool.bytes_per_block, pool.bytes_per_block)
    tc = Stack(mgr, pool, [host], TierSpec(async_io=False, calibrate=False))
    idx = tc.tiers.lower.indexes[0]
    eng = Engine(tc, pool)
    a = prompts(1, 2)[0]
    b = prompts(1, 4, seed=1)[0]
    c, d, e = prompts(3, 1, seed=2)
    ka = mgr.make_request("ka", a).keys
    kb = mgr.make_request("kb", b).keys
    eng.run(a)
    eng.run(b)  # host: a1, a0
    touch_below(tc, a, "t")  # LRU: a0 coldest, then a1
    eng.run(c)  # b3 comes down: the host (3 slots) is full
    assert set(idx.entries) == {ka[0], ka[1], kb[3]}
    eng.run(d)  # b2 comes down: LRU order a0, a1, b3; a0 has a child below: a1 goes
    assert set(idx.entries) == {ka[0], kb[3], kb[2]}
    assert tc.tiers.counters.orphans_dropped == 0 and tc.tiers.counters.dropped_bottom == 1
    eng.run(e)  # b1 comes down: a0, a leaf again, is the coldest
    assert set(idx.entries) == {kb[3], kb[2], kb[1]}
    assert tc.tiers.counters.orphans_dropped == 0 and tc.tiers.counters.dropped_bottom == 2
    tc.close()


def test_write_through_drops_children_with_the_last_copy(tmp_path: Path) -> None:
    """Write-through: a parent dropped by one tier but still on another keeps its children;
    they go only when its last copy does."""
    tc, pool = build("gqa", None, tmp_path, async_io=False, mode="write_through",
                     device_blocks=4, host_blocks=2, disk_blocks=1)
    eng = Engine(tc, pool)
    host = tc.tiers.stores[0]
    a = prompts(1, 2)[0]
    b = prompts(1, 4, seed=1)[0]
    c = prompts(1, 1, seed=2)[0]
    ka = tc.mgr.make_request("ka", a).keys
    eng.run(a)
    eng.run(b)  # a1, a0 to both tiers; the one-entry disk keeps a0 (a1 is on the host)
    assert list(tc.tiers.lower.indexes[1].entries) == [ka[0]] and set(tc.tiers.lower.indexes[0].entries) == set(ka)
    touch_below(tc, a, "t")  # host LRU: a0 colder than a1
    eng.run(c)  # b3 down: the host drops a0 (the disk has it), then the disk drops a0
    assert ka[0] not in tc.tiers.lower.indexes[0].entries and ka[0] not in tc.tiers.lower.indexes[1].entries
    assert tc.tiers.counters.orphans_dropped == 1 and ka[1] not in tc.tiers.lower.indexes[0].entries
    assert not host.contains(ka[1], NO_TENANT)
    tc.close()


def test_write_through_parent_dropped_above_keeps_children(tmp_path: Path) -> None:
    tc, pool = build("gqa", None, tmp_path, async_io=False, mode="write_through",
                     device_blocks=4, host_blocks=2)
    eng = Engine(tc, pool)
    a = prompts(1, 2)[0]
    b = prompts(1, 4, seed=1)[0]
    c = prompts(1, 1, seed=2)[0]
    ka = tc.mgr.make_request("ka", a).keys
    eng.run(a)
    eng.run(b)
    touch_below(tc, a, "t")
    eng.run(c)  # the host drops a0; the disk still has it
    assert ka[0] not in tc.tiers.lower.indexes[0].entries and ka[0] in tc.tiers.lower.indexes[1].entries
    assert tc.tiers.counters.orphans_dropped == 0
    assert eng.run(a) == 2 * BS
    tc.close()


@pytest.mark.parametrize("policy", ["lru", "kvheat"])
@pytest.mark.parametrize("async_io", [False, True])
def test_replay_leaves_no_unreachable_entries(policy: str, async_io: bool,
                                              tmp_path: Path) -> None:
    """Prompts that share heads of many lengths, replayed in a random order through small
    tiers: whatever each tier evicts, no lower-tier entry is left behind a missing key, and
    the links agree with the indexes."""
    pool = make_pool("gqa", 6)
    mgr = KVCacheManager(CacheConfig(6, BS, policy=policy))
    host = HostStore(4 * pool.bytes_per_block, pool.bytes_per_block)
    disk = DiskStore(tmp_path / "disk", 5 * (pool.bytes_per_block + 200), fsync=False)
    tc = Stack(mgr, pool, [host, disk], TierSpec(policy=policy, async_io=async_io,
                                                         calibrate=False))
    eng = Engine(tc, pool)
    rng = random.Random(7)
    families = [prompts(4, 5, seed=s, shared=s % 4 + 1) for s in range(4)]
    ps = [p[:rng.randrange(1, 6) * BS] for fam in families for p in fam]
    keys = [mgr.make_request("k", p).keys for p in ps]
    checks = 0
    for step in range(300):
        eng.run(rng.choice(ps))
        if step % 20 == 19:
            tc.tiers.flush()
            assert unreachable(tc, keys) == []
            below = {k for idx in tc.tiers.lower.indexes for k in idx.entries}
            recs = tc.tiers.lower.key_index.records
            assert set(recs) == below  # nothing in flight after flush
            assert all(recs[k].held == len(tc.tiers.lower.key_index.where(k)) for k in below)
            # One index: each key's parent is held below or on the device, and it has the
            # key among its children.
            for k in below:
                p = tc.tiers.lower.key_index.parent(k)
                assert p is None or k in tc.tiers.lower.key_index.kids[p]
            checks += 1
    assert checks == 15 and tc.tiers.counters.dropped_bottom > 0
    assert tc.tiers.counters.worker_errors == 0
    if not async_io:  # with the demotion thread, a load may race a disk write: a miss
        assert tc.tiers.counters.load_failed == 0
    tc.close()
