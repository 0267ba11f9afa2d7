"""The one index of what lies below the device: for each key, which tiers hold it, its
parent, its namespace and the tenant that filled it (`KeyIndex`), and per tier the order
its policy evicts in (`TierIndex`).

Every entry keeps its parent key (taken from the device block's parent at demotion, or
given to `TierManager.save`; None for a first block, and for entries found in a store at
start-up, whose parent is unknown: they count as roots). A key that leaves the hierarchy
for good (dropped at the bottom, a failed load, a refused or dropped demotion) while
neither the device nor any tier holds it takes every lower-tier descendant with it: a
prefix match ends at the first missing key, so they could never be served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from ..cache.eviction import EvictionPolicy
from ..cache.hashing import BlockKey, Namespace
from ..cache.node import Node
from .counters import TierCounters

# The owner of an entry found in a store at start-up: whoever filled it is unknown.
UNKNOWN_OWNER = object()

# (tier, key, namespace) of a lower-tier entry to delete from its store.
Deletion = tuple[int, BlockKey, Namespace]

# (tier name, key, parent key, tokens, stored): a tier took a key (True) or lost it.
IndexListener = Callable[[str, BlockKey, BlockKey | None, int, bool], None]


class TierEntry(Node):
    """One key on one lower tier, as its policy orders it (it never holds KV itself)."""

    __slots__ = ()
    key: BlockKey | None

    def __init__(self, key: BlockKey, tokens: int, now: float) -> None:
        super().__init__()
        self.key = key
        self.num_tokens = tokens
        self.last_access = self.inserted_at = now


@dataclass(slots=True)
class PeerEntry:
    """A key another replica holds in a shared tier (not in this replica's index)."""

    key: BlockKey
    num_tokens: int


class KeyRecord:
    """What the index knows of one key held below: namespace, parent, owner and holdings.

    Its namespace (its tenant's, or, for an entry found at start-up whose tenant is not
    known, `Namespace.stored` of the digest it is stored under), its parent key, the
    tenant whose request filled it (`UNKNOWN_OWNER` if found at start-up), and how many
    holdings keep it (tier entries, moves queued or in flight)."""

    __slots__ = ("ns", "parent", "owner", "held")

    def __init__(self, ns: Namespace, parent: BlockKey | None, owner: object) -> None:
        self.ns = ns
        self.parent = parent
        self.owner = owner
        self.held = 0


class TierIndex:
    """The keys one lower tier holds, ordered for eviction by an `EvictionPolicy`.

    Entries are `TierEntry` nodes of the device's policy family; a pinned entry (being
    loaded) has ref_cnt > 0, so the policy never picks it. With `leaf_first`, an entry's
    `num_children` counts its children held below: the policy parks such an entry as it
    parks a device parent (`KeyIndex.victim` takes one when no leaf is left)."""

    def __init__(self, policy: EvictionPolicy, capacity_entries: int,
                 leaf_first: bool = False) -> None:
        self.policy = policy
        policy.bind(max(1, capacity_entries))
        self.leaf_first = leaf_first
        self.entries: dict[BlockKey, TierEntry] = {}
        self.sizes: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: BlockKey) -> TierEntry | None:
        """The entry of `key` on this tier, or None."""
        return self.entries.get(key)

    def insert(self, key: BlockKey, tokens: int, size: int, now: float, children: int = 0) -> bool:
        """Add `key` (True) or refresh it (False). `children`: its children held below."""
        b = self.entries.get(key)
        if b is not None:
            self.sizes[key] = size
            self.touch(b, now)
            return False
        b = TierEntry(key, tokens, now)
        if self.leaf_first and children:
            b.num_children = children
        b.ref_cnt = 1  # as the manager does: inserted while held, then released
        self.policy.on_insert(b, now)
        b.ref_cnt = 0
        self.policy.on_release(b, now)
        self.entries[key] = b
        self.sizes[key] = size
        return True

    def set_children(self, key: BlockKey, n: int) -> None:
        """`key` now has `n` children held below; at 0 it may be evicted again."""
        b = self.entries.get(key)
        if b is None or not self.leaf_first or b.num_children == n:
            return
        was = b.num_children
        b.num_children = n
        if was and not n and b.ref_cnt == 0:
            self.policy.on_leaf(b)

    def touch(self, b: TierEntry, now: float) -> None:
        """Refresh `b` as accessed at `now`: a hit for the policy, pinned or not."""
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
        """Drop one pin of `b` (see `pin`); at the last, a live entry is evictable again."""
        b.ref_cnt -= 1
        if b.ref_cnt == 0 and self._holds(b):
            self.policy.on_release(b, now)

    def remove(self, key: BlockKey) -> TierEntry | None:
        """Forget `key`; its entry stays referenced so the policy never returns it."""
        b = self.entries.pop(key, None)
        if b is None:
            return None
        self.sizes.pop(key, None)
        if b.ref_cnt == 0:
            self.policy.on_acquire(b)
        b.ref_cnt += 1
        self.policy.on_evict(b)
        return b

    def victim(self) -> TierEntry | None:
        """The policy's choice among evictable entries (leaves, with `leaf_first`)."""
        while True:
            b = self.policy.victim()
            if b is None:
                return None
            if self._holds(b):
                return b

    def _holds(self, b: Node) -> TypeGuard[TierEntry]:
        """Is `b` the live entry of its key (not one removed, or replaced since)?"""
        return isinstance(b, TierEntry) and b.key is not None and self.entries.get(b.key) is b


class KeyIndex:
    """The index of every key held below the device, all lower tiers together.

    For each key: its `KeyRecord`, the tiers holding it (`tiers[t]`, each tier's eviction
    order), and its children below (`kids[k]`: the held keys whose parent is k; k itself
    may be on the device only).

    A key is held while a tier has it or a move of it is queued or in flight (`hold`).
    Pure bookkeeping, called with the tiers' lock held: `release` and `settle` remove the
    orphaned entries and return what to delete from the stores, which the caller does
    after, unlocked. `on_device(key)`: does the device hold the key now?"""

    def __init__(self, tiers: list[TierIndex], names: list[str],
                 counters: TierCounters) -> None:
        self.tiers = tiers
        self.names = names
        self.counters = counters  # counts `orphans_dropped`
        self.records: dict[BlockKey, KeyRecord] = {}
        # In the order each got its first child below: the bottom tier's last resort.
        self.kids: dict[BlockKey, set[BlockKey]] = {}
        self.on_device: Callable[[BlockKey], bool] = lambda key: True
        # Called with (tier name, key, parent, tokens, True) when a tier takes a key and
        # (tier name, key, None, 0, False) when it loses it (KV events): keep them quick.
        self.listeners: list[IndexListener] = []

    def __contains__(self, key: BlockKey) -> bool:
        """Is `key` held below (on a tier, or moving to one)?"""
        return key in self.records

    def record(self, key: BlockKey) -> KeyRecord | None:
        """The `KeyRecord` of `key`, or None when it is not held below."""
        return self.records.get(key)

    def parent(self, key: BlockKey) -> BlockKey | None:
        """The parent key recorded for `key` (None: a root, or not held below)."""
        rec = self.records.get(key)
        return rec.parent if rec is not None else None

    def where(self, key: BlockKey) -> list[int]:
        """The tiers holding `key`, top first."""
        return [t for t, idx in enumerate(self.tiers) if key in idx.entries]

    # ---- a tier takes or loses a key ------------------------------------------------------
    def add(self, tier: int, key: BlockKey, ns: Namespace, tokens: int, size: int,
            now: float, owner: object, parent: BlockKey | None) -> bool:
        """Tier `tier` takes `key` (True), or already has it: refreshed (False)."""
        if not self.tiers[tier].insert(key, tokens, size, now, self.children(key)):
            return False
        self.hold(key, parent, ns, owner)
        for listener in self.listeners:
            listener(self.names[tier], key, parent, tokens, True)
        return True

    def remove(self, tier: int, key: BlockKey) -> TierEntry | None:
        """Tier `tier` no longer has `key`; its holding stays until `release`."""
        e = self.tiers[tier].remove(key)
        if e is not None:
            for listener in self.listeners:
                listener(self.names[tier], key, None, 0, False)
        return e

    # ---- holdings -------------------------------------------------------------------------
    def hold(self, key: BlockKey, parent: BlockKey | None, ns: Namespace,
             owner: object) -> None:
        """One more holding of `key` below (a tier entry, a queued or moving copy)."""
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = KeyRecord(ns, None, owner)
        elif not rec.ns.known and ns.known:
            rec.ns = ns  # a key found at start-up meets its tenant
        rec.held += 1
        if parent is None:
            return
        # Also when already held: a restored root learns its parent, and a key whose parent
        # left and came back while it was queued is linked to the parent's new life.
        rec.parent = parent
        kids = self.kids.get(parent)
        if kids is None:
            kids = self.kids[parent] = set()
        if key not in kids:
            kids.add(key)
            self._mark(parent)

    def release(self, key: BlockKey, leaving_device: bool = False) -> list[Deletion]:
        """Drop one holding of `key`; return what to delete from the stores.

        When it was the last and the device does not hold the key either
        (`leaving_device`: it is being evicted from there now), the key is gone and its
        descendants below go too."""
        rec = self.records.get(key)
        if rec is not None:
            rec.held -= 1
            if rec.held > 0:
                return []
            del self.records[key]
            parent = rec.parent
            if parent is not None:
                kids = self.kids.get(parent)
                if kids is not None and key in kids:
                    kids.discard(key)
                    if not kids:
                        del self.kids[parent]
                    self._mark(parent)
        return self.settle(key, leaving_device)

    def settle(self, key: BlockKey, leaving_device: bool = False) -> list[Deletion]:
        """Remove `key`'s descendants from every tier if `key` is held nowhere.

        Held nowhere: no tier, no queued move, not the device. O(descendants). Returns
        what to delete from the stores."""
        if key in self.records or (not leaving_device and self.on_device(key)):
            return []
        out: list[Deletion] = []
        stack = [key]
        while stack:
            for c in self.kids.pop(stack.pop(), ()):
                rec = self.records.get(c)
                if rec is not None:
                    for t in range(len(self.tiers)):
                        if self.remove(t, c) is not None:
                            out.append((t, c, rec.ns))
                            self.counters.orphans_dropped += 1
                            rec.held -= 1
                    if rec.held == 0:
                        del self.records[c]
                # A copy still queued is dropped when placed (its parent is gone then);
                # a key the device holds keeps its children reachable.
                if c not in self.records and not self.on_device(c):
                    stack.append(c)
        return out

    def orphan(self, parent: BlockKey | None) -> bool:
        """Whether an entry under `parent` would be unreachable (its parent held nowhere)."""
        return parent is not None and parent not in self.records and not self.on_device(parent)

    def children(self, key: BlockKey) -> int:
        """How many children `key` has held below."""
        return len(self.kids.get(key, ()))

    def victim(self, tier: int) -> TierEntry | None:
        """Pick the entry tier `tier` evicts next, or None.

        It is the tier policy's choice; on a leaf-first tier where only parents are left
        (rare: their children sit on other tiers), the one that became a parent first
        (the caller's removal then drops its descendants too)."""
        idx = self.tiers[tier]
        v = idx.victim()
        if v is not None or not idx.leaf_first:
            return v
        return next((e for k in self.kids if (e := idx.entries.get(k)) is not None
                     and e.ref_cnt == 0), None)

    def _mark(self, key: BlockKey) -> None:
        """Tell the leaf-first tiers holding `key` how many children it has below."""
        n = self.children(key)
        for idx in self.tiers:
            if idx.leaf_first:
                idx.set_children(key, n)
