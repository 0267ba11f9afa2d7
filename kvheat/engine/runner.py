"""The model runner: one forward step of a batch of sequences over the paged KV pool.

The scheduler decides what runs; the runner turns a list of `SeqBatchItem`s (each a
prefill chunk or one decode token, with the block table the cache manager gave it) into
flat token/position tensors and attention metadata, runs the model, and returns the
logits at each item's last new token. The new tokens' KV lands in the pool slots the
block tables name, so the next step (or the next request sharing the prefix) finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention_metadata import AttentionMetadata, SeqSpan, build_metadata
from .kv_pool import DeviceKVPool
from .llama import CausalLM
from .model_config import ModelConfig


@dataclass(slots=True)
class SeqBatchItem:
    """One sequence's part of a forward pass: its new tokens, its KV so far, its blocks."""

    token_ids: list[int]  # new tokens to run: a prefill chunk or one decode token
    num_computed: int  # tokens of this sequence whose KV is already in the pool
    block_table: list[int]  # pool blocks covering positions [0, num_computed + len(token_ids))


class ModelRunner:
    """Runs a model's forward passes over a batch of sequences on the paged KV pool."""

    def __init__(self, model: CausalLM, kv_pool: DeviceKVPool) -> None:
        cfg: ModelConfig = model.config
        layout = "mla" if cfg.is_mla else "gqa"
        if kv_pool.layout != layout or kv_pool.num_layers != cfg.num_hidden_layers:
            raise ValueError(f"KV pool ({kv_pool.layout}, {kv_pool.num_layers} layers) does not "
                             f"fit the model ({layout}, {cfg.num_hidden_layers} layers)")
        expect = ((cfg.kv_lora_rank + cfg.qk_rope_head_dim,) if cfg.is_mla
                  else (cfg.num_key_value_heads, cfg.head_dim))
        if tuple(kv_pool.token_shape) != expect:
            raise ValueError(f"KV pool token shape {kv_pool.token_shape} != model's {expect}")
        mdev, pdev = next(model.parameters()).device, kv_pool.device
        if mdev.type != pdev.type or (None not in (mdev.index, pdev.index) and mdev != pdev):
            raise ValueError(f"model is on {mdev} but the KV pool on {pdev}")
        self.model = model.eval()
        model.pack_weights()
        self.kv_pool = kv_pool
        self.config = cfg
        self.block_size = kv_pool.block_size
        self.device = kv_pool.device
        self.num_forward_tokens = 0  # tokens run through the model so far

    # ---- input checking -----------------------------------------------------------------
    def _spans(self, batch: Sequence[SeqBatchItem]) -> tuple[list[int], list[int], list[SeqSpan]]:
        if not batch:
            raise ValueError("empty batch")
        vocab, bs, nb = self.config.vocab_size, self.block_size, self.kv_pool.num_blocks
        max_pos = self.config.max_position_embeddings
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        for i, item in enumerate(batch):
            n = len(item.token_ids)
            if n == 0:
                raise ValueError(f"batch item {i} has no new tokens")
            if item.num_computed < 0:
                raise ValueError(f"batch item {i}: num_computed {item.num_computed} < 0")
            ctx = item.num_computed + n
            if ctx > max_pos:
                raise ValueError(f"batch item {i}: {ctx} tokens exceed max_position_embeddings "
                                 f"{max_pos}")
            need = -(-ctx // bs)
            if len(item.block_table) < need:
                raise ValueError(f"batch item {i}: {ctx} tokens need {need} blocks of {bs}, "
                                 f"block table has {len(item.block_table)}")
            table = item.block_table[:need]
            if min(table) < 0 or max(table) >= nb:
                raise ValueError(f"batch item {i}: block id outside the pool of {nb}")
            if min(item.token_ids) < 0 or max(item.token_ids) >= vocab:
                raise ValueError(f"batch item {i}: token id outside the vocabulary of {vocab}")
            spans.append(SeqSpan(len(ids), n, item.num_computed, table))
            ids.extend(item.token_ids)
            positions.extend(range(item.num_computed, ctx))
        return ids, positions, spans

    def prepare(self, batch: Sequence[SeqBatchItem]) -> tuple[torch.Tensor, torch.Tensor,
                                                              AttentionMetadata]:
        """The input ids, positions and attention metadata of a batch."""
        ids, positions, spans = self._spans(batch)
        meta = build_metadata(spans, self.block_size, self.device,  # checks slot clashes
                              share_prefixes=not self.config.is_mla)
        dev = self.device
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    # ---- running ------------------------------------------------------------------------
    @torch.inference_mode()
    def hidden_states(self, batch: Sequence[SeqBatchItem]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Final hidden states of all new tokens, and each item's (start, length) in them."""
        ids, positions, meta = self.prepare(batch)
        hidden = self.model(ids, positions, meta, self.kv_pool)
        self.num_forward_tokens += int(ids.numel())
        spans = []
        start = 0
        for item in batch:
            spans.append((start, len(item.token_ids)))
            start += len(item.token_ids)
        return hidden, spans

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqBatchItem]) -> torch.Tensor:
        """[len(batch), vocab] fp32 logits at each item's last new token."""
        hidden, spans = self.hidden_states(batch)
        last = torch.tensor([s + n - 1 for s, n in spans], device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, last))

    @torch.inference_mode()
    def forward_all_logits(self, batch: Sequence[SeqBatchItem]) -> list[torch.Tensor]:
        """fp32 logits at every new token, one [q_len, vocab] tensor per item."""
        hidden, spans = self.hidden_states(batch)
        logits = self.model.compute_logits(hidden)
        return [logits[s:s + n] for s, n in spans]
