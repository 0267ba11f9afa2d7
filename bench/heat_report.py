"""Markdown tables for docs/heat.md from the JSON the heat benchmarks and `kvheat replay`
wrote under docs/.

    .venv/bin/python bench/heat_report.py
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
ONLINE = ("lru", "fifo", "lfu", "arc", "s3fifo", "twoq")


def replay_table(name: str) -> str:
    d = json.loads((DOCS / f"heat_{name}.json").read_text())
    caps = sorted({r["capacity_tokens"] for r in d["results"]})
    cell = {(r["policy"], r["capacity_tokens"]): r for r in d["results"]}
    pols = list(dict.fromkeys(r["policy"] for r in d["results"]))
    head = "| policy | " + " | ".join(f"{c // 1_000_000}M" for c in caps) + " |"
    lines = [f"**{d['trace']}** (infinite cache {100 * d['infinite']:.2f}%)", "", head,
             "|---|" + "---:|" * len(caps)]
    for p in pols:
        row = []
        for c in caps:
            r = cell[(p, c)]
            g = r.get("gap_closed")
            best = max(cell[(q, c)]["hit_rate"] for q in ONLINE if (q, c) in cell)
            txt = f"{100 * r['hit_rate']:.2f}%"
            if p not in ("lru", "belady") and g is not None:
                txt += f" ({100 * g:+.0f}%)"
            if p == "kvheat":
                txt = f"**{txt}**" + (" ✓" if r["hit_rate"] > best else " ✗")
            row.append(txt)
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def misses_table(name: str) -> str:
    d = json.loads((DOCS / f"heat_{name}.json").read_text())
    lines = ["| policy | capacity | compulsory | capacity miss | sub-block | isolation |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in d["results"]:
        if r["policy"] not in ("lru", "arc", "kvheat", "belady"):
            continue
        m, t = r["misses"], r["total_tokens"]
        lines.append(f"| {r['policy']} | {r['capacity_tokens'] // 1_000_000}M | "
                     + " | ".join(f"{100 * m[k] / t:.1f}%" for k in
                                  ("compulsory", "capacity", "sub_block", "isolation")) + " |")
    return "\n".join(lines)


def ablation_table() -> str:
    rows = json.loads((DOCS / "heat_ablation.json").read_text())
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["trace"], r["variant"]): r["hit_rate"] for r in rows}
    lines = ["| variant | conv 1M | conv 3M | conv 10M | synth 1M | synth 3M | synth 10M |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for v in variants:
        vals = cell.get(("conv", v), []) + cell.get(("synth", v), [])
        lines.append(f"| {v} | " + " | ".join(f"{100 * x:.2f}%" for x in vals) + " |")
    return "\n".join(lines)


def main() -> None:
    for name in ("conv", "synth", "builtin"):
        if (DOCS / f"heat_{name}.json").exists():
            print(replay_table(name), "\n")
    for name in ("conv", "synth"):
        if (DOCS / f"heat_{name}.json").exists():
            print(misses_table(name), "\n")
    if (DOCS / "heat_ablation.json").exists():
        print(ablation_table())


if __name__ == "__main__":
    main()
