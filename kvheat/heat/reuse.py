"""The workload's own time scale: how long, in block accesses, a block waits to be reused.

The heat policy's half-life must not be a number of seconds (a constant that fits one
traffic rate) nor a number of blocks chosen on one trace. It is a multiple of the typical
reuse gap of the traffic the cache serves, measured here online:

- time is *virtual*: the number of block accesses seen so far, so the same requests at ten
  times the rate give the same gaps (and a policy that reads only this clock makes the same
  decisions at every rate);
- a fixed fraction of keys is followed (spatial sampling, as SHARDS does: a key is in the
  sample when its first hash byte is below `rate * 256`), so the estimate does not depend
  on what the cache holds, and costs one byte compare for the other keys;
- gaps go into a histogram with `bins_per_octave` logarithmic bins, smoothed by `smoothing`
  every `window` samples (the feedback window of `OnlineTuner`), and the estimate is one of
  its quantiles;
- the last-access map keeps two generations, the newer retiring the older when it holds
  `max_keys` keys, so memory stays bounded and gaps up to about 2 × `max_keys` / `rate`
  distinct blocks are seen.
"""

from __future__ import annotations

import math


class ReuseGapEstimator:
    """The workload's reuse gap in block accesses, on a spatial sample of the keys."""

    def __init__(self, rate: float = 1 / 16, quantile: float = 0.5, window: int = 64,
                 smoothing: float = 0.95, bins_per_octave: int = 4, max_keys: int = 1 << 14) -> None:
        if not 0 < rate <= 1:
            raise ValueError("rate must be in (0, 1]")
        if not 0 < quantile < 1:
            raise ValueError("quantile must be in (0, 1)")
        self.threshold = max(1, round(rate * 256))  # sample keys whose first byte is below
        self.quantile = quantile
        self.window = window
        self.smoothing = smoothing
        self.bpo = bins_per_octave
        self.max_keys = max_keys
        self.hist = [0.0] * (64 * bins_per_octave)
        self.total = 0.0
        self.samples = 0
        self._pending = 0
        self.last: dict[bytes, float] = {}
        self.last_old: dict[bytes, float] = {}
        self.estimate: float | None = None  # the quantile, in block accesses; None until known

    def sampled(self, key: bytes) -> bool:
        """Whether `key` is in the sample (its first byte below the threshold)."""
        return key[0] < self.threshold

    def observe(self, key: bytes, vtime: float) -> bool:
        """A sampled key accessed at virtual time `vtime`; True when the estimate changed."""
        prev = self.last.pop(key, None)
        if prev is None and self.last_old:
            prev = self.last_old.pop(key, None)
        self.last[key] = vtime
        if len(self.last) >= self.max_keys:
            self.last_old, self.last = self.last, {}
        if prev is None or vtime <= prev:
            return False  # first sight, or a second block of the same request
        i = min(len(self.hist) - 1, int(math.log2(vtime - prev) * self.bpo))
        self.hist[i] += 1.0
        self.total += 1.0
        self.samples += 1
        self._pending += 1
        if self._pending < self.window:
            return False
        self._pending = 0
        self.estimate = self._quantile()
        s = self.smoothing
        self.hist = [h * s for h in self.hist]
        self.total *= s
        return True

    def _quantile(self) -> float:
        """The histogram's quantile, interpolated geometrically inside its bin."""
        target = self.quantile * self.total
        acc = 0.0
        for i, h in enumerate(self.hist):
            if h > 0 and acc + h >= target:
                frac = (target - acc) / h
                return 2.0 ** ((i + frac) / self.bpo)
            acc += h
        return 2.0 ** (len(self.hist) / self.bpo)
