"""Online tuning (docs/heat.md, "Online tuning and drift"): a parameter adapted from hit/miss feedback.

A hill climber on one parameter (kept in log space): every `step_events` block events
it measures the hit ratio of the last step and turns the change since the previous
step into a signed gradient sample (did the last move help?). A move that hurt reverses
the direction and halves the step (down to `min_step`); a run of moves that helped, as
judged by the exponentially smoothed sum of the last `window` (64) samples (factor 0.95), grows it back. The value stays within [lo, hi]."""

from __future__ import annotations

import math
from collections import deque


class OnlineTuner:
    """A hill climber on one parameter, in log space, driven by hit/miss feedback."""

    def __init__(self, value: float, lo: float, hi: float, step: float = 0.2,
                 step_events: int = 2048, window: int = 64, smoothing: float = 0.95,
                 min_step: float = 0.05) -> None:
        if not 0 < lo <= value <= hi:
            raise ValueError("need 0 < lo <= value <= hi")
        self.log_value = math.log(value)
        self.lo, self.hi = math.log(lo), math.log(hi)
        self.step = self.max_step = step
        self.min_step = min_step
        self.step_events = step_events
        self.grads: deque[float] = deque(maxlen=window)
        self.smoothing = smoothing
        self.direction = 1.0
        self.hits = 0
        self.events = 0
        self.prev_ratio: float | None = None
        self.moves = 0

    @property
    def value(self) -> float:
        """The parameter's current value."""
        return math.exp(self.log_value)

    def smoothed_gradient(self) -> float:
        """The exponentially smoothed sum of the recent gradient samples."""
        a = self.smoothing
        return sum(a ** i * g for i, g in enumerate(reversed(self.grads)))

    def record(self, hit: bool) -> bool:
        """Count one block event; True when the parameter moved."""
        self.events += 1
        self.hits += hit
        if self.events < self.step_events:
            return False
        ratio = self.hits / self.events
        self.hits = self.events = 0
        if self.prev_ratio is not None:
            g = (ratio - self.prev_ratio) * self.direction
            self.grads.append(g)
            if g < 0:
                self.direction = -self.direction
                self.step = max(self.min_step, self.step / 2)
            elif self.smoothed_gradient() > 0:
                self.step = min(self.max_step, self.step * 1.5)
        self.prev_ratio = ratio
        new = min(self.hi, max(self.lo, self.log_value + self.direction * self.step))
        moved = new != self.log_value
        self.log_value = new
        self.moves += moved
        return moved
