"""bench/cluster/real.py's report: a round's figures, the summary over rounds (median and
range), the doc's tables in markdown, and the plot."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Round:
    router: str
    round: int
    hit_rate: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    requests_per_s: float
    errors: int
    per_replica: list[dict[str, float]] = field(default_factory=list)
    imbalance_requests: float | None = None
    imbalance_prefill: float | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)  # per request, for analysis
    # CPU seconds the router and the replicas (all three) used: over the round, and over
    # its first second (the cold burst, where the TTFT tail is)
    router_cpu_s: float | None = None
    replica_cpu_s: float | None = None
    router_cpu_first_s: float | None = None
    replica_cpu_first_s: float | None = None


def write_json(path: str | Path, report: Any) -> None:
    """Write `report` as indented JSON at `path` (its folder made first), and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def summarize(rounds: list[Round]) -> list[dict[str, Any]]:
    out = []
    for kind in dict.fromkeys(r.router for r in rounds):
        rs = [r for r in rounds if r.router == kind]

        def agg(attr: str, rs: list[Round] = rs) -> dict[str, float | None]:
            xs = [getattr(r, attr) for r in rs if getattr(r, attr) is not None]
            if not xs:
                return {"median": None, "min": None, "max": None}
            return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        out.append({"router": kind, "rounds": len(rs), **{a: agg(a) for a in (
            "hit_rate", "ttft_p50_s", "ttft_p99_s", "requests_per_s", "imbalance_requests",
            "imbalance_prefill", "router_cpu_s", "replica_cpu_s", "router_cpu_first_s",
            "replica_cpu_first_s")}, "errors": sum(r.errors for r in rs),
            **pooled_tail(rs)})
    return out


def pooled_tail(rs: list[Round]) -> dict[str, float | None]:
    """P99 TTFT over every request of every round (a round's own P99 is its second
    slowest request of 144, so one cold request moves it), and the same past each round's
    cold burst (the requests sent before the first answer came back: empty caches)."""
    every: list[float] = []
    warm: list[float] = []
    for r in rs:
        done = [q for q in r.requests if q.get("ttft") is not None]
        every += [q["ttft"] for q in done]
        if done:
            first = min(q["start"] + q["ttft"] for q in done)
            warm += [q["ttft"] for q in done if q["start"] >= first]
    return {"ttft_p99_pooled_s": pct(every, 0.99), "ttft_p99_warm_s": pct(warm, 0.99),
            "pooled_requests": len(every)}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def max_over_mean(xs: list[float]) -> float | None:
    m = sum(xs) / len(xs) if xs else 0
    return max(xs) / m if m else None


def print_table(summary: list[dict[str, Any]]) -> None:
    def cell(d: dict[str, float | None], scale: float = 1.0, spec: str = ".1f") -> str:
        if d["median"] is None:
            return "-"
        return f"{d['median'] * scale:{spec}} ({d['min'] * scale:{spec}}-{d['max'] * scale:{spec}})"
    print(f"{'router':10} {'hit rate %':>20} {'TTFT P50 ms':>20} {'TTFT P99 ms':>22} "
          f"{'req/s':>18} {'req max/mean':>18} {'prefill max/mean':>18} {'errors':>7}")
    for s in summary:
        print(f"{s['router']:10} {cell(s['hit_rate'], 100):>20} {cell(s['ttft_p50_s'], 1000, '.0f'):>20} "
              f"{cell(s['ttft_p99_s'], 1000, '.0f'):>22} {cell(s['requests_per_s'], 1, '.2f'):>18} "
              f"{cell(s['imbalance_requests'], 1, '.2f'):>18} "
              f"{cell(s['imbalance_prefill'], 1, '.2f'):>18} {s['errors']:>7}")
    for s in summary:
        if s.get("ttft_p99_pooled_s") is not None:
            print(f"  {s['router']}: P99 over all {s['pooled_requests']} requests "
                  f"{s['ttft_p99_pooled_s'] * 1000:.0f} ms, past the cold bursts "
                  f"{(s['ttft_p99_warm_s'] or 0) * 1000:.0f} ms")


def markdown(report: dict[str, Any]) -> str:
    """docs/cluster.md's tables from a report (`--markdown JSON` re-renders a saved run)."""
    def cell(d: dict[str, float | None], scale: float, spec: str) -> str:
        if d["median"] is None:
            return "-"
        return (f"{d['median'] * scale:{spec}} ({d['min'] * scale:{spec}} – "
                f"{d['max'] * scale:{spec}})")
    n = report["summary"][0]["rounds"] if report["summary"] else 0
    lines = [f"Median (min – max) over {n} interleaved rounds:", "",
             "| router | hit rate % | TTFT P50 ms | TTFT P99 ms | requests/s | "
             "max/mean requests | max/mean prefill | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["summary"]:
        lines.append(f"| {s['router']} | {cell(s['hit_rate'], 100, '.1f')} | "
                     f"{cell(s['ttft_p50_s'], 1000, '.0f')} | "
                     f"{cell(s['ttft_p99_s'], 1000, '.0f')} | "
                     f"{cell(s['requests_per_s'], 1, '.2f')} | "
                     f"{cell(s['imbalance_requests'], 1, '.2f')} | "
                     f"{cell(s['imbalance_prefill'], 1, '.2f')} | {s['errors']} |")
    pooled = [s for s in report["summary"] if s.get("ttft_p99_pooled_s") is not None]
    if pooled:
        lines += ["", "TTFT P99 over the requests of all rounds together, and past each "
                  "round's cold burst (requests sent before its first answer):", "",
                  "| router | requests | P99 ms | P99 past the cold burst ms |",
                  "|---|---:|---:|---:|"]
        for s in pooled:
            lines.append(f"| {s['router']} | {s['pooled_requests']} | "
                         f"{s['ttft_p99_pooled_s'] * 1000:.0f} | "
                         f"{(s['ttft_p99_warm_s'] or 0) * 1000:.0f} |")
    if report.get("kill"):
        lines += ["", "A replica SIGKILLed a third of the way in, restarted at two thirds:", "",
                  "| router | requests | failed (error event) | hung | wrong output | "
                  "last failure after the kill s | restart to served again s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k in report["kill"]:
            def sec(x: float | None) -> str:
                return "-" if x is None else f"{x:.2f}"
            lines.append(f"| {k['router']} | {k['requests']} | {k['failed']} | {k['hung']} | "
                         f"{k['wrong']} | {sec(k['recovery_s'])} | "
                         f"{sec(k['restart_to_served_s'])} |")
    if report.get("overhead"):
        lines += ["", "The router's own cost (one small completion, interleaved):", "",
                  "| path | P50 ms | over direct ms |", "|---|---:|---:|"]
        for name, o in report["overhead"].items():
            lines.append(f"| {name} | {o['p50_ms']:.2f} | {o['over_direct_ms']:+.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = report["summary"]
    names = [s["router"] for s in summ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    palette = {"rr": "tab:gray", "sglang": "tab:orange", "kvheat": "black",
               "kvheat-1": "tab:blue"}
    colors = [palette.get(n, "tab:blue") for n in names]
    for ax, key, scale, label in ((axes[0], "hit_rate", 100, "prefix hit rate (%)"),
                                  (axes[1], "ttft_p99_s", 1000, "TTFT P99 (ms)")):
        med = [s[key]["median"] * scale if s[key]["median"] is not None else 0 for s in summ]
        lo = [m - (s[key]["min"] or 0) * scale for m, s in zip(med, summ)]
        hi = [(s[key]["max"] or 0) * scale - m for m, s in zip(med, summ)]
        ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=4)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    rounds = [r for r in report["rounds"] if r["round"] == 0]
    width = 0.8 / max(1, len(rounds))
    for k, r in enumerate(rounds):
        pre = [x["prompt_tokens"] - x["cached_tokens"] for x in r["per_replica"]]
        axes[2].bar([i + (k - (len(rounds) - 1) / 2) * width for i in range(len(pre))], pre,
                    width, label=r["router"], color=palette.get(r["router"], "tab:blue"))
    axes[2].set_xticks(range(3), [f"replica {i}" for i in range(3)])
    axes[2].set_ylabel("prefill tokens computed (round 1)")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle("3 kvheat serve replicas + 3-node Redis Cluster tier, same multi-turn "
                 "multi-tenant load (median, range over rounds)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
