"""Reports of cluster simulations: a table, one JSON object, a plot of hit rate and
balance per router and capacity."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..replay.report import _fmt_tokens, print_uncut, table_console
from .simulate import ClusterResult


def summarize(trace_name: str, results: list[ClusterResult], **extra: object) -> dict:
    """The cluster report: the trace's name, the extra fields and each router's result."""
    return {"trace": trace_name, **extra, "results": [r.as_dict() for r in results]}


def print_table(summary: dict, console: Console | None = None) -> None:
    """Print the cluster report: hit rate against the bound, and load per replica."""
    console = console or table_console()
    rows = summary["results"]
    if not rows:
        return
    first = rows[0]
    shared = f", shared tier {_fmt_tokens(first['shared_tokens'])}" if first["shared_tokens"] else ""
    t = Table(title=f"{summary['trace']}: {first['replicas']} replicas{shared}; hit rate "
                    f"(device + shared tier) against one cache of N x C, load per replica")
    for col in ("C", "router", "hit", "/bound", "req max/mean", "prefill max/mean", "TTFT p50",
                "p99"):
        t.add_column(col, justify="left" if col in ("router", "C") else "right")
    for r in rows:
        bound = "" if r["of_bound"] is None else f"{r['of_bound']:.1%}"
        t.add_row(_fmt_tokens(r["capacity_tokens"]), r["router"], f"{r['hit_rate']:.2%}", bound,
                  f"{r['imbalance_requests']:.2f}", f"{r['imbalance_prefill_tokens']:.2f}",
                  f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}")
    print_uncut(t, console)
    bounds = {(r["capacity_tokens"], r["bound_hit_rate"]) for r in rows if r["bound_hit_rate"]}
    for cap, b in sorted(bounds):
        console.print(f"  one cache of {first['replicas']} x {_fmt_tokens(cap)}"
                      f"{' + shared' if first['shared_tokens'] else ''}: {b:.2%}")


def write_json(summary: dict, path: str | Path) -> None:
    """Write the report as indented JSON at `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")


def plot(summaries: list[dict], path: str | Path) -> None:
    """Write a PNG per trace of each router's share of the bound and its prefill imbalance.

    Hit rate as a share of the N·C bound (bars) and max/mean prefill tokens (markers), by
    capacity and router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(summaries), figsize=(5.5 * len(summaries), 6.5),
                             squeeze=False)
    for col, summary in enumerate(summaries):
        rows = summary["results"]
        caps = sorted({r["capacity_tokens"] for r in rows})
        routers = list(dict.fromkeys(r["router"] for r in rows))
        cell = {(r["router"], r["capacity_tokens"]): r for r in rows}
        width = 0.8 / max(1, len(routers))
        for k, name in enumerate(routers):
            xs = [i + (k - (len(routers) - 1) / 2) * width for i in range(len(caps))]
            color = "black" if name == "kvheat" else None
            axes[0][col].bar(xs, [100 * (cell[(name, c)]["of_bound"] or 0) for c in caps],
                             width, label=name, color=color)
            axes[1][col].plot(range(len(caps)),
                              [cell[(name, c)]["imbalance_prefill_tokens"] for c in caps],
                              marker="s" if name == "kvheat" else "o", label=name, color=color,
                              linewidth=2.5 if name == "kvheat" else 1)
        axes[0][col].axhline(90, color="grey", linestyle=":", label="90% target")
        axes[0][col].set_ylabel("hit rate, % of one N·C cache")
        axes[0][col].set_title(summary["trace"], fontsize=9)
        axes[1][col].axhline(1.25, color="grey", linestyle=":", label="1.25 target")
        axes[1][col].set_ylabel("max / mean prefill tokens")
        top = max(r["imbalance_prefill_tokens"] for r in rows)
        if top > 2:  # one far outlier (a prefix hash on one shared head): say it, clip it
            axes[1][col].set_ylim(0.95, 1.6)
            axes[1][col].text(0.02, 0.95, f"off the chart: up to {top:.2f}",
                              transform=axes[1][col].transAxes, fontsize=7, va="top")
        for ax in axes[:, col]:
            ax.set_xticks(range(len(caps)), [_fmt_tokens(c) + " / replica" for c in caps])
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=6, loc="lower right", framealpha=0.9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
