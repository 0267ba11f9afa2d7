"""Attention metadata: where a step's new tokens write their KV, and which pool blocks
each sequence reads (`build_metadata`), once per step for all layers.

A step runs a flat list of new tokens from several sequences. Each sequence has
`num_computed` tokens whose KV already lies in the pool and `q_len` new tokens at
positions `num_computed ...`. Prefills (q_len > 1, or a first token) get their block
table as a tensor and, on a cached prefix, a causal mask offset by it; decodes (q_len ==
1) are batched, padded to the longest table, and decodes whose tables start alike may
share one read of that prefix (`SharedPrefix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the 0 / -inf bias SDPA adds to the scores."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


@dataclass(slots=True)
class SeqSpan:
    """One sequence's part of a step: its new tokens, its KV so far and its block table."""

    q_start: int  # offset of the sequence's first new token in the flat token list
    q_len: int
    num_computed: int  # KV already in the pool before this step
    # blocks covering num_computed + q_len tokens; a list from the caller, made an int64
    # tensor on the pool's device by build_metadata for the prefills that read it
    block_table: torch.Tensor | list[int]
    # bool [q_len, context_len] for a prefill on a cached prefix, built once per step by
    # build_metadata and shared by all layers (None: no prefix, plain causal)
    prefix_mask: torch.Tensor | None = None
    prefix_bias: torch.Tensor | None = None  # the mask as 0 / -inf of the model's dtype

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`prefix_mask` as an additive bias of `dtype` (None without a prefix).

        Made on the first layer and reused by the others (SDPA converts a bool mask on every
        call)."""
        if self.prefix_mask is None:
            return None
        if self.prefix_bias is None or self.prefix_bias.dtype != dtype:
            self.prefix_bias = _additive_bias(self.prefix_mask, dtype)
        return self.prefix_bias

    @property
    def context_len(self) -> int:
        """Tokens the sequence's new tokens attend to: its KV so far plus themselves."""
        return self.num_computed + self.q_len

    @property
    def device_table(self) -> torch.Tensor:
        """The block table as build_metadata leaves it for a prefill: an int64 tensor."""
        if not isinstance(self.block_table, torch.Tensor):
            raise TypeError("build_metadata has not made this span's block table a tensor")
        return self.block_table


@dataclass(slots=True)
class SharedPrefix:
    """Decode sequences whose block tables begin with the same blocks.

    A shared system prompt, one conversation's turns: the prefix's K/V is gathered once and
    all their queries attend to it in one call, instead of once per sequence."""
    rows: torch.Tensor  # int64 [m]: rows of these sequences in the decode batch
    blocks: torch.Tensor  # int64 [P]: the shared blocks, in order


# A shared prefix is attended separately when it saves re-reading at least this many
# tokens' K/V; below that the extra call and the merge cost more than they save.
MIN_SHARED_TOKENS_SAVED = 128


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's KV goes, and which pool blocks each sequence reads."""
    block_size: int
    slot_mapping: torch.Tensor  # int64 [tokens]: block_id * block_size + offset
    prefills: list[SeqSpan]  # sequences with q_len > 1, or a first token with no context
    decode_index: torch.Tensor  # int64 [D]: flat index of each decode token
    # int64 [D, max_blocks], padded with block 0: the blocks each decode reads itself,
    # i.e. after the prefix it shares with others (decode_shared), all of them otherwise
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor  # int64 [D]
    # bool [D, 1, 1, max_blocks * block_size]: keys of decode_block_tables each decode
    # sees (None: every key)
    decode_mask: torch.Tensor | None
    decode_shared: list[SharedPrefix] = field(default_factory=list)
    _decode_bias: torch.Tensor | None = None

    @property
    def num_decodes(self) -> int:
        """Decode sequences in the step."""
        return int(self.decode_index.numel())

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """decode_mask as an additive 0 / -inf bias, made once per step and dtype."""
        if self.decode_mask is None:
            return None
        if self._decode_bias is None or self._decode_bias.dtype != dtype:
            self._decode_bias = _additive_bias(self.decode_mask, dtype)
        return self._decode_bias


def build_metadata(spans: list[SeqSpan], block_size: int, device: torch.device,
                   share_prefixes: bool = False) -> AttentionMetadata:
    """The slot mapping and per-path views of a step's spans.

    Plain Python arithmetic: a decode step is many one-token sequences, for which tensor ops
    per sequence cost more than the step's attention. `share_prefixes`: find decodes whose
    tables start alike (`SharedPrefix`); only the GQA decode path reads them."""
    slots: list[int] = []
    prefills: list[SeqSpan] = []
    decodes: list[tuple[SeqSpan, list[int]]] = []
    bs = block_size
    for s in spans:
        table = s.block_table.tolist() if isinstance(s.block_table, torch.Tensor) \
            else list(s.block_table)
        start = s.num_computed
        if s.q_len == 1:
            slots.append(table[start // bs] * bs + start % bs)
        else:
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, s.context_len))
        if s.q_len == 1 and s.num_computed > 0:
            decodes.append((s, table[:-(-s.context_len // bs)]))
        else:
            s.block_table = torch.tensor(table, dtype=torch.int64, device=device)
            if s.num_computed > 0:
                s.prefix_mask = causal_offset_mask(s.q_len, s.num_computed, device)
            prefills.append(s)
    if len(set(slots)) != len(slots):
        raise ValueError("two new tokens of this batch would write the same KV slot")
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    if not decodes:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return AttentionMetadata(bs, slot_mapping, prefills, empty,
                                 torch.zeros(0, 1, dtype=torch.int64, device=device), empty, None)
    shared, skip = _shared_prefixes(decodes, bs) if share_prefixes else ([], [0] * len(decodes))
    own = [t[k:] for (_, t), k in zip(decodes, skip, strict=True)]
    max_blocks = max(len(t) for t in own)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in own], dtype=torch.int64)
    lens = [s.context_len for s, _ in decodes]
    own_lens = torch.tensor([n - k * bs for n, k in zip(lens, skip, strict=True)],
                            dtype=torch.int64)
    mask = None
    if int(own_lens.min()) != max_blocks * bs:
        keys = torch.arange(max_blocks * bs)
        mask = (keys[None, :] < own_lens[:, None])[:, None, None, :].to(device)
    index = torch.tensor([s.q_start for s, _ in decodes], dtype=torch.int64, device=device)
    groups = [SharedPrefix(torch.tensor(rows, dtype=torch.int64, device=device),
                           torch.tensor(blocks, dtype=torch.int64, device=device))
              for rows, blocks in shared]
    return AttentionMetadata(bs, slot_mapping, prefills, index, tables.to(device),
                             torch.tensor(lens, dtype=torch.int64, device=device), mask,
                             groups)


def _shared_prefixes(decodes: list[tuple[SeqSpan, list[int]]], bs: int
                     ) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Group decodes by their first block; each group shares its tables' longest common
    run of leading blocks that lie wholly before every member's new token. Returns the
    groups worth a call of their own (rows, blocks) and, per decode, how many leading
    blocks its group covers (0 outside one)."""
    by_first: dict[int, list[int]] = {}
    for row, (_, table) in enumerate(decodes):
        by_first.setdefault(table[0], []).append(row)
    skip = [0] * len(decodes)
    groups: list[tuple[list[int], list[int]]] = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        tables = [decodes[r][1] for r in rows]
        limit = min((decodes[r][0].context_len - 1) // bs for r in rows)
        first = tables[0]
        n = limit
        for t in tables[1:]:
            if t[:n] != first[:n]:  # a slice compare runs in C; scan only where it fails
                n = next(i for i in range(n) if t[i] != first[i])
        if n * bs * (len(rows) - 1) < MIN_SHARED_TOKENS_SAVED:
            continue
        groups.append((rows, first[:n]))
        for r in rows:
            skip[r] = n
    return groups, skip


def causal_offset_mask(q_len: int, num_computed: int, device: torch.device,
                        first: int = 0) -> torch.Tensor:
    """The causal mask of `q_len` new tokens after `num_computed + first` earlier ones.

    bool [q_len, num_computed + first + q_len]: new token `first + i` (at position
    num_computed + first + i) sees keys up to its own position."""
    end = num_computed + first + q_len
    q_pos = torch.arange(num_computed + first, end, device=device)
    return torch.arange(end, device=device)[None, :] <= q_pos[:, None]
