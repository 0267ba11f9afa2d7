"""What the block cache is asked for: its configuration, a request (a sequence holding
blocks), the hit statistics it keeps, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from .block import Block
from .hashing import BlockKey


class CacheError(Exception):
    """Base class of the cache's own errors; the pool is unchanged when one is raised."""


class PromptTooLong(CacheError):
    """The request needs more blocks than the whole pool has."""


class OutOfBlocks(CacheError):
    """No free or evictable block is left for the request."""


class UnknownRequest(CacheError):
    """The request holds no blocks in this cache."""


@dataclass(slots=True)
class CacheConfig:
    """The cache's size, block size, eviction policy and tenant share groups."""

    num_blocks: int
    block_size: int = 16
    policy: str = "lru"
    # tenant -> share group: tenants in one group see each other's blocks. Default: none.
    share_groups: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")


def hit_rate(hit_tokens: int, prompt_tokens: int) -> float:
    """The prefix hit rate: prompt tokens served from cache over all prompt tokens.

    THE hit rate, wherever one is reported (the cache's stats, the tiers' stats, the server's
    arms). Served from cache means on the device or loaded from a lower tier. An engine never
    counts the last prompt token as served (it runs again, for its logits), so a fully cached
    prompt of n tokens is n - 1 hits."""
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass(slots=True)
class CacheStats:
    """The cache's counters: prompts, the tokens served from cache, inserts, evictions.

    Prompts are counted once each (an engine: at a request's first admission), with the tokens
    served from cache: from the device, and (with lower tiers) loaded from them."""

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    collisions: int = 0  # a key matched but the tokens differed: served as a miss

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens (`hit_rate`)."""
        return hit_rate(self.hit_tokens, self.query_tokens)


class Request:
    """A sequence holding blocks.

    Token requests hash their full blocks once, at creation; trace requests come with precomputed
    keys and per-block token counts."""

    __slots__ = (
        "request_id", "tenant", "session", "root", "keys", "contents", "block_tokens",
        "num_tokens", "blocks", "num_cached_tokens", "raw", "lora",
    )

    def __init__(self, request_id: str, tenant: str | None, root: bytes, keys: list[BlockKey],
                 contents: list[bytes], block_tokens: list[int], num_tokens: int,
                 raw: bytearray | None = None, session: str | None = None,
                 lora: str | None = None) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.session = session
        self.lora = lora
        self.root = root
        self.keys = keys  # keys of the cacheable blocks, in order
        self.contents = contents
        self.block_tokens = block_tokens  # tokens in each block the request needs
        self.num_tokens = num_tokens
        self.blocks: list[Block] = []
        self.num_cached_tokens = 0  # prompt tokens served from cache at allocate
        self.raw = raw  # token bytes (token requests only), grown by append_tokens

    @property
    def block_table(self) -> list[int]:
        """The ids of the blocks the request holds, in order."""
        return [b.block_id for b in self.blocks]

    def head(self, n_tokens: int, block_size: int) -> Request:
        """A request for this one's first `n_tokens` tokens, reusing its block keys.

        For a chunk of a chunked prefill."""
        n_full = n_tokens // block_size
        bt = [block_size] * n_full
        if n_tokens % block_size:
            bt.append(n_tokens % block_size)
        raw = self.raw[:4 * n_tokens] if self.raw is not None else None
        return Request(self.request_id, self.tenant, self.root, self.keys[:n_full],
                       self.contents[:n_full], bt, n_tokens, raw, self.session, self.lora)
