"""Projections for inference on CPU: weights prepacked once for oneDNN, and the
projections that read the same input (q/k/v, gate/up) run as one GEMM.

On this kind of machine (one AVX2 core, fp32) MKL's GEMM on a plain `[out, in]` weight
does decode-sized batches (4-64 rows) at 15-25 GFLOP/s; the same product on a weight
reordered for oneDNN runs 1.3-1.7x faster, and a single row is fastest as MKL's GEMV
(bench/engine/prefix.py, docs/engine.md). vLLM's CPU backend packs its weights the same way.
The plain parameters stay in place (checkpoint names, `state_dict`, tied embeddings);
the packed copies are made by `pack` after the weights are final, and made again if
`pack` is called after a change of weights.

oneDNN builds (JIT-compiles) a kernel per row count and keeps ~0.6 MB of it in a
process-wide cache of 1,024 entries; past that it evicts and rebuilds, and memory grows
without bound (measured: 5 GB after two passes over 3-1,500 rows). A server sees every
row count from 1 to its token budget, so rows are padded up to 8 sizes per octave (at
most 1/8 more rows, ~3% on average; powers of two as they are): 78 kernels per weight up
to 4,096 rows. Running long inputs in fixed pieces instead costs 3-13% in copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows, the plain GEMV per part beats the packed GEMM.
GEMV_ROWS = 2
# The batch size oneDNN picks its weight layout for (any batch runs on it).
PACK_BATCH_HINT = 32
# Row counts up to this run as they are; above, they are padded to 8 sizes per octave.
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at.

    `rows` up to EXACT_ROWS, else rounded up to a multiple of 1/16 of the next power of two
    (at most 1/8 more rows)."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows - 1).bit_length()) >> 4
    return -(-rows // step) * step


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack `weight`: float32, on the CPU, with oneDNN available."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class PackedGemm:
    """Several linear layers' outputs side by side, from one packed GEMM.

    y = x [W_1; W_2; ...]^T + [b_1; b_2; ...]: the parts' weights concatenated and packed
    for oneDNN."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        with torch.no_grad():
            weight = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            biases = [p.bias for p in parts]
            self.bias = (None if all(b is None for b in biases) else torch.cat([
                b if b is not None else weight.new_zeros(p.out_features)
                for b, p in zip(biases, parts, strict=True)]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= GEMV_ROWS:
            outs = [F.linear(x, p.weight, p.bias) for p in self.parts]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        padded = padded_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if padded == rows else out[:rows]


def fused_projection(x: torch.Tensor, gemm: PackedGemm | None,
                     parts: list[nn.Linear]) -> list[torch.Tensor]:
    """Each part's projection of x: through the packed GEMM when there is one."""
    if gemm is None:
        return [p(x) for p in parts]
    return list(gemm(x).split(gemm.sizes, dim=-1))


def project(x: torch.Tensor, gemm: PackedGemm | None, layer: nn.Linear) -> torch.Tensor:
    """`layer(x)`, through its packed GEMM when it has one."""
    return layer(x) if gemm is None else gemm(x)


def make_gemm(parts: list[nn.Linear]) -> PackedGemm | None:
    """A packed GEMM over `parts`, or None where oneDNN packing does not apply.

    GPU, half precision, no oneDNN: then the layers run as they are."""
    if not all(packable(p.weight) for p in parts):
        return None
    return PackedGemm(parts)
