"""The packed CPU projections: the same products as the plain layers at every row count,
on a bounded set of oneDNN kernel shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvheat.engine.linear import EXACT_ROWS, make_gemm, padded_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def test_padded_rows_are_few_and_waste_at_most_an_eighth() -> None:
    sizes = {padded_rows(m) for m in range(1, 4097)}
    assert len(sizes) <= 80
    for m in range(1, 4097):
        p = padded_rows(m)
        assert m <= p <= 4096
        assert p == m if m <= EXACT_ROWS else (p - m) / m <= 1 / 8


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 33, 100, 512, 513, 1100])
def test_packed_projection_matches_the_plain_layers(rows: int) -> None:
    torch.manual_seed(rows)
    parts = [nn.Linear(64, 48), nn.Linear(64, 16, bias=False)]
    gemm = make_gemm(parts)
    assert gemm is not None
    x = torch.randn(rows, 64)
    want = torch.cat([F.linear(x, p.weight, p.bias) for p in parts], dim=-1)
    got = gemm(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
