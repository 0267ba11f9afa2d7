"""Host tier: one preallocated byte pool cut into fixed slots (pinned when CUDA is present,
so device<->host copies can run asynchronously). Puts and gets are `torch` copies into and
out of a slot; nothing is allocated per block. Every get re-checks the slot's xxh3-64
checksum taken at put time, so a stray write into the pool is a counted miss.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import xxhash

from .store import KVStore, copy_out

_ALIGN = 64  # slot starts stay aligned for any dtype and for cache lines


@dataclass(slots=True)
class _Entry:
    slot: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    ns: bytes
    checksum: int


class _SlotView:
    """A slot's typed tensor view and its byte view, kept while the entry layout is the
    same (every block of one model has the same), so a put or get builds no new views."""

    __slots__ = ("dtype", "shape", "tensor", "raw")

    def __init__(self, row: torch.Tensor, nbytes: int, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape
        self.tensor = row[:nbytes].view(dtype).view(shape)
        self.raw = memoryview(row[:nbytes].numpy())


class HostStore(KVStore):
    name = "host"
    inline = True

    def __init__(self, capacity_bytes: int, slot_bytes: int, model: str = "model",
                 layout: str = "kv", pin: bool | None = None, verify: bool = True) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be positive")
        slot = -(-slot_bytes // _ALIGN) * _ALIGN
        n_slots = capacity_bytes // slot
        if n_slots < 1:
            raise ValueError(f"{capacity_bytes} bytes hold no slot of {slot} bytes")
        super().__init__(n_slots * slot, model, layout)
        self.slot_bytes = slot
        self.num_slots = n_slots
        self.verify = verify
        pin = torch.cuda.is_available() if pin is None else pin
        self.pool = torch.empty((n_slots, slot), dtype=torch.uint8, pin_memory=pin)
        self.free_slots = list(range(n_slots - 1, -1, -1))
        self.entries: dict[bytes, _Entry] = {}
        self._rows = list(self.pool.unbind(0))
        self._views: list[_SlotView | None] = [None] * n_slots
        self._lock = threading.Lock()

    def used_bytes(self) -> int:
        return len(self.entries) * self.slot_bytes

    def entry_bytes(self, kv: torch.Tensor, key: bytes) -> int:
        return self.slot_bytes

    def _view(self, slot: int, nbytes: int, dtype: torch.dtype,
              shape: tuple[int, ...]) -> _SlotView:
        v = self._views[slot]
        if v is None or v.dtype != dtype or v.shape != shape:
            v = self._views[slot] = _SlotView(self._rows[slot], nbytes, dtype, shape)
        return v

    def _put(self, key: bytes, kv: torch.Tensor, salt: str | None) -> bool:
        nbytes = kv.numel() * kv.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"a value of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        shape = kv.shape  # torch.Size is a tuple
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                slot = old.slot
            elif self.free_slots:
                slot = self.free_slots.pop()
            else:
                return False
            v = self._view(slot, nbytes, kv.dtype, shape)
            v.tensor.copy_(kv)
            # A chunked copy-then-hash (hashing each chunk while cached) measured no faster.
            csum = xxhash.xxh3_64_intdigest(v.raw) if self.verify else 0
            self.entries[key] = _Entry(slot, nbytes, kv.dtype, shape, self.ns(salt), csum)
            return True

    def _get(self, key: bytes, salt: str | None, out: torch.Tensor | None) -> torch.Tensor | None:
        with self._lock:
            e = self.entries.get(key)
            if e is None:
                return None
            if e.ns != self.ns(salt):
                self._count_corrupt("key", key, "stored for another namespace")
                return None
            v = self._view(e.slot, e.nbytes, e.dtype, e.shape)
            if self.verify and xxhash.xxh3_64_intdigest(v.raw) != e.checksum:
                self._count_corrupt("checksum", key, "host slot changed since put")
                del self.entries[key]
                self.free_slots.append(e.slot)
                return None
            return copy_out(v.tensor, out)

    def contains(self, key: bytes, salt: str | None = None) -> bool:
        e = self.entries.get(key)
        return e is not None and e.ns == self.ns(salt)

    def delete(self, key: bytes, salt: str | None = None) -> bool:
        with self._lock:
            e = self.entries.pop(key, None)
            if e is None:
                return False
            self.free_slots.append(e.slot)
            self.stats.deletes += 1
            return True

    def stored(self) -> Iterable[tuple[bytes, bytes]]:
        with self._lock:
            return [(k, e.ns) for k, e in self.entries.items()]
