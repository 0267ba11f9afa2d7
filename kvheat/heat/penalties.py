"""KVHeat's penalty factors on a block's count, and the penalties learned online.

A penalty of p half-lives is a constant factor 2^-p on the count, whatever the half-life:
- a partial last block (the end of a prompt, which the next turn extends and so re-keys)
  is charged `tail_penalty`;
- a first-seen block is flagged ONE_OFF while the entropy regime is high (`admit_penalty`),
  and EXTENSION when it extends a prefix known before its request (`extension_penalty`,
  scaled by how much less often such suffixes are reused than fresh prompts, measured on
  hits and ghost hits of first-seen blocks); both flags clear at the block's first reuse;
- a root is PINNED while the regime is low (`pin_bonus`, a bonus).
The extension penalty fades as the cache's eviction age reaches `fade` reuse gaps (a
cache that holds most suffix reuses anyway loses by demoting them); the admission penalty
does not: a long-lived cache still has to choose between one-offs and the rest, which is
where ARC's scan resistance beat it. Neither applies before the first eviction.
KVHeat's defaults (docs/heat.md, "The regime's warm-up"; this class's own keyword
defaults are KVHeat's previous ones): with `admit_now` every first-seen block carries
ONE_OFF (every root PINNED) and the regime of the moment decides the charge, so a block
first seen during the entropy's warm-up is charged like the rest; with `admit_fade` the
admission penalty above `admit_floor` fades as the extension penalty does (KVHeat: 3.2
half-lives fading to 1.6).
docs/heat.md has the measurements behind each default.
"""

from __future__ import annotations

import math

from .regime import HIGH, LOW

# HeatRecord.flags bits; all but PINNED clear at the block's first reuse. Bits 4-6 hold
# the class of the session end that released the block (kvheat/heat/sessions.py), 0 when
# no hint said.
PINNED, ONE_OFF, EXTENSION, FRESH = 1, 2, 4, 8
FLAG_BITS = 16


class Penalties:
    """The factors a block's count is multiplied by to make its key, and what sets them.

    `flag[flags]`, and `tail` for a block shorter than `block_size`."""

    def __init__(self, tail_penalty: float, admit_penalty: float, pin_bonus: float,
                 extension_penalty: float, adapt_extension: bool, fade: float,
                 admit_now: bool = False) -> None:
        self.tail_penalty = tail_penalty
        self.block_size = 0  # largest block seen: a smaller last block is a partial tail
        self.max_admit_penalty = admit_penalty
        self.admit_penalty = admit_penalty
        self.fade = fade
        self.pin_bonus = pin_bonus
        # Updated every 64 first-seen inserts, smoothing 0.95 (docs/heat.md, "Online
        # tuning and drift").
        self.max_extension_penalty = extension_penalty
        self.adapt_extension = adapt_extension
        self.extension_penalty = 0.0 if adapt_extension else extension_penalty
        self.reuse = [1.0, 4.0, 1.0, 4.0]  # extension reused, inserted; fresh reused, inserted
        self.first_seen = 0  # first-seen full blocks since the last update
        self.ext_seen = 0  # of which extensions
        self.extensions = extension_penalty > 0  # flag extensions at all
        self.scale = 1.0  # the starting multiple over the current one (KVHeat's adapt_mult)
        # The flags the regime gives: every new block's, and whether roots are pinned.
        self.new_flags = 0
        self.pin_roots = False
        # With `admit_now` every first-seen block is flagged ONE_OFF and the regime of the
        # moment decides whether the flag is charged (`admitting`); else only blocks
        # first seen while the regime is high carry the flag, always charged.
        self.admit_now = admit_now
        self.admitting = not admit_now
        self.pinning = not admit_now  # (likewise every root flagged PINNED)
        self.admit_fade = False
        self.admit_floor = 0.0
        self.tail = 1.0
        self.flag: list[float] = []
        # Per session-end class, the age it charges, in reuse gaps (SessionBook); the
        # table has a row of 16 flag combinations per class once a hint has been seen.
        self.session: list[float] = [0.0]
        self.factors()

    def factors(self) -> None:
        """Key multipliers, precomputed: per flag combination and for a partial tail."""
        scale = self.scale
        self.tail = 2.0 ** (-self.tail_penalty * scale)
        f = []
        for st in range(FLAG_BITS):
            s = 0.0
            if st & PINNED and self.pinning:
                s += self.pin_bonus
            if st & ONE_OFF and self.admitting:
                s -= self.admit_penalty
            if st & EXTENSION:
                s -= self.extension_penalty
            f.append(2.0 ** (s * scale))
        # A row per session-end class: the base row times the class's charge (a class
        # charged 0 repeats the base row exactly).
        rows = [f]
        for charge in self.session[1:]:
            k = 2.0 ** (-charge * scale)
            rows.append(f if k == 1.0 else [x * k for x in f])
        self.flag = [x for row in rows for x in row] if len(rows) > 1 else f

    def follow_regime(self, mode: str) -> bool:
        """Set the entropy regime's flags: one-offs charged when high, roots pinned when low.

        True when the factors of blocks already cached changed (the heap needs a re-key)."""
        if not self.admit_now:
            self.pin_roots = mode == LOW
            self.new_flags = ONE_OFF if mode == HIGH else 0
            return False
        self.pin_roots = True
        self.new_flags = ONE_OFF
        admitting, pinning = mode == HIGH, mode == LOW
        if admitting == self.admitting and pinning == self.pinning:
            return False
        self.admitting, self.pinning = admitting, pinning
        self.factors()
        return True

    def update(self, gap: float | None, evictions: int, evict_age: float) -> None:
        """Update the learned penalties (every 64 first-seen inserts).

        The extension penalty ∝ how much rarer extension reuse is, fading with the cache's
        eviction age (`evict_age` accesses, against the reuse gap `gap`); the admission
        penalty in full once the cache has evicted."""
        r = self.reuse
        r[1] += self.ext_seen
        r[3] += self.first_seen - self.ext_seen
        self.first_seen = self.ext_seen = 0
        ratio = (r[0] / r[1]) / (r[2] / r[3])
        for i in range(4):
            r[i] *= 0.95
        fade = 1.0
        if not evictions:
            fade = 0.0  # nothing evicted yet: every reuse so far was held
        elif gap and self.fade < math.inf:
            fade = max(0.0, 1.0 - evict_age / (gap * self.fade))
        if self.admit_fade:  # the part above `admit_floor` fades like the extension's
            lo = min(self.admit_floor, self.max_admit_penalty)
            self.admit_penalty = (lo + (self.max_admit_penalty - lo) * fade) if evictions else 0.0
        else:
            self.admit_penalty = self.max_admit_penalty if evictions else 0.0
        if self.adapt_extension:
            self.extension_penalty = self.max_extension_penalty * min(1.0, max(0.0, 1.0 - ratio)) * fade
        else:
            self.extension_penalty = self.max_extension_penalty * fade
        self.factors()
