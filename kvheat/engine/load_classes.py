"""Load classes: how a step's prefill budget is shared among short, regular and long requests.

A request's class comes from its estimated work, prompt plus `max_tokens` (the design
classes by latency; on one engine latency grows with work). Each class weighs
`base + load_coef * load_ratio`, capped, where `load_ratio` is the class's share of the
pending prefill tokens (the design's load compensation; the table is in docs/engine.md,
"Load classes"). The scheduler's mechanism (blocks, admission, preemption) is the
`try_run` it hands to `share_prefill_budget`; this module only decides the order and
each class's share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

SHORT, REGULAR, LONG = "short", "regular", "long"
LOAD_CLASSES = (SHORT, REGULAR, LONG)


class Candidate(Protocol):
    """What the budget split reads of a sequence (`sequence.Seq`)."""

    @property
    def arrival(self) -> float:
        """When it arrived (the clock of the scheduler)."""

    @property
    def load_class(self) -> str:
        """Its load class."""

    @property
    def num_pending(self) -> int:
        """Prompt tokens it still has to run."""


C = TypeVar("C", bound=Candidate)


@dataclass(slots=True, frozen=True)
class ClassWeight:
    """Weight of a load class: `base + load_coef * load_ratio`, capped."""

    base: float
    load_coef: float
    cap: float | None = None

    def weight(self, load_ratio: float) -> float:
        """The class's weight at `load_ratio`: base plus the load term, capped."""
        w = self.base + self.load_coef * load_ratio
        return w if self.cap is None else min(w, self.cap)


def default_class_weights() -> dict[str, ClassWeight]:
    """The design's weights of the short, regular and long load classes."""
    # The design's table: short 1.8 (+0.5 x load), long-tail 0.3 (+0.2 x load, at most
    # 0.45); regular is its calcWeight base 1.0 with the same +0.5 x load compensation.
    return {SHORT: ClassWeight(1.8, 0.5), REGULAR: ClassWeight(1.0, 0.5),
            LONG: ClassWeight(0.3, 0.2, 0.45)}


def load_class(work: int, short_max_tokens: int, long_min_tokens: int) -> str:
    """The class of a request of `work` tokens (prompt + max new tokens)."""
    if work <= short_max_tokens:
        return SHORT
    return LONG if work >= long_min_tokens else REGULAR


def share_prefill_budget(running: Sequence[C], waiting: Sequence[C], budget: int,
                         now: float, weights: dict[str, ClassWeight], aging_s: float,
                         try_run: Callable[[C, int], int]) -> int:
    """Hand `budget` prefill tokens to the candidates; returns the budget left.

    The candidates are the running sequences with tokens to run, then waiting ones: aged
    requests first, whatever their class (the guard against starvation); then each class
    within its weighted share of the rest, running ones first, oldest first; then what a
    class left unused to the others, heaviest class first. `try_run(seq, limit)` schedules
    up to `limit` tokens of `seq` and returns how many it did."""
    cands = [*running, *waiting]
    if not cands:
        return budget
    aged = [s for s in cands if now - s.arrival >= aging_s]
    aged.sort(key=lambda s: s.arrival)
    # Load compensation: a class's share of the pending prefill work raises its weight.
    pending = {c: 0 for c in LOAD_CLASSES}
    for s in cands:
        pending[s.load_class] += s.num_pending
    total = sum(pending.values()) or 1
    weight = {c: weights[c].weight(pending[c] / total) for c in LOAD_CLASSES if pending[c]}
    wsum = sum(weight.values())
    shares = {c: max(1, int(budget * w / wsum)) for c, w in weight.items()}
    by_class: dict[str, list[C]] = {c: [] for c in weight}
    for s in [*sorted(running, key=lambda s: s.arrival), *sorted(waiting, key=lambda s: s.arrival)]:
        by_class[s.load_class].append(s)

    for seq in aged:
        if budget <= 0:
            return budget
        budget -= try_run(seq, budget)
    left = budget
    for c, seqs in by_class.items():
        share = min(shares[c], left)
        for seq in seqs:
            if share <= 0:
                break
            used = try_run(seq, share)
            share -= used
            left -= used
    for c in sorted(by_class, key=lambda c: -weight[c]):
        for seq in by_class[c]:
            if left <= 0:
                return left
            left -= try_run(seq, left)
    return left
