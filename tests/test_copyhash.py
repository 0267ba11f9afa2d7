"""The host tier's C kernel (kvheat.tiers._copyhash): a copy and its xxh3-64 in one pass.

Each kernel must copy exactly the bytes torch would and return what `xxhash` returns for
them, for every length (xxh3's short and long paths, stripe and block edges), every layout
the host tier hands it (one run, runs at a stride on either side) and any alignment; and
refuse arguments it cannot use with an error, never a crash."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import xxhash
from conftest import unavailable
from hypothesis import given, settings
from hypothesis import strategies as st

from kvheat.tiers import host

# Lengths around xxh3's edges: its short paths (<= 240 bytes), a stripe (64), a block of
# stripes (1024), the copy-then-hash piece (16 KiB), and multi-MiB blocks.
ROW_BYTES = [0, 1, 63, 64, 128, 240, 256, 1000, 1024, 1088, 16384, 16448, 65536, 1 << 20]


def _bytes(t: torch.Tensor, offset: int, rows: int, row_bytes: int, stride: int) -> bytes:
    return b"".join(t[offset + r * stride:offset + r * stride + row_bytes].numpy().tobytes()
                    for r in range(rows))


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_kernels_copy_and_hash_like_torch_and_xxhash(copy_kernel: str, rows: int) -> None:
    ext = host._copyhash
    assert ext is not None and ext.kernel() == copy_kernel
    draw = random.Random(rows)
    sizes = ROW_BYTES + [64 * draw.randint(1, 700) for _ in range(4)] + \
        [draw.randint(1, 50_000) for _ in range(4)]
    for row_bytes in sizes:
        if rows * row_bytes > 8 << 20:
            continue
        gap = draw.choice([0, 7, 64, 4096])
        src_stride, dst_stride = row_bytes + gap, row_bytes + gap + 3
        src = torch.randint(0, 256, (rows * src_stride + 8,), dtype=torch.uint8)
        dst = torch.zeros(rows * dst_stride + 8, dtype=torch.uint8)
        so, do = draw.randint(0, 7), draw.randint(0, 7)  # any alignment
        h = ext.copy(rows, row_bytes, dst_stride, src_stride, dst.data_ptr() + do,
                     src.data_ptr() + so)
        want = _bytes(src, so, rows, row_bytes, src_stride)
        assert _bytes(dst, do, rows, row_bytes, dst_stride) == want, (rows, row_bytes)
        assert h == xxhash.xxh3_64_intdigest(want), (rows, row_bytes)
        # Bytes between the runs are left alone.
        assert dst[:do].eq(0).all() and dst[do + (rows - 1) * dst_stride + row_bytes:].eq(0).all()
        again = torch.zeros_like(dst)
        hs = ext.copy_many(rows, row_bytes, dst_stride, src_stride,
                           [again.data_ptr() + do, dst.data_ptr() + do],
                           [src.data_ptr() + so] * 2)
        assert hs == [h, h] and torch.equal(again, dst)


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 9), stripes=st.integers(0, 70), tail=st.integers(0, 63),
       gaps=st.tuples(st.integers(0, 200), st.integers(0, 200)), kernel=st.sampled_from(
           ["avx2", "portable"]), seed=st.integers(0, 2**32 - 1))
def test_any_layout_copies_and_hashes_like_xxhash(rows: int, stripes: int, tail: int,
                                                 gaps: tuple[int, int], kernel: str,
                                                 seed: int) -> None:
    ext = host._copyhash
    if ext is None:
        unavailable("kvheat.tiers._copyhash is not built")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(host.copy_path(kernel))
        except ValueError:
            return  # no AVX2 on this CPU: the portable examples still run
        row_bytes = 64 * stripes + tail
        src_stride, dst_stride = row_bytes + gaps[0], row_bytes + gaps[1]
        gen = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 256, (rows * src_stride + 1,), dtype=torch.uint8, generator=gen)
        dst = torch.zeros(rows * dst_stride + 1, dtype=torch.uint8)
        h = ext.copy(rows, row_bytes, dst_stride, src_stride, dst.data_ptr(), src.data_ptr())
        want = _bytes(src, 0, rows, row_bytes, src_stride)
        assert _bytes(dst, 0, rows, row_bytes, dst_stride) == want
        assert h == xxhash.xxh3_64_intdigest(want)


def test_kernel_refuses_what_it_cannot_use(copy_kernel: str) -> None:
    ext = host._copyhash
    assert ext is not None
    a, b = torch.zeros(4096, dtype=torch.uint8), torch.ones(4096, dtype=torch.uint8)
    pa, pb = a.data_ptr(), b.data_ptr()
    with pytest.raises(ValueError, match="bad layout"):
        ext.copy(0, 64, 64, 64, pa, pb)  # no rows
    with pytest.raises(ValueError, match="bad layout"):
        ext.copy(2, 64, 32, 64, pa, pb)  # rows that overlap
    with pytest.raises(OverflowError, match="more bytes"):
        ext.copy(1 << 40, 1 << 30, 1 << 30, 1 << 30, pa, pb)
    with pytest.raises(ValueError, match="null address"):
        ext.copy(1, 64, 64, 64, 0, pb)
    with pytest.raises(TypeError, match="6 arguments"):
        ext.copy(1, 64, 64, 64, pa)
    with pytest.raises(TypeError):
        ext.copy(1, "64", 64, 64, pa, pb)
    with pytest.raises(ValueError, match="one length"):
        ext.copy_many(1, 64, 64, 64, [pa], [pb, pb])
    with pytest.raises(ValueError, match="one length"):
        ext.copy_many(1, 64, 64, 64, (pa,), (pb,))
    with pytest.raises(ValueError, match="no kernel"):
        ext.use_kernel("fast")
    assert ext.copy_many(1, 64, 64, 64, [], []) == []
    assert a.eq(0).all()  # nothing was copied by any refused call


def test_runs_describe_what_the_kernel_takes(copy_path: str) -> None:
    """`host._runs`: one run for contiguous tensors, runs at a stride for a paged pool's
    block, None (torch copies) for anything else."""
    if copy_path == "torch":
        assert host._runs(torch.zeros(8)) is None
        return
    pool = torch.zeros((3, 2, 5, 16, 2, 8), dtype=torch.float16)  # [L, K/V, blocks, ...]
    block = pool[:, :, 1]
    assert host._runs(block) == (6, 16 * 2 * 8 * 2, 5 * 16 * 2 * 8 * 2)
    assert host._runs(torch.zeros(4, 8)) == (1, 128, 128)
    assert host._runs(pool[:, :, :1].squeeze(2)) == (6, 512, 2560)
    assert host._runs(torch.zeros(4, 8)[:, ::2]) is None  # no contiguous run
    assert host._runs(torch.zeros(8).expand(4, 8)) is None  # rows overlap
    assert host._runs(torch.zeros(4, 4, 8)[:, :2]) == (4, 64, 128)
    assert host._runs(torch.zeros(4, 6, 8)[::2, :3]) == (2, 96, 384)
    assert host._runs(torch.zeros(3, 5, 8)[:, ::2]) is None  # outer steps differ
    assert host._runs(torch.zeros(4, dtype=torch.complex64)) is None
    assert host._runs(torch._neg_view(torch.zeros(4))) is None  # bytes are not the values


def test_store_reads_into_a_negated_view_as_torch_would(copy_path: str) -> None:
    """An output carrying a lazy negation bit gets the values, not the raw bytes."""
    store = host.HostStore(1 << 16, 1 << 12)
    kv = torch.randn(256)
    assert store.put(b"k" * 16, kv)
    out = torch._neg_view(torch.zeros(256))
    assert out.is_neg() and out.is_contiguous()
    assert store.get(b"k" * 16, out=out) is out and torch.equal(out, kv)
    outs = [torch._neg_view(torch.zeros(256)) for _ in range(2)]
    store.get_many([b"k" * 16] * 2, outs=outs)
    assert all(torch.equal(o, kv) for o in outs)


def test_the_kernel_is_built() -> None:
    """`make test` and CI build the extension (setup.py): a build that silently fell back to
    torch copies would read the host tier at 1.2-1.6x the cost (docs/tiers.md)."""
    if host.kernel() == "torch":
        unavailable("kvheat.tiers._copyhash is not built (setup.py needs a C compiler and "
                    "Python's headers)")
    assert host.kernel() in ("avx2", "portable")
