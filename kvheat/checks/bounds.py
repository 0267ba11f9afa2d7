"""The overflow of a bounded structure (a map, queue or buffer filled from outside data):
counted, and logged at most once per interval, so a flood of overflows costs one line per
interval (with how many since the last) instead of a line each."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Overflow:
    """Counts one structure's overflows and warns of them, at most once every `every_s`.

    `count`, and `on_count(n)` too (e.g. a Prometheus counter's `inc`); the warning goes to
    `log`."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = 10.0,
                 on_count: Callable[[int], object] | None = None) -> None:
        self.log = log
        self.what = what
        self.every_s = every_s
        self.on_count = on_count
        self.count = 0
        self._said = 0  # `count` when last logged
        self._said_at = -float("inf")

    def __call__(self, n: int = 1, why: str = "") -> None:
        self.count += n
        if self.on_count is not None:
            self.on_count(n)
        now = time.monotonic()
        if now - self._said_at >= self.every_s:
            self.log.warning("%s overflowed its bound %d time(s) since last said (%d in all)%s",
                             self.what, self.count - self._said, self.count,
                             f": {why}" if why else "")
            self._said, self._said_at = self.count, now
