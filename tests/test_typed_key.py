"""Block keys and their namespaces (`kvheat.cache.hashing.BlockKey`, `Namespace`): the
keys are the same bytes as ever, a namespace's digest is the tenant salt's as ever, a key
saved in one tenant's namespace is never found in another's (through `TierManager` and
through a store directly), and entries a store kept from before a restart, whose tenant
is not known then, are found once it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash
from test_tier_client import NS_A, NS_B, chain, client, disk_spec
from test_tiers import random_pool, same_bytes

from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.cache.hashing import (
    MAX_KEY_BYTES,
    NO_TENANT,
    BlockKey,
    Namespace,
    block_keys,
    chain_key,
    probe_key,
    root_key,
    stored_key,
    tenant_salt,
    trace_block_keys,
)
from kvheat.tiers import DiskStore, HostStore, LoadPlan, TierManager, TierSpec
from kvheat.tiers.codec import namespace_digest
from kvheat.tiers.spec import store_layout

torch.set_num_threads(1)


# ---- the types --------------------------------------------------------------------------
def test_keys_are_the_chained_digests_they_always_were() -> None:
    root = root_key("tenant:a")
    toks = list(range(40))
    keys, contents = block_keys(toks, 16, root)
    h, want = root, []
    for c in contents:
        h = xxhash.xxh3_128_digest(h + c)
        want.append(h)
    assert keys == want and len(keys) == 2 and all(type(k) is bytes for k in keys)
    assert chain_key(keys[0], contents[1]) == keys[1]
    tkeys, tcont = trace_block_keys(root, [7, 9])
    assert tkeys[0] == xxhash.xxh3_128_digest(root + tcont[0])


def test_namespaces_and_their_constructors() -> None:
    assert Namespace.of(None) is NO_TENANT and NO_TENANT.known
    a = Namespace.of("tenant:a")
    assert a == Namespace.of("tenant:a") and hash(a) == hash(Namespace.of("tenant:a"))
    assert a != Namespace.of("tenant:b") and a.known and a.salt == "tenant:a"
    d = Namespace.stored(b"\x01" * 16)
    assert not d.known and d.digest == b"\x01" * 16 and d.salt is None and d != NO_TENANT
    with pytest.raises(ValueError, match="not both"):
        Namespace("tenant:a", b"\x01" * 16)
    with pytest.raises(AttributeError):
        a.salt = "tenant:b"  # type: ignore[misc]  # frozen
    assert stored_key(bytearray(b"k" * 16)) == b"k" * 16
    with pytest.raises(ValueError, match="at most"):
        stored_key(b"k" * (MAX_KEY_BYTES + 1))
    assert probe_key("kvheat-probe-health") == b"kvheat-probe-health"


def test_a_namespace_digest_is_the_salts_and_a_stored_one_passes_through(
        tmp_path: Path) -> None:
    disk = DiskStore(tmp_path, 1 << 20, model="m", layout="gqa")
    for salt in ("tenant:a", "group:g", None):
        want = namespace_digest("m", "gqa", salt, disk.mac_key)
        assert disk.ns(Namespace.of(salt)) == want  # as the files on disk are named
        assert disk.ns(Namespace.stored(want)) == want
    assert disk.ns(NO_TENANT) == namespace_digest("m", "gqa", "", disk.mac_key)


def test_the_cache_resolves_a_tenants_namespace_once() -> None:
    mgr = KVCacheManager(CacheConfig(4, 16, share_groups={"a": "g", "b": "g"}))
    ns = mgr.namespace_of("a")
    assert ns is mgr.namespace_of("a") and ns == Namespace.of(tenant_salt("a", {"a": "g"}))
    assert ns == mgr.namespace_of("b") == Namespace.of("group:g")  # one share group
    assert mgr.namespace_of("c") == Namespace.of("tenant:c") and mgr.namespace_of(None) is NO_TENANT


# ---- one tenant's keys are never another's ------------------------------------------------
@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_key_saved_in_one_namespace_is_found_in_no_other(where: str, tmp_path: Path) -> None:
    pool = random_pool("gqa", 8)
    spec = TierSpec(host_blocks=8) if where == "host" else disk_spec(tmp_path)
    tc = client(spec, pool)
    keys, parents = chain(3)
    assert tc.save(NS_A, keys, parents, [0, 1, 2], pool) == 3
    tc.flush()
    assert [tc.holds(NS_A, k) for k in keys] == [where] * 3
    for other in (NS_B, NO_TENANT, Namespace.of("tenant:a ")):
        assert all(tc.holds(other, k) is None for k in keys)
        assert tc.lookup(other, keys, 0).keys == []
        # A plan built by hand for the other namespace (another process's) loads nothing.
        hand = LoadPlan(other, keys=list(keys), tier_names=[where] * 3)
        assert tc.load(hand, [5, 6, 7], pool) == 0
    plan = tc.lookup(NS_A, keys, 0)
    assert plan.ns == NS_A and tc.load(plan, [5, 6, 7], pool) == 3
    assert all(same_bytes(pool.block_view(5 + i), pool.block_view(i)) for i in range(3))
    # The store itself: a value is read back in its own namespace only, the other's
    # read is a miss (the key names the same file or slot; the namespace digest differs).
    st = tc.stores[0]
    assert st.contains(keys[0], NS_A) and not st.contains(keys[0], NS_B)
    assert st.get(keys[0], NS_B) is None
    assert same_bytes(st.get(keys[0], NS_A), pool.block_view(0))
    tc.close()


def test_a_store_keeps_two_namespaces_of_one_key_apart(tmp_path: Path) -> None:
    pool = random_pool("gqa", 4)
    disk = DiskStore(tmp_path, 1 << 22)
    k = BlockKey(b"k" * 16)
    assert disk.put(k, pool.read_block(0), NS_A) and disk.put(k, pool.read_block(1), NS_B)
    assert same_bytes(disk.get(k, NS_A), pool.read_block(0))
    assert same_bytes(disk.get(k, NS_B), pool.read_block(1))
    assert disk.get(k, NO_TENANT) is None and not disk.contains(k)
    assert disk.delete(k, NS_B) and disk.get(k, NS_B) is None
    assert same_bytes(disk.get(k, NS_A), pool.read_block(0))
    host = HostStore(2 * pool.bytes_per_block, pool.bytes_per_block)
    assert host.put(k, pool.read_block(2), NS_A)
    assert host.get(k, NS_B) is None and same_bytes(host.get(k, NS_A), pool.read_block(2))
    # A delete in another namespace leaves the entry, as on disk (one slot per key here).
    assert not host.delete(k, NS_B) and host.delete_many([k, k], NS_B) == 0
    assert same_bytes(host.get(k, NS_A), pool.read_block(2))
    assert host.delete_many([k, k], NS_A) == 1 and host.get(k, NS_A) is None
    assert host.used_bytes() == 0


# ---- restarts ---------------------------------------------------------------------------
def _restarted(tmp_path: Path, pool, known: list[Namespace] | None = None) -> TierManager:
    return TierManager(disk_spec(tmp_path), block_bytes=pool.bytes_per_block,
                       block_tokens=pool.block_size, model="tiny-test",
                       layout=store_layout(pool),
                       known_namespaces=(lambda: known) if known is not None else None)


def test_entries_found_at_start_up_are_found_once_their_tenant_is_known(
        tmp_path: Path) -> None:
    pool = random_pool("mla", 10)
    tc = client(disk_spec(tmp_path), pool)
    keys, parents = chain(3)
    want = [pool.read_block(s) for s in range(3)]
    assert tc.save(NS_A, keys, parents, [0, 1, 2], pool) == 3
    tc.close()
    # A restart that knows no tenant: the entries keep the digest they are stored under.
    tc2 = _restarted(tmp_path, pool)
    recs = tc2.lower.key_index.records
    disk = tc2.stores[0]
    assert {recs[k].ns for k in keys} == {Namespace.stored(disk.ns(NS_A))}
    assert all(not recs[k].ns.known for k in keys)
    assert all(tc2.holds(NS_B, k) is None for k in keys)  # still never another tenant's
    assert tc2.lookup(NS_B, keys, 0).keys == []
    # Its tenant asks: found, and loaded byte for byte.
    assert [tc2.holds(NS_A, k) for k in keys] == ["disk"] * 3
    plan = tc2.lookup(NS_A, keys, 0)
    assert tc2.load(plan, [5, 6, 7], pool) == 3
    assert all(same_bytes(pool.block_view(5 + i), w) for i, w in enumerate(want))
    # Saved again by its tenant, a key found at start-up meets its namespace.
    tc2.save(NS_A, keys[:1], parents[:1], [5], pool)
    assert recs[keys[0]].ns == NS_A and not recs[keys[1]].ns.known
    tc2.close()
    # A restart that knows the tenant indexes them in its namespace at once.
    tc3 = _restarted(tmp_path, pool, [NS_B, NS_A])
    assert {tc3.lower.key_index.records[k].ns for k in keys} == {NS_A}
    assert all(tc3.holds(NS_B, k) is None for k in keys)
    assert tc3.load(tc3.lookup(NS_A, keys, 0), [5, 6, 7], pool) == 3
    tc3.close()
