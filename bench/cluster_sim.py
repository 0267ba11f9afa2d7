"""Routing policies on the Mooncake traces (`kvheat replay --replicas` for the issue's grid):
4 replicas, 0.25M / 1M / 2.5M tokens each, every router, each beside the single N·C cache's
hit rate; then the kvheat and sglang-like rows again at other traffic rates (time scales)
and with a shared (Redis) tier budget; then the spread over replica names (the hash and
tie orders) for kvheat and sglang-like, so a difference can be told from noise.

    python bench/cluster_sim.py                      # needs ../shared/traces
    python bench/cluster_sim.py --quick              # one trace, one capacity

Writes docs/cluster_sim.json and docs/cluster_sim.png (`--json`, `--plot`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
sys.path.insert(0, str(ROOT))

from kvheat.replay import PreparedTrace, load_trace  # noqa: E402
from kvheat.router import policy as P  # noqa: E402
from kvheat.router.report import plot  # noqa: E402
from kvheat.router.simulate import ClusterConfig, simulate  # noqa: E402


class Renamed(P.RoutingPolicy):
    """A policy that sees the replicas in another order (its ties and hashes change)."""

    def __init__(self, inner: P.RoutingPolicy, seed: int) -> None:
        self.inner, self.name, self.rng = inner, inner.name, random.Random(seed)
        self.mode_counts = getattr(inner, "mode_counts", {})

    def choose(self, req: P.RouteRequest, replicas):  # type: ignore[override]
        perm = list(range(len(replicas)))
        self.rng.shuffle(perm)
        d = self.inner.choose(req, [replicas[i] for i in perm])
        d.replica = perm[d.replica]
        return d

    def routed(self, req, replica, expected_hit_tokens=0):  # type: ignore[override]
        self.inner.routed(req, replica, expected_hit_tokens)


def row(res, **extra) -> dict:
    d = res.as_dict()
    d.pop("per_replica", None)
    return {**d, **extra}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "docs" / "cluster_sim.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "cluster_sim.png"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --json")
    args = ap.parse_args()
    if args.plot_only:
        grid = json.loads(Path(args.json).read_text())["grid"]
        traces = list(dict.fromkeys(r["trace"] for r in grid))
        plot([{"trace": t, "results": [r for r in grid if r["trace"] == t]} for t in traces],
             args.plot)
        return 0
    names = ["mooncake_conversation_part1.jsonl", "mooncake_synthetic_trace.jsonl"]
    if not all((TRACES / n).exists() for n in names):
        print(f"the Mooncake traces are not in {TRACES}: nothing to do")
        return 0
    if args.quick:
        names = names[:1]
    caps = [1_000_000] if args.quick else [250_000, 1_000_000, 2_500_000]
    routers = list(P.POLICIES)
    out: dict = {"grid": [], "time_scales": [], "shared": [], "spread": []}
    summaries = []
    for name in names:
        pt = PreparedTrace(load_trace(TRACES / name), 512)
        results = []
        for cap in caps:
            for r in [*routers, "kvheat+guard"]:
                spec = (lambda ix: P.make_policy("kvheat", ix, overload_guard=True)) \
                    if r == "kvheat+guard" else r
                res = simulate(pt, spec, ClusterConfig(replicas=4, capacity_tokens=cap))
                res.router = r
                results.append(res)
                out["grid"].append(row(res, trace=name))
                print(f"{name[:16]} {cap / 1e6:.2f}M {r:12s} hit {res.hit_rate:6.2%} "
                      f"({res.of_bound:6.1%} of {res.bound_hit_rate:6.2%})  max/mean req "
                      f"{res.imbalance_requests:.2f} prefill {res.imbalance_prefill:.2f}  "
                      f"TTFT p99 {res.ttft_p99_s:.2f} s", flush=True)
        from kvheat.router.report import summarize

        summaries.append(summarize(name, results))
        if args.quick:
            continue
        for ts in (0.25, 0.5, 2.0, 4.0):
            for r in ("sglang-like", "kvheat"):
                res = simulate(pt, r, ClusterConfig(replicas=4, capacity_tokens=1_000_000,
                                                    time_scale=ts))
                out["time_scales"].append(row(res, trace=name, time_scale=ts))
                print(f"  x{ts:g} {r:12s} hit {res.hit_rate:6.2%} ({res.of_bound:.1%}) "
                      f"prefill max/mean {res.imbalance_prefill:.2f} p99 {res.ttft_p99_s:.2f}",
                      flush=True)
        for r in ("rr", "sglang-like", "kvheat"):
            res = simulate(pt, r, ClusterConfig(replicas=4, capacity_tokens=250_000,
                                                shared_tokens=1_000_000))
            out["shared"].append(row(res, trace=name))
            print(f"  shared 1M + 4 x 0.25M {r:12s} hit {res.hit_rate:6.2%} "
                  f"(shared {res.shared_hit_tokens / res.total_tokens:.2%}) "
                  f"({res.of_bound:.1%} of {res.bound_hit_rate:.2%})", flush=True)
        for cap in caps:
            for r in ("sglang-like", "kvheat"):
                rates = []
                for seed in range(4):
                    res = simulate(pt, lambda ix, r=r, seed=seed: Renamed(
                        P.make_policy(r, ix), seed), ClusterConfig(
                        replicas=4, capacity_tokens=cap), bound=False)
                    rates.append(res.hit_rate)
                out["spread"].append({"trace": name, "router": r, "capacity_tokens": cap,
                                      "hit_rates": rates})
                print(f"  spread {cap / 1e6:.2f}M {r:12s} "
                      + " ".join(f"{x:.2%}" for x in rates), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    plot(summaries, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
