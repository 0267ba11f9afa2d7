"""Every policy at every time scale, capacity and block size: the grid of issue "heat that
holds at every traffic rate".

A time scale k multiplies every timestamp of a trace by k (the same requests in the same
order, k times slower traffic). A policy is scale-free when its hit rates do not move with k.

    .venv/bin/python bench/heat/grid.py                      # the full grid (minutes)
    .venv/bin/python bench/heat/grid.py --quick              # a reduced grid
    .venv/bin/python bench/heat/grid.py --json docs/results/heat/grid.json --plot docs/results/heat/grid.png

Prints one table per trace and block size (kvheat's margin over the best other online
policy in each cell, and the share of the LRU -> Belady gap it closes) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if not __package__:  # run as `python bench/heat/grid.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import TRACES
from bench._lib.traces import TRACE_FILES, prepared
from kvheat.replay import parse_tokens, replay

ONLINE = ["lru", "fifo", "lfu", "arc", "s3fifo", "twoq", "lruk", "lirs", "lecar"]
def _run(job: tuple[str, int, float, str, int]) -> dict:
    name, block, scale, policy, cap = job
    r = replay(prepared(name, block), policy, cap, block, time_scale=scale)
    return {"trace": name, "block_tokens": block, "scale": scale, **r.as_dict()}


def run_grid(jobs: list[tuple[str, int, float, str, int]], workers: int) -> list[dict]:
    if workers <= 1:
        return [_run(j) for j in jobs]
    with ProcessPoolExecutor(workers) as ex:
        return list(ex.map(_run, jobs, chunksize=1))


def _row_key(r: dict) -> tuple:
    return (r["trace"], r["block_tokens"], r["scale"], r["policy"], r["capacity_tokens"])


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each replay that `new` reran (same trace, block, scale, policy and
    capacity) replaced by the new one: one policy rerun, the others kept."""
    rerun = {_row_key(r) for r in new}
    return [r for r in old if _row_key(r) not in rerun] + new


def summarize(rows: list[dict], policies: list[str]) -> list[dict]:
    """One record per (trace, block, scale, capacity): kvheat against the best other."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["block_tokens"], r["scale"], r["capacity_tokens"]), {})[
            r["policy"]] = r["hit_rate"]
    out = []
    for (tr, bt, sc, cap), rates in sorted(cells.items()):
        others = {p: v for p, v in rates.items() if p in ONLINE and p in policies}
        best = max(others, key=others.__getitem__) if others else None
        rec = {"trace": tr, "block_tokens": bt, "scale": sc, "capacity_tokens": cap, **rates}
        if "kvheat" in rates and best is not None:
            rec["best_other"] = best
            rec["margin"] = rates["kvheat"] - others[best]
            if "belady" in rates and "lru" in rates and rates["belady"] > rates["lru"]:
                rec["gap_closed"] = (rates["kvheat"] - rates["lru"]) / (rates["belady"] - rates["lru"])
        out.append(rec)
    return out


def by_trace(records: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """Records grouped by (trace, block size), in first-seen order."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["trace"], r["block_tokens"]), []).append(r)
    return groups


def print_tables(cells: list[dict]) -> None:
    for (tr, bt), cs in by_trace(cells).items():
        caps = sorted({c["capacity_tokens"] for c in cs})
        scales = sorted({c["scale"] for c in cs})
        print(f"\n{tr}, {bt}-token blocks: kvheat hit rate, margin over the best other online "
              "policy (points), share of the LRU->Belady gap closed")
        print(f"{'scale':>7} " + " ".join(f"{_fmt(c):>22}" for c in caps))
        by = {(c["scale"], c["capacity_tokens"]): c for c in cs}
        for s in scales:
            line = []
            for cap in caps:
                c = by.get((s, cap), {})
                if "kvheat" not in c:
                    line.append(f"{'':>22}")
                    continue
                g = c.get("gap_closed")
                gs = f"{g:+4.0%}" if g is not None else "  - "
                line.append(f"{100 * c['kvheat']:6.2f} {100 * c.get('margin', 0):+5.2f} {gs:>5}")
            print(f"{s:>7g} " + " ".join(f"{x:>22}" for x in line))
        lost = [c for c in cs if c.get("margin", 0) < 0]
        print(f"cells where kvheat is below another online policy: {len(lost)} of {len(cs)}"
              + "".join(f"\n  scale {c['scale']:g} {_fmt(c['capacity_tokens'])}: "
                        f"{c['best_other']} by {-100 * c['margin']:.2f} points" for c in lost))


def markdown(rows: list[dict], cells: list[dict]) -> str:
    """Per trace and block size: every policy's hit rate at each capacity (the lowest time
    scale; a line says whether any policy's rates moved with the scale), kvheat's margin
    over the best other online policy and the share of the LRU -> Belady gap it closes."""
    out = []
    for (tr, bt), rs in by_trace(rows).items():
        caps = sorted({r["capacity_tokens"] for r in rs})
        scales = sorted({r["scale"] for r in rs})
        pols = list(dict.fromkeys(r["policy"] for r in rs))
        rate = {(r["policy"], r["scale"], r["capacity_tokens"]): r["hit_rate"] for r in rs}
        moved = sorted({p for (p, s, c) in rate if rate[(p, s, c)] != rate.get((p, scales[0], c))})
        s0 = scales[0]
        out.append(f"**{tr}, {bt}-token blocks** (time scales {', '.join(f'{s:g}' for s in scales)}; "
                   + ("every policy's hit rates identical at every scale" if not moved
                      else f"rates that moved with the scale: {', '.join(moved)}") + ")\n")
        out.append("| policy | " + " | ".join(_fmt(c) for c in caps) + " |")
        out.append("|---|" + "---:|" * len(caps))
        for p in pols:
            vals = [rate.get((p, s0, c)) for c in caps]
            cellstr = [f"{100 * v:.2f}%" if v is not None else "" for v in vals]
            if p == "kvheat":
                cellstr = [f"**{x}**" for x in cellstr]
            out.append(f"| {p} | " + " | ".join(cellstr) + " |")
        by = {(c["scale"], c["capacity_tokens"]): c for c in cells if c["trace"] == tr and c["block_tokens"] == bt}
        marg = [by.get((s0, c), {}).get("margin") for c in caps]
        out.append("| kvheat − best other | " + " | ".join(
            f"{100 * m:+.2f}" if m is not None else "" for m in marg) + " |")
        gaps = [by.get((s0, c), {}).get("gap_closed") for c in caps]
        out.append("| LRU→Belady gap closed | " + " | ".join(
            f"{g:+.0%}" if g is not None else "–" for g in gaps) + " |\n")
    return "\n".join(out)


def _fmt(tokens: int) -> str:
    return f"{tokens / 1e6:g}M" if tokens >= 1_000_000 else f"{tokens / 1e3:g}K"


def plot(cells: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = by_trace([c for c in cells if "margin" in c])
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, ((tr, bt), cs) in zip(axes[0], groups.items()):
        caps = sorted({c["capacity_tokens"] for c in cs})
        scales = sorted({c["scale"] for c in cs})
        m = np.full((len(scales), len(caps)), np.nan)
        for c in cs:
            m[scales.index(c["scale"]), caps.index(c["capacity_tokens"])] = 100 * c["margin"]
        lim = max(1.0, float(np.nanmax(np.abs(m))))
        im = ax.imshow(m, cmap="RdYlGn", vmin=-lim, vmax=lim, aspect="auto")
        for i in range(len(scales)):
            for j in range(len(caps)):
                if not np.isnan(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:+.1f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(caps)), [_fmt(c) for c in caps], fontsize=7)
        ax.set_yticks(range(len(scales)), [f"x{s:g}" for s in scales], fontsize=7)
        ax.set_xlabel("capacity (tokens)")
        ax.set_ylabel("time scale")
        ax.set_title(f"{tr}, {bt}-token blocks", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8, label="kvheat - best other (points)")
    fig.suptitle("kvheat's margin over the best other online policy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="conv:512,synth:512,gen:512,gen:16",
                    help="name:block_tokens, comma-separated (conv, synth, gen or a JSONL path)")
    ap.add_argument("--scales", default="0.01,0.1,1,10,100")
    ap.add_argument("--capacity", default="0.5M,1M,2M,3M,5M,10M,20M")
    ap.add_argument("--policies", default=",".join(ONLINE + ["kvheat", "belady"]))
    ap.add_argument("--gen-scales", default="1,100",
                    help="time scales for the generator (its trace is not a measurement)")
    ap.add_argument("--quick", action="store_true", help="conv and gen:512 at 1M / 3M, scales 0.1 and 10")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--markdown", default="", help="write the tables as markdown here")
    ap.add_argument("--merge", default="",
                    help="a grid JSON this run's replays join, replacing its rows of the same "
                         "trace, block, scale, policy and capacity (rerun one policy, keep the "
                         "others)")
    a = ap.parse_args()
    if a.quick:
        a.traces, a.scales, a.capacity, a.gen_scales = "conv:512,gen:512", "0.1,10", "1M,3M", "1"
    policies = a.policies.split(",")
    caps = [parse_tokens(c) for c in a.capacity.split(",")]
    jobs = []
    for spec in a.traces.split(","):
        name, _, bt = spec.partition(":")
        if name in TRACE_FILES and not (TRACES / TRACE_FILES[name]).exists():
            print(f"skipping {name}: {TRACES / TRACE_FILES[name]} not found", file=sys.stderr)
            continue
        scales = a.gen_scales if name == "gen" else a.scales
        for s in (float(x) for x in scales.split(",")):
            jobs += [(name, int(bt or 512), s, p, c) for c in caps for p in policies]
    t0 = time.perf_counter()
    rows = run_grid(jobs, a.jobs)
    if a.merge:
        old = json.loads(Path(a.merge).read_text())["replays"]
        rows = merge_rows(old, rows)
        policies = list(dict.fromkeys([*(r["policy"] for r in old), *policies]))
    cells = summarize(rows, policies)
    print_tables(cells)
    print(f"\n{len(jobs)} replays in {time.perf_counter() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"replays": rows, "cells": cells}, indent=1))
        print(f"wrote {a.json}")
    if a.markdown:
        Path(a.markdown).write_text(markdown(rows, cells))
        print(f"wrote {a.markdown}")
    if a.plot:
        plot(cells, a.plot)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
