"""Stores (host, disk, Redis) and the value codec: round trips of real KV blocks of both
layouts, namespaces, integrity checks and restarts."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import xxhash

from kvheat.cache.hashing import NO_TENANT, Namespace
from kvheat.engine.kv_pool import DeviceKVPool
from kvheat.tiers import DiskStore, HostStore, codec, side_check
from kvheat.tiers import host as host_module
from kvheat.tiers.codec import (
    BLAKE2B_VERSION,
    BLAKE3_VERSION,
    CorruptValue,
    decode,
    encode,
    namespace_digest,
    tier_key,
    value_mac_version,
)
from kvheat.tiers.numa import NumaNode, numa_nodes, parse_cpulist, placement

NS_A = Namespace.of("tenant:a")
NS_B = Namespace.of("tenant:b")
NS_V = Namespace.of("tenant:v")
NS_X = Namespace.of("tenant:x")
NS_Y = Namespace.of("tenant:y")

torch.set_num_threads(1)

LAYOUTS = {
    # layout, layers, block_size, per-token shape, dtype
    "gqa": ("gqa", 2, 16, (2, 8), torch.float16),
    "mla": ("mla", 2, 16, (24,), torch.bfloat16),
}


def random_pool(layout: str, num_blocks: int = 4, seed: int = 0) -> DeviceKVPool:
    lay, layers, bs, shape, dtype = LAYOUTS[layout]
    pool = DeviceKVPool(lay, layers, num_blocks, bs, shape, dtype)
    g = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(dtype))
    return pool


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


# ---- codec --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.int8])
def test_codec_round_trip_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5, 7) * 4).to(dtype)
    mk = tier_key("a deployment secret")
    ns = namespace_digest("m", "gqa", None, mk)
    back = decode(bytearray(encode(t, key(1), ns, mk)), key(1), ns, mk)
    assert same_bytes(back, t)


def test_codec_rejects_every_single_byte_flip() -> None:
    t = torch.randn(4, 8)
    mk = tier_key("a deployment secret")
    ns = namespace_digest("m", "gqa", "tenant:a", mk)
    value = encode(t, key(7), ns, mk)
    for pos in range(len(value)):
        bad = bytearray(value)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptValue):
            decode(bad, key(7), ns, mk)
    with pytest.raises(CorruptValue) as e:
        decode(bytearray(value[:-3]), key(7), ns, mk)
    assert e.value.kind == "torn"
    with pytest.raises(CorruptValue) as e:
        decode(bytearray(value), key(8), ns, mk)
    assert e.value.kind == "key"
    with pytest.raises(CorruptValue) as e:
        decode(bytearray(value), key(7), namespace_digest("m", "gqa", "tenant:b", mk), mk)
    assert e.value.kind == "key"
    # The same value under another tier key (a writer without the secret): never valid.
    other = tier_key("another deployment's")
    with pytest.raises(CorruptValue) as e:
        decode(bytearray(value), key(7), ns, other)
    assert e.value.kind == "checksum"
    with pytest.raises(ValueError, match="at least 16"):
        tier_key("short")



# ---- the MAC: BLAKE3 (format 3), BLAKE2b (format 2, the old values and the fallback) -----
MACS = ["blake3", "blake2b"]


def planted_values(t: torch.Tensor, k: bytes, ns: bytes, mac_key: bytes) -> dict[str, bytes]:
    """Values an attacker (or a bug) could leave under the name of (k, ns), none valid for
    a holder of `mac_key`: each format MAC'd under another tier key, a genuine value with
    one payload byte flipped, with its version byte changed to the other MAC's, and with
    the retired unkeyed format's version (1)."""
    foreign = tier_key("an attacker's guess at the secret")
    good = encode(t, k, ns, mac_key, BLAKE3_VERSION)
    flipped = bytearray(good)
    flipped[-1] ^= 0x01
    other_mac = bytearray(good)
    other_mac[4] = BLAKE2B_VERSION  # the version byte: asks for the other MAC
    v1 = bytearray(encode(t, k, ns, mac_key, BLAKE2B_VERSION))
    v1[4] = 1
    return {"blake3, another key": encode(t, k, ns, foreign, BLAKE3_VERSION),
            "blake2b (old format), another key": encode(t, k, ns, foreign, BLAKE2B_VERSION),
            "flipped payload byte": bytes(flipped), "version byte changed": bytes(other_mac),
            "format 1 (unkeyed checksum)": bytes(v1)}


@pytest.mark.parametrize("version", [BLAKE3_VERSION, BLAKE2B_VERSION])
def test_codec_each_mac_round_trips_and_rejects_planted_values(version: int) -> None:
    t = torch.randn(4, 64).half()
    mk = tier_key("a deployment secret")
    ns = namespace_digest("m", "gqa", "tenant:a", mk)
    value = encode(t, key(3), ns, mk, version)
    assert value[4] == version  # the version byte names the MAC
    assert same_bytes(decode(bytearray(value), key(3), ns, mk), t)
    for what, bad in planted_values(t, key(3), ns, mk).items():
        with pytest.raises(CorruptValue) as e:
            decode(bytearray(bad), key(3), ns, mk)
        assert e.value.kind == ("format" if what.startswith("format 1") else "checksum"), what
    # The two MACs of one value differ (different functions and keys), both 16 bytes.
    other = encode(t, key(3), ns, mk, BLAKE2B_VERSION + BLAKE3_VERSION - version)
    assert value[12:28] != other[12:28] and len(value) == len(other)


def test_mac_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(codec.MAC_ENV, raising=False)
    assert value_mac_version() == BLAKE3_VERSION  # the wheel is installed here
    assert value_mac_version("blake2b") == BLAKE2B_VERSION
    monkeypatch.setenv(codec.MAC_ENV, "blake2b")
    assert value_mac_version() == BLAKE2B_VERSION
    assert HostStore(1 << 16, 1 << 12).mac == "blake2b"
    monkeypatch.setenv(codec.MAC_ENV, "sha1")
    with pytest.raises(ValueError, match="'blake3' or 'blake2b'"):
        value_mac_version()
    with pytest.raises(ValueError, match="no value format version 1"):
        encode(torch.zeros(2), key(0), b"n" * 16, b"k" * 32, 1)


def test_without_blake3_values_fall_back_to_blake2b(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """Forced fallback (the `blake3` module missing): writes BLAKE2b, still reads it and
    the old values, refuses BLAKE3 values cleanly (a counted miss, the file deleted)."""
    monkeypatch.delenv(codec.MAC_ENV, raising=False)
    pool = random_pool("gqa", 3)
    mk = tier_key("a deployment secret")
    ns = namespace_digest("m", "gqa", None, mk)
    v3 = encode(pool.read_block(0), key(0), ns, mk, BLAKE3_VERSION)
    disk = DiskStore(tmp_path, 1 << 20, secret="a deployment secret")
    assert disk.mac == "blake3"
    assert disk.put(key(1), pool.read_block(1))  # BLAKE3, by a process that has it

    monkeypatch.setattr(codec, "_blake3", None)
    assert value_mac_version() == BLAKE2B_VERSION
    with pytest.raises(ValueError, match="not installed"):
        value_mac_version("blake3")
    with pytest.raises(CorruptValue, match="blake3 module") as e:
        decode(bytearray(v3), key(0), ns, mk)
    assert e.value.kind == "format"
    with pytest.raises(ValueError, match="needs the blake3 module"):
        encode(pool.read_block(0), key(0), ns, mk, BLAKE3_VERSION)
    v2 = encode(pool.read_block(0), key(0), ns, mk)
    assert v2[4] == BLAKE2B_VERSION
    assert same_bytes(decode(bytearray(v2), key(0), ns, mk), pool.read_block(0))
    fallback = DiskStore(tmp_path, 1 << 20, secret="a deployment secret")
    assert fallback.mac == "blake2b"
    assert fallback.rejected_on_open == 1 and fallback.stats.corrupt_format == 1
    assert list(tmp_path.glob("*.kv")) == []  # the BLAKE3 file: deleted, not indexed
    assert fallback.put(key(2), pool.read_block(2))
    assert same_bytes(fallback.get(key(2)), pool.read_block(2))
    monkeypatch.undo()
    again = DiskStore(tmp_path, 1 << 20, secret="a deployment secret")  # blake3 back
    assert same_bytes(again.get(key(2)), pool.read_block(2))  # reads the BLAKE2b file


@pytest.mark.parametrize("mac", MACS)
def test_disk_never_serves_planted_values_and_reads_the_old_format(mac: str,
                                                                   tmp_path: Path) -> None:
    pool = random_pool("gqa", 3)
    disk = DiskStore(tmp_path, 1 << 22, secret="the deployment's own secret")
    disk.mac = mac
    ns = disk.ns(NS_V)
    blk = pool.read_block(0)
    names = {}
    for i, what in enumerate(planted_values(blk, key(0), ns, disk.mac_key)):
        k = key(10 + i)  # each planted under the name the store looks up for its key
        forged = planted_values(blk, k, ns, disk.mac_key)[what]
        path = disk._path(disk._name(k, ns))
        path.write_bytes(forged)
        names[what] = (k, path)
    # A value written by this deployment before BLAKE3 (format 2, BLAKE2b): still served.
    old = disk._path(disk._name(key(1), ns))
    old.write_bytes(encode(pool.read_block(1), key(1), ns, disk.mac_key, BLAKE2B_VERSION))
    assert disk.put(key(2), pool.read_block(2), ns=NS_V)
    again = DiskStore(tmp_path, 1 << 22, secret="the deployment's own secret")
    assert again.rejected_on_open == 1  # format 1: refused on sight
    for what, (k, path) in names.items():
        assert again.get(k, ns=NS_V) is None, what
        assert not path.exists(), what  # deleted after the failed check
    s = again.stats
    assert (s.corrupt_checksum, s.corrupt_format, s.hits) == (4, 1, 0)
    assert same_bytes(again.get(key(1), ns=NS_V), pool.read_block(1))
    assert same_bytes(again.get(key(2), ns=NS_V), pool.read_block(2))
    assert again.stats.hits == 2


# ---- host ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_host_round_trip_and_capacity(layout: str, copy_path: str) -> None:
    pool = random_pool(layout, 6)
    host = HostStore(4 * pool.bytes_per_block, pool.bytes_per_block)
    data_ptr = host.pool.data_ptr()
    for b in range(4):
        assert host.put(key(b), pool.block_view(b))  # strided device view in
    assert not host.put(key(4), pool.read_block(4))  # full: refused, not raised
    assert host.stats.put_refused == 1
    assert host.used_bytes() == host.capacity_bytes
    for b in range(4):
        assert same_bytes(host.get(key(b)), pool.read_block(b))
    out = torch.empty_like(pool.read_block(0))
    assert host.get(key(2), out=out) is out and same_bytes(out, pool.read_block(2))
    for wrong in (out.float(), out.reshape(-1), out[:1]):  # dtype, shape, size
        with pytest.raises(ValueError, match="out has"):
            host.get(key(2), out=wrong)
    assert host.delete(key(0)) and not host.contains(key(0))
    assert host.put(key(4), pool.read_block(4))
    assert same_bytes(host.get(key(4)), pool.read_block(4))
    assert host.pool.data_ptr() == data_ptr  # one preallocated pool, never reallocated
    assert host.get(key(99)) is None and host.stats.misses == 1


def test_host_detects_corrupted_slot_and_foreign_namespace(copy_path: str) -> None:
    pool = random_pool("gqa")
    host = HostStore(2 * pool.bytes_per_block, pool.bytes_per_block)
    host.put(key(1), pool.read_block(1), ns=NS_A)
    assert host.get(key(1), ns=NS_B) is None  # another tenant's namespace
    assert host.stats.corrupt_key == 1
    host.pool[0, 5] ^= 0xFF  # a stray write into the pool
    assert host.get(key(1), ns=NS_A) is None
    assert host.stats.corrupt_checksum == 1
    assert not host.contains(key(1), ns=NS_A)  # dropped, slot reusable
    assert len(host.free_slots) == 2


def test_host_batches_match_single_calls_and_leave_failed_outputs_unserved(
        copy_path: str) -> None:
    pool = random_pool("gqa", 6)
    host = HostStore(4 * pool.bytes_per_block, pool.bytes_per_block)
    assert host.put_many([(key(b), pool.block_view(b)) for b in range(5)]) == [True] * 4 + [False]
    assert host.stats.puts == 4 and host.stats.put_refused == 1
    outs = [torch.empty_like(pool.read_block(0)) for _ in range(5)]
    host.pool[2, 0] ^= 0x01  # corrupt the third slot
    got = host.get_many([key(b) for b in range(5)], outs=outs)
    assert [t is None for t in got] == [False, False, True, False, True]
    for b in (0, 1, 3):
        assert got[b] is outs[b] and same_bytes(outs[b], pool.read_block(b))
    assert host.stats.corrupt_checksum == 1 and host.stats.hits == 3
    # Every key held and every output matching: the batched copy, checked after it.
    host.put(key(2), pool.block_view(2))
    host.pool[host.entries[key(3)], 0] ^= 0x01  # corrupt the fourth
    outs = [torch.empty_like(pool.read_block(0)) for _ in range(4)]
    got = host.get_many([key(b) for b in range(4)], outs=outs)
    assert [t is None for t in got] == [False, False, False, True]
    for b in (0, 1, 2):
        assert got[b] is outs[b] and same_bytes(outs[b], pool.read_block(b))
    assert host.stats.corrupt_checksum == 2 and not host.contains(key(3))
    with pytest.raises(ValueError, match="output tensors"):
        host.get_many([key(0)], outs=[])
    # A batch checks its outputs as single calls do: a wrong dtype or shape is the caller's
    # ValueError, a strided output of the right shape is filled (copied, not moved by
    # address), and so is a strided single get.
    good = torch.empty_like(pool.read_block(0))
    for wrong in (good.float(), good.reshape(-1), good[:1]):
        with pytest.raises(ValueError, match="out has"):
            host.get_many([key(0), key(1)], outs=[good, wrong])
    wide = torch.zeros((*good.shape, 2), dtype=good.dtype)
    strided = wide[..., 1]
    assert not strided.is_contiguous()
    got = host.get_many([key(0), key(1)], outs=[good, strided])
    assert same_bytes(got[0], pool.read_block(0)) and same_bytes(got[1], pool.read_block(1))
    assert host.get(key(2), out=wide[..., 0]) is not None
    assert same_bytes(wide[..., 0], pool.read_block(2))
    # A load: straight into the (strided) blocks of a device pool, K and V of each layer
    # apart; a corrupt slot among them is a miss and the rest are served.
    into = random_pool("gqa", 6, seed=1)
    assert not into.block_view(0).is_contiguous()
    host.pool[host.entries[key(1)], 3] ^= 0x04
    got = host.get_many([key(b) for b in (0, 1, 2)], outs=[into.block_view(b) for b in (5, 4, 3)])
    assert [t is None for t in got] == [False, True, False]
    assert same_bytes(into.read_block(5), pool.read_block(0))
    assert same_bytes(into.read_block(3), pool.read_block(2))
    assert host.stats.corrupt_checksum == 3 and not host.contains(key(1))


def test_host_large_reads_are_checked_beside_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch copies (a build without `_copyhash`, a tensor it does not take), reads
    of 4 MiB and more are hashed on the side thread while they are copied: a corrupt slot
    is still a counted miss, in a batch and alone, and the rest is served."""
    monkeypatch.setattr(host_module, "_copyhash", None)
    checker = side_check.SideChecker(cpus=lambda: 2)
    monkeypatch.setattr(host_module, "CHECKER", checker)
    blocks = [torch.randn(512 << 10).half() for _ in range(4)]  # 1 MiB each
    host = HostStore(4 * blocks[0].nbytes, blocks[0].nbytes)
    for i, b in enumerate(blocks):
        assert host.put(key(i), b)
    assert checker.worth_it(4 * blocks[0].nbytes) and not checker.worth_it(blocks[0].nbytes)
    host.pool[host.entries[key(2)], 7] ^= 0x10
    outs = [torch.empty_like(b) for b in blocks]
    got = host.get_many([key(i) for i in range(4)], outs=outs)
    assert [t is None for t in got] == [False, False, True, False]
    assert all(torch.equal(outs[i], blocks[i]) for i in (0, 1, 3))
    assert host.stats.corrupt_checksum == 1 and not host.contains(key(2))
    assert any(t.name == "kvheat-side-check" for t in threading.enumerate())
    # One large block alone goes the same way.
    big = torch.randn(2 << 20).half()  # 4 MiB
    alone = HostStore(big.nbytes, big.nbytes)
    assert alone.put(key(9), big)
    assert torch.equal(alone.get(key(9), out=torch.empty_like(big)), big)
    alone.pool[0, 3] ^= 0x01
    assert alone.get(key(9), out=torch.empty_like(big)) is None
    assert alone.stats.corrupt_checksum == 1
    # One core: nothing is sent; a check the thread never answers is done inline.
    assert not side_check.SideChecker(cpus=lambda: 1).worth_it(8 << 20)
    monkeypatch.setattr(side_check, "_WAIT_S", 0.01)
    raw = big.numpy().data
    lost = side_check.SideCheck([raw, raw], [0, xxhash.xxh3_64_intdigest(raw)])
    assert lost.result() == [0]


# ---- NUMA placement -----------------------------------------------------------------------
def fake_sysfs(root: Path, cpulists: dict[int, str]) -> Path:
    for node, cpus in cpulists.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (root / "possible").write_text("0-9\n")  # not a node directory
    return root


def test_numa_topology_and_placement(tmp_path: Path) -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    nodes = numa_nodes(fake_sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: "", 10: "8"}))
    assert [(n.id, sorted(n.cpus)) for n in nodes] == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]),
                                                       (10, [8])]  # node 2 has no CPUs
    assert numa_nodes(tmp_path / "missing") == []
    allowed = sorted(os.sched_getaffinity(0))
    two = [NumaNode(0, frozenset(allowed[:1])), NumaNode(1, frozenset(allowed[1:] or allowed))]
    assert placement("auto", two[:1]) == [None]  # one node: nothing to bind
    assert placement("off", two) == placement(None, two) == [None]
    assert placement("interleave", two) == two
    assert placement(1, two) == [two[1]]
    with pytest.raises(ValueError, match="no NUMA node 7"):
        placement(7, two)
    with pytest.raises(ValueError, match="numa must be"):
        placement("spread", two)
    # A node none of whose CPUs this process may use is never chosen.
    assert placement("interleave", [*two, NumaNode(5, frozenset({10_000}))]) == two


def test_host_pool_interleaved_over_nodes_round_trips_and_restores_affinity() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    two = [NumaNode(0, frozenset(allowed[:1])), NumaNode(1, frozenset(allowed[1:] or allowed))]
    pool = random_pool("mla", 5)
    before = os.sched_getaffinity(0)
    host = HostStore(5 * pool.bytes_per_block, pool.bytes_per_block, numa="interleave",
                     topology=two)
    assert os.sched_getaffinity(0) == before
    assert host.segment_nodes == [0, 1] and [s.shape[0] for s in host.segments] == [3, 2]
    def slot_node(slot: int) -> int | None:  # slots go round the segments
        return host.segment_nodes[slot % len(host.segments)]

    assert [slot_node(s) for s in range(5)] == [0, 1, 0, 1, 0]
    for b in range(5):
        assert host.put(key(b), pool.block_view(b))
    used = {slot_node(s) for s in host.entries.values()}
    assert used == {0, 1}
    for b in range(5):
        assert same_bytes(host.get(key(b)), pool.read_block(b))


def vma_nodes(ptr: int) -> str:
    """The numa_maps line of the mapping holding address `ptr`."""
    starts = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            starts[lo] = True
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        if int(line.split()[0], 16) in starts:
            return line
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not Path("/proc/self/numa_maps").exists() or not numa_nodes(),
                    reason="the kernel exposes no NUMA placement")
def test_host_pool_pages_lie_on_the_chosen_node() -> None:
    node = numa_nodes()[-1]
    host = HostStore(64 << 20, 1 << 20, numa=node.id)
    assert host.segment_nodes == [node.id]
    line = vma_nodes(host.pool.data_ptr())
    counts = dict(f.split("=") for f in line.split()[1:] if f.startswith("N"))
    assert counts and set(counts) == {f"N{node.id}"}, line  # every touched page on the node


# ---- disk ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_disk_round_trip_and_restart(layout: str, tmp_path: Path) -> None:
    pool = random_pool(layout, 5)
    disk = DiskStore(tmp_path, 1 << 20, model="tiny", layout=layout)
    for b in range(5):
        assert disk.put(key(b), pool.block_view(b), ns=NS_X)
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
    assert same_bytes(disk.get(key(3), ns=NS_X), pool.read_block(3))
    # A new object over the same directory (a restarted process) serves the same bytes.
    again = DiskStore(tmp_path, 1 << 20, model="tiny", layout=layout)
    assert again.rejected_on_open == 0
    assert again.used_bytes() == disk.used_bytes()
    assert sorted(k for k, _ in again.stored()) == [key(b) for b in range(5)]
    for b in range(5):
        assert same_bytes(again.get(key(b), ns=NS_X), pool.read_block(b))
    # Another model or tenant never reads these bytes.
    other_model = DiskStore(tmp_path, 1 << 20, model="other", layout=layout)
    assert other_model.get(key(1), ns=NS_X) is None
    # ... nor counts, lists or deletes them: one directory, separate stores.
    assert other_model.used_bytes() == 0 and list(other_model.stored()) == []
    assert other_model.rejected_on_open == 0 and again.used_bytes() == disk.used_bytes()
    assert again.get(key(1), ns=NS_Y) is None


def test_disk_restart_rejects_torn_corrupt_renamed_and_temp_files(tmp_path: Path) -> None:
    pool = random_pool("gqa", 4)
    disk = DiskStore(tmp_path, 1 << 20)
    for b in range(4):
        disk.put(key(b), pool.read_block(b))
    files = sorted(tmp_path.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    name = {k: disk._path(disk._name(k, disk.ns(NO_TENANT))) for k, _ in disk.stored()}
    # torn: truncated mid-payload (a crash that bypassed the rename, or a bad disk)
    with open(name[key(0)], "r+b") as f:
        f.truncate(name[key(0)].stat().st_size - 100)
    # renamed: a valid file under another key's name
    os.replace(name[key(1)], tmp_path / (disk.prefix + "0" * 32 + ".kv"))
    # flipped payload byte: passes the cheap open check, caught on read
    with open(name[key(2)], "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    (tmp_path / f".tmp-{disk.prefix}deadbeef-1-1").write_bytes(b"half a value")
    (tmp_path / ".tmp-feedface-2-2").write_bytes(b"another model's write in flight")
    assert len(files) == 4
    again = DiskStore(tmp_path, 1 << 20)
    assert again.rejected_on_open == 2  # torn + renamed deleted, never indexed
    assert again.stats.corrupt_torn == 1 and again.stats.corrupt_key == 1
    assert not (tmp_path / f".tmp-{disk.prefix}deadbeef-1-1").exists()
    assert (tmp_path / ".tmp-feedface-2-2").exists()  # not ours: left alone
    assert again.get(key(0)) is None and again.get(key(1)) is None
    assert again.get(key(2)) is None and again.stats.corrupt_checksum == 1
    assert not again.contains(key(2))  # dropped after the failed check
    assert same_bytes(again.get(key(3)), pool.read_block(3))


def test_disk_rewrite_keeps_the_value_readable_and_counted_once(tmp_path: Path) -> None:
    import threading

    pool = random_pool("gqa", 2)
    disk = DiskStore(tmp_path, 1 << 20, fsync=False)
    assert disk.put(key(0), pool.read_block(0))
    one = disk.used_bytes()
    misses: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            t = disk.get(key(0))
            if t is None or not same_bytes(t, pool.read_block(0)):
                misses.append(1)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for _ in range(200):  # the same key again (a block demoted twice)
            assert disk.put(key(0), pool.read_block(0))
    finally:
        stop.set()
        th.join()
    assert misses == [] and disk.used_bytes() == one
    assert disk.delete(key(0)) and disk.used_bytes() == 0


def test_disk_truncated_after_open_is_a_counted_miss(tmp_path: Path) -> None:
    pool = random_pool("mla", 2)
    disk = DiskStore(tmp_path, 1 << 20)
    disk.put(key(0), pool.read_block(0))
    path = disk._path(disk._name(key(0), disk.ns(NO_TENANT)))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    assert disk.get(key(0)) is None
    assert disk.stats.corrupt_torn == 1 and disk.used_bytes() == 0


def test_disk_cap_refuses_without_exceeding(tmp_path: Path) -> None:
    pool = random_pool("gqa", 8)
    one = DiskStore(tmp_path, 1 << 20).entry_bytes(pool.read_block(0), key(0))
    disk = DiskStore(tmp_path / "capped", 3 * one + 10)
    ok = [disk.put(key(b), pool.read_block(b)) for b in range(8)]
    assert ok == [True] * 3 + [False] * 5
    assert disk.used_bytes() <= disk.capacity_bytes and disk.stats.put_refused == 5
    assert disk.put(key(1), pool.read_block(5))  # overwriting an entry fits in place
    assert same_bytes(disk.get(key(1)), pool.read_block(5))


def test_disk_full_file_system_pauses_demotion(tmp_path: Path) -> None:
    """A real file-size limit (RLIMIT_FSIZE, EFBIG) in a child process: the put fails,
    nothing raises, demotion pauses, and a fresh process finds only whole files."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, signal, torch
        from kvheat.tiers import DiskStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        disk = DiskStore({str(tmp_path)!r}, 1 << 30, fsync=True)
        small = torch.arange(64, dtype=torch.float32)
        assert disk.put(b"k-small", small)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        big = torch.arange(4096, dtype=torch.float32)  # 16 KiB: over the limit
        assert not disk.put(b"k-big", big)
        assert disk.stats.io_errors == 1 and disk.full_events == 1
        assert not disk.writable()
        assert not disk.put(b"k-small-2", small)  # paused: not even tried
        assert disk.stats.skipped_down == 1
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
    again = DiskStore(tmp_path, 1 << 30)
    assert again.rejected_on_open == 0
    assert [k for k, _ in again.stored()] == [b"k-small"]
    assert same_bytes(again.get(b"k-small"), torch.arange(64, dtype=torch.float32))
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))


def test_transfer_model_fits_latency_and_bandwidth() -> None:
    from kvheat.tiers import TransferModel

    m = TransferModel()
    assert m.estimate(1000) is None  # never measured: no guess
    for n in (1000, 4000, 16000):  # 50 µs + 1 GB/s
        m.record(n, 50e-6 + n / 1e9)
    lat, bw = m.fit()
    assert lat == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(1e9, rel=1e-6)
    assert m.estimate(8000, ops=2) == pytest.approx(2 * 50e-6 + 8000 / 1e9)
    one = TransferModel()
    one.record(4096, 1e-3)  # one size: throughput only
    assert one.fit() == (0.0, pytest.approx(4096 / 1e-3))
    # Stalls (a GC pause, a page-cache miss) in a few transfers do not move the estimate.
    for _ in range(40):
        for n in (1000, 4000, 16000):
            m.record(n, 50e-6 + n / 1e9)
    for n in (4000, 16000, 1000):
        m.record(n, 0.2)
    lat, bw = m.fit()
    assert lat == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(1e9, rel=1e-6)
    for _ in range(9):
        one.record(4096, 1e-3)
    one.record(4096, 0.25)
    assert one.fit() == (0.0, pytest.approx(4096 / 1e-3))
