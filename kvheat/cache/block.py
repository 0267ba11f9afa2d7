"""Blocks and the intrusive doubly-linked queue every policy orders them with.

A block is one page of KV for `block_size` tokens. Its links (`prev`, `next`) live on the
block itself, so a queue can unlink any block in O(1) without searching (as vLLM's
free-block queue does).

Besides the tree and the links, a block carries only what means the same to every policy
that reads it (`freq`, `state`, `heap_ver`); whatever else a policy keeps per block is its
own record in `rec` (KVHeat's `HeatRecord`, LRU-K's `LRUKHistory`, Fused's candidate index).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Block:
    __slots__ = (
        "block_id", "key", "content", "parent", "num_children", "ref_cnt", "num_tokens",
        "depth", "tenant", "prev", "next", "queue", "parked", "state", "freq",
        "last_access", "inserted_at", "heap_ver", "rec",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.key: bytes | None = None  # chained prefix hash; None while the block is not cached
        self.content: bytes | None = None  # the block's own tokens, compared on every hit
        self.parent: Block | None = None
        self.num_children = 0  # cached children; a block with children is never evicted
        self.ref_cnt = 0
        self.num_tokens = 0
        self.depth = 0
        self.tenant: str | None = None
        self.prev: Block | None = None
        self.next: Block | None = None
        self.queue: BlockQueue | None = None
        self.parked: BlockQueue | None = None  # queue to rejoin (cold end) once evictable again
        self.state = 0  # which list of the policy the block belongs to (ARC, 2Q, S3-FIFO)
        self.freq = 0  # accesses counted by the policy (LFU, S3-FIFO's 2 bits, Fused)
        self.last_access = 0.0  # cache clock of the last insert or hit (set by the cache)
        self.inserted_at = 0.0
        # Which heap entry of the policy is live (Belady: a version, heat heaps: a slot).
        self.heap_ver: float = 0
        # The policy's own per-block record; its type is the policy's (one policy type per
        # cache), so it is typed here as Any and precisely where each policy reads it.
        self.rec: Any = None

    @property
    def evictable(self) -> bool:
        return self.ref_cnt == 0 and self.num_children == 0 and self.key is not None

    def __repr__(self) -> str:
        k = self.key.hex()[:8] if self.key else None
        return f"Block({self.block_id}, key={k}, ref={self.ref_cnt}, children={self.num_children})"


class BlockQueue:
    """Doubly-linked list of blocks with sentinels: O(1) append, appendleft and remove."""

    __slots__ = ("head", "tail", "size", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.head = Block(-1)
        self.tail = Block(-2)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.size = 0

    def append(self, b: Block) -> None:
        """Insert at the hot (most recent) end."""
        last = self.tail.prev
        last.next = b  # type: ignore[union-attr]
        b.prev = last
        b.next = self.tail
        self.tail.prev = b
        b.queue = self
        self.size += 1

    def appendleft(self, b: Block) -> None:
        """Insert at the cold end: the next block to be considered for eviction."""
        first = self.head.next
        first.prev = b  # type: ignore[union-attr]
        b.next = first
        b.prev = self.head
        self.head.next = b
        b.queue = self
        self.size += 1

    def remove(self, b: Block) -> None:
        b.prev.next = b.next  # type: ignore[union-attr]
        b.next.prev = b.prev  # type: ignore[union-attr]
        b.prev = b.next = None
        b.queue = None
        self.size -= 1

    def first(self) -> Block | None:
        b = self.head.next
        return None if b is self.tail else b

    def popleft(self) -> Block | None:
        b = self.head.next
        if b is None or b is self.tail:
            return None
        self.remove(b)
        return b

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Block]:
        b = self.head.next
        while b is not None and b is not self.tail:  # (never None: the tail sentinel ends it)
            nxt = b.next
            yield b
            b = nxt
