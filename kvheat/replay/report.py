"""Replay reports: a table on the terminal, one JSON object, a PNG of hit rate vs capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .replayer import ReplayResult

# Below one point of hit rate between LRU and Belady the share of it a policy closes is
# noise (a 0.1-point gap made a 0.1-point loss read "-103%"): no share is given.
MIN_GAP = 0.01
GAP_LEGEND = ("gap: the share of the LRU→Belady gap a policy closes at that capacity, "
              "(policy − LRU) / (Belady − LRU): 0% is LRU, 100% Belady (the offline "
              "optimum), below 0 worse than LRU; \"–\" where Belady is under "
              f"{MIN_GAP * 100:g} point above LRU (too small a gap to share out).")


def gap_closed(rate: float, lru: float, belady: float) -> float | None:
    """The fraction of the LRU -> Belady gap a policy closes.

    None where that gap is under `MIN_GAP` (hit rates as fractions)."""
    return (rate - lru) / (belady - lru) if belady - lru >= MIN_GAP else None


def summarize(trace_name: str, block_tokens: int, infinite: float,
              results: list[ReplayResult]) -> dict:
    """The replay report: each result, with the share of the LRU -> Belady gap it closes."""
    by = {(r.policy, r.capacity_tokens): r for r in results}
    rows = []
    for r in results:
        d = r.as_dict()
        lru, bel = by.get(("lru", r.capacity_tokens)), by.get(("belady", r.capacity_tokens))
        if lru and bel:
            d["gap_closed"] = gap_closed(r.hit_rate, lru.hit_rate, bel.hit_rate)
        rows.append(d)
    return {"trace": trace_name, "block_tokens": block_tokens, "infinite": infinite, "results": rows}


def table_console() -> Console:
    """Where tables go: the terminal, at its width, else an unbounded console.

    A pipe, a log file or CI get an unbounded width, since rich would otherwise assume 80
    columns and cut cells."""
    con = Console()
    return con if con.is_terminal else Console(width=100_000)


def print_uncut(table: Table, console: Console | None = None) -> None:
    """Print `table` with no cell cut.

    Cells wrap (fold) where a terminal is narrower than the table, and a non-terminal is as
    wide as the table (`table_console`)."""
    for col in table.columns:
        col.overflow = "fold"
        col.no_wrap = False
    (console or table_console()).print(table)


def print_table(summary: dict, console: Console | None = None) -> None:
    """Print the report's hit rates: a row per policy, a column per capacity."""
    caps = sorted({r["capacity_tokens"] for r in summary["results"]})
    pols = list(dict.fromkeys(r["policy"] for r in summary["results"]))
    cell = {(r["policy"], r["capacity_tokens"]): r for r in summary["results"]}
    gaps = any("gap_closed" in r for r in summary["results"])
    t = Table(title=f"{summary['trace']}: token-weighted prefix hit rate "
                    f"({summary['block_tokens']}-token blocks, infinite cache "
                    f"{summary['infinite']:.2%})",
              caption=GAP_LEGEND if gaps else None, caption_justify="left")
    t.add_column("policy")
    for c in caps:
        t.add_column(f"{_fmt_tokens(c)} tokens", justify="right")
    for p in pols:
        cells = []
        for c in caps:
            r = cell.get((p, c))
            if r is None:
                cells.append("")
                continue
            extra = ""
            if "gap_closed" in r and p not in ("lru", "belady"):
                g = r["gap_closed"]
                extra = f" ({'–' if g is None else f'{g:+.0%}'} gap)"
            cells.append(f"{r['hit_rate']:.2%}{extra}")
        t.add_row(p, *cells)
    print_uncut(t, console)


def print_misses(summary: dict, console: Console | None = None) -> None:
    """Print why prompt tokens missed, by policy and capacity."""
    t = Table(title="Why prompt tokens missed (share of all prompt tokens)")
    for col in ("policy", "capacity", "compulsory", "capacity miss", "sub-block", "isolation", "too long"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in summary["results"]:
        m, tot = r["misses"], max(r["total_tokens"], 1)
        t.add_row(r["policy"], _fmt_tokens(r["capacity_tokens"]),
                  *(f"{m[k] / tot:.1%}" for k in ("compulsory", "capacity", "sub_block", "isolation", "too_long")))
    print_uncut(t, console)


def print_curves(summary: dict, console: Console | None = None) -> None:
    """Print the curves of `summary["curves"]` (`kvheat replay --curve`).

    Hit rate by capacity and policy, each policy's knee, and each estimate's error against a
    full replay."""
    cv = summary["curves"]
    pols = cv["policies"]
    share = cv["knee_share"]
    t = Table(title=f"{summary['trace']}: hit rate against capacity (infinite cache "
                    f"{cv['unbounded']:.2%}; knee: the capacity reaching {share:.0%} of it)",
              caption="* a sampled miniature (SHARDS, rate shown in the JSON); LRU exact by "
                      "stack distance; the rest full replays", caption_justify="left")
    t.add_column("capacity")
    for p in pols:
        t.add_column(p["policy"], justify="right")
    for i, c in enumerate(cv["capacities"]):
        cells = []
        for p in pols:
            pt = p["points"][i]
            cells.append(f"{pt['hit_rate']:.2%}{'*' if pt['method'] == 'miniature' else ''}")
        t.add_row(_fmt_approx(c), *cells)
    t.add_row("knee", *(_fmt_approx(p["knee_tokens"]) if p["knee_tokens"] else "beyond"
                        for p in pols))
    print_uncut(t, console)
    checks = [(p["policy"], c) for p in pols for c in p["checks"]]
    if any(c["method"] == "miniature" for _, c in checks):
        e = Table(title="Curve estimates against full replays (points)")
        for col in ("policy", "capacity", "sample rate", "curve", "replay", "error"):
            e.add_column(col, justify="left" if col == "policy" else "right")
        for pol, c in checks:
            e.add_row(pol, _fmt_tokens(c["capacity_tokens"]), f"{c['sample_rate']:g}",
                      f"{c['curve']:.2%}", f"{c['replay']:.2%}", f"{c['error_points']:+.2f}")
        print_uncut(e, console)


def write_json(summary: dict, path: str | Path) -> None:
    """Write the report as indented JSON at `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")


def plot(summary: dict, path: str | Path) -> None:
    """Write a PNG of each policy's hit rate against capacity at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({r["capacity_tokens"] for r in summary["results"]})
    pols = list(dict.fromkeys(r["policy"] for r in summary["results"]))
    cell = {(r["policy"], r["capacity_tokens"]): r["hit_rate"] for r in summary["results"]}
    curves = summary.get("curves")
    if curves:  # the curve's points, the table's full replays among them
        for p in curves["policies"]:
            for pt in p["points"]:
                cell.setdefault((p["policy"], pt["capacity_tokens"]), pt["hit_rate"])
        caps = sorted({c for _, c in cell})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in pols:
        xs = [c for c in caps if (p, c) in cell]
        # kvheat: bold black squares, unlike any colour of the default cycle (arc gets
        # tab:red from it); Belady: the dashed grey ceiling.
        style: dict[str, Any] = ({"linestyle": "--", "color": "dimgray"} if p == "belady"
                                 else {"marker": "o"})
        if p == "kvheat":
            style = {"marker": "s", "linewidth": 2.5, "color": "black", "zorder": 3}
        ax.plot(xs, [100 * cell[(p, c)] for c in xs], label=p, **style)
    ax.axhline(100 * summary["infinite"], color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    if curves:
        for p in curves["policies"]:
            if p["knee_tokens"]:
                ax.axvline(p["knee_tokens"], color="black" if p["policy"] == "kvheat" else
                           "lightgray", linewidth=0.8, linestyle="-.")
    else:
        ax.set_xticks(caps, [_fmt_tokens(c) for c in caps])
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title(summary["trace"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_approx(n: int) -> str:
    """A token count to three significant digits (a curve's log-spaced capacities)."""
    return _fmt_tokens(n, exact=False)


def _fmt_tokens(n: int, exact: bool = True) -> str:
    """1M, 2.5K: `exact`, only where that is the count exactly; else to three digits."""
    for div, suf in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "K")):
        if n >= div and (not exact or n % (div // 100) == 0):
            return f"{n / div:g}{suf}" if exact else f"{n / div:.3g}{suf}"
    return str(n)


def print_explain(summary: dict, console: Console | None = None) -> None:
    """Print what each adaptive policy followed over the trace.

    Its multiple at the start, each move (when, to what, on what lead) and where it ended,
    with its candidates' hits."""
    con = console or table_console()
    t = Table(title=f"{summary['trace']}: what the adaptive policies learned")
    for col in ("policy", "capacity", "rounds", "moves", "multiple over the trace",
                "protection (protect.py)", "candidates (an octave either side, at the end; alt: "
                "the other protection mode): multiple = hit tokens per sampled request"):
        t.add_column(col)
    shown = 0
    for r in summary["results"]:
        rounds = r.get("explain")
        if not rounds:
            continue
        shown += 1
        total = max(rounds[-1]["accesses"], 1)
        path = [f"{r['policy_stats'].get('mini_start_mult', rounds[0]['multiple']):g}"]
        path += [f"→{d['multiple']:g} at {d['accesses'] / total:.0%} (z {d['lead_z']:.1f})"
                 for d in rounds if d["moved"]]
        st = r["policy_stats"]
        cands = ", ".join(f"{n} {st[f'mini_{n}_mult']:g} = "
                          f"{st[f'mini_{n}_hit_tokens_per_request']:,.0f}"
                          for n in ("lo", "hi", "alt") if f"mini_{n}_mult" in st)
        switches = " ".join(f"{'on' if d.get('protect') else 'off'} at "
                            f"{d['accesses'] / total:.0%} (z {d.get('alt_lead_z', 0.0):.1f})"
                            for d in rounds if d.get("switched"))
        t.add_row(r["policy"], _fmt_tokens(r["capacity_tokens"]), str(len(rounds)),
                  str(sum(1 for d in rounds if d["moved"])), " ".join(path),
                  switches or "off throughout", cands)
    if shown:
        print_uncut(t, con)
    else:
        con.print("no adaptive policy among these (kvheat adapts by miniature simulation "
                  "when its cache holds at least 64 blocks)")
