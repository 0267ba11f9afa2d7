"""The block cache: blocks, prefix hashing, the manager and baseline eviction policies.

No torch here: this layer runs anywhere, including the trace replayer.
"""

from . import policies  # noqa: F401  (registers the baseline policies)
from .block import Block, BlockQueue
from .hashing import block_keys, chain_key, root_key, tokens_to_bytes
from .manager import KVCacheManager
from .policy import EvictionPolicy, make_policy, policy_names, register_policy
from .request import (
    CacheConfig,
    CacheError,
    CacheStats,
    OutOfBlocks,
    PromptTooLong,
    Request,
    UnknownRequest,
)

__all__ = [
    "Block", "BlockQueue", "CacheConfig", "CacheError", "CacheStats", "EvictionPolicy",
    "KVCacheManager", "OutOfBlocks", "PromptTooLong", "Request", "UnknownRequest",
    "block_keys", "chain_key", "make_policy", "policy_names", "register_policy", "root_key",
    "tokens_to_bytes",
]
