"""The replayer at production scale: a day-sized trace, every policy at three capacities
plus miss-ratio curves, with wall time and peak memory.

    python bench/cache/scale.py [--copies 40] [--trace PATH] [--capacity 1M,10M,100M]
        [--policy lru,fifo,arc,s3fifo,twoq,lruk,kvheat,belady] [--curve lru,kvheat]
        [--jobs 2] [--json results/cache/scale.json] [--plot results/cache/scale.png]
    python bench/cache/scale.py --from-json docs/results/cache/scale.json --plot OUT.png

`--from-json` prints (and plots) a result file again without rerunning it.

The trace is `--copies` plays of a shared agentic draw at once (`iter_copies`: each copy
its own blocks and sessions, started at a seeded offset, merged in time order as a
stream), spooled once (`Spool.build`), then replayed as `kvheat replay --jobs N` does:
each (policy, capacity) a task in N forked processes. The curves are `kvheat replay
--curve`'s: LRU's exact by stack distance, the others from SHARDS miniatures, each checked
against the full replays at the table's capacities (the error, in points, is in the file).

Recorded: wall time of each phase and of the whole, and peak resident memory: this
process's (`ru_maxrss`), the largest worker's, and their sum over the workers that ran at
once (an upper bound: forked workers share the parent's pages). Per replay, block
references per second of its replay loop (`ReplayResult.seconds`, in a worker that has a
core to itself when N is at most the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/cache/scale.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, TRACES
from bench._lib.peers import check_quiet
from kvheat.replay import parse_tokens
from kvheat.replay.curves import KNEE, capacity_grid, policy_curves
from kvheat.replay.parallel import ReplayTask, run_replays
from kvheat.replay.spool import Spool
from kvheat.replay.traces import iter_copies

BLOCK_TOKENS = 512
POLICIES = "lru,fifo,arc,s3fifo,twoq,lruk,kvheat,belady"
TRACE = TRACES / "agentic" / "agentic_dev.jsonl"


def rss_mb(who: int) -> float:
    """Peak resident memory of this process (RUSAGE_SELF) or of its largest finished
    child (RUSAGE_CHILDREN), in MB (Linux reports KiB)."""
    return resource.getrusage(who).ru_maxrss / 1024


def run(args: argparse.Namespace) -> dict[str, Any]:
    capacities = [parse_tokens(c) for c in args.capacity.split(",")]
    policies = args.policy.split(",")
    curve_policies = [p for p in args.curve.split(",") if p]
    report: dict[str, Any] = {
        "trace": Path(args.trace).name, "copies": args.copies, "seed": args.seed,
        "block_tokens": BLOCK_TOKENS, "capacities_tokens": capacities, "policies": policies,
        "jobs": args.jobs, "cores": os.cpu_count(),
        "machine": {"python": platform.python_version(), "machine": platform.machine()},
        "goal": {"wall_s": 20 * 60, "peak_rss_mb": 4096},
    }
    check_quiet(report, "start")
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    sp = Spool.build(iter_copies(args.trace, BLOCK_TOKENS, args.copies, args.seed), BLOCK_TOKENS)
    s = sp.summary
    report["trace_stats"] = {"requests": s.requests, "block_references": s.refs,
                             "distinct_blocks": s.distinct, "footprint_blocks": sp.footprint_blocks(),
                             "unbounded_hit_rate": sp.infinite_hit_rate(),
                             "span_hours": (s.max_ms - s.first_ms) / 3.6e6}
    phases = {"spool_s": time.perf_counter() - t0}
    print(f"spooled {s.requests:,} requests, {s.refs:,} block references "
          f"({s.distinct:,} distinct) in {phases['spool_s']:.0f} s", flush=True)
    tasks = [ReplayTask(0, p, c) for c in capacities for p in policies]
    t0 = time.perf_counter()
    done = [0]

    def progress(t: ReplayTask) -> None:
        done[0] += 1
        print(f"  [{done[0]}/{len(tasks)}] {t.policy} @ {t.capacity_tokens:,} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)

    results = run_replays([sp], tasks, args.jobs, progress)
    phases["replays_s"] = time.perf_counter() - t0
    report["results"] = [{"policy": r.policy, "capacity_tokens": r.capacity_tokens,
                          "hit_rate": r.hit_rate, "replay_s": r.seconds,
                          "refs_per_s": s.refs / r.seconds if r.seconds > 0 else None}
                         for r in results]
    if curve_policies:
        t0 = time.perf_counter()
        grid = capacity_grid(sp, args.curve_points)
        curves = policy_curves(sp, curve_policies, grid,
                               [r for r in results if r.policy in curve_policies], args.jobs,
                               args.seed)
        phases["curves_s"] = time.perf_counter() - t0
        report["curves"] = {"capacities": grid, "unbounded": sp.infinite_hit_rate(),
                            "knee_share": KNEE, "policies": [c.as_dict() for c in curves]}
    phases["total_s"] = time.perf_counter() - t_all
    worker = rss_mb(resource.RUSAGE_CHILDREN)
    parent = rss_mb(resource.RUSAGE_SELF)
    report["wall"] = phases
    report["peak_rss_mb"] = {"parent": parent, "largest_worker": worker,
                             "bound": parent + min(args.jobs, len(tasks)) * worker
                             if args.jobs > 1 else parent}
    report["within_goal"] = {"wall": phases["total_s"] <= report["goal"]["wall_s"],
                             "memory": report["peak_rss_mb"]["bound"] <= report["goal"]["peak_rss_mb"]}
    check_quiet(report, "end", after_own_run=True)
    sp.close()
    return report


def print_report(rep: dict[str, Any]) -> None:
    from rich.table import Table

    from kvheat.replay.report import print_uncut, table_console

    st = rep["trace_stats"]
    caps = rep["capacities_tokens"]
    t = Table(title=f"{rep['copies']} copies of {rep['trace']}: {st['requests']:,} requests, "
                    f"{st['block_references']:,} block references, "
                    f"{st['distinct_blocks']:,} distinct; unbounded {st['unbounded_hit_rate']:.2%}",
              caption="hit rate, and M block references/s of the replay loop", caption_justify="left")
    t.add_column("policy")
    for c in caps:
        t.add_column(f"{c:,} tok", justify="right")
    for p in rep["policies"]:
        row = []
        for c in caps:
            r = next(x for x in rep["results"] if x["policy"] == p and x["capacity_tokens"] == c)
            row.append(f"{r['hit_rate']:.2%} ({r['refs_per_s'] / 1e6:.2f}M/s)")
        t.add_row(p, *row)
    con = table_console()
    print_uncut(t, con)
    for c in rep.get("curves", {}).get("policies", []):
        knee = f"{c['knee_tokens']:,} tokens" if c["knee_tokens"] else "beyond the grid"
        errs = ", ".join(f"{e['error_points']:+.2f}" for e in c["checks"])
        con.print(f"curve {c['policy']}: knee ({rep['curves']['knee_share']:.0%} of unbounded) "
                  f"at {knee}; error against full replays (points): {errs}")
    w, m = rep["wall"], rep["peak_rss_mb"]
    con.print(f"wall {w['total_s'] / 60:.1f} min (spool {w['spool_s']:.0f} s, replays "
              f"{w['replays_s']:.0f} s, curves {w.get('curves_s', 0):.0f} s); peak RSS "
              f"{m['parent']:.0f} MB parent, {m['largest_worker']:.0f} MB largest worker, "
              f"{m['bound']:.0f} MB bound")


def plot_report(rep: dict[str, Any], path: str | Path) -> None:
    """The table's hit rates and the curves (knees marked), as `kvheat replay --plot`."""
    from kvheat.replay.report import plot

    st = rep["trace_stats"]
    plot({"trace": f"{rep['copies']} copies of {rep['trace']} "
                   f"({st['block_references'] / 1e6:.0f}M block references)",
          "results": rep["results"], "infinite": st["unbounded_hit_rate"],
          "curves": rep.get("curves")}, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace")
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", default="1M,10M,100M", help="tokens, comma-separated")
    ap.add_argument("--policy", default=POLICIES)
    ap.add_argument("--curve", default="lru,kvheat", help="policies to draw curves of ('' for none)")
    ap.add_argument("--curve-points", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=str(RESULTS / "cache" / "scale.json"))
    ap.add_argument("--plot", default=None, help="a PNG of the hit rates and curves")
    ap.add_argument("--from-json", default=None, help="show this result file; run nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        rep = json.loads(Path(args.from_json).read_text())
        print_report(rep)
        if args.plot:
            plot_report(rep, args.plot)
        return 0
    if args.copies < 1 or args.jobs < 1 or args.curve_points < 2:
        ap.error("--copies and --jobs must be >= 1, --curve-points >= 2")
    if not Path(args.trace).exists():
        ap.error(f"no trace at {args.trace}")
    rep = run(args)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print_report(rep)
    if args.plot:
        plot_report(rep, args.plot)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
