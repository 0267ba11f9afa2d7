"""The docs' figures, rendered from the result files they cite.

    python bench/render_docs.py           # rewrite every marked region of the docs
    python bench/render_docs.py --check   # change nothing; exit 1 and say where a doc disagrees

A table that a result file backs sits between two markers; the first names the file(s)
(relative to the repository root, under docs/results/) and the table kind with its options:

    <!-- results: docs/results/heat/grid.json table=grid trace=conv block=512 -->
    ...the rendered table...
    <!-- /results -->

A single figure in prose is an inline marker: the file (relative to docs/results/), a path
into its JSON and a format, separated by single spaces (so none of them holds a space). A
path is dot-separated keys; `[k=v,...]` picks the one list element whose fields equal those
values (`_` matches a space), `[3]` an index; `@name:arg` is a derived value from VALUES
(`a.json+b.json` hands it both files). Formats are Python's (`.1%` gives 62.5%, `,d` 14,561); `pt` in front multiplies
by 100 first (`pt+.2f` gives +0.07 for 0.0007):

    <!-- r: engine/table.json results[strategy=no_cache].prefill_tokens ,d -->46,519<!-- /r -->

Everything between the markers belongs to this script: edit the result file (rerun its
bench) or the table kind here, never the text. tests/test_docs_results.py runs `--check`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/render_docs.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench._lib import ROOT

RESULTS_DIR = ROOT / "docs" / "results"
BLOCK = re.compile(r"<!-- results:(?P<args>[^>]*?)-->\n(?P<body>.*?)<!-- /results -->", re.S)
INLINE = re.compile(r"<!-- r: (?P<file>\S+) (?P<path>\S+) (?P<fmt>\S+) -->(?P<body>.*?)<!-- /r -->")
OPEN = re.compile(r"<!-- (results:|r: )")


class DocError(ValueError):
    """A marker that cannot be rendered: no source file, an unknown kind, a path that
    selects nothing."""


Table = Callable[[list[Any], dict[str, str]], str]
TABLES: dict[str, Table] = {}
Value = Callable[[Any, str], float]
VALUES: dict[str, Value] = {}


def docs() -> list[Path]:
    """Every file the markers may sit in."""
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def table(name: str) -> Callable[[Table], Table]:
    def register(fn: Table) -> Table:
        TABLES[name] = fn
        return fn
    return register


def value(name: str) -> Callable[[Value], Value]:
    def register(fn: Value) -> Value:
        VALUES[name] = fn
        return fn
    return register


def pct(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def tokens(n: float) -> str:
    """1M, 2.5M, 500K: capacities as the docs write them."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}K"


def mtokens(n: float) -> str:
    """0.25M, 1M: the cluster simulation's capacities per replica."""
    return f"{n / 1e6:g}M"


def md_table(header: list[str], align: str, rows: list[list[str]]) -> str:
    """A markdown table; `align` is one letter per column, l or r."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"
    out = [line(header), "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    return "\n".join(out + [line(r) for r in rows])


def bold(s: str, on: bool = True) -> str:
    return f"**{s}**" if on else s


# -- selecting a value ---------------------------------------------------------------------

def _matches(x: Any, want: str) -> bool:
    if isinstance(x, bool):
        return want.lower() == str(x).lower()
    if isinstance(x, (int, float)):
        try:
            return float(want) == float(x)
        except ValueError:
            return False
    return str(x) in (want, want.replace("_", " "))


def select(data: Any, path: str) -> Any:
    """The value at `path` (see the module docstring); DocError when it selects nothing or
    a filter matches more or fewer than one element."""
    if path.startswith("@"):
        name, _, arg = path[1:].partition(":")
        if name not in VALUES:
            raise DocError(f"unknown derived value @{name}")
        return VALUES[name](data, arg)
    cur = data
    for part in re.findall(r"[^.\[\]]+|\[[^\]]*\]", path):
        try:
            if part.startswith("["):
                inner = part[1:-1]
                if re.fullmatch(r"-?\d+", inner):
                    cur = cur[int(inner)]
                    continue
                conds = [c.split("=", 1) for c in inner.split(",")]
                hits = [x for x in cur if all(k in x and _matches(x[k], v) for k, v in conds)]
                if len(hits) != 1:
                    raise DocError(f"{part} matches {len(hits)} elements in {path}")
                cur = hits[0]
            else:
                cur = cur[int(part)] if isinstance(cur, list) else cur[part]
        except (KeyError, IndexError, TypeError) as e:
            raise DocError(f"{path}: nothing at {part} ({e!r})") from None
    return cur


def fmt(v: Any, spec: str) -> str:
    if spec.startswith("pt"):
        v, spec = 100 * v, spec[2:]
    return format(v, spec)


def load(rel: str) -> Any:
    """The JSON of a result file, `rel` from the repository root."""
    path = (ROOT / rel).resolve()
    if not path.is_relative_to(RESULTS_DIR.resolve()) or not path.is_file():
        raise DocError(f"no result file {rel} (a marker must cite a file under docs/results/)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DocError(f"{rel} is not JSON: {e}") from None


# -- rendering a document ------------------------------------------------------------------

def render_block(args: str) -> str:
    files = [a for a in args.split() if "=" not in a]
    opts = dict(a.split("=", 1) for a in args.split() if "=" in a)
    kind = opts.pop("table", "")
    if not files:
        raise DocError(f"results block without a source file: {args.strip()!r}")
    if kind not in TABLES:
        raise DocError(f"unknown table kind {kind!r} (known: {', '.join(sorted(TABLES))})")
    return TABLES[kind]([load(f) for f in files], opts).rstrip("\n")


def render(text: str, where: str = "") -> str:
    """`text` with every marked region re-rendered; DocError (naming `where`) on a marker
    that cannot be."""
    def block(m: re.Match[str]) -> str:
        try:
            body = render_block(m["args"])
        except DocError as e:
            raise DocError(f"{where}: {e}") from None
        return f"<!-- results:{m['args']}-->\n{body}\n\n<!-- /results -->"

    def inline(m: re.Match[str]) -> str:
        try:
            data = [load(f"docs/results/{f}") for f in m["file"].split("+")]
            v = select(data[0] if len(data) == 1 else data, m["path"])
            return f"<!-- r: {m['file']} {m['path']} {m['fmt']} -->{fmt(v, m['fmt'])}<!-- /r -->"
        except (DocError, ValueError, TypeError) as e:
            raise DocError(f"{where}: {m['file']} {m['path']}: {e}") from None

    out = INLINE.sub(inline, BLOCK.sub(block, text))
    opened = len(OPEN.findall(text))
    closed = len(BLOCK.findall(text)) + len(INLINE.findall(text))
    if opened != closed:
        raise DocError(f"{where}: {opened - closed} marker(s) without their closing marker")
    return out


def disagreements(path: Path) -> list[str]:
    """Each marked region of `path` whose text is not what its result file renders."""
    text, where = path.read_text(), str(path.relative_to(ROOT))
    render(text, where)  # a marker that cannot be rendered raises here
    out = []
    for m in BLOCK.finditer(text):
        if render(m[0], where) != m[0]:
            out.append(f"{where}: the table of `results:{m['args'].rstrip()}` differs from its result file")
    for m in INLINE.finditer(text):
        new = render(m[0], where)
        if new != m[0]:
            got = INLINE.fullmatch(new)
            out.append(f"{where}: {m['file']} {m['path']} says {got['body'] if got else '?'}, "
                       f"the doc {m['body']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    a = ap.parse_args(argv)
    problems: list[str] = []
    for path in docs():
        try:
            if a.check:
                problems += disagreements(path)
                continue
            text = path.read_text()
            new = render(text, str(path.relative_to(ROOT)))
            if new != text:
                path.write_text(new)
                print(f"rendered {path.relative_to(ROOT)}")
        except DocError as e:
            problems.append(str(e))
    for p in problems:
        print(p, file=sys.stderr)
    if problems and a.check:
        print("run `python bench/render_docs.py` (after rerunning the bench if a result "
              "file is stale)", file=sys.stderr)
    return 1 if problems else 0


# -- the table kinds -----------------------------------------------------------------------

def _grid_cells(d: dict, trace: str, block: int) -> list[dict]:
    cells = [c for c in d["cells"] if c["trace"] == trace and c["block_tokens"] == block]
    if not cells:
        raise DocError(f"grid.json has no cells for {trace} at {block}-token blocks")
    s0 = min(c["scale"] for c in cells)  # every scale gives the same rates (grid.py checks)
    return [c for c in cells if c["scale"] == s0]


@value("grid")
def _grid_value(d: Any, which: str) -> float:
    """Over the grid's distinct cells (each trace, block size and capacity once; every time
    scale gives the same rates): `cells`, `wins` (kvheat at or above every other online
    policy) or `sum` (its margins summed)."""
    cells = [c for trace, block in dict.fromkeys((c["trace"], c["block_tokens"]) for c in d["cells"])
             for c in _grid_cells(d, trace, block)]
    if which == "cells":
        return float(len(cells))
    if which == "wins":
        return float(sum(c["margin"] >= 0 for c in cells))
    if which == "sum":
        return float(sum(c["margin"] for c in cells))
    raise DocError(f"@grid: unknown {which!r}")


@value("mean")
def _mean(d: Any, path: str) -> float:
    """The mean of the list at `path`."""
    xs = select(d, path)
    return float(sum(xs) / len(xs))


@value("median")
def _median(d: Any, path: str) -> float:
    """The median of the list at `path`."""
    from statistics import median

    return float(median(select(d, path)))


@value("count_at_least")
def _count_at_least(d: Any, arg: str) -> float:
    """`PATH:X`: how many of the list at PATH are at least X."""
    path, x = arg.rsplit(":", 1)
    return float(sum(v >= float(x) for v in select(d, path)))


@value("mean_diff")
def _mean_diff(d: Any, arg: str) -> float:
    """`ROW:A:B`: mean of list field A minus mean of list field B of the element at ROW."""
    row, a, b = arg.split(":")
    r = select(d, row)
    return float(sum(r[a]) / len(r[a]) - sum(r[b]) / len(r[b]))


@table("grid")
def _grid(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: every policy at every capacity for one trace and block size (grid.py's own
    markdown)."""
    from bench.heat.grid import markdown

    d, trace, block = files[0], o["trace"], int(o["block"])

    def keep(r: dict) -> bool:
        return bool(r["trace"] == trace and r["block_tokens"] == block)
    return markdown([r for r in d["replays"] if keep(r)], [c for c in d["cells"] if keep(c)])


@table("policies")
def _policies(files: list[Any], o: dict[str, str]) -> str:
    """README: the chosen policies at the chosen capacities, the best online one bold per
    column, Belady and (from a replay file, when cited) the infinite cache below."""
    d = files[0]
    cells = {c["capacity_tokens"]: c for c in _grid_cells(d, o["trace"], int(o["block"]))}
    caps = [int(float(c[:-1]) * (1e6 if c.endswith("M") else 1e3)) for c in o["caps"].split(",")]
    pols = o["policies"].split(",")
    best = {c: max(cells[c][p] for p in pols) for c in caps}
    rows = [[p] + [bold(pct(cells[c][p]), cells[c][p] == best[c]) for c in caps] for p in pols]
    rows.append(["belady (bound)"] + [pct(cells[c]["belady"]) for c in caps])
    if len(files) > 1:
        rows.append(["infinite cache"] + [pct(files[1]["infinite"])] * len(caps))
    return md_table(["policy"] + [tokens(c) for c in caps], "l" + "r" * len(caps), rows)


@table("sessions")
def _sessions(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: sessions.json's plain replays, every trace (`traces=a,b`) by capacity, with
    hints on: each online policy (`policies=`), kvheat, Belady, kvheat's margin over the
    best other online policy (in italics in its row) and the share of the LRU -> Belady
    gap kvheat closes."""
    d = files[0]
    pols = o["policies"].split(",")
    hints = o.get("hints", "on") == "on"
    cells = {(c["trace"], c["capacity_tokens"]): c for c in d["cells"]
             if c["mode"] == o.get("mode", "plain") and c["hints"] == hints}
    rows = []
    for tr in o["traces"].split(","):
        caps = sorted(cap for t, cap in cells if t == tr)
        if not caps:
            raise DocError(f"sessions.json has no plain cells for {tr}")
        for cap in caps:
            c = cells[(tr, cap)]
            rates, best = c["rates"], c.get("best_other")
            row = [tr, tokens(cap)]
            row += [("*" + pct(rates[p]) + "*" if p == best else pct(rates[p]))
                    if p in rates else "–" for p in pols]
            row += [bold(pct(rates["kvheat"]), c.get("margin", -1) >= 0),
                    pct(rates["belady"]) if "belady" in rates else "–",
                    f"{100 * c['margin']:+.2f} ({best})" if "margin" in c else "–",
                    f"{100 * c['gap_closed']['kvheat']:.0f}%"
                    if "kvheat" in c.get("gap_closed", {}) else "–"]
            rows.append(row)
    head = ["trace", "capacity", *pols, "kvheat", "Belady", "kvheat − best other", "gap closed"]
    return md_table(head, "ll" + "r" * (len(head) - 2), rows)


@value("sessions")
def _sessions_value(d: Any, which: str) -> float:
    """Over sessions.json's plain cells with hints on that have a margin: `cells`, `flags`
    (kvheat more than `flag_points` below the best other online policy), `worst` (its
    lowest margin)."""
    cs = [c for c in d["cells"] if c["mode"] == "plain" and c["hints"] and "margin" in c]
    if which == "cells":
        return float(len(cs))
    if which == "flags":
        return float(sum(bool(c["flag"]) for c in cs))
    if which == "worst":
        return float(min(c["margin"] for c in cs))
    raise DocError(f"@sessions: unknown {which!r}")


@table("multiples")
def _multiples(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: kvheat with its multiple fixed (`kvheat[adapt=off,reuse_mult=X]`, X in
    `mults=`), the previous default (`adapt=victims`) and the default (miniatures), per
    trace (`traces=`) and capacity, hints on, from sessions.json; the best fixed multiple
    bold."""
    d = files[0]
    mults = o["mults"].split(",")
    cells = {(c["trace"], c["capacity_tokens"]): c for c in d["cells"]
             if c["mode"] == "plain" and c["hints"]}
    rows = []
    for tr in o["traces"].split(","):
        for cap in sorted(cap for t, cap in cells if t == tr):
            rates = cells[(tr, cap)]["rates"]
            fixed = [rates.get(f"kvheat[adapt=off,reuse_mult={m}]") for m in mults]
            if any(v is None for v in fixed):
                continue
            top = max(v for v in fixed if v is not None)
            rows.append([tr, tokens(cap)] + [bold(pct(v), v == top) for v in fixed]
                        + [pct(rates.get("kvheat[adapt=victims]")), pct(rates.get("kvheat"))])
    if not rows:
        raise DocError("sessions.json has no fixed-multiple rows for these traces")
    head = ["trace", "capacity", *(f"fixed {m}" for m in mults), "victims (previous default)",
            "miniatures (default)"]
    return md_table(head, "ll" + "r" * (len(head) - 2), rows)


@table("overhead")
def _overhead(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: bench/heat/overhead.py's rows, µs per block access (median, p99, mean), and
    each policy's median over ARC's (`ratio=arc`, the default)."""
    rows = files[0]
    ref = {r["policy"]: r for r in rows}.get(o.get("ratio", "arc"))
    out = []
    for r in rows:
        ratio = f"{r['median_us'] / ref['median_us']:.2f}×" if ref else "–"
        out.append([r["policy"], f"{r['median_us']:.2f}", f"{r['p99_us']:.2f}",
                    f"{r['mean_us']:.2f}", ratio])
    return md_table(["policy", "median", "p99", "mean", f"median / {o.get('ratio', 'arc')}'s"],
                    "lrrrr", out)


@table("replay")
def _replay(files: list[Any], o: dict[str, str]) -> str:
    """cache.md: a `kvheat replay --json` file, policy by capacity, Belady bold and the
    infinite cache below (`title=` names the first column; `_` stands for a space)."""
    d = files[0]
    caps = list(dict.fromkeys(r["capacity_tokens"] for r in d["results"]))
    pols = list(dict.fromkeys(r["policy"] for r in d["results"]))
    rate = {(r["policy"], r["capacity_tokens"]): r["hit_rate"] for r in d["results"]}
    rows = [[bold(p, p == "belady")] + [pct(rate[(p, c)]) for c in caps] for p in pols]
    rows.append(["infinite"] + [pct(d["infinite"])] * len(caps))
    return md_table([o["title"].replace("_", " ")] + [tokens(c) for c in caps],
                    "l" + "r" * len(caps), rows)


@table("scale")
def _scale(files: list[Any], o: dict[str, str]) -> str:
    """cache.md: bench/cache/scale.py, policy by capacity: hit rate and the replay loop's
    speed (M block references/s); Belady bold, the unbounded cache below."""
    d = files[0]
    caps = d["capacities_tokens"]
    cell = {(r["policy"], r["capacity_tokens"]): r for r in d["results"]}
    rows = [[bold(p, p == "belady")] + [f"{pct(cell[(p, c)]['hit_rate'])} "
                                        f"({cell[(p, c)]['refs_per_s'] / 1e6:.2f})" for c in caps]
            for p in d["policies"]]
    rows.append(["unbounded"] + [pct(d["trace_stats"]["unbounded_hit_rate"])] * len(caps))
    return md_table(["policy"] + [f"{tokens(c)} (M refs/s)" for c in caps],
                    "l" + "r" * len(caps), rows)


@table("curves")
def _curves(files: list[Any], o: dict[str, str]) -> str:
    """cache.md: a `curves` section (kvheat replay --curve, bench/cache/scale.py): each
    policy's knee, how its points were made, and its error against full replays."""
    c = files[0]["curves"]
    rows = []
    for p in c["policies"]:
        methods = ", ".join(sorted({f"{q['method']} (1/{round(1 / q['sample_rate'])})"
                                    if q["sample_rate"] < 1 else q["method"]
                                    for q in p["points"]}))
        errs = ", ".join(f"{tokens(e['capacity_tokens'])}: {e['error_points']:+.2f}"
                         for e in p["checks"])
        rows.append([p["policy"], f"{p['knee_tokens'] / 1e6:.1f}M" if p["knee_tokens"] else "beyond",
                     methods, errs or "–"])
    return md_table(["policy", f"knee ({c['knee_share']:.0%} of unbounded)", "points by",
                     "error against a full replay (points)"], "lrll", rows)


@table("libcachesim")
def _libcachesim(files: list[Any], o: dict[str, str]) -> str:
    """cache.md: bench/cache/libcachesim.py, each policy and capacity: block hits of both
    sides, and each side's speed (M refs/s, median of the rounds) with libCacheSim's ratio."""
    rows = []
    for c in files[0]["cells"]:
        ours, theirs = c["kvheat"], c["libcachesim"]
        same = "–" if c["same_hits"] is None else "yes" if c["same_hits"] else "no"
        ratio = c["libcachesim_over_kvheat"]
        pre = c["kvheat_prefix"]
        rows.append([c["policy"], tokens(c["capacity_tokens"]),
                     f"{ours['hits']:,}" if ours else "–", f"{theirs['hits']:,}" if theirs else "–",
                     same,
                     f"{ours['refs_per_s']['median'] / 1e6:.2f}" if ours else "–",
                     f"{pre['refs_per_s']['median'] / 1e6:.2f}" if pre else "–",
                     f"{theirs['refs_per_s']['median'] / 1e6:.2f}" if theirs else "–",
                     f"x{ratio['median']:.1f}" if ratio else "–"])
    return md_table(["policy", "capacity", "kvheat hits", "libCacheSim hits", "same",
                     "kvheat M refs/s", "kvheat, prefix form", "libCacheSim M refs/s",
                     "libCacheSim / kvheat"], "lrrrlrrrr", rows)


@table("engine")
def _engine(files: list[Any], o: dict[str, str]) -> str:
    """engine.md: bench/engine/table.py's strategies at equal memory, kvheat's rows bold."""
    d = files[0]
    rows = []
    for r in d["results"]:
        block = r["prefix_caching"] == "block"
        belady = d["bound"]["belady_device_plus_host" if r["host_tier"] else "belady"]
        mine = r["policy"] == "kvheat" and block
        rows.append([bold(r["strategy"].replace("device+host", "device + host"), mine),
                     f"{r['mean_ttft_ms']:.1f} ms", f"{r['p99_ttft_ms']:.1f} ms",
                     pct(r["kv_memory_saved"], 1), bold(pct(r["hit_rate"], 1), mine),
                     pct(belady, 1) if block else "–", f"{r['prefill_tokens']:,}"])
    return md_table(["strategy", "mean TTFT", "P99 TTFT", "KV memory saved", "prefix hit rate",
                     "Belady, same memory", "tokens computed"], "lrrrrrr", rows)


@value("engine_fewer")
def _engine_fewer(d: Any, host: str) -> float:
    """How many fewer prompt tokens kvheat computes than LRU (device, or `host` tier too)."""
    by = {(r["policy"], r["host_tier"]): r for r in d["results"] if r["prefix_caching"] == "block"}
    h = host == "host"
    return float(1 - by[("kvheat", h)]["prefill_tokens"] / by[("lru", h)]["prefill_tokens"])


@table("cluster")
def _cluster(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: one trace's routers at each capacity per replica (sim.json's grid),
    kvheat route's row bold."""
    rows = []
    for r in files[0]["grid"]:
        if r["trace"] != o["trace"]:
            continue
        mine = r["router"] == "kvheat"
        rows.append([mtokens(r["capacity_tokens"]), bold(r["router"], mine),
                     bold(pct(r["hit_rate"]), mine), pct(r["of_bound"], 1),
                     f"{r['imbalance_requests']:.2f}", f"{r['imbalance_prefill_tokens']:.2f}",
                     f"{r['ttft_p99_s']:.2f}"])
    if not rows:
        raise DocError(f"sim.json has no grid rows for {o['trace']}")
    return md_table(["C / replica", "router", "hit rate", "of N·C bound", "max/mean requests",
                     "max/mean prefill", "modelled TTFT P99 s"], "llrrrrr", rows)


TRACE_NAMES = {"mooncake_conversation_part1.jsonl": "conversation",
               "mooncake_synthetic_trace.jsonl": "synthetic"}


def _sim_row(d: dict, trace: str, cap: int, router: str) -> Any:
    return select(d, f"grid[trace={trace},capacity_tokens={cap},router={router}]")


@table("cluster_targets")
def _cluster_targets(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: the grid's checks per cell (kvheat ≥ 90% of the bound, prefill balance
    ≤ 1.25, beating prefix-hash and sglang-like on hit rate at equal or better balance)."""
    d, rows = files[0], []
    for trace, short in TRACE_NAMES.items():
        for cap in dict.fromkeys(r["capacity_tokens"] for r in d["grid"] if r["trace"] == trace):
            kv, sg, ph = (_sim_row(d, trace, cap, r) for r in ("kvheat", "sglang-like", "prefix-hash"))
            bal = kv["imbalance_prefill_tokens"]

            def beats(other: dict, kv: dict = kv, bal: float = bal) -> bool:
                return bool(kv["hit_rate"] > other["hit_rate"]
                            and bal <= other["imbalance_prefill_tokens"])
            ob = kv["of_bound"] >= 0.9
            rows.append([f"{short} {mtokens(cap)}",
                         f"{'yes' if ob else '**no**'} ({pct(kv['of_bound'], 1)})",
                         f"{'yes' if bal <= 1.25 else '**no**'} ({bal:.2f})",
                         "yes" if beats(ph) else "**no**",
                         f"{'yes' if beats(sg) else '**no**'}: {pct(kv['hit_rate'])} vs "
                         f"{pct(sg['hit_rate'])} (balance {bal:.2f} vs "
                         f"{sg['imbalance_prefill_tokens']:.2f})"])
    return md_table(["cell", "≥ 90% of bound", "prefill balance ≤ 1.25", "beats prefix-hash",
                     "beats sglang-like"], "lllll", rows)


@value("cluster_checks")
def _cluster_checks(d: Any, which: str) -> float:
    """How many of the grid's 4 checks per cell pass (`which`: passed or total)."""
    body = _cluster_targets([d], {})
    cells = [line.split(" | ")[1:] for line in body.splitlines()[2:]]
    total = 4 * len(cells)
    failed = sum(c.count("**no**") for line in cells for c in line)
    return float(total if which == "total" else total - failed)


@table("cluster_spread")
def _cluster_spread(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: hit rate range and mean of sglang-like and kvheat in other replica orders."""
    d, rows = files[0], []
    for trace, short in TRACE_NAMES.items():
        for cap in dict.fromkeys(r["capacity_tokens"] for r in d["spread"] if r["trace"] == trace):
            cells = []
            for router in ("sglang-like", "kvheat"):
                xs = select(d, f"spread[trace={trace},capacity_tokens={cap},router={router}]")["hit_rates"]
                cells.append(f"{pct(min(xs))} – {pct(max(xs))} (mean {pct(sum(xs) / len(xs))})")
            rows.append([short, mtokens(cap), *cells])
    return md_table(["trace", "C", "sglang-like", "kvheat"], "llll", rows)


@table("cluster_names")
def _cluster_names(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: the grid under K other sets of replica names (sim.json "names")."""
    from statistics import mean, median

    rows = []
    for r in files[0]["names"]:
        hit, k = r["hit_rates"], r["name_sets"]

        def spread(xs: list[float]) -> str:
            if max(xs) == min(xs):
                return pct(xs[0])
            return f"{pct(median(xs))} [{100 * min(xs):.2f}, {100 * max(xs):.2f}]"
        ob = r["kvheat_of_bound"]
        ahead = sum(a > b for a, b in zip(hit["kvheat"], hit["sglang-like"]))
        bal = r["median_prefill_imbalance"]
        rows.append([TRACE_NAMES[r["trace"]], mtokens(r["capacity_tokens"]), spread(hit["kvheat"]),
                     spread(hit["sglang-like"]), spread(hit["prefix-hash"]), f"{ahead}/{k}",
                     f"{median(ob):.1f}% [{min(ob):.1f}, {max(ob):.1f}] "
                     f"({sum(x >= 90 for x in ob)}/{k}), mean {mean(ob):.1f}%",
                     " / ".join(f"{bal[x]:.2f}" for x in ("kvheat", "sglang-like", "prefix-hash"))])
    return md_table(["trace", "C", "kvheat, median [min, max]", "sglang-like", "prefix-hash",
                     "kvheat ahead of sglang-like",
                     "kvheat of the bound, median [min, max] (at 90%+)",
                     "max/mean prefill kvheat / sglang / hash"], "llrrrrrr", rows)


def _short(trace: str) -> str:
    return TRACE_NAMES.get(trace, trace)


@table("cluster_perturbed")
def _cluster_perturbed(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: kvheat against sglang-like on K perturbed variants of each trace."""
    from statistics import mean

    from bench.cluster.sim import _pm

    rows = []
    for r in files[0]["perturbed"]:
        d, k, ob = r["diff_points"], r["variants"], r["kvheat_of_bound"]

        def paired(xs: list[float], k: int = k) -> str:
            return f"{_pm(xs)} ({sum(x > 0 for x in xs)}/{k})"
        rows.append([_short(r["trace"]), mtokens(r["capacity_tokens"]),
                     f"{_pm(d)} [{min(d):+.2f}, {max(d):+.2f}]", f"{sum(x > 0 for x in d)} of {k}",
                     f"{mean(ob):.1f}% [{min(ob):.1f}, {max(ob):.1f}]",
                     f"{mean(r['kvheat_prefill_imbalance']):.2f} / "
                     f"{mean(r['sglang_prefill_imbalance']):.2f}",
                     paired(r["own_diff_points"]), paired(r["hints_diff_points"])])
    return md_table(["trace", "C", "kvheat − sglang-like, mean ± se [min, max]", "kvheat ahead",
                     "kvheat of the bound, mean [min, max]", "max/mean prefill kvheat / sglang",
                     "replicas on their own regime − sglang-like", "both told"], "llrrrrrr", rows)


@table("cluster_time_scales")
def _cluster_time_scales(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: sglang-like and kvheat at other traffic rates (1M per replica)."""
    d, rows = files[0], []
    for trace in TRACE_NAMES:
        for ts in dict.fromkeys(r["time_scale"] for r in d["time_scales"] if r["trace"] == trace):
            sg, kv = (select(d, f"time_scales[trace={trace},time_scale={ts},router={r}]")
                      for r in ("sglang-like", "kvheat"))
            rows.append([_short(trace), f"×{ts:g}", pct(sg["hit_rate"]), pct(kv["hit_rate"]),
                         f"{sg['imbalance_prefill_tokens']:.2f}",
                         f"{kv['imbalance_prefill_tokens']:.2f}",
                         f"{sg['ttft_p99_s']:.2f}", f"{kv['ttft_p99_s']:.2f}"])
    return md_table(["trace", "time scale", "sglang-like hit", "kvheat hit",
                     "sglang-like max/mean prefill", "kvheat max/mean prefill",
                     "sglang-like TTFT P99 s", "kvheat TTFT P99 s"], "lrrrrrrr", rows)


@table("cluster_shared")
def _cluster_shared(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: the routers over a shared (Redis) tier budget."""
    rows = [[_short(r["trace"]), r["router"], pct(r["hit_rate"]),
             pct(r["shared_hit_tokens"] / r["total_tokens"]), pct(r["of_bound"], 1)]
            for r in files[0]["shared"]]
    return md_table(["trace", "router", "hit rate", "of which from the shared tier",
                     "of bound"], "llrrr", rows)


CACHE_POLICIES = {"lru": "LRU", "lruk": "LRU-K", "arc": "ARC", "kvheat": "kvheat (told)",
                  "kvheat/own": "kvheat, own regime"}


@table("cluster_policies")
def _cluster_policies(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: kvheat routing over each replica eviction policy; `show=hit`: its hit
    rate and share of the bound on the trace · mean over the variants; `show=diff`:
    kvheat − sglang-like over the variants."""
    from statistics import mean

    from bench.cluster.sim import _pm

    rows_in = files[0]["policies"]
    by = {(r["trace"], r["capacity_tokens"], r["cache_policy"]): r for r in rows_in}

    def cell(r: dict) -> str:
        if o["show"] == "diff":
            d = r["diff_points"]
            return f"{_pm(d)} ({sum(x > 0 for x in d)}/{r['variants']})"
        share = mean(a / b for a, b in zip(r["variant_kvheat_hits"], r["variant_bounds"]))
        return (f"{pct(r['kvheat_hit'])} ({pct(r['kvheat_hit'] / r['bound_hit'], 1)}) · "
                f"{pct(mean(r['variant_kvheat_hits']))} ({pct(share, 1)})")
    rows = [[_short(t), mtokens(c)] + [cell(by[(t, c, p)]) for p in CACHE_POLICIES]
            for t, c in dict.fromkeys((r["trace"], r["capacity_tokens"]) for r in rows_in)]
    return md_table(["trace", "C", *CACHE_POLICIES.values()], "ll" + "r" * len(CACHE_POLICIES), rows)


@table("cluster_replica_counts")
def _cluster_replica_counts(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: 2 and 8 replicas, kvheat against sglang-like."""
    from statistics import mean

    from bench.cluster.sim import _pm

    rows = []
    for r in files[0]["replica_counts"]:
        d, k = r["diff_points"], r["variants"]
        rows.append([_short(r["trace"]), str(r["replicas"]), mtokens(r["capacity_tokens"]),
                     f"{pct(r['kvheat_hit'])} ({pct(r['kvheat_hit'] / r['bound_hit'], 1)}) / "
                     f"{pct(r['sglang_hit'])}", f"{_pm(d)} ({sum(x > 0 for x in d)}/{k})",
                     _pm(r["own_diff_points"]), f"{mean(r['kvheat_of_bound']):.1f}%",
                     f"{mean(r['variant_kvheat_imbalance']):.2f} / "
                     f"{mean(r['variant_sglang_imbalance']):.2f}"])
    return md_table(["trace", "N", "C", "kvheat on the trace (of bound) / sglang-like",
                     "variants: kvheat − sglang-like", "own regime − sglang-like",
                     "kvheat of bound", "max/mean prefill kvheat / sglang"], "lrlrrrrr", rows)


@table("cluster_placement")
def _cluster_placement(files: list[Any], o: dict[str, str]) -> str:
    """cluster.md: two hashed choices for new prefixes against one and against sglang-like,
    at three traffic rates (median over the trace and its variants)."""
    from statistics import median

    from bench.cluster.sim import _pm

    rs = files[0]["placement"]
    by = {(r["trace"], r["capacity_tokens"], r["time_scale"], r["against"]): r for r in rs}

    def cells(r: dict) -> list[str]:
        p99 = r["ttft_p99_ratio"]
        return [_pm(r["hit_diff_points"]), f"{median(p99):.2f} [{min(p99):.2f}, {max(p99):.2f}]",
                f"{median(r['ttft_mean_ratio']):.2f}"]
    rows = [[_short(t), mtokens(c), f"{1 / x:g}×", *cells(by[(t, c, x, "kvheat-1")]),
             *cells(by[(t, c, x, "sglang-like")])]
            for t, c, x in dict.fromkeys((r["trace"], r["capacity_tokens"], r["time_scale"]) for r in rs)]
    return md_table(["trace", "C", "rate", "vs one choice: hit", "P99 TTFT", "mean TTFT",
                     "vs sglang-like: hit", "P99 TTFT", "mean TTFT"], "llrrrrrrr", rows)


def _offload_rows(files: list[Any]) -> list[dict]:
    return [r for f in files for r in f["rows"]]


def _best_other(res: dict) -> float:
    return max(res[p]["hit_rate"] for p in ("lru", "arc"))


@table("offload")
def _offload(files: list[Any], o: dict[str, str]) -> str:
    """vllm.md: hit rates inside vLLM's offload manager, kvheat bold where it is above
    both LRU and ARC."""
    rows = []
    for r in _offload_rows(files):
        res, best = r["results"], _best_other(r["results"])
        kv = res["kvheat"]["hit_rate"]
        rows.append([f"{r['trace']} {tokens(r['capacity_tokens'])}", f"{r['time_scale']:g}",
                     pct(res["lru"]["hit_rate"]), pct(res["arc"]["hit_rate"]),
                     bold(pct(kv), kv > best), pct(res["belady"]["hit_rate"]),
                     f"{100 * (kv - best):+.2f}"])
    return md_table(["trace, capacity", "time scale", "lru", "arc", "kvheat", "belady",
                     "kvheat − best"], "lrrrrrr", rows)


ROOM = 0.001  # Belady within 0.1 point of the best of lru/arc: no room for any policy


@value("offload")
def _offload_value(d: Any, which: str) -> float:
    """Over offload files' cells with room: `wins` (kvheat above lru and arc), `room`
    (cells with room), `sum` (kvheat − best of lru/arc summed over every cell)."""
    rows = [r for f in (d if isinstance(d, list) else [d]) for r in f["rows"]]
    room = [r for r in rows if r["results"]["belady"]["hit_rate"] - _best_other(r["results"]) > ROOM]
    if which == "room":
        return float(len(room))
    if which == "wins":
        return float(sum(r["results"]["kvheat"]["hit_rate"] > _best_other(r["results"]) for r in room))
    if which == "sum":
        return float(sum(r["results"]["kvheat"]["hit_rate"] - _best_other(r["results"]) for r in rows))
    raise DocError(f"@offload: unknown {which!r}")


@value("offload_margin")
def _offload_margin(d: Any, cell: str) -> float:
    """kvheat − best of lru/arc in one cell, `trace,capacity_tokens,time_scale`."""
    trace, cap, ts = cell.split(",")
    r = select(d, f"rows[trace={trace},capacity_tokens={cap},time_scale={ts}]")["results"]
    return float(r["kvheat"]["hit_rate"] - _best_other(r))


@table("offload_heldout")
def _offload_heldout(files: list[Any], o: dict[str, str]) -> str:
    """vllm.md: the held-out generator shapes, "no room" where Belady leaves none."""
    rows = []
    for r in _offload_rows(files):
        res, best = r["results"], _best_other(r["results"])
        room = res["belady"]["hit_rate"] - best > ROOM
        rows.append([f"{r['trace']} {tokens(r['capacity_tokens'])}", pct(res["lru"]["hit_rate"]),
                     pct(res["arc"]["hit_rate"]), pct(res["kvheat"]["hit_rate"]),
                     pct(res["belady"]["hit_rate"]),
                     f"{100 * (res['kvheat']['hit_rate'] - best):+.2f}", "" if room else "no room"])
    return md_table(["shape, capacity", "lru", "arc", "kvheat", "belady", "kvheat − best", ""],
                    "lrrrrrl", rows)


@table("offload_overhead")
def _offload_overhead(files: list[Any], o: dict[str, str]) -> str:
    """vllm.md: µs per manager call, lru / arc / kvheat, and the per-round ratios
    (`lru=yes` adds kvheat/lru)."""
    from statistics import median

    def ratio(xs: list[float]) -> str:
        return f"{median(xs):.2f} [{min(xs):.2f}–{max(xs):.2f}]"
    with_lru = o.get("lru") == "yes"
    rows = []
    for r in _offload_rows(files):
        us = r["us_per_call"]
        rows.append([f"{r['trace']} {tokens(r['capacity_tokens'])} {r['time_scale']:g}",
                     " / ".join(f"{median(us[p]):.1f}" for p in ("lru", "arc", "kvheat")),
                     ratio(r["kvheat_over_arc"])] + ([ratio(r["kvheat_over_lru"])] if with_lru else []))
    head = ["cell", "µs/call lru / arc / kvheat (median)", "kvheat/arc median [range]"]
    if with_lru:
        head.append("kvheat/lru median [range]")
    return md_table(head, "llr" + "r" * with_lru, rows)


@table("lmcache")
def _lmcache(files: list[Any], o: dict[str, str]) -> str:
    """vllm.md: bench/vllm/lmcache.py: prompt tokens served per row and budget
    (`show=served`), or per repeat (`show=repeats`), or every figure per budget and row (median, range over the repeats),
    then whether the greedy outputs agreed."""
    from bench.vllm.lmcache import load_line, outputs_line, repeats_table, served_table
    from bench.vllm.lmcache import table as full_table

    d = files[0]
    if o.get("show") == "served":
        return served_table(d["summary"])
    if o.get("show") == "repeats":
        return repeats_table(d)
    return full_table(d["summary"]) + "\n\n" + outputs_line(d) + " " + load_line(d)


@table("cycles")
def _cycles(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: bench/heat/cycles.py: each policy's hit rate on the cycle of conversations,
    per capacity, over every set and per set."""
    from bench.heat.cycles import table as cycles_table

    return cycles_table(files[0])


@table("ablation")
def _ablation(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: bench/heat/ablation.py's variants, one column per trace and capacity."""
    rows = files[0]
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    caps = rows[0]["capacities"]
    by = {(r["trace"], r["variant"]): r["hit_rate"] for r in rows}
    body = [[v] + [pct(by[(t, v)][i]) for t in traces for i in range(len(caps))] for v in variants]
    return md_table(["variant"] + [f"{t} {tokens(c)}" for t in traces for c in caps],
                    "l" + "r" * len(traces) * len(caps), body)


@table("oracle")
def _oracle(files: list[Any], o: dict[str, str]) -> str:
    """heat.md: kvheat told a perfect reuse bit, beside LRU, the best other online policy,
    kvheat and Belady (share of the LRU → Belady gap in brackets)."""
    from bench.heat.grid import ONLINE

    rows = []
    for r in files[0]:
        h, g = r["hit_rate"], r["gap_closed"]
        best = max((p for p in ONLINE if p in h and p != "lru"), key=h.__getitem__)
        rows.append([r["trace"], tokens(r["capacity_tokens"]), pct(h["lru"]),
                     f"{best} {pct(h[best])} ({g[best]:+.0%})", f"{pct(h['kvheat'])} ({g['kvheat']:+.0%})",
                     f"{pct(h['kvheat+oracle'])} ({g['kvheat+oracle']:+.0%})", pct(h["belady"])])
    return md_table(["trace", "capacity", "LRU", "best other online", "kvheat",
                     "kvheat + perfect reuse bit", "Belady"], "lrrrrrr", rows)


_DECODE_ROWS = {"vllm": "vLLM alone", "noop": "no-op connector", "kvheat-host": "KVHeatConnector, host"}


def _range_ms(c: dict[str, float] | None) -> str:
    if not c:
        return "–"
    return f"{1000 * c['median']:.2f} ({1000 * c['min']:.2f}-{1000 * c['max']:.2f})"


def _ratio(c: dict[str, float] | None) -> str:
    return "–" if not c else f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})"


@table("vllm_decode")
def _vllm_decode(files: list[Any], o: dict[str, str]) -> str:
    """vllm.md: bench/vllm/decode.py, each server (row and binding): the cores vLLM bound
    its compute to, TPOT and fresh-prefill TTFT (median and range over the draws, ms) and
    their ratios to vLLM alone of the same binding within each draw."""
    d = files[0]
    s = d["summary"]
    body = []
    for name, dec in s.get("decode", {}).items():
        row, bind = name.split("@", 1)
        pre = s.get("prefill", {}).get(name, {})
        body.append([_DECODE_ROWS.get(row, row), f"`{bind}`", str(d["bindings"].get(name)),
                     _range_ms(dec.get("tpot_s")), _ratio(dec.get("ratio")),
                     _range_ms(pre.get("ttft_s")), _ratio(pre.get("ratio"))])
    return md_table(["server", "binding asked", "cores vLLM bound", "TPOT ms",
                     "TPOT / vLLM alone", "fresh prefill TTFT ms", "TTFT / vLLM alone"],
                    "lllrrrr", body)


if __name__ == "__main__":
    sys.exit(main())
