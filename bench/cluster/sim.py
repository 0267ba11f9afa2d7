"""Routing policies on the Mooncake traces (`kvheat replay --replicas` for the issue's grid):
4 replicas, 0.25M / 1M / 2.5M tokens each, every router, each beside the single N·C cache's
hit rate; then the kvheat and sglang-like rows again at other traffic rates (time scales)
and with a shared (Redis) tier budget; then the spread over replica names (the hash and
tie orders) for kvheat and sglang-like, so a difference can be told from noise.

    python bench/cluster/sim.py                      # needs ../shared/traces
    python bench/cluster/sim.py --quick              # one trace, one capacity
    python bench/cluster/sim.py --perturb 12         # only the ensemble below
    python bench/cluster/sim.py --placement 6        # new prefixes: two choices or one
    python bench/cluster/sim.py --policies 8         # over each replica eviction policy
    python bench/cluster/sim.py --replica-counts 8   # 2 and 8 replicas
    python bench/cluster/sim.py --names 16           # the grid under other replica names

`--perturb K` replays kvheat and sglang-like on K variants of each trace, each missing 3%
of its requests at random (seeded), and reports the paired difference of their hit rates
and kvheat's share of the bound: at margins of a few tenths of a point a single trace's
placement is chaotic (a request dropped anywhere moves every later placement), so what
holds across the variants is what the trace says about the routers.

`--policies K` replays kvheat and sglang-like routing over replicas that evict by LRU,
LRU-K, ARC or kvheat (and kvheat replicas left on their own entropy regime, `kvheat/own`),
on the traces and K variants: whether the comparison between the routers holds whatever
the replicas' eviction policy.

Router names with a suffix change who tells the replicas the cluster's entropy (see
`ClusterConfig.regime_hints`): `kvheat` does, as `kvheat route` does; `kvheat-own` is
kvheat routing whose replicas keep their own regime; `sglang-like+hints` is sglang-like
routing whose replicas are told it too (an ablation: no SGLang router does).

`--replica-counts K` replays kvheat (told, and on its replicas' own regime) and
sglang-like with 2 and 8 replicas of 0.25M and 1M tokens, on the traces and K variants.

`--placement K` compares how kvheat places a new prefix, on the traces and K variants, at
three traffic rates: the less queued of the two replicas its key hashes to (the default)
against the first only (`shard_choices=1`), and sglang-like beside them: the hit rate
difference and the ratios of the modelled TTFT P99 and mean (and placement.png next to the JSON).

`--names K` replays the issue's grid (kvheat, sglang-like, prefix-hash) on the traces as they
are with K other sets of replica names (seeded, pod-like): hashing routers place by name,
so each set is another equally valid run of the same trace, as another deployment would
name its pods. It reports the median and range of each router's hit rate and kvheat's
share of the bound, and the grid's checks on the medians.

Writes results/cluster/sim.json and sim.png (`--json`, `--plot`; the doc's copies are under
docs/results/cluster/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from functools import cache
from pathlib import Path

if not __package__:  # run as `python bench/cluster/sim.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, TRACES
from kvheat.replay import PreparedTrace, load_trace
from kvheat.router import routing as P
from kvheat.router.report import plot
from kvheat.router.simulate import ClusterConfig, simulate


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


def _spec(router: str) -> tuple[object, str]:
    """A router name of this script: the policy (or factory) and who hints the regime."""
    if router == "kvheat+guard":
        return (lambda ix: P.make_routing_policy("kvheat", ix, overload_guard=True)), "kvheat"
    if router == "kvheat-1":  # new prefixes to the first hashed replica only
        return (lambda ix: P.make_routing_policy("kvheat", ix, shard_choices=1)), "kvheat"
    if router.endswith("-own"):
        return router[:-4], "none"
    if router.endswith("+hints"):
        return router[:-6], "all"
    return router, "kvheat"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(RESULTS / "cluster" / "sim.json"))
    ap.add_argument("--plot", default=str(RESULTS / "cluster" / "sim.png"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --json")
    ap.add_argument("--perturb", type=int, default=0, metavar="K",
                    help="only the ensemble: K variants of each trace, 3%% of requests dropped")
    ap.add_argument("--placement", type=int, default=None, metavar="K",
                    help="only the placement comparison: the traces and K variants")
    ap.add_argument("--replica-counts", type=int, default=None, metavar="K",
                    help="only other cluster sizes: 2 and 8 replicas, kvheat (told and on "
                         "their own regime) against sglang-like, the traces and K variants")
    ap.add_argument("--names", type=int, default=None, metavar="K",
                    help="only the grid under K other sets of replica names, on the traces")
    ap.add_argument("--policies", type=int, default=None, metavar="K",
                    help="only the replicas' eviction policies: kvheat and sglang-like routing "
                         "over LRU, LRU-K, ARC and kvheat replicas, the traces and K variants")
    args = ap.parse_args()
    if args.perturb:
        return perturbed(args.perturb, Path(args.json))
    if args.names is not None:
        return renamed(args.names, Path(args.json))
    if args.policies is not None:
        return policies(args.policies, Path(args.json))
    if args.replica_counts is not None:
        return replica_counts(args.replica_counts, Path(args.json))
    if args.placement is not None:
        return placement(args.placement, Path(args.json))
    if args.plot_only:
        grid = json.loads(Path(args.json).read_text())["grid"]
        traces = list(dict.fromkeys(r["trace"] for r in grid))
        plot([{"trace": t, "results": [r for r in grid if r["trace"] == t]} for t in traces],
             args.plot)
        return 0
    names = list(NAMES)
    if not _have_traces():
        return 0
    if args.quick:
        names = names[:1]
    caps = [1_000_000] if args.quick else list(CAPS)
    routers = list(P.ROUTING_POLICIES)
    out: dict = {"grid": [], "time_scales": [], "shared": [], "spread": []}
    summaries = []
    for name in names:
        pt = _variant(name, None)
        results = []
        for cap in caps:
            for r in [*routers, "kvheat+guard", "kvheat-own", "sglang-like+hints"]:
                spec, hints = _spec(r)
                res = simulate(pt, spec, ClusterConfig(replicas=4, capacity_tokens=cap,
                                                       regime_hints=hints))
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
                        P.make_routing_policy(r, ix), seed), ClusterConfig(
                        replicas=4, capacity_tokens=cap,
                        regime_hints="all" if r == "kvheat" else "none"), bound=False)
                    rates.append(res.hit_rate)
                out["spread"].append({"trace": name, "router": r, "capacity_tokens": cap,
                                      "hit_rates": rates})
                print(f"  spread {cap / 1e6:.2f}M {r:12s} "
                      + " ".join(f"{x:.2%}" for x in rates), flush=True)
    for key, rows in out.items():  # the --perturb, --placement and --policies sections stay
        _merge_json(Path(args.json), key, rows)
    plot(summaries, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


NAMES = ("mooncake_conversation_part1.jsonl", "mooncake_synthetic_trace.jsonl")
CAPS = (250_000, 1_000_000, 2_500_000)  # tokens per replica: the grid


def _have_traces() -> bool:
    if all((TRACES / n).exists() for n in NAMES):
        return True
    print(f"the Mooncake traces are not in {TRACES}: nothing to do")
    return False


@cache
def _variant(name: str, seed: int | None) -> PreparedTrace:
    """The trace less 3% of its requests, drawn with `seed` (once per worker process);
    seed None: the trace itself."""
    if seed is None:
        return PreparedTrace(_trace(name), 512)
    rng = random.Random(1000 + seed)
    return PreparedTrace([r for r in _trace(name) if rng.random() >= 0.03], 512)


def _in_parallel(fn, jobs: list, chunksize: int = 1) -> dict:
    """job -> result, over the machine's cores (at most 2: the machine's, and the traces'
    memory per worker)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as ex:
        return dict(ex.map(fn, jobs, chunksize=chunksize))


def _grid(fn, seeds, arms: tuple[str, ...]) -> dict:
    """fn over every trace, capacity of the issue's grid, seed and arm, in parallel."""
    jobs = [(n, c, s, r) for n in NAMES for c in CAPS for s in seeds for r in arms]
    return _in_parallel(fn, jobs, chunksize=len(arms))


def _pm(d: list[float]) -> str:
    """Mean ± standard error of the mean of paired differences (points)."""
    from statistics import mean, stdev

    se = stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
    return f"{mean(d):+.2f} ± {se:.2f}"


def _merge_json(json_path: Path, key: str, rows: list[dict]) -> None:
    """Write `rows` under `key` of the JSON report, keeping its other parts."""
    out = json.loads(json_path.read_text()) if json_path.exists() else {}
    out[key] = rows
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=2) + "\n")


@cache
def _trace(name: str) -> list:
    return load_trace(TRACES / name)


def _one(job: tuple[str, int, int, str]) -> tuple[tuple[str, int, int, str], tuple[float, float, float]]:
    name, cap, seed, router = job
    return job, _on_policy((name, cap, seed, "kvheat", router))[1]


def _simulate(name: str, seed: int | None, router: str, cache_policy: str = "kvheat",
              bound: bool = True, **cfg: object):
    """One router of this script (`_spec`) on one variant; a cache policy ending in "/own"
    keeps its replicas on their own regime. The bound (one cache of all the memory) is
    only computed for kvheat, whose share of it the tables read, and not without `bound`."""
    spec, hints = _spec(router)
    if cache_policy.endswith("/own"):
        cache_policy, hints = cache_policy[:-4], "none"
    return simulate(_variant(name, seed), spec, ClusterConfig(
        cache_policy=cache_policy, regime_hints=hints, **cfg),  # type: ignore[arg-type]
        bound=bound and router == "kvheat")


def _on_policy(job: tuple[str, int, int | None, str, str]) -> tuple[tuple, tuple[float, ...]]:
    name, cap, seed, cache_policy, router = job
    res = _simulate(name, seed, router, cache_policy, replicas=4, capacity_tokens=cap)
    return job, (res.hit_rate, res.bound_hit_rate or 0.0, res.imbalance_prefill)


def perturbed(k: int, json_path: Path) -> int:
    """kvheat against sglang-like on K perturbed copies of each trace (see the docstring)."""
    from statistics import mean

    names, caps = list(NAMES), list(CAPS)
    if not _have_traces():
        return 0
    got = _grid(_one, range(k), ("kvheat", "sglang-like", "kvheat-own", "sglang-like+hints"))
    rows = []
    print(f"{'trace':14} {'C':>6}  kvheat - sglang-like (points): mean ± se [min, max]  "
          f"kvheat ahead  kvheat of bound mean [min, max]  prefill max/mean kvheat / sglang")
    for n in names:
        for c in caps:
            kv = [got[(n, c, s, "kvheat")] for s in range(k)]
            sg = [got[(n, c, s, "sglang-like")] for s in range(k)]
            own = [got[(n, c, s, "kvheat-own")] for s in range(k)]
            sgh = [got[(n, c, s, "sglang-like+hints")] for s in range(k)]
            d = [100 * (a[0] - b[0]) for a, b in zip(kv, sg)]
            d_own = [100 * (a[0] - b[0]) for a, b in zip(own, sg)]
            d_h = [100 * (a[0] - b[0]) for a, b in zip(kv, sgh)]
            ob = [100 * a[0] / a[1] for a in kv]
            row = {"trace": n, "capacity_tokens": c, "variants": k, "diff_points": d,
                   "kvheat_of_bound": ob, "kvheat_hit": [a[0] for a in kv],
                   "sglang_hit": [b[0] for b in sg],
                   "kvheat_own_hit": [a[0] for a in own],
                   "sglang_hints_hit": [b[0] for b in sgh],
                   "own_diff_points": d_own, "hints_diff_points": d_h,
                   "kvheat_prefill_imbalance": [a[2] for a in kv],
                   "sglang_prefill_imbalance": [b[2] for b in sg]}
            rows.append(row)
            print(f"{n[9:23]:14} {c / 1e6:>5g}M  {_pm(d)} [{min(d):+.2f}, "
                  f"{max(d):+.2f}]  {sum(x > 0 for x in d):>3}/{k}  {mean(ob):.1f}% "
                  f"[{min(ob):.1f}, {max(ob):.1f}]  {mean(r[2] for r in kv):.2f} / "
                  f"{mean(r[2] for r in sg):.2f}   own regime {_pm(d_own)} "
                  f"({sum(x > 0 for x in d_own)}/{k}), both hinted {_pm(d_h)} "
                  f"({sum(x > 0 for x in d_h)}/{k})", flush=True)
    _merge_json(json_path, "perturbed", rows)
    print(f"wrote {json_path}")
    return 0


def replica_names(seed: int, n: int = 4) -> tuple[str, ...]:
    """`n` pod-like names, seeded (a Deployment's pods: name, hash, random suffix)."""
    rng = random.Random(seed)
    pod = "".join(rng.choice("0123456789abcdef") for _ in range(9))
    return tuple(f"kvheat-{pod}-{''.join(rng.choice('bcdfghjklmnpqrstvwxz2456789') for _ in range(5))}"
                 for _ in range(n))


def _named(job: tuple[str, int, int | None, str]) -> tuple[tuple, tuple[float, ...]]:
    name, cap, seed, router = job
    names = () if seed is None else replica_names(seed)
    res = _simulate(name, None, router, replicas=4, capacity_tokens=cap, names=names)
    return job, (res.hit_rate, res.bound_hit_rate or 0.0, res.imbalance_prefill)


def renamed(k: int, json_path: Path) -> int:
    """The issue's grid on the traces as they are, under K other sets of replica names."""
    from statistics import median

    if not _have_traces():
        return 0
    arms = ("kvheat", "sglang-like", "prefix-hash")
    seeds: list[int | None] = [None, *range(k)]
    got = _grid(_named, seeds, arms)
    rows = []
    print(f"{'trace':14} {'C':>6}  hit rate over {k} sets of names, median [min, max]: "
          f"kvheat | sglang-like | prefix-hash   kvheat of bound   prefill max/mean")
    for n in NAMES:
        for c in CAPS:
            hit = {r: [got[(n, c, s, r)][0] for s in seeds[1:]] for r in arms}
            bal = {r: median(got[(n, c, s, r)][2] for s in seeds[1:]) for r in arms}
            bound = got[(n, c, None, "kvheat")][1]
            ob = [100 * h / bound for h in hit["kvheat"]]
            med = {r: median(hit[r]) for r in arms}
            checks = {"of_bound": 100 * med["kvheat"] / bound >= 90.0,
                      "balance": bal["kvheat"] <= 1.25,
                      "beats": all(med["kvheat"] > med[r] and bal["kvheat"] <= bal[r]
                                   for r in arms[1:])}
            rows.append({"trace": n, "capacity_tokens": c, "name_sets": k,
                         "bound_hit_rate": bound,
                         "default_names": {r: got[(n, c, None, r)][0] for r in arms},
                         "hit_rates": hit, "median_prefill_imbalance": bal,
                         "kvheat_of_bound": ob, "checks": checks})
            print(f"{n[9:23]:14} {c / 1e6:>5g}M  " + " | ".join(
                f"{100 * med[r]:.2f}% [{100 * min(hit[r]):.2f}, {100 * max(hit[r]):.2f}]"
                for r in arms) + f"   {median(ob):.1f}% [{min(ob):.1f}, {max(ob):.1f}], "
                f"{sum(x >= 90 for x in ob)}/{k} at 90%+   " + " / ".join(
                f"{bal[r]:.2f}" for r in arms) + "   checks " + " ".join(
                f"{key} {'yes' if v else 'NO'}" for key, v in checks.items()), flush=True)
    _merge_json(json_path, "names", rows)
    print(f"wrote {json_path}")
    return 0


def policies(k: int, json_path: Path) -> int:
    """kvheat against sglang-like routing over each eviction policy the replicas may run,
    on each trace and K variants: does the comparison hold whatever the replicas evict by?"""
    names = list(NAMES)
    if not _have_traces():
        return 0
    caps = list(CAPS)
    cache_policies = ("lru", "lruk", "arc", "kvheat", "kvheat/own")
    seeds: list[int | None] = [None, *range(k)]
    jobs = [(n, c, s, p, r) for n in names for s in seeds for c in caps for p in cache_policies
            for r in ("kvheat", "sglang-like")]
    got = _in_parallel(_on_policy, jobs, chunksize=2 * len(cache_policies))
    rows = []
    print(f"{'trace':14} {'C':>6} {'replicas':8}  on the trace: kvheat (of bound) / sglang-like"
          f"   variants: kvheat - sglang-like mean ± se, kvheat ahead")
    for n in names:
        for c in caps:
            for p in cache_policies:
                kv = [got[(n, c, s, p, "kvheat")] for s in seeds]
                sg = [got[(n, c, s, p, "sglang-like")] for s in seeds]
                d = [100 * (a[0] - b[0]) for a, b in zip(kv[1:], sg[1:])]
                rows.append({"trace": n, "capacity_tokens": c, "cache_policy": p,
                             "variants": k, "kvheat_hit": kv[0][0], "bound_hit": kv[0][1],
                             "sglang_hit": sg[0][0], "kvheat_prefill_imbalance": kv[0][2],
                             "sglang_prefill_imbalance": sg[0][2], "diff_points": d,
                             "variant_kvheat_hits": [a[0] for a in kv[1:]],
                             "variant_sglang_hits": [b[0] for b in sg[1:]],
                             "variant_bounds": [a[1] for a in kv[1:]]})
                print(f"{n[9:23]:14} {c / 1e6:>5g}M {p:8}  {100 * kv[0][0]:6.2f}% "
                      f"({100 * kv[0][0] / kv[0][1]:5.1f}%) / {100 * sg[0][0]:6.2f}%   "
                      + (f"{_pm(d)}  {sum(x > 0 for x in d)}/{k}" if d else ""),
                      flush=True)
    _merge_json(json_path, "policies", rows)
    print(f"wrote {json_path}")
    return 0


def _sized(job: tuple[str, int, int, int | None, str]) -> tuple[tuple, tuple[float, ...]]:
    name, n, cap, seed, router = job
    res = _simulate(name, seed, router, replicas=n, capacity_tokens=cap)
    return job, (res.hit_rate, res.bound_hit_rate or 0.0, res.imbalance_prefill)


def replica_counts(k: int, json_path: Path) -> int:
    """kvheat against sglang-like with 2 and 8 replicas (the grid has 4), on each trace
    and K variants: does the comparison hold at another cluster size?"""
    from statistics import mean

    names = list(NAMES)
    if not _have_traces():
        return 0
    sizes, caps = (2, 8), (250_000, 1_000_000)
    routers = ("kvheat", "kvheat-own", "sglang-like")
    seeds: list[int | None] = [None, *range(k)]
    jobs = [(n, m, c, s, r) for n in names for m in sizes for c in caps for s in seeds
            for r in routers]
    got = _in_parallel(_sized, jobs, chunksize=len(routers))
    rows = []
    print(f"{'trace':14} {'N':>2} {'C':>6}  on the trace: kvheat (of bound) / sglang-like   "
          f"variants: kvheat - sglang-like, own regime - sglang-like, of bound, balance")
    for n in names:
        for m in sizes:
            for c in caps:
                kv, own, sg = ([got[(n, m, c, s, r)] for s in seeds] for r in routers)
                d = [100 * (a[0] - b[0]) for a, b in zip(kv[1:], sg[1:])]
                d_own = [100 * (a[0] - b[0]) for a, b in zip(own[1:], sg[1:])]
                ob = [100 * a[0] / a[1] for a in kv[1:]]
                rows.append({"trace": n, "replicas": m, "capacity_tokens": c, "variants": k,
                             "kvheat_hit": kv[0][0], "bound_hit": kv[0][1],
                             "kvheat_own_hit": own[0][0], "sglang_hit": sg[0][0],
                             "kvheat_prefill_imbalance": kv[0][2],
                             "sglang_prefill_imbalance": sg[0][2], "diff_points": d,
                             "own_diff_points": d_own, "kvheat_of_bound": ob,
                             "variant_kvheat_imbalance": [a[2] for a in kv[1:]],
                             "variant_sglang_imbalance": [b[2] for b in sg[1:]]})
                print(f"{n[9:23]:14} {m:>2} {c / 1e6:>5g}M  {100 * kv[0][0]:6.2f}% "
                      f"({100 * kv[0][0] / kv[0][1]:5.1f}%) / {100 * sg[0][0]:6.2f}%   "
                      f"{_pm(d)} ({sum(x > 0 for x in d)}/{k}), {_pm(d_own)}, "
                      f"{mean(ob):.1f}%, {mean(a[2] for a in kv[1:]):.2f} / "
                      f"{mean(b[2] for b in sg[1:]):.2f}", flush=True)
    _merge_json(json_path, "replica_counts", rows)
    print(f"wrote {json_path}")
    return 0


def _timed(job: tuple[str, int, int | None, float, str]) -> tuple[tuple, tuple[float, ...]]:
    name, cap, seed, scale, router = job
    res = _simulate(name, seed, router, bound=False, replicas=4, capacity_tokens=cap,
                    time_scale=scale)
    return job, (res.hit_rate, res.ttft_p99_s, res.ttft_mean_s, res.imbalance_prefill)


def placement(k: int, json_path: Path) -> int:
    """kvheat's new-prefix placement, two hashed choices against one (and sglang-like), on
    each trace and K variants of it, at three traffic rates."""
    from statistics import median

    names = list(NAMES)
    if not _have_traces():
        return 0
    caps, scales = list(CAPS), [0.5, 1.0, 2.0]
    routers = ("kvheat", "kvheat-1", "sglang-like")
    seeds: list[int | None] = [None, *range(k)]
    jobs = [(n, c, s, x, r) for n in names for s in seeds for c in caps for x in scales
            for r in routers]
    got = _in_parallel(_timed, jobs, chunksize=len(caps) * len(scales) * len(routers))
    rows = []
    print(f"{'trace':14} {'C':>6} {'rate':>5}  {'vs':11} hit diff (points) mean ± se   "
          f"TTFT P99 ratio median [min, max]   TTFT mean ratio median")
    for n in names:
        for c in caps:
            for x in scales:
                base = [got[(n, c, s, x, "kvheat")] for s in seeds]
                for other in routers[1:]:
                    o = [got[(n, c, s, x, other)] for s in seeds]
                    d = [100 * (a[0] - b[0]) for a, b in zip(base, o)]
                    p99 = [a[1] / b[1] for a, b in zip(base, o)]
                    avg = [a[2] / b[2] for a, b in zip(base, o)]
                    rows.append({"trace": n, "capacity_tokens": c, "time_scale": x,
                                 "against": other, "variants": k, "hit_diff_points": d,
                                 "ttft_p99_ratio": p99, "ttft_mean_ratio": avg,
                                 "kvheat_prefill_imbalance": [a[3] for a in base],
                                 "other_prefill_imbalance": [b[3] for b in o]})
                    print(f"{n[9:23]:14} {c / 1e6:>5g}M {1 / x:>4g}x  {other:11} "
                          f"{_pm(d)}   "
                          f"{median(p99):.2f} [{min(p99):.2f}, {max(p99):.2f}]   "
                          f"{median(avg):.2f}", flush=True)
    _merge_json(json_path, "placement", rows)
    png = json_path.with_name("placement.png")
    plot_placement(rows, png)
    print(f"wrote {json_path} and {png}")
    return 0


def plot_placement(rows: list[dict], path: Path) -> None:
    """kvheat's modelled TTFT P99 over the other's, per trace, size and rate: the median
    over the variants, the bar from the lowest to the highest."""
    from statistics import median

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 4), sharey=True)
    for ax, t in zip(list(getattr(axes, "flat", [axes])), traces):
        cells = list(dict.fromkeys((r["capacity_tokens"], r["time_scale"])
                                   for r in rows if r["trace"] == t))
        for k, (other, color) in enumerate((("kvheat-1", "tab:blue"),
                                            ("sglang-like", "tab:red"))):
            sel = {(r["capacity_tokens"], r["time_scale"]): r["ttft_p99_ratio"]
                   for r in rows if r["trace"] == t and r["against"] == other}
            xs = [i + (k - 0.5) * 0.35 for i in range(len(cells))]
            med = [median(sel[c]) for c in cells]
            lo = [m - min(sel[c]) for m, c in zip(med, cells)]
            hi = [max(sel[c]) - m for m, c in zip(med, cells)]
            label = "against one choice" if other == "kvheat-1" else "against sglang-like"
            ax.bar(xs, med, 0.35, yerr=[lo, hi], color=color, capsize=2, label=label)
        ax.axhline(1.0, color="gray", lw=1, ls=":")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{c / 1e6:g}M\n{1 / x:g}x rate" for c, x in cells], fontsize=8)
        ax.set_title(t.replace(".jsonl", ""), fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes_list = list(getattr(axes, "flat", [axes]))
    axes_list[0].set_ylabel("kvheat's modelled TTFT P99 / other's")
    axes_list[0].legend(fontsize=8)
    fig.suptitle("kvheat with two choices for new prefixes: TTFT P99 ratio (median, range "
                 "over the trace and its variants; below 1 is faster)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
