"""vLLM's paged KV as kvheat's `DeviceBlocks`: one block of every layer in one tensor.

vLLM gives a KV connector one tensor per attention layer (`register_kv_caches`). Their
block dimension depends on the attention backend: the first one on CPU
(`[blocks, kv heads, block size, 2 x head size]`) and for MLA (`[blocks, block size,
latent + rope]`), the second one behind a K/V split (`[2, blocks, ...]`, FlashAttention's).
A backend whose kernel blocks are smaller than the scheduler's blocks has a whole number of
them per block. `VLLMDeviceBlocks` finds that dimension per layer and gathers block `i` of
every layer into one `[layers, ...]` tensor for the tiers (`block_view`), and scatters
one back (`write_block`). Layers that share one tensor (cross-layer KV sharing) are kept
once. Needs no vLLM import: it sees tensors only.

A gathered block is a copy, not a view of the pool, so a tier that reads straight into
`block_view`'s tensor (the host tier's batched read) would fill the copy only: loads run
inside `writing_back()`, which writes every tensor handed out meanwhile back into its
block at the end (per thread: a loader thread's views never catch the engine's saves).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping

import torch

LAYOUTS = ("gqa", "mla")


class VLLMDeviceBlocks:
    """kvheat's `DeviceBlocks` (kvheat/tiers/store.py) over vLLM's per-layer KV tensors."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int,
                 layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout
        # (tensor, block dimension, kernel blocks per block), one per distinct tensor.
        self._layers: list[tuple[torch.Tensor, int, int]] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        shape: tuple[int, ...] | None = None
        for name, t in kv_caches.items():
            ident = (t.data_ptr(), tuple(t.shape))
            if ident in seen:
                continue
            seen.add(ident)
            dim, per = _block_dim(name, t, num_blocks)
            one = tuple(t.narrow(dim, 0, per).shape)
            if shape is None:
                shape, self.dtype = one, t.dtype
            elif one != shape or t.dtype != self.dtype:
                raise ValueError(
                    f"KV layer {name} holds blocks of {one} {t.dtype}, the first layer "
                    f"{shape} {self.dtype}: layers of different KV shapes (a hybrid model) "
                    "are not supported")
            self._layers.append((t, dim, per))
        if shape is None:
            raise ValueError("no KV cache tensors to register")
        self.block_shape = (len(self._layers), *shape)
        self.bytes_per_block = math.prod(self.block_shape) * self.dtype.itemsize
        self._local = threading.local()  # .lent: block id -> tensor handed out, or None

    @property
    def num_layers(self) -> int:
        """The KV tensors a block spans."""
        return len(self._layers)

    def describe(self) -> str:
        """The stored format of one block (names what the tiers hold, with the model)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"vllm-{self.layout}-b{self.block_size}-{dtype}-" + \
            "x".join(str(d) for d in self.block_shape)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside vLLM's pool of {self.num_blocks}")

    @contextlib.contextmanager
    def writing_back(self) -> Iterator[None]:
        """Write back, at the end, each tensor `block_view` hands out within it.

        On this thread: each one is written into its block as filled by then; a
        `write_block` of that block meanwhile supersedes it."""
        lent: dict[int, torch.Tensor] = {}
        self._local.lent = lent
        try:
            yield
        finally:
            self._local.lent = None
            for block_id, data in lent.items():
                self.write_block(block_id, data)

    def block_view(self, block_id: int) -> torch.Tensor:
        """Block `block_id` of every layer, copied into one contiguous tensor."""
        self._check(block_id)
        out = torch.empty(self.block_shape, dtype=self.dtype)
        for i, (t, dim, per) in enumerate(self._layers):
            out[i].copy_(t.narrow(dim, block_id * per, per))
        lent = getattr(self._local, "lent", None)
        if lent is not None:
            lent[block_id] = out
        return out

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Scatter `data` (a `block_view`'s shape and dtype) into block `block_id`."""
        self._check(block_id)
        if tuple(data.shape) != self.block_shape or data.dtype != self.dtype:
            raise ValueError(f"a block is {self.block_shape} {self.dtype}, not "
                             f"{tuple(data.shape)} {data.dtype}")
        lent = getattr(self._local, "lent", None)
        if lent is not None:
            lent.pop(block_id, None)
        for i, (t, dim, per) in enumerate(self._layers):
            t.narrow(dim, block_id * per, per).copy_(data[i])


def _block_dim(name: str, t: torch.Tensor, num_blocks: int) -> tuple[int, int]:
    """(the dimension of `t` that indexes blocks, kernel blocks per scheduler block)."""
    def fits(dim: int) -> bool:
        return t.dim() > dim + 1 and t.shape[dim] >= num_blocks and \
            t.shape[dim] % num_blocks == 0

    kv_split = t.shape[0] == 2 and fits(1)
    if kv_split and fits(0):  # [2, 2, ...] over a pool of 1 or 2 blocks: either reading
        raise ValueError(f"KV layer {name} of shape {tuple(t.shape)} over a pool of "
                         f"{num_blocks} blocks: cannot tell its block dimension")
    if kv_split:
        return 1, t.shape[1] // num_blocks
    if fits(0):
        return 0, t.shape[0] // num_blocks
    raise ValueError(f"KV layer {name} of shape {tuple(t.shape)}: no dimension indexes "
                     f"the {num_blocks} blocks of vLLM's pool (expected [blocks, ...] or "
                     "[2, blocks, ...])")
