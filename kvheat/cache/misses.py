"""Why a prompt token missed the prefix cache: one classifier for the server's metrics and
the trace replayer's report, so both name the same traffic the same way.

Every prompt token not served from cache is put in one class, by its block:
- capacity: the block was seen before under this tenant's salt and has been evicted
  (before the request arrived, or while it waited);
- isolation: the block was seen before, but only under another tenant's salt;
- sub_block: the prompt's shared prefix ends inside the block (a partial last block that
  is not cached as such), or the block is cached but the engine still had to run it (the
  last prompt token is always computed, for its logits);
- compulsory: the block was never seen.

"Seen" is a set of keys: exact (`set`) in the replayer, a fixed-size bitmap in the server
(flat memory under any load, docs/server.md), where a collision can call a compulsory
miss a capacity or isolation miss with probability about (keys seen) / 2**bits.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Protocol

from .hashing import block_keys, root_key, scoped_root

if TYPE_CHECKING:
    from .manager import KVCacheManager

MISS_KINDS = ("compulsory", "capacity", "sub_block", "isolation")
# What /metrics shows (it needs no key, so every tenant reads it): an isolation miss
# says another tenant sent the prompt, so publicly it is a compulsory one (never seen
# under this tenant's salt). The full classes go to the admin API only.
PUBLIC_MISS_KINDS = ("compulsory", "capacity", "sub_block")
CACHED = "cached"  # a block cached when the request arrived
_PLAIN_ROOT = root_key(None, None)


def public_misses(misses: dict[str, int]) -> dict[str, int]:
    """The miss counts as reported: isolation misses counted as compulsory."""
    out = {k: misses.get(k, 0) for k in PUBLIC_MISS_KINDS}
    out["compulsory"] += misses.get("isolation", 0)
    return out


class SeenKeys(Protocol):
    """The keys a `MissClassifier` has seen: a set, or a `SeenBitmap`."""

    def __contains__(self, key: bytes, /) -> bool: ...

    def add(self, key: bytes) -> None:
        """Remember `key` as seen."""


class SeenBitmap:
    """Keys seen, as one bit each at the key's low bits (collisions read as seen)."""

    def __init__(self, bits: int = 23) -> None:
        self.mask = (1 << bits) - 1
        self.words = bytearray((1 << bits) // 8 or 1)

    def __contains__(self, key: bytes, /) -> bool:
        i = int.from_bytes(key[:8], "little") & self.mask
        return bool(self.words[i >> 3] & (1 << (i & 7)))

    def add(self, key: bytes) -> None:
        """Set the bit of `key`."""
        i = int.from_bytes(key[:8], "little") & self.mask
        self.words[i >> 3] |= 1 << (i & 7)


class MissClassifier:
    """Seen keys of one cache, and the class of each missed block.

    At arrival, `prepare_keys` (or `prepare`, for a token prompt) takes the prompt's
    keyed blocks: salted keys (as the cache names them) and plain keys (the same chain
    without the tenant salt); once the cache knows how many leading blocks it served,
    `count` (or `classify`) adds up the missed tokens by class."""

    def __init__(self, block_size: int, bits: int | None = 23) -> None:
        self.block_size = block_size
        # None: exact sets (a replay); else two bitmaps of 2**bits bits.
        self.here: SeenKeys = set() if bits is None else SeenBitmap(bits)
        self.anywhere: SeenKeys = set() if bits is None else SeenBitmap(bits)

    def prepare_keys(self, keys: Sequence[bytes], plain_keys: Sequence[bytes],
                     cached: Container[bytes]) -> list[str]:
        """The class each keyed block would have if it missed; then they are marked seen."""
        here, anywhere = self.here, self.anywhere
        kinds: list[str] = []
        for key, plain in zip(keys, plain_keys):
            if key in cached:
                kinds.append(CACHED)
            elif key in here:
                kinds.append("capacity")
            elif plain in anywhere:
                kinds.append("isolation")
            else:
                kinds.append("compulsory")
            here.add(key)
            anywhere.add(plain)
        return kinds

    def prepare(self, cache: KVCacheManager, prompt: Sequence[int], tenant: str | None,
                scope: bytes | None = None) -> list[str]:
        """`prepare_keys` for a token prompt, keyed as `cache` keys it.

        The keys are in `scope` when the engine keys the prompt so (exact-prompt caching:
        `Scheduler.prompt_scope`); else a block of another prompt's prefix would read as seen, or
        as cached, for this one."""
        keys = cache.make_request("", prompt, tenant, scope=scope).keys
        plain = keys if tenant is None else \
            block_keys(list(prompt), self.block_size, scoped_root(_PLAIN_ROOT, scope))[0]
        return self.prepare_keys(keys, plain, cache.cached)

    def count(self, kinds: Sequence[str], block_tokens: Sequence[int], n_hit: int,
              out: dict[str, int] | None = None) -> dict[str, int]:
        """Add the missed tokens of blocks `n_hit` on, by class, to `out` (a new dict if None).

        `block_tokens`: tokens of each of the prompt's blocks; `kinds` covers the keyed ones (a
        block past them has no key: a partial last block the cache cannot hold)."""
        if out is None:
            out = dict.fromkeys(MISS_KINDS, 0)
        last = len(block_tokens) - 1
        bs = self.block_size
        for i in range(n_hit, len(block_tokens)):
            n = block_tokens[i]
            kind = kinds[i] if i < len(kinds) else "sub_block"
            if kind == CACHED:  # cached at arrival: the logits rule, or evicted since
                kind = "sub_block" if i == last else "capacity"
            elif kind == "compulsory" and n < bs:
                kind = "sub_block"
            out[kind] += n
        return out

    def classify(self, kinds: Sequence[str], num_prompt_tokens: int, cached_tokens: int,
                 ) -> dict[str, int]:
        """`count` for a token prompt of which the engine served `cached_tokens`."""
        bs = self.block_size
        block_tokens = [bs] * len(kinds)
        if num_prompt_tokens > len(kinds) * bs:
            block_tokens.append(num_prompt_tokens - len(kinds) * bs)
        return self.count(kinds, block_tokens, min(cached_tokens // bs, len(kinds)))
