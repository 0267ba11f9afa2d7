"""Miss-ratio curves: hit rate against capacity for each policy, from one spooled trace.

LRU's is exact, in one pass, by stack distance (`stack.py`). Every other policy is
replayed for real at each capacity, on a miniature when the trace is large: SHARDS'
spatial sample of its keys (`Spool.sample`) through a cache scaled by the same rate, the
sampled-token shortfall counted as hits (SHARDS_adj: what a sample misses is mostly the
few hottest keys). A small trace is replayed whole at every point. Each estimate says
how it was made; `checks` puts estimates beside full replays at a few capacities, the
sampling error in points.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .parallel import ReplayTask, run_replays
from .replayer import ReplayResult
from .spool import Spool
from .stack import LRUStackDistance

KNEE = 0.9  # the share of an unbounded cache's hit rate that marks a curve's knee
BUDGET_REFS = 4_000_000  # block references a miniature replays at most (about 10 s)
MIN_MINI_BLOCKS = 512  # a miniature cache holds at least this many blocks


@dataclass(slots=True)
class CurvePoint:
    """One point of a hit-rate curve: a capacity, its hit rate and how it was found."""

    capacity_tokens: int
    hit_rate: float
    method: str  # "stack distance" (exact), "replay" (the whole trace) or "miniature"
    sample_rate: float = 1.0

    def as_dict(self) -> dict:
        """The point as the JSON report writes it."""
        return {"capacity_tokens": self.capacity_tokens, "hit_rate": self.hit_rate,
                "method": self.method, "sample_rate": self.sample_rate}


@dataclass(slots=True)
class PolicyCurve:
    """One policy's hit-rate curve, its knee, and the full replays checked against it."""

    policy: str
    points: list[CurvePoint]
    knee_tokens: int | None  # the smallest capacity reaching KNEE x unbounded (interpolated)
    checks: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The curve as the JSON report writes it."""
        return {"policy": self.policy, "points": [p.as_dict() for p in self.points],
                "knee_tokens": self.knee_tokens, "checks": self.checks}


def capacity_grid(spool: Spool, points: int = 12) -> list[int]:
    """`points` capacities (tokens, whole blocks), evenly spaced in log up to the footprint.

    From the longest request (a smaller cache cannot hold it) or 1/1024 of the trace's
    footprint, whichever is larger, to the footprint (the cache that never evicts)."""
    bt = spool.block_tokens
    hi = max(spool.footprint_blocks(), 1)
    lo = min(max(spool.summary.max_blocks, hi // 1024, 1), hi)
    if points < 2 or lo == hi:
        return [hi * bt]
    step = (math.log(hi) - math.log(lo)) / (points - 1)
    blocks = sorted({round(math.exp(math.log(lo) + i * step)) for i in range(points)})
    return [b * bt for b in blocks]


def sample_rate(spool: Spool, capacity_tokens: int, budget_refs: int = BUDGET_REFS,
                min_blocks: int = MIN_MINI_BLOCKS) -> float:
    """The sampling rate of a miniature at this capacity, a power of two.

    1 when the trace is within the budget, else the budget's share of it, raised so the
    miniature cache keeps `min_blocks` blocks; a power of two, so miniatures of one rate are
    shared."""
    refs = max(spool.summary.refs, 1)
    blocks = max(capacity_tokens // spool.block_tokens, 1)
    want = max(budget_refs / refs, min_blocks / blocks)
    if want >= 1:
        return 1.0
    return 2.0 ** math.ceil(math.log2(want))


def adjusted_hit_rate(mini: ReplayResult, rate: float, total_tokens: int) -> float:
    """SHARDS_adj for a miniature's replay, clipped to [0, 1].

    Hit tokens plus the sample's token shortfall against `rate` x all tokens, over that
    expected total."""
    expected = rate * total_tokens
    if expected <= 0:
        return 0.0
    est = (mini.hit_tokens + expected - mini.total_tokens) / expected
    return min(max(est, 0.0), 1.0)


def knee(points: Sequence[tuple[int, float]], unbounded: float, share: float = KNEE
         ) -> int | None:
    """The smallest capacity whose hit rate reaches `share` x `unbounded`.

    Interpolated in log capacity between the two points around it (points ascending); None:
    not within."""
    target = share * unbounded
    if target <= 0:
        return None
    prev: tuple[int, float] | None = None
    for c, h in points:
        if h >= target:
            if prev is None or h == prev[1]:
                return c
            pc, ph = prev
            f = (target - ph) / (h - ph)
            return round(math.exp(math.log(pc) + f * (math.log(c) - math.log(pc))))
        prev = (c, h)
    return None


def lru_curve(spool: Spool, capacities: Sequence[int]) -> list[CurvePoint]:
    """LRU's exact hit rate at each capacity, from one stack-distance pass."""
    bt = spool.block_tokens
    acc = LRUStackDistance(bt)
    for recs, ids in spool.id_chunks():
        off = 0
        for n, inp in zip(recs["n"].tolist(), recs["input"].tolist()):
            acc.add(ids[off:off + n], inp)
            off += n
    res = acc.result()
    return [CurvePoint(c, res.hit_rate(c // bt), "stack distance") for c in capacities]


def policy_curves(spool: Spool, policies: Sequence[str], capacities: Sequence[int],
                  checks: Sequence[ReplayResult] = (), jobs: int = 1, seed: int = 0,
                  budget_refs: int = BUDGET_REFS, options: dict | None = None,
                  on_done: Callable[[ReplayTask], None] | None = None) -> list[PolicyCurve]:
    """Each policy's hit-rate curve at `capacities` (ascending tokens).

    `checks`: full replays (e.g. the table's) to set beside this method's estimate at their
    capacities. `options`: `replay`'s keyword arguments (hints, time scale) for every
    replay. LRU is exact by stack distance where the longest request fits and requests run
    one at a time (the stack model describes neither `hold` nor `lookahead`): elsewhere it
    is replayed like the others."""
    opts = dict(options or {})
    bt = spool.block_tokens

    def by_stack(policy: str, capacity: int) -> bool:  # exact: LRU, the longest request fits
        return (policy == "lru" and not opts.get("hold") and not opts.get("lookahead")
                and capacity // bt >= spool.summary.max_blocks)

    spools: list[Spool] = [spool]
    by_rate: dict[float, int] = {1.0: 0}
    tasks: list[ReplayTask] = []
    where: list[tuple[str, int, float]] = []  # (policy, capacity, sample rate) per task

    def mini(rate: float) -> int:
        if rate not in by_rate:
            by_rate[rate] = len(spools)
            spools.append(spool.sample(rate, seed))
        return by_rate[rate]

    wanted = [(p, c) for p in policies for c in capacities]
    wanted += [(r.policy, r.capacity_tokens) for r in checks if r.policy in policies]
    stacked: set[int] = set()
    for p, c in dict.fromkeys(wanted):
        if by_stack(p, c):
            stacked.add(c)
            continue
        rate = sample_rate(spool, c, budget_refs)
        tasks.append(ReplayTask(mini(rate), p, max(int(c * rate), bt), opts))
        where.append((p, c, rate))
    results = run_replays(spools, tasks, jobs, on_done)
    total = spool.summary.total_tokens
    est: dict[tuple[str, int], CurvePoint] = {}
    for (p, c, rate), res in zip(where, results):
        h = res.hit_rate if rate == 1 else adjusted_hit_rate(res, rate, total)
        est[(p, c)] = CurvePoint(c, h, "replay" if rate == 1 else "miniature", rate)
    if stacked:
        for pt in lru_curve(spool, sorted(stacked)):
            est[("lru", pt.capacity_tokens)] = pt
    unbounded = spool.infinite_hit_rate()
    out = []
    for p in policies:
        pts = [est[(p, c)] for c in capacities]
        chk = [{"capacity_tokens": r.capacity_tokens, "replay": r.hit_rate,
                "curve": est[(p, r.capacity_tokens)].hit_rate,
                "error_points": 100 * (est[(p, r.capacity_tokens)].hit_rate - r.hit_rate),
                "method": est[(p, r.capacity_tokens)].method,
                "sample_rate": est[(p, r.capacity_tokens)].sample_rate}
               for r in checks if r.policy == p]
        out.append(PolicyCurve(p, pts, knee([(q.capacity_tokens, q.hit_rate) for q in pts],
                                            unbounded), chk))
    return out
