"""An intrusive list of policy records, for policies that order blocks twice over.

A `Node`'s own links serve one `NodeQueue`. A policy that needs a second order over the
same blocks (LeCaR's LFU buckets beside its LRU queue), or an order that outlives the
block (LIRS's stack, whose non-resident entries are keys of evicted blocks), keeps a
`Link` record per block (`Node.rec`) and orders the records in a `LinkList`: O(1) append,
insert beside a record, and remove, as `NodeQueue`.
"""

from __future__ import annotations

from collections.abc import Iterator

from .node import PolicyRecord


class Link(PolicyRecord):
    """A record in at most one `LinkList`; `owner` is that list, or None."""

    __slots__ = ("prev", "next", "owner")

    def __init__(self) -> None:
        self.prev: Link = self
        self.next: Link = self
        self.owner: LinkList | None = None


class LinkList:
    """A circular doubly-linked list of `Link` records around a sentinel.

    `end.next` is the cold (oldest) end, `end.prev` the hot (newest) end."""

    __slots__ = ("end", "size")

    def __init__(self) -> None:
        self.end = Link()
        self.size = 0

    def append(self, e: Link) -> None:
        """Insert at the hot end."""
        end = self.end
        last = end.prev
        last.next = e
        e.prev = last
        e.next = end
        end.prev = e
        e.owner = self
        self.size += 1

    def appendleft(self, e: Link) -> None:
        """Insert at the cold end."""
        end = self.end
        first = end.next
        first.prev = e
        e.next = first
        e.prev = end
        end.next = e
        e.owner = self
        self.size += 1

    def insert_before(self, e: Link, at: Link) -> None:
        """Insert `e` just on the cold side of `at` (a member)."""
        prev = at.prev
        prev.next = e
        e.prev = prev
        e.next = at
        at.prev = e
        e.owner = self
        self.size += 1

    def remove(self, e: Link) -> None:
        """Unlink `e` from this list."""
        prev, nxt = e.prev, e.next
        prev.next = nxt
        nxt.prev = prev
        e.prev = e.next = e
        e.owner = None
        self.size -= 1

    def first(self) -> Link | None:
        """The link at the cold end, or None when the list is empty."""
        e = self.end.next
        return None if e is self.end else e

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Link]:
        end = self.end
        e = end.next
        while e is not end:
            nxt = e.next
            yield e
            e = nxt
