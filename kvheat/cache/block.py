"""A device block: one page of KV for `block_size` tokens, at `block_id` in the KV pool.

Its place in the prefix tree and in its policy's order it has as a `Node` (what every
eviction policy orders); a block adds only what the device cache keeps of it.
"""

from __future__ import annotations

from .hashing import BlockKey
from .node import Node


class Block(Node):
    """A device block: a `Node` with its id, its own tokens and the tenant that filled it."""

    __slots__ = ("block_id", "content", "tenant")
    key: BlockKey | None
    parent: Block | None

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.block_id = block_id
        self.content: bytes | None = None  # the block's own tokens, compared on every hit
        self.tenant: str | None = None  # who filled it (its quota and usage count it)

    def __repr__(self) -> str:
        k = self.key.hex()[:8] if self.key else None
        return f"Block({self.block_id}, key={k}, ref={self.ref_cnt}, children={self.num_children})"
