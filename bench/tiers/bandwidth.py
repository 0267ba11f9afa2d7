"""Tier bandwidth against plain baselines, measured side by side in one run.

    python bench/tiers/bandwidth.py [--json results/tiers/bandwidth.json] [--quick]

1. host tier put/get vs a plain `torch` copy of the same bytes (target >= 70%), with the
   checksum on (the default) and off;
2. disk tier read (cold: pages dropped with posix_fadvise) and write vs a plain sequential
   read / write+fsync of the same bytes (target: read >= 50%);
3. Redis tier GET/SET of 256-token chunks, pipelined, vs `redis-benchmark` with the same
   value size, pipeline depth and one client (target >= 50%), on a redis-server this
   script starts on a free loopback port;
4. Redis Cluster: three nodes on loopback, the same store through `RedisCluster`: a round
   trip of checked chunks, throughput, and a node killed (no exception, misses counted).

Each pair runs interleaved (A, B, A, B, ...) and reports the best run of each side, so
load from other processes hits both sides alike and disturbs the result least. Redis
figures are medians (redis-benchmark reports one rate per run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not __package__:  # run as `python bench/tiers/bandwidth.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.procs import Redis, RedisCluster
from kvheat.tiers import DiskStore, HostStore
from kvheat.tiers.redis_store import RedisStore, connect

torch.set_num_threads(1)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(a: Callable[[], object], b: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Best (least disturbed) seconds of `a` and of `b` over `rounds`, run alternately:
    on a shared machine the minimum is the run other processes slowed down least."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(timed(a))
        tb.append(timed(b))
    return min(ta), min(tb)


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


# ---- host -------------------------------------------------------------------------------
def bench_host(block_bytes: int, n_blocks: int, rounds: int, batch: int = 16) -> dict:
    """Host put/get with the checksum on and off, one block per call and in batches of
    `batch` blocks (`put_many`/`get_many`: a promoted prefix is loaded that way), and a
    plain torch copy of the same bytes block by block, all interleaved in every round;
    best round of each."""
    shape = (block_bytes // 2,)
    blocks = [torch.randn(shape).half() for _ in range(n_blocks)]
    stores = {True: HostStore(n_blocks * block_bytes, block_bytes, verify=True),
              False: HostStore(n_blocks * block_bytes, block_bytes, verify=False)}
    plain = torch.empty((n_blocks, block_bytes // 2), dtype=torch.float16)
    outs = [torch.empty(shape, dtype=torch.float16) for _ in range(n_blocks)]
    keys = [i.to_bytes(16, "little") for i in range(n_blocks)]
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
            stores[True].put_many(items[r])

    def get_batch() -> None:
        for r in runs:
            if any(t is None for t in stores[True].get_many(keys[r], outs=outs[r])):
                raise RuntimeError("host tier lost a block")

    def plain_put() -> None:
        for i, b in enumerate(blocks):
            plain[i].copy_(b)

    def plain_get() -> None:
        for i, o in enumerate(outs):
            o.copy_(plain[i])

    fns = {"put": put(stores[True]), "put_nocheck": put(stores[False]), "put_batch": put_batch,
           "plain_put": plain_put,
           "get": get(stores[True]), "get_nocheck": get(stores[False]), "get_batch": get_batch,
           "plain_get": plain_get}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn))
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    total = n_blocks * block_bytes
    out: dict[str, float | int] = {"block_bytes": block_bytes, "blocks": n_blocks, "batch": batch}
    out.update({f"{k}_GBps": gbps(total, v) for k, v in best.items()})
    for k in ("put", "put_nocheck", "put_batch"):
        out[f"{k}_ratio"] = best["plain_put"] / best[k]
    for k in ("get", "get_nocheck", "get_batch"):
        out[f"{k}_ratio"] = best["plain_get"] / best[k]
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
    blocks = [torch.randn(block_bytes // 2).half() for _ in range(n_blocks)]
    keys = [i.to_bytes(16, "little") for i in range(n_blocks)]
    store_dir, plain_dir = root / "store", root / "plain"
    plain_dir.mkdir(parents=True, exist_ok=True)
    disk = DiskStore(store_dir, 4 * n_blocks * (block_bytes + 4096), fsync=True)
    raw = [b.view(torch.uint8).numpy().tobytes() for b in blocks]
    plain_paths = [plain_dir / f"{i}.bin" for i in range(n_blocks)]

    def write() -> None:
        for k, b in zip(keys, blocks, strict=True):
            if not disk.put(k, b):
                raise RuntimeError("disk tier refused a block")

    def plain_write() -> None:
        for p, data in zip(plain_paths, raw, strict=True):
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    store_paths: list[Path] = []

    def read() -> None:
        for k in keys:
            if disk.get(k) is None:
                raise RuntimeError("disk tier lost a block")

    def plain_read() -> None:
        for p in plain_paths:
            with open(p, "rb") as f:
                f.read()

    def cold(fn: Callable[[], None], paths_of: Callable[[], list[Path]]) -> Callable[[], None]:
        def run() -> None:
            drop_pages(paths_of())
            fn()
        return run

    total = n_blocks * block_bytes
    tw, tpw = interleaved(write, plain_write, rounds)
    store_paths = sorted(store_dir.glob("*.kv"))
    # Dropping pages is inside both timings alike; it costs microseconds per file.
    tr, tpr = interleaved(cold(read, lambda: store_paths), cold(plain_read, lambda: plain_paths),
                          rounds)
    twr, tpwr = interleaved(read, plain_read, rounds)
    got = disk.get(keys[0])
    assert got is not None and torch.equal(got, blocks[0])
    return {"block_bytes": block_bytes, "files": n_blocks,
            "write_GBps": gbps(total, tw), "plain_write_GBps": gbps(total, tpw),
            "write_ratio": tpw / tw,
            "cold_read_GBps": gbps(total, tr), "plain_cold_read_GBps": gbps(total, tpr),
            "cold_read_ratio": tpr / tr,
            "warm_read_GBps": gbps(total, twr), "plain_warm_read_GBps": gbps(total, tpwr),
            "warm_read_ratio": tpwr / twr}


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
    st = RedisStore(connect(f"redis://127.0.0.1:{port}/0", timeout_s=5.0), 1 << 40,
                    model="bench", layout="gqa")
    chunk = chunk_tensor(chunk_bytes)
    value_bytes = st.entry_bytes(chunk, b"k" * 16)
    keys = [i.to_bytes(16, "little") for i in range(pipeline)]
    items = [(k, chunk) for k in keys]
    # GETs land in preallocated tensors, as a load lands in device blocks.
    outs = [torch.empty_like(chunk) for _ in keys]
    batches = max(1, n_ops // pipeline)

    def ours_set() -> None:
        for _ in range(batches):
            if not all(st.put_many(items)):
                raise RuntimeError("redis tier refused a chunk")

    def ours_get() -> None:
        for _ in range(batches):
            got = st.get_many(keys, outs=outs)
            if any(g is None for g in got):
                raise RuntimeError("redis tier lost a chunk")

    ops = batches * pipeline
    ours_set()
    set_rps, get_rps, ref_set, ref_get = [], [], [], []
    for _ in range(rounds):  # interleaved with redis-benchmark runs
        set_rps.append(ops / timed(ours_set))
        get_rps.append(ops / timed(ours_get))
        ref = redis_benchmark(port, value_bytes, ops, pipeline)
        ref_set.append(ref["SET"])
        ref_get.append(ref["GET"])
    got = st.get(keys[0])
    assert got is not None and torch.equal(got, chunk)
    med = statistics.median
    st.client.flushall()
    return {"chunk_bytes": chunk.numel() * 2, "value_bytes": value_bytes, "pipeline": pipeline,
            "ops": ops, "set_ops": med(set_rps), "get_ops": med(get_rps),
            "redis_benchmark_set_ops": med(ref_set), "redis_benchmark_get_ops": med(ref_get),
            "set_ratio": med(set_rps) / med(ref_set), "get_ratio": med(get_rps) / med(ref_get)}


def bench_cluster(root: Path, chunk_bytes: int, n_chunks: int) -> dict:
    cluster = RedisCluster(root)
    try:
        cluster.start()
        st = RedisStore(connect(cluster.url, cluster=True, timeout_s=1.0),
                        1 << 40, model="bench", layout="gqa", backoff_initial_s=0.2)
        chunks = [torch.randn(chunk_bytes // 2).half() for _ in range(n_chunks)]
        keys = [i.to_bytes(16, "little") for i in range(n_chunks)]
        t_set = timed(lambda: st.put_many(list(zip(keys, chunks, strict=True)), salt="tenant:a"))
        got: list = []
        t_get = timed(lambda: got.extend(st.get_many(keys, salt="tenant:a")))
        identical = sum(1 for g, c in zip(got, chunks, strict=True)
                        if g is not None and torch.equal(g, c))
        slots = {int(st.client.keyslot(st.rkey(k, "tenant:a"))) // 5462 for k in keys}
        cluster.nodes[1].kill()
        after: list = []
        raised = None
        try:
            after = st.get_many(keys, salt="tenant:a")
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
    ap.add_argument("--only", default="host,disk,redis,cluster",
                    help="comma-separated parts to run")
    args = ap.parse_args()
    only = set(args.only.split(","))
    rounds = 3 if args.quick else 11
    res: dict[str, object] = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    rows: list[tuple[str, str, str, str, str]] = []

    res["host"] = []
    # 64 KiB: a 16-token block of the tiny Llama; 1 MiB: its 256-token chunk; 2 MiB: a
    # 16-token block of Llama-3-8B in bf16 (128 KiB of KV per token).
    for block in (64 << 10, 1 << 20, 2 << 20) if "host" in only else ():
        h = bench_host(block, 128 if block < (1 << 20) else 16, 4 * rounds)
        res["host"].append(h)  # type: ignore[union-attr]
        for op in ("put", "get"):
            for suffix, label in (("", ""), ("_batch", f", {h['batch']} a call"),
                                  ("_nocheck", ", no checksum")):
                rows.append((f"host {block >> 10} KiB blocks{label}: {op}",
                             f"{h[op + suffix + '_GBps']:.2f} GB/s",
                             f"copy {h['plain_' + op + '_GBps']:.2f} GB/s",
                             f"{h[op + suffix + '_ratio']:.0%}", ">=70%"))

    with tempfile.TemporaryDirectory(prefix="kvheat-bench-") as tmp:
        d = bench_disk(2 << 20, 16 if args.quick else 32, rounds, Path(tmp) / "disk") \
            if "disk" in only else None
        res["disk"] = d
        rows += [] if d is None else [("disk 2 MiB files: cold read", f"{d['cold_read_GBps']:.2f} GB/s",
                     f"plain read {d['plain_cold_read_GBps']:.2f} GB/s",
                     f"{d['cold_read_ratio']:.0%}", ">=50%"),
                    ("disk 2 MiB files: warm read", f"{d['warm_read_GBps']:.2f} GB/s",
                     f"plain read {d['plain_warm_read_GBps']:.2f} GB/s",
                     f"{d['warm_read_ratio']:.0%}", ">=50%"),
                    ("disk 2 MiB files: write+fsync", f"{d['write_GBps']:.2f} GB/s",
                     f"plain write {d['plain_write_GBps']:.2f} GB/s",
                     f"{d['write_ratio']:.0%}", "-")]

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
                    tag = f"redis {chunk >> 10} KiB chunks, pipeline 16"
                    rows.append((tag + ": SET", f"{r['set_ops']:.0f}/s",
                                 f"redis-benchmark {r['redis_benchmark_set_ops']:.0f}/s",
                                 f"{r['set_ratio']:.0%}", ">=50%"))
                    rows.append((tag + ": GET", f"{r['get_ops']:.0f}/s",
                                 f"redis-benchmark {r['redis_benchmark_get_ops']:.0f}/s",
                                 f"{r['get_ratio']:.0%}", ">=50%"))
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
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
