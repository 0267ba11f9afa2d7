"""Block-cache operation cost: µs per block and per request, and side by side with
vLLM's KVCacheManager and SGLang's RadixCache.

    python bench/cache/ops.py [--json results/cache/ops.json] [--rounds 5]
    KVHEAT_VLLM_PYTHON=/tmp/vllm/bin/python python bench/cache/ops.py   # vLLM elsewhere
    KVHEAT_SGLANG_PYTHON=/tmp/sgl/bin/python python bench/cache/ops.py  # + SGLang

Load A: 12,000-token prompts, 16-token blocks, 50% shared prefix.
Load B (the peers' load): 2,000 requests of 640 tokens over 8 shared 512-token prefixes.
vLLM is found as bench/_lib/peers.py finds it (the project's .venv after `make vllm`). Each peer
runs in its own interpreter, started once and kept alive (`--peer NAME`); the rounds are
interleaved, kvheat, vLLM, SGLang, kvheat, vLLM, SGLang ..., and each ratio is taken
between the runs of one round: the median and range over the rounds are reported, every
round's figures are in the JSON, and a warning is printed when the machine is not idle.
All sides run with the garbage collector off and one thread.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

if not __package__:  # run as `python bench/cache/ops.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.peers import check_quiet, find_vllm_python, fmt_ratio, paired_ratio

BS = 16


def load_a(n_prompts: int = 40, length: int = 12_000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(32_000) for _ in range(length // 2)]
    return [shared + [rng.randrange(32_000) for _ in range(length - len(shared))] for _ in range(n_prompts)]


def load_b(n: int = 2000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32_000) for _ in range(512)] for _ in range(8)]
    return [prefixes[i % 8] + [rng.randrange(32_000) for _ in range(128)] for i in range(n)]


def bench_kvheat() -> dict:
    from kvheat.cache import CacheConfig, KVCacheManager

    out: dict = {}
    # Load A.
    prompts = load_a()
    m = KVCacheManager(CacheConfig(num_blocks=40 * 750 + 64, block_size=BS))
    t = time.perf_counter()
    reqs = [m.make_request(f"a{i}", p) for i, p in enumerate(prompts)]
    hash_s = time.perf_counter() - t
    n_blocks = sum(len(r.keys) for r in reqs)
    alloc_s = free_s = 0.0
    for r in reqs:
        t = time.perf_counter()
        m.allocate(r)
        alloc_s += time.perf_counter() - t
        t = time.perf_counter()
        m.free(r)
        free_s += time.perf_counter() - t
    # Match of fully cached prompts (every request above is now cached).
    match_times = []
    for r in reqs:
        t = time.perf_counter()
        hit = m.match_prefix(r)
        match_times.append(time.perf_counter() - t)
        assert len(hit) == len(r.keys)
    # Allocate + free of fully cached prompts (all hits: refcount and policy bookkeeping).
    t = time.perf_counter()
    for r in reqs:
        m.allocate(r)
        m.free(r)
    warm_s = time.perf_counter() - t
    out["A"] = {
        "blocks_per_prompt": n_blocks // len(reqs),
        "hash_us_per_block": 1e6 * hash_s / n_blocks,
        "match_cached_us_per_block": 1e6 * statistics.median(match_times) / (n_blocks / len(reqs)),
        "alloc_free_cold_us_per_block": 1e6 * (alloc_s + free_s) / n_blocks,
        "alloc_free_warm_us_per_block": 1e6 * warm_s / n_blocks,
        "alloc_free_cold_us_per_request": 1e6 * (alloc_s + free_s) / len(reqs),
    }
    # Load B, with a pool small enough to evict (as the peers were run).
    prompts_b = load_b()
    m = KVCacheManager(CacheConfig(num_blocks=2048, block_size=BS))
    t = time.perf_counter()
    reqs = [m.make_request(f"b{i}", p) for i, p in enumerate(prompts_b)]
    hash_b = time.perf_counter() - t
    look = alloc = free = 0.0
    for r in reqs:
        t0 = time.perf_counter()
        hit = m.match_prefix(r)
        t1 = time.perf_counter()
        m.allocate(r, hit)
        t2 = time.perf_counter()
        m.free(r)
        t3 = time.perf_counter()
        look += t1 - t0
        alloc += t2 - t1
        free += t3 - t2
    n = len(reqs)
    out["B"] = {"hash_us": 1e6 * hash_b / n, "lookup_us": 1e6 * look / n,
                "allocate_us": 1e6 * alloc / n, "free_us": 1e6 * free / n,
                "hit_rate": m.stats.hit_rate}
    return out


def bench_vllm() -> dict:
    """vLLM v1's KVCacheManager on load B (run inside vLLM's own venv)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=2048, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    mgr = KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                         enable_caching=True)
    hasher = get_request_block_hasher(BS, sha256)
    sp = SamplingParams(max_tokens=1)
    prompts = load_b()
    t = time.perf_counter()
    reqs = [Request(f"b{i}", p, sp, None, block_hasher=hasher) for i, p in enumerate(prompts)]
    hash_s = time.perf_counter() - t
    look = alloc = free = 0.0
    hits = total = 0
    for r in reqs:
        t0 = time.perf_counter()
        blocks, n_computed = mgr.get_computed_blocks(r)[:2]
        t1 = time.perf_counter()
        mgr.allocate_slots(r, len(r.prompt_token_ids) - n_computed, n_computed, blocks)
        t2 = time.perf_counter()
        mgr.free(r)
        t3 = time.perf_counter()
        look += t1 - t0
        alloc += t2 - t1
        free += t3 - t2
        hits += n_computed
        total += len(r.prompt_token_ids)
    n = len(reqs)
    return {"hash_us": 1e6 * hash_s / n, "lookup_us": 1e6 * look / n, "allocate_us": 1e6 * alloc / n,
            "free_us": 1e6 * free / n, "hit_rate": hits / total}


def bench_sglang() -> dict:
    """SGLang's RadixCache (simulated allocator) on load B (run inside SGLang's venv)."""
    import types
    from array import array
    from importlib.abc import Loader, MetaPathFinder
    from importlib.machinery import ModuleSpec

    class Anything(type):  # a placeholder class whose every attribute is itself
        def __getattr__(cls, attr: str) -> type:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return cls

    class StandIn(types.ModuleType):  # any attribute is a placeholder class
        def __getattr__(self, attr: str) -> type:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Anything(attr, (), {})

    class StandInFinder(MetaPathFinder, Loader):
        """SGLang's config package imports torchvision, whose PyPI build fails beside CPU
        torch; the radix cache never uses it, so every torchvision module is a stand-in."""

        def find_spec(self, name, path=None, target=None):  # noqa: ANN001
            if name == "torchvision" or name.startswith("torchvision."):
                return ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec: ModuleSpec) -> types.ModuleType:
            return StandIn(spec.name)

        def exec_module(self, module: types.ModuleType) -> None:
            module.__path__ = []

    sys.meta_path.insert(0, StandInFinder())
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    class SlotAllocator:  # hands out KV slot indices, as SGLang's token-to-KV pool does
        def __init__(self, size: int) -> None:
            self.free_slots = list(range(size))

        def alloc(self, n: int) -> torch.Tensor:
            out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
            return torch.tensor(out, dtype=torch.int64)

        def free(self, idx: torch.Tensor) -> None:
            self.free_slots.extend(idx.tolist())

    capacity = 2048 * BS
    alloc = SlotAllocator(capacity + 4096)
    cache = RadixCache.create_simulated(mock_allocator=alloc, page_size=BS)
    prompts = load_b()
    look = ins = ev = 0.0
    hits = total = 0
    for p in prompts:
        key = RadixKey(array("q", p))
        t0 = time.perf_counter()
        res = cache.match_prefix(MatchPrefixParams(key=key))
        t1 = time.perf_counter()
        n_hit = res.device_prefix_len
        value = torch.cat([res.device_indices[:n_hit], alloc.alloc(len(p) - n_hit)])
        t2 = time.perf_counter()
        cache.insert(InsertParams(key=key, value=value))
        t3 = time.perf_counter()
        if cache.total_size() > capacity:
            cache.evict(EvictParams(num_tokens=cache.total_size() - capacity))
        t4 = time.perf_counter()
        look += t1 - t0
        ins += t3 - t2
        ev += t4 - t3
        hits += n_hit
        total += len(p)
    n = len(prompts)
    return {"lookup_us": 1e6 * look / n, "insert_us": 1e6 * ins / n, "free_us": 1e6 * ev / n,
            "hit_rate": hits / total}


def median_of(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def b_total(b: dict) -> float:
    """µs per request of lookup + allocate (insert) + free (evict), hashing excluded."""
    return b["lookup_us"] + b.get("allocate_us", b.get("insert_us", 0.0)) + b.get("free_us", 0.0)


class Peer:
    """A peer's interpreter running `--peer NAME`: one Load B round per `round()` call."""

    MARK = "CACHE_OPS_RESULT "

    def __init__(self, name: str, python: str) -> None:
        self.name = name
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([python, __file__, "--peer", name], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)

    def round(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(self.MARK):
                return json.loads(line[len(self.MARK):])
        raise RuntimeError(f"{self.name} exited with {self.proc.wait()}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve_peer(name: str) -> None:
    """The peer's side: one round of Load B for each "run" line on stdin."""
    fn = bench_vllm if name == "vllm" else bench_sglang
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(Peer.MARK + json.dumps(fn()), flush=True)


def load_b_table(res: dict, absent: dict[str, str]) -> Table:
    """Load B per system; the ratio column only when a peer ran, and a footer line for each
    peer that did not, saying why (`absent`: name -> reason)."""
    from rich.table import Table

    ran = [name for name in res if name != "kvheat"]
    t = Table(title="Load B: 2,000 requests × 640 tokens over 8 shared 512-token prefixes "
                    "(µs per request, medians"
                    + ("; ratio: median and range of the rounds' ratios)" if ran else ")"),
              caption="\n".join(f"no {name}: {why}" for name, why in absent.items()) or None,
              caption_justify="left")
    cols = ["system", "hash", "lookup", "allocate", "free", "total (no hash)", "hit rate"]
    for col in cols + (["kvheat ÷ peer"] if ran else []):
        t.add_column(col, justify="right" if col != "system" else "left", no_wrap=True)
    for name in ("kvheat", *ran):
        b = res[name] if name != "kvheat" else res["kvheat"]["B"]
        ratio = [fmt_ratio(b["kvheat_over_peer"]) if name != "kvheat" else ""] if ran else []
        t.add_row(name, f"{b.get('hash_us', float('nan')):.1f}", f"{b['lookup_us']:.1f}",
                  f"{b.get('allocate_us', b.get('insert_us', 0.0)):.1f}", f"{b.get('free_us', 0.0):.1f}",
                  f"{b_total(b):.1f}", f"{b['hit_rate']:.1%}", *ratio)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(RESULTS / "cache" / "ops.json"))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (at least 3)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--no-peer", action="store_true",
                    help="kvheat alone: run neither vLLM nor SGLang")
    ap.add_argument("--peer", choices=["vllm", "sglang"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    gc.disable()  # the collector's pauses are noise here; the peers run the same way
    if args.peer:
        serve_peer(args.peer)
        return
    from rich.table import Table

    from kvheat.replay.report import print_uncut, table_console

    report: dict = {"rounds": args.rounds}
    check_quiet(report, "start")
    peers: list[Peer] = []
    absent: dict[str, str] = {}  # a peer not run -> why (said under the table)
    vllm_py = None if args.no_peer else find_vllm_python(args.vllm_python)
    if vllm_py:
        peers.append(Peer("vllm", vllm_py))
    else:
        absent["vllm"] = ("--no-peer" if args.no_peer else
                          "vLLM is not installed (`make vllm`, --vllm-python or "
                          "$KVHEAT_VLLM_PYTHON)")
    if os.environ.get("KVHEAT_SGLANG_PYTHON") and not args.no_peer:
        peers.append(Peer("sglang", os.environ["KVHEAT_SGLANG_PYTHON"]))
    runs: dict[str, list[dict]] = {"kvheat": [], **{p.name: [] for p in peers}}
    try:
        for _ in range(max(3, args.rounds)):
            runs["kvheat"].append(bench_kvheat())
            for p in peers:
                try:
                    runs[p.name].append(p.round())
                except RuntimeError as e:
                    print(f"{p.name}: failed ({e})", file=sys.stderr)
    finally:
        for p in peers:
            p.close()
    check_quiet(report, "end", after_own_run=True)
    res: dict = {"kvheat": {load: median_of([r[load] for r in runs["kvheat"]]) for load in ("A", "B")}}
    report["raw"] = runs
    for p in peers:
        if len(runs[p.name]) == len(runs["kvheat"]):
            res[p.name] = median_of(runs[p.name])
            res[p.name]["kvheat_over_peer"] = paired_ratio(
                [b_total(r["B"]) for r in runs["kvheat"]], [b_total(r) for r in runs[p.name]])
        else:
            absent[p.name] = (f"failed in {len(runs['kvheat']) - len(runs[p.name])} of "
                              f"{len(runs['kvheat'])} rounds (see the errors above)")
    a = res["kvheat"]["A"]
    con = table_console()
    t = Table(title=f"Load A: 12,000-token prompts, {BS}-token blocks, 50% shared prefix "
                    f"(median of {len(runs['kvheat'])} rounds)")
    t.add_column("operation")
    t.add_column("µs per block", justify="right")
    t.add_column("target", justify="right")
    t.add_row("hash (once per request)", f"{a['hash_us_per_block']:.2f}", "")
    t.add_row("match, fully cached prompt", f"{a['match_cached_us_per_block']:.2f}", "< 1")
    t.add_row("allocate + free, 50% hit", f"{a['alloc_free_cold_us_per_block']:.2f}", "< 2")
    t.add_row("allocate + free, 100% hit", f"{a['alloc_free_warm_us_per_block']:.2f}", "< 2")
    print_uncut(t, con)
    print_uncut(load_b_table(res, absent), con)
    report["results"] = res
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    con.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
