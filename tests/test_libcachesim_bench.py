"""bench/cache/libcachesim.py: kvheat's replayer and libCacheSim hit alike on the block-level
form of a trace (LRU, FIFO, Belady), the bench's run end to end, and libCacheSim (GPL-3.0,
the optional `eval` extra) never imported by kvheat itself."""

from __future__ import annotations

import ast
import json
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from bench.cache import libcachesim as bench
from kvheat.replay import PreparedTrace, WorkloadConfig, generate_workload, save_trace

ROOT = Path(__file__).resolve().parents[1]
# Small enough to run in a few seconds, big enough that 60 and 250 blocks evict.
SMALL = WorkloadConfig(num_conversations=80, num_system_prompts=4, seed=5)
CAPACITIES = [60 * 512, 250 * 512]


def needs_libcachesim():
    return pytest.importorskip(
        "libcachesim", reason="libCacheSim is an optional extra (pip install 'kvheat[eval]')")


def reference_hits(ids: list[int], capacity: int, lru: bool) -> int:
    """Textbook LRU (or FIFO: hits do not reorder) of `capacity` unit objects."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i in ids:
        if i in cache:
            hits += 1
            if lru:
                cache.move_to_end(i)
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[i] = None
    return hits


def test_block_level_hits_equal_libcachesim(tmp_path: Path) -> None:
    lcs = needs_libcachesim()
    trace = generate_workload(SMALL, 512)
    exact = [bench.POLICIES[p] for p in ("lru", "fifo", "belady")]
    res = bench.compare(trace, CAPACITIES, exact, 1, lcs, tmp_path, prefix_form=False)
    assert bench.mismatches(res) == []
    stream = bench.block_stream(PreparedTrace(trace, 512))
    assert (res["refs"], res["distinct_blocks"]) == (stream.refs, stream.distinct)
    unbounded = stream.refs - stream.distinct  # every reference after an id's first
    for c in res["cells"]:
        ours, theirs = c["kvheat"]["hits"], c["libcachesim"]["hits"]
        assert c["same_hits"] and ours == theirs
        assert 0 < ours < unbounded, "the capacity must evict, or equal hits prove little"
        if c["policy"] in ("lru", "fifo"):  # and both are the textbook policy
            assert ours == reference_hits(stream.ids, c["capacity_blocks"], c["policy"] == "lru")
    by = {(c["policy"], c["capacity_blocks"]): c["kvheat"]["hits"] for c in res["cells"]}
    for cap in (60, 250):
        assert by["belady", cap] >= max(by["lru", cap], by["fifo", cap])


def test_bench_runs_end_to_end_with_limit(tmp_path: Path) -> None:
    needs_libcachesim()
    trace_file = tmp_path / "small.jsonl"
    save_trace(generate_workload(SMALL, 512), trace_file)
    out = tmp_path / "out.json"
    rc = bench.main(["--trace", str(trace_file), "--limit", "120", "--capacity", "30720,128000",
                     "--policy", "lru,arc,lirs", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 120 and report["rounds"] == 3  # at least 3, whatever asked
    assert report["equal_hits"] is True
    assert report["versions"]["libcachesim"] and report["versions"]["python"]
    cells = {(c["policy"], c["capacity_tokens"]): c for c in report["cells"]}
    assert set(cells) == {(p, c) for p in ("lru", "arc", "lirs") for c in (30720, 128000)}
    lru = cells["lru", 30720]
    assert lru["capacity_blocks"] == 60 and lru["same_hits"] is True
    assert lru["kvheat"]["refs"] == lru["kvheat_prefix"]["refs"] == report["refs"]
    assert len(lru["kvheat"]["seconds"]) == 3 and lru["libcachesim_over_kvheat"]["n"] == 3
    lirs = cells["lirs", 30720]  # both sides, hits shown, not asserted equal
    assert lirs["kvheat"]["hits"] > 0 and lirs["libcachesim"]["hits"] > 0
    assert lirs["exact"] is False


def test_mismatch_only_on_exact_policies() -> None:
    def cell(policy: str, exact: bool, ours: int, theirs: int) -> dict:
        return {"policy": policy, "exact": exact, "capacity_blocks": 10, "same_hits": ours == theirs,
                "kvheat": {"hits": ours}, "libcachesim": {"hits": theirs}}

    res = {"cells": [cell("lru", True, 5, 5), cell("arc", False, 5, 6), cell("fifo", True, 7, 8)]}
    assert bench.mismatches(res) == ["fifo at 10 blocks: kvheat 7, libCacheSim 8"]


def test_without_libcachesim_exits_2_saying_how_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "libcachesim", None)  # None in sys.modules: ImportError
    with pytest.raises(SystemExit) as e:
        bench.main(["--limit", "1"])
    assert e.value.code == 2
    assert "pip install 'kvheat[eval]'" in capsys.readouterr().err


def test_kvheat_never_imports_libcachesim() -> None:
    """GPL-3.0: an evaluation extra of the bench only, never a dependency of the package."""
    found = []
    for f in (ROOT / "kvheat").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{f.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "libcachesim"]
    assert found == []
