"""kvheat's replayer against libCacheSim on the block-level form of a shared trace: the
same hits, and the speed of each.

    python bench/cache/libcachesim.py [--trace agentic|conversation|PATH] [--capacity 1M,3M,10M]
        [--policy lru,fifo,arc,lirs,belady] [--rounds 3] [--limit N]
        [--json results/cache/libcachesim.json]

Block-level form: every block reference of the trace (each request's chained prefix keys,
as the cache names them, `PreparedTrace(trace, 512).keys`, in request order, each
request's blocks in prefix order) is one object of size 1, its key interned to a dense
integer id in first-appearance order. libCacheSim replays that stream from an
oracleGeneral binary file (next-access times included, for its Belady) in its native C
loop, `process_trace`; kvheat replays the same stream through its real replayer as one
single-block request per reference, where prefix semantics equal block semantics. So
LRU, FIFO and Belady must hit exactly as often on both sides at every capacity (Belady:
the optimum's hit count is unique, whatever the tie-breaks); the bench writes its JSON and
then fails (exit 1) when they do not. ARC's and LIRS's hits are shown, not asserted (the
implementations differ in detail: kvheat's LIRS is built for prefix semantics,
kvheat/cache/lirs.py, its HIR share 1% of the cache).

Speed, in block references per second: the sides interleaved (kvheat, libCacheSim, kvheat,
... for each policy and capacity, at least 3 rounds), median and range, and the ratio of
the runs of one round. kvheat is timed on its replay loop alone (`ReplayResult.seconds`:
no trace loading, no key hashing), libCacheSim on `process_trace` (its loop reads the
memory-mapped trace file). kvheat is also timed on the trace's normal prefix form
(`replay(PreparedTrace(trace, 512), policy, capacity)`, references = the requests' blocks).

libCacheSim is GPL-3.0: an optional evaluation extra of this bench only
(`pip install 'kvheat[eval]'`); kvheat never imports it.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

    from rich.table import Table

if not __package__:  # run as `python bench/cache/libcachesim.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (so `libcachesim` is the package)

from bench._lib import RESULTS, TRACES
from bench._lib.peers import check_quiet, fmt_ratio, paired_ratio, spread
from kvheat.replay import PreparedTrace, TraceRequest, load_trace, parse_tokens, replay

BLOCK_TOKENS = 512
NAMED_TRACES = {"agentic": TRACES / "agentic" / "agentic_dev.jsonl",
                "conversation": TRACES / "mooncake_conversation_part1.jsonl"}
MISSING = ("libCacheSim is not installed: it is an optional evaluation extra "
           "(GPL-3.0), pip install 'kvheat[eval]'")


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    ours: str | None  # kvheat's policy name; None: kvheat has none
    theirs: str | None  # libCacheSim's class; None: libCacheSim has none
    exact: bool  # the hit counts must be equal (same algorithm, unit-size objects)


POLICIES = {p.name: p for p in (
    Policy("lru", "lru", "LRU", exact=True),
    Policy("fifo", "fifo", "FIFO", exact=True),
    Policy("arc", "arc", "ARC", exact=False),
    Policy("lirs", "lirs", "LIRS", exact=False),
    Policy("belady", "belady", "Belady", exact=True),
)}


def import_libcachesim() -> ModuleType:
    """The libcachesim package, or exit 2 saying how to install it."""
    try:
        import libcachesim  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        print(MISSING, file=sys.stderr)
        raise SystemExit(2) from None
    return libcachesim


@dataclass(slots=True)
class BlockStream:
    """A trace's block references, one object each, as dense integer ids."""

    ids: list[int]  # one per block reference, in request order, prefix order within one
    times_ms: list[float]  # the timestamp of the request each reference belongs to
    distinct: int

    @property
    def refs(self) -> int:
        return len(self.ids)


def block_stream(trace: PreparedTrace) -> BlockStream:
    """Every block reference of `trace`, its chained key interned to an id in first-appearance order."""
    dense: dict[bytes, int] = {}
    ids: list[int] = []
    times: list[float] = []
    for r, keys in zip(trace.trace, trace.keys):
        ids.extend(dense.setdefault(k, len(dense)) for k in keys)
        times.extend([r.timestamp_ms] * len(keys))
    return BlockStream(ids, times, len(dense))


def single_block_trace(stream: BlockStream, block_tokens: int = BLOCK_TOKENS) -> PreparedTrace:
    """The stream as kvheat requests of one full block each: a prefix of one block is the
    block itself, so the replayer's prefix hits are the block hits."""
    return PreparedTrace([TraceRequest(t, block_tokens, 0, [i])
                          for t, i in zip(stream.times_ms, stream.ids)], block_tokens)


def write_oracle_general(stream: BlockStream, path: Path) -> None:
    """The stream as libCacheSim's oracleGeneral binary trace: per reference a packed
    (uint32 seconds, uint64 id, uint32 size, int64 index of the next reference to that id
    or -1), the next-access index being what its Belady reads."""
    import numpy as np  # libCacheSim's own dependency, so present wherever it is

    rec = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    assert rec.itemsize == 24  # numpy packs a structured dtype unless aligned
    n = stream.refs
    out = np.zeros(n, rec)
    t = np.asarray(stream.times_ms, dtype=np.float64)
    t0 = float(t.min()) if n else 0.0
    out["time"] = np.clip((t - t0) // 1000, 0, 2**32 - 1).astype(np.uint32)
    ids = np.asarray(stream.ids, dtype=np.int64)
    out["id"] = ids
    out["size"] = 1
    nxt = np.full(n, -1, dtype=np.int64)
    seen = np.full(stream.distinct, -1, dtype=np.int64)
    for i in range(n - 1, -1, -1):  # backward: the next use of each id so far
        k = ids[i]
        nxt[i] = seen[k]
        seen[k] = i
    out["next"] = nxt
    out.tofile(path)


@dataclass(slots=True)
class Run:
    hits: int | None  # block hits; None where blocks may be partial (the prefix form)
    hit_rate: float  # hits over references; kvheat's prefix form: token-weighted
    refs: int
    seconds: float

    @property
    def refs_per_s(self) -> float:
        return self.refs / self.seconds if self.seconds > 0 else float("inf")


def run_libcachesim(lcs: ModuleType, trace_file: Path, policy: str, capacity_blocks: int,
                    refs: int) -> Run:
    """One libCacheSim replay of `trace_file` (oracleGeneral) with its class `policy`."""
    reader = lcs.TraceReader(str(trace_file), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, policy)(capacity_blocks)
    gc.collect()
    t0 = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    seconds = time.perf_counter() - t0
    misses = miss_ratio * refs  # it answers a ratio; with unit sizes its count is exact
    if abs(misses - round(misses)) > 1e-3:
        raise RuntimeError(f"libCacheSim's miss ratio {miss_ratio!r} is not a count of {refs} references")
    hits = refs - round(misses)
    return Run(hits, hits / max(refs, 1), refs, seconds)


def run_kvheat(trace: PreparedTrace, policy: str, capacity_blocks: int, single: bool) -> Run:
    """One replay through kvheat's replayer, timed on its replay loop. `single`: the
    single-block form, whose hit tokens are whole blocks."""
    gc.collect()
    r = replay(trace, policy, capacity_blocks * trace.block_tokens, trace.block_tokens)
    refs = sum(len(ks) for ks in trace.keys)
    hits = None
    if single:
        hits, partial = divmod(r.hit_tokens, trace.block_tokens)
        assert not partial, "a single-block request hits a whole block or nothing"
    return Run(hits, r.hit_rate, refs, r.seconds)


def compare(trace: list[TraceRequest], capacities: list[int], policies: list[Policy],
            rounds: int, lcs: ModuleType, workdir: Path, prefix_form: bool = True) -> dict[str, Any]:
    """Every policy at every capacity (tokens) on both sides, the sides interleaved for
    `rounds` rounds; hits (equal where `Policy.exact`: see `mismatches`) and speeds."""
    prepared = PreparedTrace(trace, BLOCK_TOKENS)
    stream = block_stream(prepared)
    single = single_block_trace(stream)
    trace_file = workdir / "blocks.oracleGeneral"
    write_oracle_general(stream, trace_file)
    runs: dict[str, dict[str, list[Run]]] = {}
    capacities_blocks = [c // BLOCK_TOKENS for c in capacities]
    for _ in range(rounds):
        for cap in capacities_blocks:
            for p in policies:
                cell = runs.setdefault(f"{p.name}@{cap}", {"kvheat": [], "libcachesim": [],
                                                           "kvheat_prefix": []})
                if p.ours:
                    cell["kvheat"].append(run_kvheat(single, p.ours, cap, single=True))
                if p.theirs:
                    cell["libcachesim"].append(run_libcachesim(lcs, trace_file, p.theirs, cap,
                                                               stream.refs))
                if p.ours and prefix_form:
                    cell["kvheat_prefix"].append(run_kvheat(prepared, p.ours, cap, single=False))
    cells = []
    for tokens, cap in zip(capacities, capacities_blocks):
        for p in policies:
            cells.append(summarize_cell(p, tokens, cap, runs[f"{p.name}@{cap}"]))
    return {"requests": len(trace), "refs": stream.refs, "distinct_blocks": stream.distinct,
            "cells": cells}


def summarize_cell(p: Policy, tokens: int, cap: int, cell: dict[str, list[Run]]) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": p.name, "capacity_tokens": tokens, "capacity_blocks": cap,
                           "exact": p.exact}
    for side, rs in cell.items():
        if not rs:
            out[side] = None
            continue
        if len({(r.hits, r.hit_rate) for r in rs}) != 1:  # a replay is deterministic
            raise RuntimeError(f"{side} {p.name}@{cap}: hits differ between rounds "
                               f"{[r.hit_rate for r in rs]}")
        out[side] = {"hits": rs[0].hits, "refs": rs[0].refs, "hit_rate": rs[0].hit_rate,
                     "refs_per_s": spread(r.refs_per_s for r in rs),
                     "seconds": [r.seconds for r in rs]}
    ours, theirs = cell["kvheat"], cell["libcachesim"]
    out["same_hits"] = ours[0].hits == theirs[0].hits if ours and theirs else None
    # how many times faster libCacheSim is, from the runs of one round; the prefix form
    # walks the same block references, so its speed compares too
    for key, mine in (("libcachesim_over_kvheat", ours),
                      ("libcachesim_over_kvheat_prefix", cell["kvheat_prefix"])):
        out[key] = (paired_ratio([r.refs_per_s for r in theirs], [r.refs_per_s for r in mine])
                    if mine and theirs else None)
    return out


def mismatches(result: dict[str, Any]) -> list[str]:
    """Cells of an exact policy whose hits differ between the sides."""
    return [f"{c['policy']} at {c['capacity_blocks']} blocks: kvheat {c['kvheat']['hits']}, "
            f"libCacheSim {c['libcachesim']['hits']}"
            for c in result["cells"] if c["exact"] and c["same_hits"] is False]


def table(result: dict[str, Any], title: str) -> Table:
    from rich.table import Table

    t = Table(title=title, caption="M refs/s: median (range) of the rounds; ratio: libCacheSim's "
                                   "speed over kvheat's, median (range) of the rounds' ratios",
                caption_justify="left")
    for col in ("policy", "capacity", "hits kvheat", "hits libCacheSim", "same",
                "kvheat M refs/s", "libCacheSim M refs/s", "ratio", "kvheat prefix form M refs/s",
                "ratio to prefix form"):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)

    def speed(side: dict | None) -> str:
        if side is None:
            return "-"
        s = side["refs_per_s"]
        return f"{s['median'] / 1e6:.3f} ({s['min'] / 1e6:.3f}-{s['max'] / 1e6:.3f})"

    def ratio(r: dict | None) -> str:
        return fmt_ratio(r) if r else "-"

    for c in result["cells"]:
        same = "-" if c["same_hits"] is None else ("yes" if c["same_hits"] else
                                                    "NO" if c["exact"] else "no")
        t.add_row(c["policy"], f"{c['capacity_tokens']:,} tok, {c['capacity_blocks']:,} blocks",
                  f"{c['kvheat']['hits']:,}" if c["kvheat"] else "-",
                  f"{c['libcachesim']['hits']:,}" if c["libcachesim"] else "-", same,
                  speed(c["kvheat"]), speed(c["libcachesim"]),
                  ratio(c["libcachesim_over_kvheat"]), speed(c["kvheat_prefix"]),
                  ratio(c["libcachesim_over_kvheat_prefix"]))
    return t


def versions(lcs: ModuleType) -> dict[str, str]:
    from importlib import metadata

    def dist(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"python": platform.python_version(), "libcachesim": str(getattr(lcs, "__version__", dist("libcachesim"))),
            "kvheat": dist("kvheat"), "machine": platform.machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="agentic",
                    help=f"{' or '.join(NAMED_TRACES)} (the shared traces) or a trace file")
    ap.add_argument("--capacity", default="1M,3M,10M", help="tokens, comma-separated")
    ap.add_argument("--policy", default=",".join(POLICIES),
                    help=f"comma-separated, of {','.join(POLICIES)}")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    ap.add_argument("--limit", type=int, default=None, help="the trace's first N requests")
    ap.add_argument("--no-prefix-form", action="store_true",
                    help="skip timing kvheat on the trace's prefix form")
    ap.add_argument("--json", default=str(RESULTS / "cache" / "libcachesim.json"))
    args = ap.parse_args(argv)
    lcs = import_libcachesim()
    try:
        capacities = [parse_tokens(c) for c in args.capacity.split(",")]
    except ValueError as e:
        ap.error(str(e))
    unknown = [p for p in args.policy.split(",") if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}: choose from {','.join(POLICIES)}")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    if min(capacities) < BLOCK_TOKENS:
        ap.error(f"a capacity below {BLOCK_TOKENS} tokens holds no block")
    path = NAMED_TRACES.get(args.trace, Path(args.trace))
    if not path.exists():
        ap.error(f"no trace at {path}")
    rounds = max(3, args.rounds)
    from kvheat.replay.report import print_uncut, table_console

    trace = load_trace(path, BLOCK_TOKENS, limit=args.limit)
    report: dict[str, Any] = {
        "trace": str(path), "limit": args.limit, "block_tokens": BLOCK_TOKENS,
        "capacities_tokens": capacities, "rounds": rounds, "versions": versions(lcs),
        "timing": {"kvheat": "ReplayResult.seconds: the replay loop alone, gc on and "
                             "collected before each run",
                   "libcachesim": "process_trace on an oracleGeneral file (its C loop, reading "
                                  "the memory-mapped trace)"},
    }
    check_quiet(report, "start")
    with tempfile.TemporaryDirectory(prefix="kvheat-lcs-") as tmp:
        res = compare(trace, capacities, [POLICIES[p] for p in args.policy.split(",")], rounds,
                      lcs, Path(tmp), prefix_form=not args.no_prefix_form)
    check_quiet(report, "end", after_own_run=True)
    report.update(res)
    bad = mismatches(res)
    report["equal_hits"] = not bad
    con = table_console()
    print_uncut(table(res, f"{path.name}: {res['refs']:,} block references of {res['requests']:,} "
                           f"requests, {res['distinct_blocks']:,} distinct blocks"), con)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    con.print(f"wrote {args.json}")
    if bad:
        print("kvheat and libCacheSim disagree on an exact policy's hits:\n  " + "\n  ".join(bad),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
