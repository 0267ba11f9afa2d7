"""The block cache: blocks, prefix hashing, the manager, the policy interface (with the
plugin registry that finds kvheat.heat's policies by name) and baseline eviction policies
(classic.py, lirs.py, lecar.py).

No torch here: this layer runs anywhere, including the trace replayer.
"""

from . import classic, lecar, lirs  # noqa: F401  (register the baseline policies)
from .block import Block
from .eviction import PARKED, EvictionPolicy, make_policy, policy_names, register_policy
from .ghost import Ghost
from .hashing import block_keys, chain_key, root_key, tokens_to_bytes
from .hints import Outcome
from .manager import KVCacheManager
from .node import Node, NodeQueue, PolicyRecord
from .request import (
    CacheConfig,
    CacheError,
    CacheStats,
    OutOfBlocks,
    PromptTooLong,
    Request,
    UnknownRequest,
    hit_rate,
)

__all__ = [
    "PARKED", "Block", "CacheConfig", "CacheError", "CacheStats", "EvictionPolicy",
    "Ghost", "KVCacheManager", "Node", "NodeQueue", "OutOfBlocks", "Outcome", "PolicyRecord",
    "PromptTooLong", "Request", "UnknownRequest",
    "block_keys", "chain_key", "hit_rate", "make_policy", "policy_names", "register_policy",
    "root_key", "tokens_to_bytes",
]
