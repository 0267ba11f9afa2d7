"""What an eviction policy orders, and the intrusive queue it orders them with.

A `Node` is anything a policy ranks for eviction: a device block (`Block`), a lower
tier's entry (`kvheat.tiers.index.TierEntry`), a vLLM offload chunk
(`kvheat.integrations.vllm_chunk.Chunk`). It carries the prefix tree a policy may read
(`key`, `parent`, `depth`, `num_children`), whether it is held (`ref_cnt`), the links of
the queue it sits in, and the fields that mean the same to every policy (`state`,
`freq`, `heap_version`, `heap_slot`, the access times); whatever else a policy keeps per
node is its own `PolicyRecord` in `rec`.

A queue's links live on the nodes themselves, so any node is unlinked in O(1) without
searching (as vLLM's free-block queue). The queue is circular around one sentinel end;
a node in no queue links to `DETACHED`, so a link is always a node, never None.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any


class PolicyRecord:
    """What one policy keeps per node beyond the shared fields.

    Each policy subclasses it: KVHeat's `HeatRecord`, LRU-K's `LRUKHistory`."""

    __slots__ = ()


class Node:
    """One thing an eviction policy ranks: a block, a tier entry or a vLLM chunk."""

    __slots__ = (
        "key", "parent", "num_children", "ref_cnt", "num_tokens", "depth", "prev", "next",
        "queue", "parked", "state", "freq", "last_access", "inserted_at", "heap_version",
        "heap_slot", "rec",
    )

    def __init__(self) -> None:
        self.key: bytes | None = None  # the chained prefix hash; None while not cached
        self.parent: Node | None = None
        self.num_children = 0  # cached children; a node with children is never evicted
        self.ref_cnt = 0
        self.num_tokens = 0
        self.depth = 0
        self.prev: Node = DETACHED
        self.next: Node = DETACHED
        self.queue: NodeQueue | None = None
        self.parked: NodeQueue | None = None  # queue to rejoin (cold end) once evictable again
        self.state = 0  # which list of the policy the node belongs to (ARC, 2Q, S3-FIFO)
        self.freq = 0  # accesses counted by the policy (LFU, S3-FIFO's 2 bits, Fused)
        self.last_access = 0.0  # cache clock of the last insert or hit (set by the cache)
        self.inserted_at = 0.0
        # A heap's entries for a node are not removed, they go stale; these two fields say
        # which one is live. `heap_version` (Belady's heap): an entry is live while it
        # carries the node's current version; raising it (at each push, acquire, eviction
        # and forget, and by the pool whenever the node loses its key) makes every older
        # entry stale. `heap_slot` (a `kvheat.heat.heap.BlockHeap`): the key of the bucket
        # holding the node's live entry; NaN while it has none (never pushed, or taken or
        # forgotten since its last push).
        self.heap_version = 0
        self.heap_slot = math.nan
        # The policy's own record (a `PolicyRecord`, or None before its first insert),
        # reused across keys. Typed Any: each policy knows its own record, and reads it
        # by a plain annotated assignment (a `cast` is a function call on every access).
        self.rec: Any = None


class QueueEnd(Node):
    """The sentinel a `NodeQueue` is linked around.

    Its `next` is the cold end, its `prev` the hot end; it is never cached, never a
    victim."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()
        self.prev = self.next = self


# Where the links of a node in no queue point.
DETACHED: Node = QueueEnd.__new__(QueueEnd)
DETACHED.prev = DETACHED.next = DETACHED


class NodeQueue:
    """Doubly-linked list of nodes: O(1) append, appendleft and remove."""

    __slots__ = ("end", "size", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.end = QueueEnd()
        self.size = 0

    def append(self, b: Node) -> None:
        """Insert at the hot (most recent) end."""
        end = self.end
        last = end.prev
        last.next = b
        b.prev = last
        b.next = end
        end.prev = b
        b.queue = self
        self.size += 1

    def appendleft(self, b: Node) -> None:
        """Insert at the cold end: the next node to be considered for eviction."""
        end = self.end
        first = end.next
        first.prev = b
        b.next = first
        b.prev = end
        end.next = b
        b.queue = self
        self.size += 1

    def remove(self, b: Node) -> None:
        """Unlink `b` from this queue."""
        b.prev.next = b.next
        b.next.prev = b.prev
        b.prev = b.next = DETACHED
        b.queue = None
        self.size -= 1

    def first(self) -> Node | None:
        """The node at the cold end, or None when the queue is empty."""
        b = self.end.next
        return None if b is self.end else b

    def popleft(self) -> Node | None:
        """Remove and return the node at the cold end (None when empty)."""
        b = self.end.next
        if b is self.end:
            return None
        self.remove(b)
        return b

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Node]:
        end = self.end
        b = end.next
        while b is not end:
            nxt = b.next
            yield b
            b = nxt
