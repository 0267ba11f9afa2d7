"""The entropy regime: the tier the decayed entropy of the keys under the roots is in
(docs/heat.md, "How `kvheat` decides")."""

from __future__ import annotations

import math
from dataclasses import dataclass

LOW, MID, HIGH = "low", "mid", "high"


@dataclass(slots=True, frozen=True)
class Regime:
    """Entropy tiers (bits): low, mid and high.

    Below `low` KVHeat pins the roots; from `high` on it charges first-seen blocks an
    admission penalty; in between neither."""

    low: float = 1.0
    high: float = 8.0

    def classify(self, bits: float, samples: float = math.inf) -> str:
        """The tier of an entropy of `bits` read from `samples` (decayed) accesses.

        With a sample count, a reading within one bit of the most those samples can show
        (log2 of their number: the keys so far nearly all distinct) counts as high: before
        2^high samples the plug-in entropy cannot reach `high` however many one-offs there
        are."""
        if bits >= self.high or (samples > 0 and bits >= math.log2(samples) - 1.0):
            return HIGH
        return LOW if bits < self.low else MID
