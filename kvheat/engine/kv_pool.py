"""The device KV pool: the engine's paged KV buffer, one tensor for all layers.

Block `b` of the pool holds the KV of `block_size` consecutive tokens of whatever
sequence the cache manager gave it to, for every layer. Layouts:

- GQA (Llama family): `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`, K then V;
- MLA (DeepSeek family): `[layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`,
  the compressed latent then the rotated rope key, nothing else.

`read_block` / `write_block` move one block (all layers) out and in, for the lower tiers
(kvheat.tiers).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class _KVShape(Protocol):  # what the pool needs of a model config
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def is_mla(self) -> bool: ...


class DeviceKVPool:
    """The device's paged KV memory: one tensor of blocks for every layer."""

    def __init__(self, layout: str, num_layers: int, num_blocks: int, block_size: int,
                 token_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if layout not in ("gqa", "mla"):
            raise ValueError(f"layout must be 'gqa' or 'mla', not {layout!r}")
        if num_blocks <= 0 or block_size <= 0 or num_layers <= 0:
            raise ValueError("num_layers, num_blocks and block_size must be positive")
        self.layout = layout
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.token_shape = token_shape  # (kv_heads, head_dim) or (latent_width,)
        self.dtype = dtype
        self.device = torch.device(device)
        if layout == "gqa":
            shape = (num_layers, 2, num_blocks, block_size, *token_shape)
        else:
            shape = (num_layers, num_blocks, block_size, *token_shape)
        # Zeroed, not empty: a slot never written must not feed NaNs through a masked-out
        # attention weight of exactly zero (0 * NaN = NaN).
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self._block_views: list[torch.Tensor] | None = None  # block_view's, made on first use
        per_token = 1
        for s in token_shape:
            per_token *= s
        width = 2 * per_token if layout == "gqa" else per_token
        self.bytes_per_token = num_layers * width * self.kv.element_size()
        self.bytes_per_block = self.bytes_per_token * block_size

    # ---- construction -----------------------------------------------------------------
    @staticmethod
    def _layout_of(cfg: _KVShape) -> tuple[str, tuple[int, ...]]:
        if cfg.is_mla:
            return "mla", (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
        return "gqa", (cfg.num_key_value_heads, cfg.head_dim)

    @classmethod
    def for_model(cls, cfg: Any, num_blocks: int, block_size: int = 16,
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> DeviceKVPool:
        """A pool of `num_blocks` blocks laid out for the model of config `cfg`."""
        layout, token_shape = cls._layout_of(cfg)
        return cls(layout, cfg.num_hidden_layers, num_blocks, block_size, token_shape,
                   dtype, device)

    @classmethod
    def block_bytes(cls, cfg: Any, block_size: int, dtype: torch.dtype) -> int:
        """The bytes one block of the model of config `cfg` takes, all layers."""
        layout, token_shape = cls._layout_of(cfg)
        per_token = 1
        for s in token_shape:
            per_token *= s
        width = 2 * per_token if layout == "gqa" else per_token
        return cfg.num_hidden_layers * width * block_size * torch.empty(
            (), dtype=dtype).element_size()

    @classmethod
    def from_memory_budget(cls, cfg: Any, budget_bytes: int, block_size: int = 16,
                           dtype: torch.dtype = torch.float32,
                           device: torch.device | str = "cpu") -> DeviceKVPool:
        """As many blocks as fit in `budget_bytes` (at least one, or a clear error)."""
        per_block = cls.block_bytes(cfg, block_size, dtype)
        n = budget_bytes // per_block
        if n < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no block "
                             f"({per_block} bytes each)")
        return cls.for_model(cfg, int(n), block_size, dtype, device)

    # ---- per-layer views (the attention kernels read and write these) -------------------
    def gqa_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        if self.layout != "gqa":
            raise ValueError(f"a {self.layout} pool has no separate K and V")
        return self.kv[layer, 0], self.kv[layer, 1]

    def mla_layer(self, layer: int) -> torch.Tensor:
        """The latent cache of one layer, [num_blocks, block_size, width]."""
        if self.layout != "mla":
            raise ValueError(f"a {self.layout} pool has no latent cache")
        return self.kv[layer]

    @property
    def total_bytes(self) -> int:
        """The bytes the pool's KV tensor takes."""
        return self.kv.numel() * self.kv.element_size()

    # ---- one block, all layers: for tier transfers -------------------------------------
    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the pool of {self.num_blocks}")

    def block_view(self, block_id: int) -> torch.Tensor:
        """A (strided) view of one block's KV in all layers; no copy."""
        self._check_block(block_id)
        views = self._block_views
        if views is None:
            # Built once, by one `unbind`: indexing the pool costs about 5 us a call, as
            # much as copying an 8 KiB block, and a tier load takes one view a block.
            views = self._block_views = list(self.kv.unbind(2 if self.layout == "gqa" else 1))
        return views[block_id]

    def read_block(self, block_id: int) -> torch.Tensor:
        """A contiguous copy of one block's KV, all layers.

        GQA [layers, 2, block_size, kv_heads, head_dim], MLA [layers, block_size, width]."""
        return self.block_view(block_id).contiguous()

    def read_block_bytes(self, block_id: int) -> bytes:
        """One block's KV as bytes (`read_block`, on the host)."""
        t = self.read_block(block_id).cpu()
        return t.view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Overwrite one block's KV with `data` as `read_block` (or `read_block_bytes`) returned it.

        A wrong size or shape raises and leaves the pool unchanged."""
        view = self.block_view(block_id)
        if isinstance(data, (bytes, bytearray, memoryview)):
            if len(data) != self.bytes_per_block:
                raise ValueError(f"block data has {len(data)} bytes, expected "
                                 f"{self.bytes_per_block}")
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            data = raw.view(self.dtype).view(view.shape)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"block data must be a tensor or bytes, not {type(data).__name__}")
        if tuple(data.shape) != tuple(view.shape):
            raise ValueError(f"block data has shape {tuple(data.shape)}, expected "
                             f"{tuple(view.shape)}")
        view.copy_(data.to(device=self.device, dtype=self.dtype))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's KV onto another (copy-on-write of a shared partial block)."""
        self.block_view(dst).copy_(self.block_view(src))

    def __repr__(self) -> str:
        return (f"DeviceKVPool({self.layout}, layers={self.num_layers}, "
                f"blocks={self.num_blocks}x{self.block_size}, {self.dtype}, "
                f"{self.total_bytes / 2**20:.1f} MiB on {self.device})")
