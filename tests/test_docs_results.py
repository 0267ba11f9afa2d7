"""The docs' figures come from the result files they cite, and the deterministic result
files still match the code.

The first half runs `bench/render_docs.py --check`'s logic: a marked table or figure that
disagrees with its JSON fails, and so does a marker with no source file. The second half
reruns cheap deterministic slices of the kept results (hit rates and decisions, never
times; `bench/cache/golden.py`'s `untimed` drops the timed fields) and compares them with
the committed JSON: a code change that moves a hit rate fails here until the result file
is regenerated (and `python bench/render_docs.py` carries it into the docs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest

from bench._lib import TRACES
from bench.cache.golden import untimed
from bench.render_docs import (
    BLOCK,
    RESULTS_DIR,
    ROOT,
    DocError,
    disagreements,
    docs,
    main,
    render,
    select,
)

HAVE_TRACES = (TRACES / "mooncake_conversation_part1.jsonl").exists()
needs_traces = pytest.mark.skipif(not HAVE_TRACES, reason=f"the Mooncake traces are not in {TRACES}")


def committed(rel: str) -> Any:
    return json.loads((RESULTS_DIR / rel).read_text())


def normal(o: Any) -> Any:
    """`o` as the JSON file holds it (tuples as lists), without its timed fields."""
    return untimed(json.loads(json.dumps(o)))


# -- the docs against their result files ----------------------------------------------------

def test_every_doc_agrees_with_the_result_files_it_cites() -> None:
    problems = [p for path in docs() for p in disagreements(path)]
    assert not problems, "\n".join(problems) + "\nrun `python bench/render_docs.py`"


def test_the_stale_tables_of_issue_51_are_rendered() -> None:
    """The tables the issue found stale each sit in a results block now."""
    text = {str(p.relative_to(ROOT)): p.read_text() for p in docs()}
    blocks = {(name, m["args"].split("table=")[1].split()[0])
              for name, t in text.items() for m in BLOCK.finditer(t)}
    for want in [("README.md", "policies"), ("docs/heat.md", "grid"), ("docs/heat.md", "ablation"),
                 ("docs/heat.md", "oracle"), ("docs/engine.md", "engine"),
                 ("docs/cluster.md", "cluster"), ("docs/vllm.md", "offload")]:
        assert want in blocks, want


def test_check_mode_fails_on_a_figure_changed_by_hand() -> None:
    readme = (ROOT / "README.md").read_text()
    m = next(m for m in BLOCK.finditer(readme) if "table=policies" in m["args"])
    grid = committed("heat/grid.json")
    kv = select(grid, "cells[trace=conv,block_tokens=512,scale=1,capacity_tokens=1000000].kvheat")
    assert f"{100 * kv:.2f}%" in m["body"]
    edited = readme.replace(m["body"], m["body"].replace(f"{100 * kv:.2f}%", "10.35%"))
    assert edited != readme and render(edited) == readme  # rendering puts the file's figure back
    edited_inline = "x <!-- r: heat/grid.json cells[trace=conv,block_tokens=512,scale=1," \
        "capacity_tokens=1000000].kvheat .2% -->10.35%<!-- /r --> y"
    assert f"{100 * kv:.2f}%<!-- /r -->" in render(edited_inline)


def test_check_mode_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--check` exits 1 and names the doc when a marked figure is stale, 0 when none is."""
    import bench.render_docs as rd

    doc = tmp_path / "doc.md"
    doc.write_text("<!-- r: engine/table.json bound.belady .1% -->12.3%<!-- /r -->\n")
    monkeypatch.setattr(rd, "ROOT", tmp_path)
    monkeypatch.setattr(rd, "docs", lambda: [doc])
    monkeypatch.setattr(rd, "load", lambda rel: committed(rel.removeprefix("docs/results/")))
    assert main(["--check"]) == 1
    assert "doc.md" in capsys.readouterr().err
    assert main([]) == 0 and main(["--check"]) == 0
    belady = committed("engine/table.json")["bound"]["belady"]
    assert f"-->{100 * belady:.1f}%<!--" in doc.read_text()


@pytest.mark.parametrize("text, why", [
    ("<!-- results: table=engine -->\n| a |\n<!-- /results -->", "without a source file"),
    ("<!-- results: docs/results/engine/nope.json table=engine -->\n| a |\n<!-- /results -->",
     "no result file"),
    ("<!-- results: README.md table=engine -->\n| a |\n<!-- /results -->", "no result file"),
    ("<!-- results: docs/results/../../README.md table=engine -->\n| a |\n<!-- /results -->",
     "no result file"),
    ("<!-- results: docs/results/engine/table.json table=nope -->\n| a |\n<!-- /results -->",
     "unknown table kind"),
    ("<!-- results: docs/results/engine/table.json table=engine -->\n| a |\n", "without their closing"),
    ("<!-- r: engine/nope.json bound.belady .1% -->1<!-- /r -->", "no result file"),
    ("<!-- r: engine/table.json bound.nope .1% -->1<!-- /r -->", "nothing at"),
    ("<!-- r: engine/table.json results[policy=kvheat].hit_rate .1% -->1<!-- /r -->",
     "matches 2 elements"),
])
def test_a_marker_without_a_usable_source_fails(text: str, why: str) -> None:
    with pytest.raises(DocError, match=why):
        render(text, "doc.md")


def test_every_block_names_a_file_under_docs_results() -> None:
    for path in docs():
        for m in BLOCK.finditer(path.read_text()):
            files = [a for a in m["args"].split() if "=" not in a]
            assert files, f"{path.name}: {m['args']}"
            for f in files:
                assert f.startswith("docs/results/") and (ROOT / f).is_file(), (path.name, f)


def test_no_rendered_table_is_copied_outside_its_markers() -> None:
    """A table whose header a block renders, found elsewhere unmarked, is a stale copy."""
    headers = set()
    for path in docs():
        for m in BLOCK.finditer(path.read_text()):
            headers |= {line for line in m["body"].splitlines() if line.startswith("| ")}
    for path in docs():
        outside = BLOCK.sub("", path.read_text())
        for line in outside.splitlines():
            if line.startswith("| ") and re.search(r"\d\.\d\d%", line):
                assert line not in headers, f"{path.name}: {line!r} copied outside its block"


# -- the deterministic results still match the code -----------------------------------------

def _rerun_hint(rel: str, command: str) -> str:
    return (f"the code no longer gives the committed docs/results/{rel}: rerun `{command}`, "
            "then `python bench/render_docs.py`")


def test_grid_generator_slice_reruns_as_committed() -> None:
    """Every policy of the heat grid on the built-in generator at 1M tokens (~8 s)."""
    from bench.heat.grid import _run

    want = [r for r in committed("heat/grid.json")["replays"] if r["trace"] == "gen"
            and r["block_tokens"] == 512 and r["scale"] == 1.0 and r["capacity_tokens"] == 1_000_000]
    assert {r["policy"] for r in want} >= {"lru", "arc", "lruk", "kvheat", "belady"}
    got = [_run(("gen", 512, 1.0, r["policy"], 1_000_000)) for r in want]
    assert normal(got) == normal(want), _rerun_hint(
        "heat/grid.json", "python bench/heat/grid.py --json docs/results/heat/grid.json")


@needs_traces
def test_grid_conversation_cell_reruns_as_committed() -> None:
    """The README's conversation column at 1M: LRU-K and kvheat."""
    from bench.heat.grid import _run

    want = [r for r in committed("heat/grid.json")["replays"] if r["trace"] == "conv"
            and r["scale"] == 1.0 and r["capacity_tokens"] == 1_000_000
            and r["policy"] in ("lruk", "kvheat")]
    got = [_run(("conv", 512, 1.0, r["policy"], 1_000_000)) for r in want]
    assert len(got) == 2 and normal(got) == normal(want), _rerun_hint(
        "heat/grid.json", "python bench/heat/grid.py --json docs/results/heat/grid.json")


def test_engine_table_hit_rates_rerun_as_committed() -> None:
    """bench/engine/table.py's deterministic columns for its cached strategies."""
    import torch

    from bench.engine.table import BenchConfig, run_bench

    want = committed("engine/table.json")
    cfg = BenchConfig(**{**want["config"], "strategies": ["lru", "kvheat", "kvheat-host"]})
    threads = torch.get_num_threads()
    try:
        got = run_bench(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)  # run_bench pins one; the rest of the suite keeps its own
    fields = ("strategy", "requests", "hit_rate", "host_hit_tokens", "kv_memory_saved",
              "prefill_tokens", "decode_tokens", "preemptions")
    rows = {r["strategy"]: {k: r[k] for k in fields} for r in want["results"]}
    assert [{k: r[k] for k in fields} for r in got["results"]] == [
        rows[r["strategy"]] for r in got["results"]], _rerun_hint(
        "engine/table.json", "python bench/engine/table.py --json docs/results/engine/table.json")
    assert got["bound"] == want["bound"]


@pytest.mark.vllm
def test_offload_builtin_cell_reruns_as_committed() -> None:
    """vLLM's offload manager under each policy on the generator, 1M tokens, scale 1."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make vllm)")
    from kvheat.integrations.vllm_replay import replay_offload, request_keys
    from kvheat.replay import generate_workload

    rel = "vllm/offload_synthetic_builtin.json"
    want = select(committed(rel), "rows[trace=builtin,capacity_tokens=1000000,time_scale=1]")
    ct = 512
    trace = generate_workload(block_tokens=ct)
    keys = request_keys(trace, ct)
    got = {p: replay_offload(trace, p, 1_000_000 // ct, ct, time_scale=1.0, keys=keys).as_dict()
           for p in want["results"]}
    assert normal(got) == normal(want["results"]), _rerun_hint(
        rel, "python bench/vllm/offload.py --traces synthetic,builtin --json docs/results/" + rel)


@needs_traces
def test_cluster_simulation_cell_reruns_as_committed() -> None:
    """The cluster simulation's conversation row at 1M per replica: kvheat and sglang-like."""
    from bench.cluster.sim import NAMES, _spec, _variant, row
    from kvheat.router.simulate import ClusterConfig, simulate

    want = {r["router"]: r for r in committed("cluster/sim.json")["grid"]
            if r["trace"] == NAMES[0] and r["capacity_tokens"] == 1_000_000
            and r["router"] in ("kvheat", "sglang-like")}
    got = {}
    for router in want:
        spec, hints = _spec(router)
        res = simulate(_variant(NAMES[0], None), cast(Any, spec),
                       ClusterConfig(replicas=4, capacity_tokens=1_000_000, regime_hints=hints))
        res.router = router
        got[router] = row(res, trace=NAMES[0])
    assert len(got) == 2 and normal(got) == normal(want), _rerun_hint(
        "cluster/sim.json", "python bench/cluster/sim.py --json docs/results/cluster/sim.json "
        "--plot docs/results/cluster/sim.png")
