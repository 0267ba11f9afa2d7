"""The wire schema of KV cache events: vLLM 0.32's (`vllm/distributed/kv_events.py`).

A publisher sends ZMQ multipart messages (topic, sequence number as 8 big-endian bytes,
payload); the payload is a msgpack `KVEventBatch` = [ts, events, data_parallel_rank]; each
event is a map tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). The
structs below are defined here (msgspec, as vLLM does) with vLLM's field names, order,
defaults and tags, so a consumer of vLLM's events decodes kvheat's and the other way round;
unknown fields (a newer vLLM) are ignored on decode.

kvheat's use of the fields:
- `block_hashes` / `parent_block_hash`: the cache's chained 16-byte keys (xxh3-128 over the
  parent key and the block's tokens, rooted at a digest of the tenant's salt), so a key
  names one tenant's prefix and nothing else.
- `token_ids`: empty unless the publisher runs in operator mode (`token_ids=True`): a key
  says which prefix, never what it holds.
- `block_size`: tokens per block; a block's token count.
- `medium` / `locality` / `ownership`: where the block lives: the engine's pool is `GPU`
  (vLLM's name for it, whatever the device), the host tier `CPU`, disk `STORAGE` (LOCAL),
  the shared Redis tier `STORAGE` with locality `REMOTE`; `ownership` names the tier.
- `data_parallel_rank`: the A/B arm's index on a server with several arms (each arm is its
  own engine, as a vLLM data-parallel rank is).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"
# Replay socket: a request whose start sequence is all ones asks a kvheat publisher for a
# snapshot (AllBlocksCleared, then every block it holds, on the PUB socket). vLLM's
# publisher answers it with no batch (no sequence is that large), so asking is harmless.
SNAPSHOT_SEQ = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes | int
# One extra key of a block (vLLM: the LoRA name, multimodal hashes and offsets, the cache
# salt): scalars, or one level of tuple. Typed so that a hostile batch nested deeper fails
# validation at depth 3 instead of recursing (an `Any` here decodes any depth).
_Scalar = str | int | float | bool | None
ExtraKey = _Scalar | tuple[_Scalar, ...]
# The largest payload a subscriber decodes (vLLM's batches of thousands of blocks with
# token ids are a few MB).
MAX_BATCH_BYTES = 64 << 20


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events: its time, its events and the publisher's data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV events."""


class BlockStored(KVCacheEvent):
    """Blocks stored: their keys, their parent's key and what vLLM's event carries of them."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[ExtraKey, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks removed from a medium."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher (or rank) is gone."""


class KVEventBatch(EventBatch):
    """A batch of kvheat's (and vLLM's) KV cache events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of `batch`."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes.

    Anything else raises `msgspec.DecodeError` (a subclass of ValueError). msgpack carries
    data only: nothing is executed on decode."""
    return _decoder.decode(payload)


def tier_place(tier_name: str) -> tuple[str, str, str | None]:
    """(medium, locality, ownership) of a kvheat tier by its store's name."""
    if tier_name == "device":
        return MEDIUM_GPU, LOCAL, None
    if tier_name == "host":
        return MEDIUM_CPU, LOCAL, "host"
    if tier_name == "redis":
        return MEDIUM_STORAGE, REMOTE, "redis"
    return MEDIUM_STORAGE, LOCAL, tier_name
