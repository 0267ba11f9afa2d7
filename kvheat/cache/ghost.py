"""The ghost list: keys of recently evicted blocks, each with what its policy keeps of it.

ARC's B1/B2, 2Q's A1out and S3-FIFO's ghost keep keys only (value `True`); LRU-K keeps a
key's last access time. Bounded by the caller's `limit`, oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class Ghost(Generic[V]):
    """Keys of recently evicted blocks, oldest first, each with what its policy keeps of it."""

    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, V] = OrderedDict()

    def add(self, key: bytes, value: V, limit: int) -> None:
        """Remember `key` with `value`, dropping the oldest keys beyond `limit`."""
        self.entries[key] = value
        while len(self.entries) > max(limit, 0):
            self.entries.popitem(last=False)

    def take(self, key: bytes) -> V | None:
        """Remove `key` and return its value (None when it is not remembered)."""
        return self.entries.pop(key, None)

    def __len__(self) -> int:
        return len(self.entries)
