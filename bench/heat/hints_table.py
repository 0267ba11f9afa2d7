"""kvheat with request hints against the other online policies and Belady, on every trace,
and what each hint is worth (issue "Heat that knows sessions").

Every replay goes through `bench/heat/hinted.py` (the project's block cache, one request
at a time, sessions passed on allocate and finish reasons on free where the trace has
them; sessions derived from whole-prompt prefixes where it has none). Policies that read
no hint decide as in `kvheat replay`. Time scales need no column: every policy here reads
no clock (kvheat's hints included: tests/test_heat_sessions.py replays at 2^j times the
rate and asserts the same evictions), so each figure holds at every time scale.

    python bench/heat/hints_table.py --json docs/results/heat/hints.json            # the table
    python bench/heat/hints_table.py --ablation --json docs/results/heat/hints_ablation.json

Traces: `agentic` (the dev draw, finish reasons), `draw<seed>` (held-out draws from the raw
sessions, sub-agents included), `conv`, `synth`, `conv_a`/`conv_b` (the conversation
trace's halves).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if not __package__:  # run as `python bench/heat/hints_table.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.heat.hinted import hinted, replay_hinted
from kvheat.heat import KVHeat
from kvheat.replay import parse_tokens

OTHERS = ["lru", "fifo", "lfu", "arc", "s3fifo", "twoq", "lruk", "sae"]
# name -> (KVHeat keyword arguments, sessions passed, finish reasons passed, queue depth)
VARIANTS: dict[str, tuple[dict, bool, bool, int]] = {
    "kvheat (no hints)": ({}, False, False, 0),
    "kvheat+hints": ({}, True, True, 0),
}
ABLATION: dict[str, tuple[dict, bool, bool, int]] = {
    "no hints": ({}, False, False, 0),
    "+ end class: median return gap": (
        {"session_hints": "log", "session_rate": False, "session_own": False}, True, True, 0),
    "+ end class: share that returns": (
        {"session_hints": "log", "session_own": False}, True, True, 0),
    "+ session's own pace (log2 charges)": ({"session_hints": "log"}, True, True, 0),
    "end class: returns within the eviction age (default)": ({}, True, True, 0),
    "default + session's own pace": ({"session_own": True}, True, True, 0),
    "default, sessions only (no finish reason)": ({}, True, False, 0),
    "default + queued blocks (1 waiting)": ({}, True, True, 1),
}


def _job(job: tuple[str, str, int, str]) -> dict:
    trace, label, cap, table = job
    ht = hinted(trace)
    if table == "policy":
        r = replay_hinted(ht, label, cap)
    else:
        kw, sess, reasons, depth = (VARIANTS if table == "variant" else ABLATION)[label]
        r = replay_hinted(ht, functools.partial(KVHeat, **kw), cap, sess, reasons,
                          queue_depth=depth)
    r["label"] = label
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="agentic,draw1,draw2,conv,conv_a,conv_b,synth")
    ap.add_argument("--capacity", default="1M,3M,10M")
    ap.add_argument("--policies", default=",".join(OTHERS + ["belady"]))
    ap.add_argument("--ablation", action="store_true", help="the kvheat variants only")
    ap.add_argument("--no-kvheat", action="store_true", help="the other policies only")
    ap.add_argument("--rows", default="", help="with --ablation: which rows (0-based, a,b,c)")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    caps = [parse_tokens(c) for c in a.capacity.split(",")]
    traces = a.trace.split(",")
    jobs: list[tuple[str, str, int, str]] = []
    for t in traces:
        for c in caps:
            if a.ablation:
                rows_wanted = [int(x) for x in a.rows.split(",")] if a.rows else range(len(ABLATION))
                names = list(ABLATION)
                jobs += [(t, names[i], c, "ablation") for i in rows_wanted]
            else:
                jobs += [(t, p, c, "policy") for p in a.policies.split(",") if p]
                if not a.no_kvheat:
                    jobs += [(t, v, c, "variant") for v in VARIANTS]
    if a.workers > 1:
        with ProcessPoolExecutor(a.workers) as ex:
            rows = list(ex.map(_job, jobs, chunksize=1))
    else:
        rows = [_job(j) for j in jobs]
    for r in rows:
        r.pop("policy_stats", None)
    rate = {(r["trace"], r["capacity_tokens"], r["label"]): r["hit_rate"] for r in rows}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    summary = []
    for t in traces:
        print(f"\n{t}: hit rate at " + ", ".join(f"{c / 1e6:g}M" for c in caps))
        for lab in labels:
            print(f"  {lab:44s} " + "  ".join(
                f"{100 * rate.get((t, c, lab), float('nan')):6.2f}%" for c in caps))
        for c in caps:
            lru, bel = rate.get((t, c, "lru")), rate.get((t, c, "belady"))
            others = {p: rate[(t, c, p)] for p in OTHERS if (t, c, p) in rate}
            for lab in labels:
                if not lab.startswith(("kvheat", "+", "default", "no hints")):
                    continue
                rec = {"trace": t, "capacity_tokens": c, "label": lab,
                       "hit_rate": rate[(t, c, lab)]}
                if others:
                    best = max(others, key=others.__getitem__)
                    rec["best_other"] = best
                    rec["margin"] = rate[(t, c, lab)] - others[best]
                if lru is not None and bel is not None and bel > lru:
                    rec["gap_closed"] = (rate[(t, c, lab)] - lru) / (bel - lru)
                summary.append(rec)
        for rec in summary:
            if rec["trace"] == t and "margin" in rec:
                print(f"  {rec['capacity_tokens'] / 1e6:g}M {rec['label']:30s} margin "
                      f"{100 * rec['margin']:+.2f} vs {rec['best_other']}, gap closed "
                      f"{100 * rec.get('gap_closed', float('nan')):.0f}%")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
