"""Tier bandwidth against plain baselines, measured side by side in one run.

    python bench/tiers/bandwidth.py [--json docs/results/tiers/bandwidth.json] [--quick]
        [--only hash,host,disk,redis,cluster] [--rounds N]

0. the MACs alone: keyed BLAKE3 (disk and Redis values, format 3), keyed BLAKE2b (format
   2: the old values and the fallback without the `blake3` wheel), unkeyed xxh3-64 (the
   host tier's check) against a plain copy of the same buffer;
1. host tier get/put vs a plain copy of the same bytes plus the index lookup (a dict
   lookup of the key, a precomputed view of the row): target get <= 1.2x that, with the
   xxh3 check, one block a call and 16 a call, each way the store can copy (the C kernel
   `_copyhash` with AVX2 and without, and torch + xxhash, what a build without the
   extension does); then a load's read as the engine makes it: 32 random slots into the
   strided blocks of a GQA device pool, both pools larger than the caches;
2. disk tier read (cold: pages dropped with posix_fadvise; warm: page cache) and write vs
   a plain sequential read / write+fsync of the same bytes, once per MAC (BLAKE3 and
   BLAKE2b), all three interleaved;
3. Redis tier GET/SET of 256-token chunks, pipelined, once per MAC, vs `redis-benchmark`
   with the same value size, pipeline depth and one client, on a redis-server this script
   starts on a free loopback port;
4. Redis Cluster: three nodes on loopback, the same store through `RedisCluster`: a round
   trip of checked chunks, throughput, and a node killed (no exception, misses counted).

Every comparison runs interleaved (A, B, A, B, ...) in one process, so load from other
processes hits both sides alike. Ratios are taken per round (each side against the
baseline run next to it) and reported as the median with the range over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

if not __package__:  # run as `python bench/tiers/bandwidth.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.procs import Redis, RedisCluster
from kvheat.cache.hashing import NO_TENANT, Namespace
from kvheat.engine.kv_pool import DeviceKVPool
from kvheat.tiers import DiskStore, HostStore
from kvheat.tiers import host as host_module
from kvheat.tiers.codec import blake3_available
from kvheat.tiers.redis_store import RedisStore, connect

NS_A = Namespace.of("tenant:a")

torch.set_num_threads(1)
MACS = ("blake3", "blake2b") if blake3_available() else ("blake2b",)
# The ways a host store copies and checks a block, fastest first: the C kernel with AVX2,
# without it, and torch + xxhash (no extension). Those this machine and build have. Older
# trees (the "before" of an A/B run) have neither the extension nor `copy_path`: they copy
# torch's way.
_EXT = getattr(host_module, "_BUILT", None)
COPY_PATHS = ([k for k in ("avx2", "portable") if _EXT is not None
               and (k == "portable" or _EXT.kernel() == "avx2")] + ["torch"])
copy_path: Callable[[str], contextlib.AbstractContextManager[None]] = getattr(
    host_module, "copy_path", lambda name: contextlib.nullcontext())


def on_path(name: str, fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with copy_path(name):
            fn()
    return run


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def shuffled(names: list[str], r: int) -> list[str]:
    """Round `r`'s order, a seeded shuffle: a side runs after each other side about equally
    often. (A fixed order, or one only rotated, always runs B right after A, and the side
    run right after a `copy_` was measured 10-40% slower, whichever it was.)"""
    order = list(names)
    random.Random(r).shuffle(order)
    return order


def rounds_of(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of `fns` in every round, run one after another (`shuffled`)."""
    secs: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in shuffled(list(fns), r):
            secs[name].append(timed(fns[name]))
    return secs


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def ratios(secs: dict[str, list[float]], base: str, invert: bool = False) -> dict[str, dict]:
    """Per round, each side's time over the baseline's (`invert`: baseline over side, a
    share of the baseline's speed), as median and range over the rounds; and `best`, the
    same ratio of the two sides' fastest rounds (the least disturbed by other processes:
    on a shared machine the range is mostly theirs)."""
    out = {}
    for name, ts in secs.items():
        if name != base:
            r = [(b / t if invert else t / b) for t, b in zip(ts, secs[base], strict=True)]
            best = min(secs[base]) / min(ts) if invert else min(ts) / min(secs[base])
            out[name] = {**spread(r), "best": best}
    return out


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def rng(d: dict[str, float], spec: str = ".2f", pct: bool = False) -> str:
    best = f", best {d['best']:{'.0%' if pct else spec}}" if "best" in d else ""
    if pct:
        return f"{d['median']:.0%} ({d['min']:.0%}-{d['max']:.0%}{best})"
    return f"{d['median']:{spec}} ({d['min']:{spec}}-{d['max']:{spec}}{best})"


# ---- the MACs alone -----------------------------------------------------------------------
def bench_hashes(rounds: int) -> list[dict]:
    """GB/s of each check over one buffer (best of `rounds` interleaved repeats, the
    issue's table), and of a plain copy of it."""
    import blake3

    key = os.urandom(32)
    res = []
    for size in (8 << 10, 64 << 10, 1 << 20):
        src = torch.randint(0, 255, (size,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        data = src.numpy().data
        reps = max(1, (8 << 20) // size)

        def many(fn: Callable[[], object], reps: int = reps) -> Callable[[], None]:
            def run() -> None:
                for _ in range(reps):
                    fn()
            return run

        def mac2(data: memoryview = data) -> bytes:
            return hashlib.blake2b(data, key=key, digest_size=16).digest()

        def mac3(data: memoryview = data) -> bytes:
            return bytes(blake3.blake3(data, key=key).digest(16))

        def xxh(data: memoryview = data) -> int:
            return xxhash.xxh3_64_intdigest(data)

        def copy(dst: torch.Tensor = dst, src: torch.Tensor = src) -> torch.Tensor:
            return dst.copy_(src)

        fns = {"blake2b": many(mac2), "xxh3_64": many(xxh), "copy": many(copy)}
        if blake3_available():
            fns["blake3"] = many(mac3)
        secs = rounds_of(fns, rounds)
        res.append({"bytes": size, **{f"{k}_GBps": gbps(size * reps, min(v))
                                      for k, v in secs.items()}})
    return res


# ---- host -------------------------------------------------------------------------------
def bench_host(block_bytes: int, n_blocks: int, rounds: int, batch: int = 16) -> dict:
    """Host get/put (xxh3 check on, the default), one block per call and in batches of
    `batch` blocks (`put_many`/`get_many`: a promoted prefix is loaded that way), each way
    the store can copy (`COPY_PATHS`; unsuffixed: the first), against the plain copy of
    each block plus the index lookup (a dict of key -> row, the rows' views built once),
    all interleaved in every round. (No "check off" side: the kernels take the checksum
    with the copy whatever `verify` says, and a second store's pool, colder in the cache
    than the one every other side touches, measured 10-40% slower for that alone.)"""
    shape = (block_bytes // 2,)
    blocks = [torch.randn(shape).half() for _ in range(n_blocks)]
    store = HostStore(n_blocks * block_bytes, block_bytes)
    rows = list(torch.empty((n_blocks, block_bytes // 2), dtype=torch.float16).unbind(0))
    outs = [torch.empty(shape, dtype=torch.float16) for _ in range(n_blocks)]
    keys = [i.to_bytes(16, "little") for i in range(n_blocks)]
    index = {k: i for i, k in enumerate(keys)}
    items = list(zip(keys, blocks, strict=True))
    runs = [slice(i, i + batch) for i in range(0, n_blocks, batch)]

    def put(host: HostStore) -> Callable[[], None]:
        def run() -> None:
            for k, b in items:
                host.put(k, b)
        return run

    def get(host: HostStore) -> Callable[[], None]:
        def run() -> None:
            for k, o in zip(keys, outs, strict=True):
                if host.get(k, out=o) is None:
                    raise RuntimeError("host tier lost a block")
        return run

    def put_batch() -> None:
        for r in runs:
            store.put_many(items[r])

    def get_batch() -> None:
        for r in runs:
            if any(t is None for t in store.get_many(keys[r], outs=outs[r])):
                raise RuntimeError("host tier lost a block")

    def plain_put() -> None:
        for k, b in items:
            rows[index[k]].copy_(b)

    def plain_get() -> None:
        for k, o in zip(keys, outs, strict=True):
            o.copy_(rows[index[k]])

    first, *others = COPY_PATHS
    put_fns: dict[str, Callable[[], object]] = {"plain_put": plain_put}
    get_fns: dict[str, Callable[[], object]] = {"plain_get": plain_get}
    for path in COPY_PATHS:
        sfx = "" if path == first else "_" + path
        put_fns |= {"put" + sfx: on_path(path, put(store)),
                    "put_batch" + sfx: on_path(path, put_batch)}
        get_fns |= {"get" + sfx: on_path(path, get(store)),
                    "get_batch" + sfx: on_path(path, get_batch)}
    puts = rounds_of(put_fns, rounds)
    gets = rounds_of(get_fns, rounds)
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    total = n_blocks * block_bytes
    out: dict[str, object] = {"block_bytes": block_bytes, "blocks": n_blocks, "batch": batch,
                              "rounds": rounds, "paths": COPY_PATHS}
    for secs in (puts, gets):
        out.update({f"{k}_GBps": gbps(total, statistics.median(v)) for k, v in secs.items()})
        out.update({f"{k}_us_per_block": statistics.median(v) / n_blocks * 1e6
                    for k, v in secs.items()})
    # Cost over the baseline's (target for get: <= 1.2), median and range of the rounds.
    out.update({f"{k}_cost_x": v for k, v in ratios(puts, "plain_put").items()})
    out.update({f"{k}_cost_x": v for k, v in ratios(gets, "plain_get").items()})
    return out


def bench_host_load(layers: int, block_tokens: int, width: int, rounds: int, batch: int = 32,
                    device_bytes: int = 64 << 20) -> dict:
    """A load's host read as the engine makes it: `get_many` of `batch` random slots of a
    host pool twice the device's, into random blocks of a GQA device pool (strided views,
    K and V apart), both pools larger than the caches, against a plain `copy_` of each
    slot into the same blocks plus the index lookup. Each side draws its own slots and
    blocks, cold as a real load's (a draw shared by the sides of a round hands every side
    after the first a warm cache)."""
    probe = DeviceKVPool("gqa", layers, 1, block_tokens, (1, width), torch.float16)
    n_device = max(batch, device_bytes // probe.bytes_per_block)
    pool = DeviceKVPool("gqa", layers, n_device, block_tokens, (1, width), torch.float16)
    bb = pool.bytes_per_block
    host = HostStore(2 * n_device * bb, bb)
    keys = [i.to_bytes(16, "little") for i in range(2 * n_device)]
    for i, k in enumerate(keys):
        host.put(k, pool.block_view(i % n_device))
    rows = {k: host._views[s].tensor for k, s in host.entries.items()}  # type: ignore[union-attr]
    draw = random.Random(0)
    paths = {("get_batch" if p == COPY_PATHS[0] else "get_batch_" + p): p for p in COPY_PATHS}
    secs: dict[str, list[float]] = {"plain_get": [], **{name: [] for name in paths}}
    for r in range(rounds):
        for name in shuffled(list(secs), r):
            ks = draw.sample(keys, batch)
            outs = [pool.block_view(b) for b in draw.sample(range(n_device), batch)]
            if name == "plain_get":
                t0 = time.perf_counter()
                for k, o in zip(ks, outs, strict=True):
                    o.copy_(rows[k])
            else:
                with copy_path(paths[name]):
                    t0 = time.perf_counter()
                    if any(t is None for t in host.get_many(ks, outs=outs)):
                        raise RuntimeError("host tier lost a block")
            secs[name].append(time.perf_counter() - t0)
    out: dict[str, object] = {"block_bytes": bb, "layers": layers, "batch": batch,
                              "device_blocks": n_device, "host_slots": 2 * n_device,
                              "rounds": rounds, "paths": COPY_PATHS}
    out.update({f"{k}_us_per_block": statistics.median(v) / batch * 1e6
                for k, v in secs.items()})
    out.update({f"{k}_cost_x": v for k, v in ratios(secs, "plain_get").items()})
    return out


# ---- disk -------------------------------------------------------------------------------
def drop_pages(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(block_bytes: int, n_blocks: int, rounds: int, root: Path) -> dict:
    """One disk store per MAC and a plain folder of the same bytes: writes, cold reads and
    warm reads, the three interleaved in every round."""
    blocks = [torch.randn(block_bytes // 2).half() for _ in range(n_blocks)]
    keys = [i.to_bytes(16, "little") for i in range(n_blocks)]
    plain_dir = root / "plain"
    plain_dir.mkdir(parents=True, exist_ok=True)
    disks = {}
    for mac in MACS:
        disks[mac] = DiskStore(root / mac, 4 * n_blocks * (block_bytes + 4096), fsync=True)
        disks[mac].mac = mac
    raw = [b.view(torch.uint8).numpy().tobytes() for b in blocks]
    plain_paths = [plain_dir / f"{i}.bin" for i in range(n_blocks)]

    def write(disk: DiskStore) -> Callable[[], None]:
        def run() -> None:
            for k, b in zip(keys, blocks, strict=True):
                if not disk.put(k, b):
                    raise RuntimeError("disk tier refused a block")
        return run

    def plain_write() -> None:
        for p, data in zip(plain_paths, raw, strict=True):
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    def read(disk: DiskStore, cold: bool) -> Callable[[], None]:
        paths = [disk._path(disk._name(k, disk.ns(NO_TENANT))) for k in keys]

        def run() -> None:
            if cold:  # dropping pages is inside both timings alike (microseconds a file)
                drop_pages(paths)
            for k in keys:
                if disk.get(k) is None:
                    raise RuntimeError("disk tier lost a block")
        return run

    def plain_read(cold: bool) -> Callable[[], None]:
        def run() -> None:
            if cold:
                drop_pages(plain_paths)
            for p in plain_paths:
                with open(p, "rb") as f:
                    f.read()
        return run

    total = n_blocks * block_bytes
    res: dict[str, object] = {"block_bytes": block_bytes, "files": n_blocks, "rounds": rounds}
    for what, base, fns in (
            ("write", plain_write, {m: write(d) for m, d in disks.items()}),
            ("cold_read", plain_read(True), {m: read(d, True) for m, d in disks.items()}),
            ("warm_read", plain_read(False), {m: read(d, False) for m, d in disks.items()})):
        secs = rounds_of({"plain": base, **fns}, rounds)
        res[f"plain_{what}_GBps"] = gbps(total, statistics.median(secs["plain"]))
        for mac, r in ratios(secs, "plain", invert=True).items():
            res[f"{what}_{mac}_GBps"] = gbps(total, statistics.median(secs[mac]))
            res[f"{what}_{mac}_share"] = r  # of the plain operation's speed
    for disk in disks.values():
        got = disk.get(keys[0])
        assert got is not None and torch.equal(got, blocks[0])
        assert disk.stats.corrupt_checksum == 0
    return res


# ---- redis ------------------------------------------------------------------------------
def redis_benchmark(port: int, value_bytes: int, n: int, pipeline: int) -> dict[str, float]:
    out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get",
                          "-d", str(value_bytes), "-n", str(n), "-P", str(pipeline), "-c", "1",
                          "--csv"], capture_output=True, text=True, check=True, timeout=300)
    rps: dict[str, float] = {}
    for line in out.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] in ("SET", "GET"):
            rps[cells[0]] = float(cells[1])
    return rps


def chunk_tensor(chunk_bytes: int) -> torch.Tensor:
    # A 256-token chunk of a GQA model: [layers, 2, 256, kv_heads, head_dim] in fp16.
    per_token = chunk_bytes // 256 // 2  # fp16 elements per token, K and V of all layers
    return torch.randn(2, 2, 256, 1, per_token // 4).half() if per_token % 4 == 0 \
        else torch.randn(chunk_bytes // 2).half()


def bench_redis(port: int, chunk_bytes: int, n_ops: int, pipeline: int, rounds: int) -> dict:
    """SET and GET through one store per MAC, interleaved with redis-benchmark runs."""
    stores = {}
    for mac in MACS:
        stores[mac] = RedisStore(connect(f"redis://127.0.0.1:{port}/0", timeout_s=5.0), 1 << 40,
                                 model=f"bench-{mac}", layout="gqa")
        stores[mac].mac = mac
    chunk = chunk_tensor(chunk_bytes)
    value_bytes = stores[MACS[0]].entry_bytes(chunk, b"k" * 16)
    keys = [i.to_bytes(16, "little") for i in range(pipeline)]
    items = [(k, chunk) for k in keys]
    # GETs land in preallocated tensors, as a load lands in device blocks.
    outs = [torch.empty_like(chunk) for _ in keys]
    batches = max(1, n_ops // pipeline)

    def ours_set(st: RedisStore) -> Callable[[], None]:
        def run() -> None:
            for _ in range(batches):
                if not all(st.put_many(items)):
                    raise RuntimeError("redis tier refused a chunk")
        return run

    def ours_get(st: RedisStore) -> Callable[[], None]:
        def run() -> None:
            for _ in range(batches):
                got = st.get_many(keys, outs=outs)
                if any(g is None for g in got):
                    raise RuntimeError("redis tier lost a chunk")
        return run

    ops = batches * pipeline
    rps: dict[str, list[float]] = {}
    for st in stores.values():
        ours_set(st)()
    for _ in range(rounds):  # interleaved: each MAC's SET and GET, then redis-benchmark
        for mac, st in stores.items():
            rps.setdefault(f"set_{mac}", []).append(ops / timed(ours_set(st)))
            rps.setdefault(f"get_{mac}", []).append(ops / timed(ours_get(st)))
        ref = redis_benchmark(port, value_bytes, ops, pipeline)
        rps.setdefault("redis_benchmark_set", []).append(ref["SET"])
        rps.setdefault("redis_benchmark_get", []).append(ref["GET"])
    for st in stores.values():
        got = st.get(keys[0])
        assert got is not None and torch.equal(got, chunk) and st.stats.corrupt_checksum == 0
    med = statistics.median
    stores[MACS[0]].client.flushall()
    res: dict[str, object] = {"chunk_bytes": chunk.numel() * 2, "value_bytes": value_bytes,
                              "pipeline": pipeline, "ops": ops, "rounds": rounds}
    res.update({f"{k}_ops": med(v) for k, v in rps.items()})
    for op in ("set", "get"):
        ref = rps[f"redis_benchmark_{op}"]
        for mac in MACS:
            # Per round: ours over the redis-benchmark run next to it.
            res[f"{op}_{mac}_share"] = {
                **spread([a / b for a, b in zip(rps[f"{op}_{mac}"], ref, strict=True)]),
                "best": max(rps[f"{op}_{mac}"]) / max(ref)}
    return res


def bench_cluster(root: Path, chunk_bytes: int, n_chunks: int) -> dict:
    cluster = RedisCluster(root)
    try:
        cluster.start()
        st = RedisStore(connect(cluster.url, cluster=True, timeout_s=1.0),
                        1 << 40, model="bench", layout="gqa", backoff_initial_s=0.2)
        chunks = [torch.randn(chunk_bytes // 2).half() for _ in range(n_chunks)]
        keys = [i.to_bytes(16, "little") for i in range(n_chunks)]
        t_set = timed(lambda: st.put_many(list(zip(keys, chunks, strict=True)), ns=NS_A))
        got: list = []
        t_get = timed(lambda: got.extend(st.get_many(keys, ns=NS_A)))
        identical = sum(1 for g, c in zip(got, chunks, strict=True)
                        if g is not None and torch.equal(g, c))
        slots = {int(st.client.keyslot(st.rkey(k, NS_A))) // 5462 for k in keys}
        cluster.nodes[1].kill()
        after: list = []
        raised = None
        try:
            after = st.get_many(keys, ns=NS_A)
        except Exception as e:  # the store must not raise; record it if it does
            raised = repr(e)
        return {"nodes": 3, "chunks": n_chunks, "chunk_bytes": chunk_bytes,
                "identical_after_round_trip": identical, "slot_ranges_used": len(slots),
                "set_ops": n_chunks / t_set, "get_ops": n_chunks / t_get,
                "node_killed_raised": raised,
                "node_killed_served": sum(1 for g in after if g is not None),
                "node_killed_went_down": st.stats.went_down}
    finally:
        cluster.stop()


class _Skip(Exception):
    pass


# ---- main -------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(RESULTS / "tiers" / "bandwidth.json"))
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per comparison (11)")
    ap.add_argument("--only", default="hash,host,disk,redis,cluster",
                    help="comma-separated parts to run")
    args = ap.parse_args()
    only = set(args.only.split(","))
    rounds = args.rounds or (3 if args.quick else 11)
    res: dict[str, object] = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                              "macs": list(MACS), "load_avg_start": os.getloadavg()}
    rows: list[tuple[str, str, str, str, str]] = []

    if "hash" in only:
        res["hash"] = hashes = bench_hashes(rounds)
        for h in hashes:
            rows.append((f"MAC alone, {h['bytes'] >> 10} KiB: BLAKE3 / BLAKE2b / xxh3-64",
                         f"{h.get('blake3_GBps', 0):.2f} / {h['blake2b_GBps']:.2f} / "
                         f"{h['xxh3_64_GBps']:.1f} GB/s", f"copy {h['copy_GBps']:.1f} GB/s",
                         "-", "BLAKE3 >=3 GB/s"))

    res["host"] = []
    # 8 KiB: the replay's block (a one-layer stand-in); 64 KiB: a 16-token block of the
    # tiny Llama; 1 MiB: its 256-token chunk; 2 MiB: a 16-token block of Llama-3-8B in bf16.
    for block in (8 << 10, 64 << 10, 1 << 20, 2 << 20) if "host" in only else ():
        h = bench_host(block, 128 if block < (1 << 20) else 16, 4 * rounds)
        res["host"].append(h)  # type: ignore[union-attr]
        first = COPY_PATHS[0]
        for op in ("get", "put"):
            for path in COPY_PATHS:
                for kind, label in (("", ""), ("_batch", f", {h['batch']} a call")):
                    name = op + kind + ("" if path == first else "_" + path)
                    rows.append((f"host {block >> 10} KiB blocks{label}, {path}: {op}",
                                 f"{h[name + '_us_per_block']:.2f} us "
                                 f"({h[name + '_GBps']:.2f} GB/s)",
                                 f"copy+lookup {h['plain_' + op + '_us_per_block']:.2f} us",
                                 rng(h[name + "_cost_x"]) + "x",  # type: ignore[arg-type]
                                 "<=1.2x" if op == "get" else "-"))

    # A load's read, as `TierManager` makes it: 8 KiB, the replay's one-layer block of 512
    # tokens; 64 KiB, a 16-token block of 16 layers; 2 MiB, a 512-token block of 16 layers.
    res["host_load"] = []
    for layers, tokens, width in ((1, 512, 4), (16, 16, 64), (16, 512, 64)) if "host" in only \
            else ():
        h = bench_host_load(layers, tokens, width, 40 * rounds)
        res["host_load"].append(h)  # type: ignore[union-attr]
        for p in COPY_PATHS:
            name = "get_batch" if p == COPY_PATHS[0] else "get_batch_" + p
            rows.append((f"host load, {h['block_bytes'] >> 10} KiB blocks, {h['batch']} a call "
                         f"into pool blocks, {p}", f"{h[name + '_us_per_block']:.2f} us",
                         f"copy+lookup {h['plain_get_us_per_block']:.2f} us",
                         rng(h[name + "_cost_x"]) + "x", "<=1.2x"))  # type: ignore[arg-type]

    with tempfile.TemporaryDirectory(prefix="kvheat-bench-") as tmp:
        d = bench_disk(2 << 20, 16 if args.quick else 32, rounds, Path(tmp) / "disk") \
            if "disk" in only else None
        res["disk"] = d
        for what, label, target in (("cold_read", "cold read", ">=50%"),
                                    ("warm_read", "warm read", ">=50%"),
                                    ("write", "write+fsync", "-")):
            for mac in MACS if d is not None else ():
                rows.append((f"disk 2 MiB files, {mac}: {label}",
                             f"{d[f'{what}_{mac}_GBps']:.2f} GB/s",  # type: ignore[index]
                             f"plain {d[f'plain_{what}_GBps']:.2f} GB/s",  # type: ignore[index]
                             rng(d[f"{what}_{mac}_share"], pct=True),  # type: ignore[index]
                             target))

        if not only & {"redis", "cluster"}:
            pass
        elif shutil.which("redis-server") and shutil.which("redis-benchmark"):
            redis = Redis(Path(tmp) / "redis").start()
            port = redis.port
            try:
                res["redis"] = []
                # 64 KiB is a small model's chunk; 1 MiB is a 256-token chunk of the built-in
                # tiny Llama (4 KiB of fp32 KV per token); real 8B models reach 32 MiB.
                for chunk in (64 << 10, 1 << 20) if "redis" in only else ():
                    r = bench_redis(port, chunk, 512 if chunk < (256 << 10) else 128, 16, rounds)
                    res["redis"].append(r)  # type: ignore[union-attr]
                    for op in ("set", "get"):
                        for mac in MACS:
                            rows.append((f"redis {chunk >> 10} KiB chunks, pipeline 16, {mac}: "
                                         f"{op.upper()}", f"{r[f'{op}_{mac}_ops']:.0f}/s",
                                         f"redis-benchmark {r[f'redis_benchmark_{op}_ops']:.0f}/s",
                                         rng(r[f"{op}_{mac}_share"], pct=True),  # type: ignore[arg-type]
                                         ">=50%"))
            finally:
                redis.kill()
            try:
                if "cluster" not in only:
                    raise _Skip
                c = bench_cluster(Path(tmp) / "cluster", 64 << 10, 64)
                res["redis_cluster"] = c
                rows.append(("redis cluster (3 nodes) 64 KiB: SET", f"{c['set_ops']:.0f}/s",
                             f"{c['identical_after_round_trip']}/{c['chunks']} identical", "-", "-"))
                rows.append(("redis cluster: GET", f"{c['get_ops']:.0f}/s",
                             f"node killed: raised={c['node_killed_raised']}, "
                             f"served {c['node_killed_served']}", "-", "-"))
            except _Skip:
                pass
            except (subprocess.SubprocessError, RuntimeError, OSError) as e:
                res["redis_cluster"] = {"error": repr(e)}
                rows.append(("redis cluster", "failed", repr(e)[:60], "-", "-"))
        else:
            res["redis"] = {"skipped": "redis-server or redis-benchmark not installed"}
            rows.append(("redis", "skipped", "redis-server not installed", "-", "-"))

    widths = [max(len(r[i]) for r in rows + [("what", "kvheat", "baseline", "ratio", "target")])
              for i in range(5)]
    head = ("what", "kvheat", "baseline", "ratio", "target")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    res["load_avg_end"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
