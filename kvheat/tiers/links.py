"""The prefix links of the keys held below the device, all lower tiers together.

Every lower-tier entry keeps its parent key (taken from the device block's parent at
demotion, carried through the queue and between tiers; None for a first block, and for
entries found in a store at start-up, whose parent is unknown: they count as roots). A key
that leaves the hierarchy for good (dropped at the bottom, a failed load, a refused or
dropped demotion) while neither the device nor any tier holds it takes every lower-tier
descendant with it: a prefix match ends at the first missing key, so they could never be
served.
"""

from __future__ import annotations

from collections.abc import Callable

from .counters import TierCounters
from .index import TierIndex

# (tier, key, salt) of a lower-tier entry to delete from its store.
Deletion = tuple[int, bytes, str | None]


class PrefixLinks:
    """A key is held while an index has it or a demotion of it is queued or moving between
    tiers (`held` counts those); `kids[k]` are the held keys whose parent is k.

    Pure bookkeeping, called with the hierarchy's lock held: `release` and `settle` remove
    the orphaned entries from the indexes and return what to delete from the stores, which
    the caller does after, unlocked."""

    def __init__(self, indexes: list[TierIndex], on_device: Callable[[bytes], bool],
                 counters: TierCounters) -> None:
        self.indexes = indexes
        self.on_device = on_device  # does the device cache hold this key now?
        self.counters = counters  # counts `orphans_dropped`
        self.held: dict[bytes, int] = {}
        self.parent: dict[bytes, bytes | None] = {}
        self.kids: dict[bytes, set[bytes]] = {}

    def hold(self, key: bytes, parent: bytes | None) -> None:
        """One more holding of `key` below (an index entry, a queued or moving demotion)."""
        self.held[key] = self.held.get(key, 0) + 1
        if parent is None:
            if key not in self.parent:
                self.parent[key] = None
            return
        # Also when already held: a restored root learns its parent, and a key whose parent
        # left and came back while it was queued is linked to the parent's new life.
        self.parent[key] = parent
        kids = self.kids.get(parent)
        if kids is None:
            kids = self.kids[parent] = set()
        if key not in kids:
            kids.add(key)
            self._mark(parent)

    def release(self, key: bytes, leaving_device: bool = False) -> list[Deletion]:
        """Drop one holding of `key`; when it was the last and the device does not hold the
        key either (`leaving_device`: it is being evicted from there now), the key is gone
        and its descendants below go too."""
        n = self.held.get(key, 0) - 1
        if n > 0:
            self.held[key] = n
            return []
        if n == 0:
            del self.held[key]
            parent = self.parent.pop(key, None)
            if parent is not None:
                kids = self.kids.get(parent)
                if kids is not None and key in kids:
                    kids.discard(key)
                    if not kids:
                        del self.kids[parent]
                    self._mark(parent)
        return self.settle(key, leaving_device)

    def settle(self, key: bytes, leaving_device: bool = False) -> list[Deletion]:
        """If `key` is held nowhere (no tier, no queued demotion, not the device), remove
        its descendants from every tier: O(descendants)."""
        if key in self.held or (not leaving_device and self.on_device(key)):
            return []
        out: list[Deletion] = []
        stack = [key]
        while stack:
            for c in self.kids.pop(stack.pop(), ()):
                for t, idx in enumerate(self.indexes):
                    e = idx.remove(c)
                    if e is not None:
                        out.append((t, c, e.salt))
                        self.counters.orphans_dropped += 1
                        self.held[c] -= 1
                if self.held.get(c, 1) == 0:
                    del self.held[c]
                    self.parent.pop(c, None)
                # A copy still queued is dropped when placed (its parent is gone then);
                # a key the device holds keeps its children reachable.
                if c not in self.held and not self.on_device(c):
                    stack.append(c)
        return out

    def orphan(self, parent: bytes | None) -> bool:
        """Would an entry under `parent` be unreachable (the parent is held nowhere)?"""
        return parent is not None and parent not in self.held and not self.on_device(parent)

    def children(self, key: bytes) -> int:
        return len(self.kids.get(key, ()))

    def _mark(self, key: bytes) -> None:
        """Tell the leaf-first tiers holding `key` how many children it has below."""
        n = self.children(key)
        for idx in self.indexes:
            if idx.leaf_first:
                idx.set_children(key, n)
