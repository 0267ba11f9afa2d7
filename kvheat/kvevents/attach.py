"""Wiring a cache (and its lower tiers) to a `KVEventPublisher`.

`attach` registers listeners on a `KVCacheManager` (`index_listeners`: a block stored
under its key, or leaving it) and on a `TierManager` (`index_listeners`: a tier taking or
losing a key); `snapshot_items` lists what they hold now, for a resync. The listeners run
on the thread changing the cache and only queue a tuple.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cache.block import Block
from ..cache.manager import KVCacheManager
from .publisher import KVEventPublisher


def attach(pub: KVEventPublisher, mgr: KVCacheManager, tiers: Any = None,
           rank: int = 0) -> Callable[[], None]:
    """Publish `mgr`'s (and `tiers`') changes; returns a function that detaches them."""
    with_tokens = pub.config.token_ids
    record = pub.record
    pub.add_rank(rank)

    def on_device(b: Block, stored: bool) -> None:
        key = b.key
        if key is None:  # (never: the pool calls this with cached blocks only)
            return
        if stored:
            parent = b.parent.key if b.parent is not None else None
            record((rank, True, "device", key, parent, b.num_tokens,
                    b.content if with_tokens else None))
        else:
            record((rank, False, "device", key, None, 0, None))

    def on_tier(name: str, key: bytes, parent: bytes | None, tokens: int, stored: bool) -> None:
        record((rank, stored, name, key, parent, tokens, None))

    mgr.index_listeners.append(on_device)
    if tiers is not None:
        tiers.index_listeners.append(on_tier)

    def detach() -> None:
        if on_device in mgr.index_listeners:
            mgr.index_listeners.remove(on_device)
        if tiers is not None and on_tier in tiers.index_listeners:
            tiers.index_listeners.remove(on_tier)

    return detach


def snapshot_items(mgr: KVCacheManager, tiers: Any = None, rank: int = 0,
                   with_tokens: bool = False) -> list[tuple]:
    """Every key `mgr` and `tiers` hold now, parents before children.

    Run it on the thread that owns the cache (the engine loop), between steps."""
    out: list[tuple] = []
    for b in sorted(mgr.cached.values(), key=lambda b: b.depth):
        parent = b.parent.key if b.parent is not None else None
        out.append((rank, True, "device", b.key, parent, b.num_tokens,
                    b.content if with_tokens else None))
    if tiers is not None:
        for name, key, parent, tokens in tiers.entries():
            out.append((rank, True, name, key, parent, tokens, None))
    return out
