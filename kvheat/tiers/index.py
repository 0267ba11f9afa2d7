"""What one lower tier holds, ordered for eviction by the device's policy family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from ..cache.node import Node
from ..cache.policy import EvictionPolicy

# The owner of an entry found in a store at start-up: whoever filled it is unknown.
UNKNOWN_OWNER = object()


class TierEntry(Node):
    """One key a lower tier holds, as its policy orders it (it never holds KV itself)."""

    __slots__ = ("salt",)

    def __init__(self, key: bytes, salt: str | None, tokens: int, now: float) -> None:
        super().__init__()
        self.key = key
        self.salt = salt  # the namespace it is stored in: its tenant's salt
        self.num_tokens = tokens
        self.last_access = self.inserted_at = now


@dataclass(slots=True)
class PeerEntry:
    """A key another replica holds in a shared tier (not in this replica's index)."""

    key: bytes
    num_tokens: int


class TierIndex:
    """The keys one lower tier holds, ordered for eviction by an `EvictionPolicy`.

    Entries are `TierEntry` nodes of the device's policy family; a pinned entry (being
    loaded) has ref_cnt > 0, so the policy never picks it. With `leaf_first`, an entry's
    `num_children` counts its children held on lower tiers: the policy parks such an entry
    as it parks a device parent, and `inner` keeps them for when no leaf is left."""

    def __init__(self, policy: EvictionPolicy, capacity_entries: int,
                 leaf_first: bool = False) -> None:
        self.policy = policy
        policy.bind(max(1, capacity_entries))
        self.leaf_first = leaf_first
        self.entries: dict[bytes, TierEntry] = {}
        self.sizes: dict[bytes, int] = {}
        # key -> the tenant whose request filled it (`UNKNOWN_OWNER` for entries found at
        # start-up): a flush deletes a tenant's own entries, not its share group's.
        self.owners: dict[bytes, object] = {}
        # Entries with children below, in the order they got their first (leaf_first only).
        self.inner: dict[bytes, TierEntry] = {}
        # Called with (entry, parent key, True) when a key is added and (entry, None,
        # False) when it goes: KV events (TieredCache.index_listeners).
        self.listener: Callable[[TierEntry, bytes | None, bool], None] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> TierEntry | None:
        return self.entries.get(key)

    def insert(self, key: bytes, salt: str | None, tokens: int, size: int, now: float,
               children: int = 0, owner: object = None, parent: bytes | None = None) -> bool:
        """Add `key` (True) or refresh it (False). `children`: its children held below."""
        b = self.entries.get(key)
        if b is not None:
            self.sizes[key] = size
            self.touch(b, now)
            return False
        b = TierEntry(key, salt, tokens, now)
        if self.leaf_first and children:
            b.num_children = children
            self.inner[key] = b
        b.ref_cnt = 1  # as the manager does: inserted while held, then released
        self.policy.on_insert(b, now)
        b.ref_cnt = 0
        self.policy.on_release(b, now)
        self.entries[key] = b
        self.sizes[key] = size
        self.owners[key] = owner
        if self.listener is not None:
            self.listener(b, parent, True)
        return True

    def set_children(self, key: bytes, n: int) -> None:
        """`key` now has `n` children held below; at 0 it may be evicted again."""
        b = self.entries.get(key)
        if b is None or not self.leaf_first or b.num_children == n:
            return
        was = b.num_children
        b.num_children = n
        if n and not was:
            self.inner[key] = b
        elif was and not n:
            del self.inner[key]
            if b.ref_cnt == 0:
                self.policy.on_leaf(b)

    def touch(self, b: TierEntry, now: float) -> None:
        b.last_access = now
        if b.ref_cnt == 0:
            self.policy.on_acquire(b)
            self.policy.on_hit(b, now)
            self.policy.on_release(b, now)
        else:
            self.policy.on_hit(b, now)

    def pin(self, b: TierEntry, now: float) -> None:
        """Hold `b` while it is being loaded; a request found it, so it counts as a hit."""
        b.ref_cnt += 1
        if b.ref_cnt == 1:
            self.policy.on_acquire(b)
        b.last_access = now
        self.policy.on_hit(b, now)

    def unpin(self, b: TierEntry, now: float) -> None:
        b.ref_cnt -= 1
        if b.ref_cnt == 0 and self._holds(b):
            self.policy.on_release(b, now)

    def remove(self, key: bytes) -> TierEntry | None:
        """Forget `key`; its entry stays referenced so the policy never returns it."""
        b = self.entries.pop(key, None)
        if b is None:
            return None
        self.sizes.pop(key, None)
        self.owners.pop(key, None)
        self.inner.pop(key, None)
        if b.ref_cnt == 0:
            self.policy.on_acquire(b)
        b.ref_cnt += 1
        self.policy.on_evict(b)
        if self.listener is not None:
            self.listener(b, None, False)
        return b

    def victim(self) -> TierEntry | None:
        """The policy's choice among evictable entries (leaves, with `leaf_first`); when
        only parents are left, the one that became a parent first."""
        while True:
            b = self.policy.victim()
            if b is None:
                break
            if self._holds(b):
                return b
        # Rare (a full tier of parents whose children sit on other tiers): the caller's
        # removal then drops the descendants too. Pinned ones are skipped, never many.
        return next((b for b in self.inner.values() if b.ref_cnt == 0), None)

    def _holds(self, b: Node) -> TypeGuard[TierEntry]:
        """Is `b` the live entry of its key (not one removed, or replaced since)?"""
        return b.key is not None and self.entries.get(b.key) is b
