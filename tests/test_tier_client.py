"""The one tier face (`kvheat.tiers.TierManager`) over real stores and a real
device pool: blocks saved from the pool's slots are found in their tenant's namespace only,
load back into other slots byte for byte, and a load stops at the first block that is
corrupt on disk or whose Redis died (the rest is recomputed, nothing raises)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_tiers import random_pool, same_bytes

from kvheat.cache.hashing import NO_TENANT, Namespace, tenant_salt
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.engine.kv_pool import DeviceKVPool
from kvheat.tiers import LoadPlan, TierManager, TierSpec
from kvheat.tiers.disk import DiskStore
from kvheat.tiers.spec import store_layout

torch.set_num_threads(1)
NS_A = Namespace.of(tenant_salt("a", {}))
NS_B = Namespace.of(tenant_salt("b", {}))


def chain(n: int, tag: bytes = b"k") -> tuple[list[bytes], list[bytes | None]]:
    """n prefix keys and each one's parent (None for the first)."""
    keys = [tag + i.to_bytes(15, "little") for i in range(n)]
    return keys, [None, *keys[:-1]]


def client(spec: TierSpec, pool: DeviceKVPool) -> TierManager:
    return TierManager(spec, block_bytes=pool.bytes_per_block, block_tokens=pool.block_size,
                       model="tiny-test", layout=store_layout(pool))


def disk_spec(tmp_path: Path, **kw) -> TierSpec:
    return TierSpec(disk_dir=str(tmp_path / "disk"), disk_bytes=1 << 24, **kw)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("where", ["host", "host+disk", "disk-async"])
def test_saved_blocks_load_into_other_slots_byte_identical(layout: str, where: str,
                                                           tmp_path: Path) -> None:
    pool = random_pool(layout, 12)
    spec = {"host": TierSpec(host_blocks=16),
            # 2 host slots: the older saves go down to disk
            "host+disk": disk_spec(tmp_path, host_blocks=2),
            "disk-async": disk_spec(tmp_path, async_io=True)}[where]
    tc = client(spec, pool)
    events: list[tuple[str, bytes, bytes | None, int, bool]] = []
    tc.index_listeners.append(lambda *e: events.append(e))
    keys, parents = chain(4)
    want = [pool.read_block(s) for s in range(4)]
    assert tc.save(NS_A, keys, parents, [0, 1, 2, 3], pool) == 4
    tc.flush()
    assert all(tc.holds(NS_A, k) is not None for k in keys)
    assert tc.holds(NS_B, keys[0]) is None and tc.holds(NO_TENANT, keys[0]) is None
    if where == "host+disk":
        assert [tc.holds(NS_A, k) for k in keys] == ["disk", "disk", "host", "host"]
    stored = {k: p for _t, k, p, _n, ok in events if ok}
    assert stored == dict(zip(keys, parents, strict=True))  # KV events carry the parents

    # Another tenant's namespace finds nothing, and a lookup past the device prefix starts there.
    assert tc.lookup(NS_B, keys, 0).keys == []
    if where == "host":  # the same key names one block: another namespace's save is refused
        assert tc.save(NS_B, keys[:1], [None], [5], pool) == 0
        assert tc.holds(NS_B, keys[0]) is None and tc.holds(NS_A, keys[0]) == "host"
    plan = tc.lookup(NS_A, keys, 1)
    assert plan.keys == keys[1:] and len(plan.tier_names) == 3 and plan.tokens == 3 * pool.block_size
    tc.release(plan)
    plan = tc.lookup(NS_A, keys, 0)
    assert isinstance(plan, LoadPlan) and plan.ns == NS_A and plan.keys == keys
    pool.kv.zero_()
    assert tc.load(plan, [8, 9, 10, 11], pool) == 4
    for s, w in zip([8, 9, 10, 11], want, strict=True):
        assert same_bytes(pool.block_view(s), w)
    assert not any(b.ref_cnt for idx in tc.lower.indexes for b in idx.entries.values())
    # A client that only saves keeps its copies after a load (no demotion brings them back).
    assert all(tc.holds(NS_A, k) is not None for k in keys)
    st = tc.stats()
    assert st["loaded_blocks"] == 4 and st["load_failed"] == 0
    tiers = st["tiers"]
    assert isinstance(tiers, dict)
    assert sum(t["load_blocks"] for t in tiers.values()) == 4
    assert sum(t["load_bytes"] for t in tiers.values()) == 4 * pool.bytes_per_block
    tc.close()


def test_plan_pins_until_release_and_hand_made_plans_load(tmp_path: Path) -> None:
    pool = random_pool("gqa", 8)
    tc = client(TierSpec(host_blocks=4), pool)
    keys, parents = chain(3)
    tc.save(NS_A, keys, parents, [0, 1, 2], pool)
    plan = tc.lookup(NS_A, keys, 0)
    idx = tc.lower.indexes[0]
    assert all(idx.entries[k].ref_cnt == 1 for k in keys)  # pinned: never evicted
    tc.release(plan)
    tc.release(plan)  # once only: a second release unpins nothing more
    assert all(idx.entries[k].ref_cnt == 0 for k in keys) and plan.keys == []
    # A plan rebuilt from its keys (another process made it) is looked up at load time.
    want = [pool.read_block(s) for s in range(3)]
    hand = LoadPlan(NS_A, keys=list(keys), tier_names=["host"] * 3, block_tokens=pool.block_size)
    assert tc.load(hand, [5, 6, 7], pool) == 3
    assert all(same_bytes(pool.block_view(s), w) for s, w in zip([5, 6, 7], want, strict=True))
    tc.release(hand)  # loaded: nothing left to release
    with pytest.raises(ValueError, match="already"):
        tc.load(hand, [5, 6, 7], pool)
    assert all(idx.entries[k].ref_cnt == 0 for k in keys)
    with pytest.raises(ValueError, match="slots"):
        tc.load(tc.lookup(NS_A, keys, 0), [5], pool)
    assert all(idx.entries[k].ref_cnt == 0 for k in keys)  # a refused load unpins
    other = DeviceKVPool("gqa", 1, 4, 16, (2, 8), torch.float16)  # another block size
    with pytest.raises(ValueError, match="bytes"):
        tc.save(NS_A, keys[:1], parents[:1], [0], other)
    with pytest.raises(ValueError, match="parents"):
        tc.save(NS_A, keys, parents[:1], [0, 1, 2], pool)
    tc.close()


def test_load_stops_at_a_corrupted_disk_value(tmp_path: Path) -> None:
    pool = random_pool("mla", 10)
    tc = client(disk_spec(tmp_path), pool)
    keys, parents = chain(4)
    want = [pool.read_block(s) for s in range(4)]
    assert tc.save(NS_A, keys, parents, [0, 1, 2, 3], pool) == 4
    tc.flush()  # written on the demotion thread
    disk = tc.stores[0]
    assert isinstance(disk, DiskStore)
    path = disk._path(disk._name(keys[2], disk.ns(NS_A)))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # one bit of the KV payload
    path.write_bytes(bytes(raw))
    plan = tc.lookup(NS_A, keys, 0)
    assert plan.keys == keys  # the index cannot know; the read checks
    pool.kv[:, 4:8].zero_()
    before = pool.read_block(6)
    assert tc.load(plan, [4, 5, 6, 7], pool) == 2
    assert same_bytes(pool.block_view(4), want[0]) and same_bytes(pool.block_view(5), want[1])
    assert same_bytes(pool.block_view(6), before)  # the bad block never reached the device
    st = tc.stats()
    assert st["load_failed"] == 1 and disk.stats.corrupt_checksum == 1
    tiers = st["tiers"]
    assert isinstance(tiers, dict) and tiers["0:disk"]["faults"] == 1
    # The bad entry and its descendants are gone: a later lookup stops before them.
    assert tc.lookup(NS_A, keys, 0).keys == keys[:2]
    tc.close()


def test_load_stops_when_redis_dies(redis_server, tmp_path: Path) -> None:
    pool = random_pool("gqa", 12)
    spec = TierSpec(host_blocks=2, redis_url=redis_server.url, redis_bytes=1 << 24,
                    async_io=False)
    tc = client(spec, pool)
    keys, parents = chain(4)
    want = [pool.read_block(s) for s in range(4)]
    assert tc.save(NS_A, keys, parents, [0, 1, 2, 3], pool) == 4
    assert [tc.holds(NS_A, k) for k in keys] == ["redis", "redis", "host", "host"]
    plan = tc.lookup(NS_A, keys, 0)
    redis_server.stop()
    pool.kv[:, :, 8:12].zero_()
    assert tc.load(plan, [8, 9, 10, 11], pool) == 0  # the first block is Redis's
    assert not pool.kv[:, :, 8:10].any()
    assert tc.counters.load_failed == 1
    # Redis is marked down: lookups skip it, the host tier's blocks still load.
    assert tc.lookup(NS_A, keys, 0).keys == []
    plan = tc.lookup(NS_A, keys, 2)
    assert plan.tier_names == ["host", "host"]
    assert tc.load(plan, [10, 11], pool) == 2
    assert same_bytes(pool.block_view(10), want[2]) and same_bytes(pool.block_view(11), want[3])
    tc.close()


def test_a_spec_without_tiers_finds_nothing() -> None:
    pool = random_pool("gqa", 4)
    tc = client(TierSpec(), pool)
    keys, parents = chain(2)
    assert tc.save(NO_TENANT, keys, parents, [0, 1], pool) == 0
    plan = tc.lookup(NO_TENANT, keys, 0)
    assert plan.keys == [] and tc.load(plan, [], pool) == 0
    assert tc.stats()["tiers"] == {}
    tc.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_one_admission_asks_the_device_cache_once_and_the_tiers_once(
        llama: tuple, tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvheat's scheduler, per admission: one device-cache lookup, one tier lookup, and a
    load when it planned one (no second match, no side channel), and the tokens unchanged."""
    model, tok, _ = llama
    spec = TierSpec(host_blocks=64) if tier == "host" else disk_spec(tmp_path)
    e = LLMEngine(model, tok, EngineConfig(num_blocks=12, policy="lru", tiers=spec,
                                           scheduler=SchedulerConfig(max_num_seqs=1)))
    rng = random.Random(5)
    ps = [[rng.randrange(2, 1000) for _ in range(64)] for _ in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    first = e.generate(ps, sp)  # the first ones overflow the 12-block device into the tier
    assert e.tiers is not None
    e.tiers.flush()
    calls: list[str] = []

    def spy(obj: object, name: str) -> None:
        orig = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **k: calls.append(name) or orig(*a, **k))

    spy(e.cache, "match_prefix")
    spy(e.tiers, "lookup")
    spy(e.tiers, "load")
    spy(e.tiers, "prefetch")
    per_admission: list[list[str]] = []
    admit = e.scheduler._admit

    def counted(seq, limit):  # type: ignore[no-untyped-def]
        calls.clear()
        n = admit(seq, limit)
        if n:
            per_admission.append(list(calls))
        return n

    monkeypatch.setattr(e.scheduler, "_admit", counted)
    again = e.generate(ps[:2], sp)
    assert [a.output_token_ids for a in again] == [f.output_token_ids for f in first[:2]]
    assert [a.metrics.num_cached_tokens for a in again] == [63, 63]
    assert [a.metrics.cached_by_tier.get(tier, 0) for a in again] == [63, 63]
    assert per_admission == [["match_prefix", "lookup", "load"]] * 2
    e.close()


def test_a_flush_deletes_a_parent_and_the_children_it_takes_along(tmp_path: Path) -> None:
    """The engine's tiers on a client that saved a chain parent first: flushing its tenant
    deletes the parent, whose children go with it (neither tier nor device holds it)."""
    from kvheat.cache import CacheConfig, KVCacheManager
    from kvheat.tiers.device import purge, tiers_for

    pool = random_pool("gqa", 8)
    mgr = KVCacheManager(CacheConfig(8, pool.block_size))
    tc = tiers_for(mgr, pool, TierSpec(host_blocks=8, calibrate=False), "tiny-test")
    keys, parents = chain(3)
    ns = mgr.namespace_of("a")
    assert tc.save(ns, keys, parents, [0, 1, 2], pool, owner="a") == 3
    assert purge(tc, mgr, "a") == {"host": 3}
    assert not tc.lower.key_index.records and all(tc.holds(ns, k) is None for k in keys)
    assert tc.stores[0].used_bytes() == 0
    tc.close()


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_load_reaches_its_store_in_three_calls(llama: tuple, where: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """From the scheduler's admission to the store's read: `TierManager.load`, then the
    store (host: `get_many` into the device blocks), or the loader's `fetch` and the store
    (disk): at most three calls, and the engine's tokens are those of a run without tiers."""
    import inspect

    from kvheat.tiers.disk import DiskStore
    from kvheat.tiers.host import HostStore

    spec = TierSpec(host_blocks=32, calibrate=False) if where == "host" else \
        TierSpec(disk_dir=str(tmp_path / "disk"), disk_bytes=1 << 24, async_io=False,
                 calibrate=False)
    model, tok, _ = llama
    e = LLMEngine(model, tok, EngineConfig(num_blocks=12, policy="lru", tiers=spec,
                                           scheduler=SchedulerConfig(max_num_seqs=1)))
    rng = random.Random(7)
    ps = [[rng.randrange(2, 1000) for _ in range(64)] for _ in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    first = e.generate(ps, sp)  # the first prompts overflow the device into the tier
    assert e.tiers is not None
    e.tiers.flush()
    depths: list[int] = []
    store_cls, method = (HostStore, "get_many") if where == "host" else (DiskStore, "get")
    orig = getattr(store_cls, method)

    def spied(self, *a, **k):  # type: ignore[no-untyped-def]
        names = [f.function for f in inspect.stack()[1:]]  # callers, innermost first
        if "_admit" in names:
            depths.append(names.index("_admit") + 1)
        return orig(self, *a, **k)

    monkeypatch.setattr(store_cls, method, spied)
    again = e.generate(ps[:2], sp)
    assert [a.output_token_ids for a in again] == [f.output_token_ids for f in first[:2]]
    assert [a.metrics.cached_by_tier.get(where, 0) for a in again] == [63, 63]
    assert depths and max(depths) <= 3, depths
    e.close()
