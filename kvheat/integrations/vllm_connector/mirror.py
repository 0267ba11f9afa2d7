"""The scheduler half's view of the worker's tiers (`TierMirror`): which keys they hold, as
the worker reported them, so that a lookup needs no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Tiers in the order a load prefers them (a key may sit in two with write_through).
TIER_ORDER = ("host", "disk", "redis")


class TierMirror:
    """Which keys the worker's tiers hold, as it reported them.

    Key -> bit mask of tiers, bit i for `names[i]` (kept in load preference order)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.where: dict[bytes, int] = {}

    def _add_tier(self, tier: str) -> None:
        old = list(self.names)
        self.names = sorted([*old, tier], key=lambda n: (
            TIER_ORDER.index(n) if n in TIER_ORDER else len(TIER_ORDER), n))
        pos = [self.names.index(n) for n in old]
        if pos != list(range(len(old))):  # a tier sorted before others: move their bits
            self.where = {k: sum(1 << p for i, p in enumerate(pos) if m >> i & 1)
                          for k, m in self.where.items()}

    def apply(self, tier: str, key: bytes, stored: bool) -> None:
        """Record that `tier` took (`stored`) or lost `key`."""
        if tier not in self.names:
            self._add_tier(tier)
        bit = 1 << self.names.index(tier)
        mask = self.where.get(key, 0)
        mask = mask | bit if stored else mask & ~bit
        if mask:
            self.where[key] = mask
        else:
            self.where.pop(key, None)

    def tier_of(self, key: bytes, down: Iterable[str] = ()) -> str | None:
        """The fastest tier holding `key`, of those not `down`."""
        mask = self.where.get(key, 0) & ~self._mask(down)
        return self.names[(mask & -mask).bit_length() - 1] if mask else None

    def _mask(self, tiers: Iterable[str]) -> int:
        return sum(1 << self.names.index(t) for t in tiers if t in self.names)

    def run(self, keys: Sequence[bytes], start: int, down: Iterable[str] = ()) -> list[str]:
        """Tiers of the keys held contiguously from `keys[start]` (in tiers not `down`)."""
        up = ~self._mask(down)
        names = self.names
        out: list[str] = []
        for k in keys[start:]:
            mask = self.where.get(k, 0) & up
            if not mask:
                break
            out.append(names[(mask & -mask).bit_length() - 1])
        return out

    def __contains__(self, key: bytes) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)
