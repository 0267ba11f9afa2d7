"""Swap preemption's host side: a preempted sequence's blocks, copied off the device pool
and written back when it resumes (the scheduler's `SwapSpace`)."""

from __future__ import annotations

import torch

from .kv_pool import DeviceKVPool


class HostSwapSpace:
    """Preempted sequences' blocks, copied to host memory (a bounded number of blocks)."""

    def __init__(self, pool: DeviceKVPool, capacity_blocks: int) -> None:
        self.pool = pool
        self.capacity_blocks = capacity_blocks
        self.saved: dict[str, list[torch.Tensor]] = {}
        self.num_blocks = 0
        self.swapped_out = 0
        self.swapped_in = 0

    def swap_out(self, seq_id: str, block_ids: list[int]) -> int:
        self.discard(seq_id)
        n = min(len(block_ids), self.capacity_blocks - self.num_blocks)
        copies = [self.pool.block_view(b).to("cpu", copy=True) for b in block_ids[:n]]
        if copies:
            self.saved[seq_id] = copies
            self.num_blocks += n
            self.swapped_out += n
        return n

    def swap_in(self, seq_id: str, first_block: int, block_ids: list[int]) -> None:
        copies = self.saved.pop(seq_id)
        self.num_blocks -= len(copies)
        for src, dst in zip(copies[first_block:], block_ids, strict=False):
            self.pool.write_block(dst, src)
            self.swapped_in += 1

    def discard(self, seq_id: str) -> None:
        copies = self.saved.pop(seq_id, None)
        if copies is not None:
            self.num_blocks -= len(copies)

