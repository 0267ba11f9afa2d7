"""Drift detector (docs/heat.md, "Online tuning and drift"): windowed access entropy; a drop larger than `threshold`
bits between consecutive windows, both holding at least `min_count` accesses, signals
that the workload has changed (e.g. a few new prefixes took over), so the policy
re-weights. A window closes after `window` accesses, or, with `window_s`, after that many
seconds of the caller's clock (then sparse windows are judged only when full enough)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import numpy as np

from .entropy import shannon_bits


class DriftDetector:
    """Signals a drop of the access entropy between consecutive windows (workload drift)."""

    def __init__(self, window: int = 2048, threshold: float = 1.0, min_count: int = 512,
                 window_s: float | None = None) -> None:
        if window <= 0 or min_count <= 0 or (window_s is None and min_count > window):
            raise ValueError("need 0 < min_count <= window")
        if window_s is not None and window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window = window
        self.window_s = window_s
        self.threshold = threshold
        self.min_count = min_count
        self.counts: Counter[Hashable] = Counter()
        self.n = 0
        self.start: float | None = None
        self.prev_bits: float | None = None  # None: no previous window with enough accesses
        self.drifts = 0

    def observe(self, key: Hashable, now: float | None = None) -> bool:
        """Count one access; True when a window closes with an entropy drop > threshold."""
        if self.window_s is not None:
            if now is None:
                raise ValueError("a time-based window needs `now`")
            if self.start is None:
                self.start = now
            elif now - self.start >= self.window_s:
                fired = self._close()
                self.start = now
                self.counts[key] += 1
                self.n += 1
                return fired
            self.counts[key] += 1
            self.n += 1
            return False
        self.counts[key] += 1
        self.n += 1
        return self._close() if self.n >= self.window else False

    def _close(self) -> bool:
        enough = self.n >= self.min_count
        bits = shannon_bits(np.fromiter(self.counts.values(), dtype=np.float64)) if enough else None
        self.counts.clear()
        self.n = 0
        prev, self.prev_bits = self.prev_bits, bits
        if bits is None:
            return False
        if prev is not None and prev - bits > self.threshold:
            self.drifts += 1
            return True
        return False
