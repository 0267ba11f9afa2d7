"""Why a prompt token missed the prefix cache.

Every prompt token not served from cache is put in one class:
- sub_block: in the prompt's partial last block (only full blocks are cached), or in a
  cached last block the engine still had to run (the last prompt token is always
  computed, for its logits);
- isolation: its block was seen before, but only under another tenant's salt;
- capacity: its block was seen before under this tenant's salt and has been evicted
  (before the request arrived, or while it waited);
- compulsory: its block was never seen.

"Seen" is kept in two fixed-size bitmaps (SPEC §3.1: compact statistics, flat memory
under any load), indexed by the block key's low bits; a collision can call a compulsory
miss a capacity or isolation miss, with probability about (keys seen) / 2**bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..cache import KVCacheManager
from ..cache.hashing import block_keys, root_key

MISS_KINDS = ("compulsory", "capacity", "sub_block", "isolation")
# What /metrics shows (it needs no key, so every tenant reads it): an isolation miss
# says another tenant sent the prompt, so publicly it is a compulsory one (never seen
# under this tenant's salt). The full classes go to the admin API only.
PUBLIC_MISS_KINDS = ("compulsory", "capacity", "sub_block")


def public_misses(misses: dict[str, int]) -> dict[str, int]:
    out = {k: misses.get(k, 0) for k in PUBLIC_MISS_KINDS}
    out["compulsory"] += misses.get("isolation", 0)
    return out
_UNSALTED_ROOT = root_key(None, None)


class SeenBitmap:
    def __init__(self, bits: int = 23) -> None:
        self.mask = (1 << bits) - 1
        self.words = np.zeros((1 << bits) // 8, dtype=np.uint8)

    def _pos(self, key: bytes) -> tuple[int, int]:
        i = int.from_bytes(key[:8], "little") & self.mask
        return i >> 3, 1 << (i & 7)

    def __contains__(self, key: bytes) -> bool:
        w, bit = self._pos(key)
        return bool(self.words[w] & bit)

    def add(self, key: bytes) -> None:
        w, bit = self._pos(key)
        self.words[w] |= bit


class MissClassifier:
    """One per arm (one cache). Used by the engine thread only."""

    def __init__(self, block_size: int, bits: int = 23) -> None:
        self.block_size = block_size
        self.salted = SeenBitmap(bits)
        self.unsalted = SeenBitmap(bits)

    def prepare(self, cache: KVCacheManager, prompt: Sequence[int], tenant: str | None,
                ) -> list[str]:
        """At arrival, before the prompt runs: the kind each full block would have if it
        missed; then the prompt's blocks are marked seen."""
        salted = cache.make_request("", prompt, tenant).keys
        unsalted = salted if tenant is None else block_keys(list(prompt), self.block_size,
                                                            _UNSALTED_ROOT)[0]
        kinds: list[str] = []
        for key, plain in zip(salted, unsalted):
            if key in cache.cached:
                kinds.append("cached")
            elif key in self.salted:
                kinds.append("capacity")
            elif plain in self.unsalted:
                kinds.append("isolation")
            else:
                kinds.append("compulsory")
            self.salted.add(key)
            self.unsalted.add(plain)
        return kinds

    def classify(self, kinds: list[str], num_prompt_tokens: int, cached_tokens: int,
                 ) -> dict[str, int]:
        """Missed prompt tokens by kind, once the engine knows how many were cached."""
        bs = self.block_size
        out = dict.fromkeys(MISS_KINDS, 0)
        out["sub_block"] += num_prompt_tokens - len(kinds) * bs
        last = len(kinds) - 1
        for i in range(min(cached_tokens // bs, len(kinds)), len(kinds)):
            kind = kinds[i]
            if kind == "cached":  # cached at arrival: the logits rule, or evicted since
                kind = "sub_block" if i == last and num_prompt_tokens == len(kinds) * bs \
                    else "capacity"
            out[kind] += bs
        return out
