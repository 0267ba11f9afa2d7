"""KV cache events in vLLM 0.32's wire schema: the schema, a ZMQ publisher that never
blocks the thread changing the cache, and a subscriber that repairs gaps.

Needs pyzmq and msgspec (`pip install kvheat[server]` or `kvheat[router]`).
"""

from .attach import attach, snapshot_items
from .publisher import KVEventPublisher, PublisherConfig, PublisherStats
from .schema import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from .subscriber import KVEventSubscriber, SubscriberStats

__all__ = [
    "LOCAL", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "REMOTE", "AllBlocksCleared",
    "BlockRemoved", "BlockStored", "KVEventBatch", "KVEventPublisher", "KVEventSubscriber",
    "PublisherConfig", "PublisherStats", "SubscriberStats", "attach", "decode_batch",
    "encode_batch", "snapshot_items",
]
