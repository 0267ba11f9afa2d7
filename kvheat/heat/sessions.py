"""What `kvheat` learns of sessions from the request hints (kvheat/cache/hints.py).

A request's end says when its session will be back. An agent whose answer stopped on
`tool_use` sends the tool's result seconds later; one that stopped on `end_turn` waits for
its human, minutes or never; a cancelled request's suffix is rarely resent. A server knows
each of these, and the session each request belongs to.

`SessionBook` turns them into a *shift of the expected return time*, not an override of
recency (docs/heat.md, "Heat and sessions"). Every time is the policy's virtual time
(block accesses), every charge a number of reuse gaps of age (a factor 2^-charge on the
key), and nothing has a unit or a constant tuned on a trace:

- **End class.** A request ends in a class: its outcome and finish reason
  (`MAX_CLASSES` - 1 of them, the first seen; class 0 is "no hint" and charges nothing).
  When a session comes back, the gap since its last request ended is one sample of that
  class's return gap: a decayed histogram of log2 gaps per class (quarter-octave bins,
  smoothed every 64 samples, as the workload's reuse gap in reuse.py). Ends are counted
  per class too (decayed every 64 ends), so sessions that never come back count.
- **The charge (default, `horizon`).** With the cache's eviction age A (what it can
  still hold, `KVHeat.evict_age`), a class's value is the share of its ends followed by a
  return within A (returns / ends × the share of its gaps up to A, one pseudo-count each
  side); its blocks are charged log2(all ends' share / its share): a class half as likely
  to be back while the cache could hold it counts half, as a decayed count would. A small
  cache charges slow classes much; a cache that holds every class's returns, little.
- **`log` charges** (an option): log2(class median gap / all ends' median gap) plus
  log2(all ends' share returning / the class's share), whatever the cache's size.
- One class alone is charged exactly 0 in both, so a session hint without finish reasons
  (the conversation traces) changes no decision.
- **The session's own pace** (`session_own`, off by default): each session keeps the mean
  of log2(its gap / its class's median) over its returns, shrunk toward 0 by one pseudo-
  sample (`own`), applied once finish reasons are passed. Measured: +0.6 points at agentic
  1M, -0.35 on a held-out draw at 1M (docs/heat.md), so it stays an option.
"""

from __future__ import annotations

import math

from ..cache.hints import Outcome

MAX_CLASSES = 8  # class 0 (no hint) and up to 7 finish classes: 3 bits of `HeatRecord.flags`
CLASS_SHIFT = 4  # where the class sits in `HeatRecord.flags` (bits 4-6)
CLASS_MASK = (MAX_CLASSES - 1) << CLASS_SHIFT


class GapHistogram:
    """A decayed histogram of log2 gaps and its median (see reuse.py's estimator)."""

    __slots__ = ("hist", "total", "pending", "median", "window", "smoothing", "bpo")

    def __init__(self, window: int = 64, smoothing: float = 0.95, bins_per_octave: int = 4) -> None:
        self.bpo = bins_per_octave
        self.hist = [0.0] * (64 * bins_per_octave)
        self.total = 0.0
        self.pending = 0
        self.window = window
        self.smoothing = smoothing
        self.median: float | None = None  # log2 of the median gap; None until known

    def bin_of(self, gap: float) -> int:
        """The bin of a gap (> 0)."""
        return min(len(self.hist) - 1, max(0, int(math.log2(gap) * self.bpo))) if gap >= 1 else 0

    def add(self, gap: float) -> bool:
        """Add one gap (> 0); True when the median was recomputed.

        That is every `window` gaps, and at the first `window // 4`, so a class is charged
        early."""
        return self.add_bin(self.bin_of(gap))

    def add_bin(self, i: int) -> bool:
        """`add` of a gap already binned (`bin_of`: histograms of one shape share it)."""
        self.hist[i] += 1.0
        self.total += 1.0
        self.pending += 1
        if self.pending < self.window and not (self.median is None and self.pending >= self.window // 4):
            return False
        self.median = self._median()
        if self.pending >= self.window:
            self.pending = 0
            s = self.smoothing
            self.hist = [h * s for h in self.hist]
            self.total *= s
        return True

    def share_within(self, log2_age: float) -> float:
        """The share of the gaps up to 2^log2_age (interpolated inside the bin)."""
        if self.total <= 0:
            return 0.0
        x = log2_age * self.bpo
        i = int(x)
        if i < 0:
            return 0.0
        hist = self.hist
        if i >= len(hist):
            return 1.0
        return (sum(hist[:i]) + hist[i] * (x - i)) / self.total

    def _median(self) -> float:
        target = 0.5 * self.total
        acc = 0.0
        for i, h in enumerate(self.hist):
            if h > 0 and acc + h >= target:
                return (i + (target - acc) / h) / self.bpo
            acc += h
        return len(self.hist) / self.bpo


class SessionBook:
    """What KVHeat knows of sessions, their request ends' classes, and the charges.

    Per session: virtual time and class of its last request's end (two generations of dicts,
    bounded like the ghost history); per class: its return gaps; the charges."""

    def __init__(self, max_sessions: int = 1 << 16, use_rate: bool = True,
                 track_own: bool = True) -> None:
        self.classes: dict[tuple[Outcome, str | None], int] = {}
        # The same classes by finish reason, one dict per outcome, the finished one at hand:
        # the per-request lookup hashes a string, not an enum member (a Python call).
        self.by_reason: dict[Outcome, dict[str | None, int]] = {o: {} for o in Outcome}
        self.finished = self.by_reason[Outcome.FINISHED]
        self.gaps = [GapHistogram() for _ in range(MAX_CLASSES)]  # [0]: every class pooled
        self.charge = [0.0] * MAX_CLASSES  # reuse gaps of age, per class (0: none)
        # session -> (virtual time its last request ended, class, own residual, samples)
        self.ended: dict[str, tuple[float, int, float, int]] = {}
        self.ended_old: dict[str, tuple[float, int, float, int]] = {}
        # Sessions back since their last end: (own residual, samples) until they end again.
        self.live: dict[str, tuple[float, int]] = {}
        self.own = 0.0  # the own charge of the session that ended last (`ended_now`)
        # With a horizon (the cache's eviction age, set by the policy), a class is charged
        # by its share of returns within it instead (`_horizon_charges`).
        self.horizon: float | None = None
        self.max_sessions = max_sessions
        self.returns = 0
        self.reasons = False  # a finish reason was seen
        # Per class, decayed counts of ends and of returns (a session that comes back
        # counts once for the class it ended in): the share of its sessions that return.
        self.ends = [0.0] * MAX_CLASSES
        self.back = [0.0] * MAX_CLASSES
        self.n_ends = 0
        self.use_rate = use_rate
        # The session's own pace (`own`, `live`, the residuals) is kept only for a caller
        # that reads it (KVHeat's session_own): it changes no charge.
        self.track_own = track_own

    def class_of(self, outcome: Outcome, reason: str | None) -> int:
        """The class of a request's end (1..MAX_CLASSES-1).

        The last one takes every class beyond the first ones seen."""
        by_reason = self.finished if outcome is Outcome.FINISHED else self.by_reason[outcome]
        c = by_reason.get(reason)
        if c is None:
            if reason is not None:
                self.reasons = True
            c = min(len(self.classes) + 1, MAX_CLASSES - 1)
            self.classes[(outcome, reason)] = by_reason[reason] = c
        return c

    def came_back(self, session: str, v: float) -> bool:
        """Record that `session` sends a request at virtual time `v`.

        One gap sample of the class its last request ended in. True when the charges
        changed."""
        # (runs at every request of a session: kept to a dict pop unless it came back)
        last = self.ended.pop(session, None)
        if last is None:
            if not self.ended_old:
                return False
            last = self.ended_old.pop(session, None)
            if last is None:
                return False
        self.returns += 1
        v_end, c, resid, n = last
        back = self.back
        back[c] += 1.0
        back[0] += 1.0
        gap = v - v_end
        gaps = self.gaps
        if self.track_own:
            # The session's own pace: the mean of log2(its gap / its class's median gap)
            # over its returns, shrunk toward 0 by one pseudo-sample (`ended_now`).
            m = gaps[c].median
            if m is not None and gap >= 1:
                n += 1
                resid += (math.log2(gap) - m - resid) / n
            if len(self.live) < self.max_sessions:
                self.live[session] = (resid, n)
        pooled = gaps[0]
        i = pooled.bin_of(gap)
        moved = pooled.add_bin(i)
        moved = gaps[c].add_bin(i) or moved
        if moved:
            self._charges()
        return moved

    def ended_now(self, session: str, v: float, c: int) -> bool:
        """Record that `session`'s request ended in class `c` at virtual time `v`.

        True when the charges changed (every 64 ends, as the returns' share moved)."""
        ends = self.ends
        ends[c] += 1.0
        ends[0] += 1.0
        self.n_ends = n_ends = self.n_ends + 1
        moved = False
        if not n_ends & 63:  # every 64 ends
            if self.use_rate:
                self._charges()
                moved = True
            back = self.back
            for i in range(MAX_CLASSES):
                ends[i] *= 0.95
                back[i] *= 0.95
        ended = self.ended
        if self.track_own:
            resid, n = self.live.pop(session, (0.0, 0))
            self.own = resid * n / (n + 1)
            ended[session] = (v, c, resid, n)
        else:
            ended[session] = (v, c, 0.0, 0)
        if len(ended) >= self.max_sessions:
            self.ended_old, self.ended = ended, {}
        return moved

    def _charges(self) -> None:
        if self.horizon is not None:
            self._horizon_charges(self.horizon)
            return
        ref = self.gaps[0].median
        ends, back = self.ends, self.back
        for c in range(1, MAX_CLASSES):
            m = self.gaps[c].median
            ch = 0.0 if m is None or ref is None else m - ref
            if self.use_rate and ends[c] > 0:
                # fewer of its sessions come back: its blocks are worth that much less
                # (one class alone: the ratio is exactly 1, the charge 0)
                ch += math.log2(((back[0] + 1.0) * (ends[c] + 2.0))
                                / ((ends[0] + 2.0) * (back[c] + 1.0)))
            self.charge[c] = ch

    def _horizon_charges(self, age: float) -> None:
        """Charges by the share of each class's ends followed by a return within `age`
        accesses (the cache's eviction age: what it can still hold), against all ends':
        log2 of the ratio, one pseudo-count each side."""
        if age <= 0:
            return
        la = math.log2(age)
        ends, back, gaps = self.ends, self.back, self.gaps
        ref = (back[0] * gaps[0].share_within(la) + 1.0) / (ends[0] + 2.0)
        for c in range(1, MAX_CLASSES):
            if ends[c] > 0:
                mine = (back[c] * gaps[c].share_within(la) + 1.0) / (ends[c] + 2.0)
                self.charge[c] = math.log2(ref / mine) if mine != ref else 0.0
