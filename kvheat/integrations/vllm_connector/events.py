"""The scheduler half's KV events (`TierEvents`): the blocks the worker's tiers take and
lose, as vLLM's `BlockStored` / `BlockRemoved` with the tier's medium and locality, for
vLLM's own publisher (`--kv-events-config`) and so for a router."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ...kvevents.schema import tier_place

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Event details kept for keys no tier holds: just saved (not yet taken) or just left
# (moving down): more than the demotion queue holds in flight.
LEFT_KEYS = 8192


@dataclass(slots=True)
class _BlockInfo:
    """What a KV event about one key says (kept only while events are on)."""

    block_hash: Any
    parent_hash: Any
    token_ids: list[int]
    extra_keys: list[tuple[Any, ...] | None] | None
    tiers: set[str] = field(default_factory=set)


class TierEvents:
    """vLLM KV events for the tiers' keys.

    Made from the worker's reports of what the tiers took and lost; what each event says
    is kept from the save of its key."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Any] = []
        self._info: dict[bytes, _BlockInfo] = {}  # keys a tier holds
        # Keys that left every tier lately: a block moving down (host to disk) leaves
        # one tier before the next takes it, and its next event needs what it says.
        self._left: OrderedDict[bytes, _BlockInfo] = OrderedDict()
        self._held: dict[tuple[Any, str], int] = {}  # (vLLM hash, tier) -> keys holding it

    def saving(self, key: bytes, request: Request, i: int) -> None:
        """`key`, block `i` of `request`, goes to the tiers: keep what its event will say."""
        if key not in self._info:
            # Waits with the keys that left (bounded) until a tier takes it.
            self._left[key] = self._block_info(request, i)
            if len(self._left) > LEFT_KEYS:
                self._left.popitem(last=False)

    def _block_info(self, r: Request, i: int) -> _BlockInfo:
        bs = self.block_size
        extra, _ = generate_block_hash_extra_keys(r, i * bs, (i + 1) * bs, 0)
        return _BlockInfo(maybe_convert_block_hash(r.block_hashes[i]),
                          maybe_convert_block_hash(r.block_hashes[i - 1]) if i else None,
                          list(r.all_token_ids[i * bs:(i + 1) * bs]),
                          to_event_extra_keys([extra]))

    def apply(self, tier: str, key: bytes, stored: bool) -> None:
        """Turn one tier change into a vLLM KV event, when it makes one.

        An event when the first key of a vLLM block hash enters a tier, or the last leaves
        it (tenants' keys of one hash count once). Keys another replica put
        in a shared tier carry no tokens here: that replica publishes them."""
        info = self._info.get(key)
        if info is None:
            info = self._left.pop(key, None) if stored else None
            if info is None:
                return
            self._info[key] = info
        medium, locality, ownership = tier_place(tier)
        ref = (info.block_hash, tier)
        if stored and tier not in info.tiers:
            info.tiers.add(tier)
            n = self._held.get(ref, 0)
            self._held[ref] = n + 1
            if n == 0:
                self._events.append(BlockStored(
                    block_hashes=[info.block_hash], parent_block_hash=info.parent_hash,
                    token_ids=info.token_ids, block_size=self.block_size, lora_id=None,
                    medium=medium, lora_name=None, extra_keys=info.extra_keys,
                    locality=locality, ownership=ownership))
        elif not stored and tier in info.tiers:
            info.tiers.discard(tier)
            n = self._held.pop(ref, 1) - 1
            if n:
                self._held[ref] = n
            else:
                self._events.append(BlockRemoved(block_hashes=[info.block_hash],
                                                 medium=medium, locality=locality,
                                                 ownership=ownership))
            if not info.tiers:
                del self._info[key]
                self._left[key] = info
                if len(self._left) > LEFT_KEYS:
                    self._left.popitem(last=False)

    def take(self) -> list[Any]:
        """The events since the last call."""
        out, self._events = self._events, []
        return out
