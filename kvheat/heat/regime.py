"""The entropy regime: the tier the decayed entropy of the keys under the roots is in
(docs/heat.md, "How `kvheat` decides")."""

from __future__ import annotations

from dataclasses import dataclass

LOW, MID, HIGH = "low", "mid", "high"


@dataclass(slots=True, frozen=True)
class Regime:
    """Entropy tiers (bits): below `low` KVHeat pins the roots; from `high` on it charges
    first-seen blocks an admission penalty; in between neither."""

    low: float = 1.0
    high: float = 8.0

    def classify(self, bits: float) -> str:
        if bits < self.low:
            return LOW
        return MID if bits < self.high else HIGH
