"""The value format every byte-holding tier shares (disk files, Redis values).

A value is a fixed header, the shape, the block key, the namespace digest, then the raw
tensor bytes. One xxh3-64 checksum covers everything after the checksum field, so a
flipped bit anywhere (dtype, shape, key or payload) makes the value unreadable rather than
wrong. Reading never trusts a value: magic, version, lengths, key, namespace and checksum
are all checked, and any failure is a `CorruptValue` the caller counts as a miss.
Tensors are rebuilt with `torch.frombuffer`; nothing is unpickled.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"KVT1"
VERSION = 1
# magic, version, dtype code, ndim, key length, payload length, checksum
_HEAD = struct.Struct("<4sBBBBQQ")
HEAD_SIZE = _HEAD.size
NS_SIZE = 16
MAX_KEY = 255
MAX_NDIM = 8

DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.float64,
    5: torch.uint8, 6: torch.int8, 7: torch.int32, 8: torch.int64,
    9: torch.float8_e4m3fn, 10: torch.float8_e5m2,
}
DTYPE_CODES: dict[torch.dtype, int] = {v: k for k, v in DTYPES.items()}

# `decode` may view immutable bytes on purpose (such tensors are only copied from).
# torch warns about that once per process; spend the warning here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


class CorruptValue(ValueError):
    """A stored value failed a check; `kind` says which (for counters)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def namespace_digest(model: str, layout: str, salt: str | None) -> bytes:
    """16 bytes naming (model, layout, tenant salt): stored with every value and checked on
    read, so one tenant or model never reads another's bytes under the same key."""
    return xxhash.xxh3_128_digest(f"kvheat-ns/v1\0{model}\0{layout}\0{salt or ''}".encode())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 and fp8 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass(slots=True)
class Header:
    dtype: torch.dtype
    shape: tuple[int, ...]
    key: bytes
    ns: bytes
    payload_len: int
    checksum: int
    body_offset: int  # where the payload starts in the value


def _meta(dtype: torch.dtype, shape: tuple[int, ...], key: bytes, ns: bytes) -> tuple[int, bytes]:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"dtype {dtype} cannot be stored")
    if len(key) > MAX_KEY or len(shape) > MAX_NDIM or len(ns) != NS_SIZE:
        raise ValueError("key, shape or namespace too long for the value header")
    tail = struct.pack(f"<{len(shape)}I", *shape) + key + ns
    return code, tail


def encode_prefix(t: torch.Tensor, key: bytes, ns: bytes) -> tuple[bytes, memoryview]:
    """(header bytes, payload view) for `t`; the value is their concatenation."""
    t = t.contiguous() if t.device.type == "cpu" else t.cpu().contiguous()
    payload = tensor_bytes(t)
    code, tail = _meta(t.dtype, tuple(t.shape), key, ns)
    h = xxhash.xxh3_64()
    head_wo_sum = _HEAD.pack(MAGIC, VERSION, code, t.dim(), len(key), len(payload), 0)[:-8]
    h.update(head_wo_sum)
    h.update(tail)
    h.update(payload)
    head = _HEAD.pack(MAGIC, VERSION, code, t.dim(), len(key), len(payload), h.intdigest())
    return head + tail, payload


def encode(t: torch.Tensor, key: bytes, ns: bytes) -> bytes:
    head, payload = encode_prefix(t, key, ns)
    return head + bytes(payload)


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse and sanity-check the header (not the checksum: see `verify`)."""
    if len(buf) < HEAD_SIZE:
        raise CorruptValue("torn", f"{len(buf)} bytes is shorter than a header")
    magic, version, code, ndim, klen, plen, csum = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptValue("format", "bad magic")
    if version != VERSION:
        raise CorruptValue("format", f"format version {version}, this reader knows {VERSION}")
    dtype = DTYPES.get(code)
    if dtype is None or ndim > MAX_NDIM:
        raise CorruptValue("format", f"dtype code {code} / ndim {ndim}")
    off = HEAD_SIZE
    need = off + 4 * ndim + klen + NS_SIZE
    if len(buf) < need:
        raise CorruptValue("torn", "value ends inside its header")
    shape = struct.unpack_from(f"<{ndim}I", buf, off)
    off += 4 * ndim
    key = bytes(buf[off:off + klen])
    off += klen
    ns = bytes(buf[off:off + NS_SIZE])
    off += NS_SIZE
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != plen:
        raise CorruptValue("format", "shape and dtype disagree with the payload length")
    return Header(dtype, tuple(shape), key, ns, plen, csum, off)


def verify(buf: bytes | bytearray | memoryview, hdr: Header, key: bytes, ns: bytes) -> None:
    """Raise CorruptValue unless `buf` holds exactly the value stored for (key, ns)."""
    if len(buf) != hdr.body_offset + hdr.payload_len:
        raise CorruptValue("torn", f"{len(buf)} bytes, header says "
                                   f"{hdr.body_offset + hdr.payload_len}")
    mv = memoryview(buf)
    verify_parts(mv[:hdr.body_offset], mv[hdr.body_offset:], hdr, key, ns)


def verify_parts(head: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview,
                 hdr: Header, key: bytes, ns: bytes) -> None:
    """`verify` for a value received in two places: its header bytes (through the
    namespace) and its payload (e.g. received straight into an output tensor)."""
    if hdr.key != key or hdr.ns != ns:
        raise CorruptValue("key", "value was stored under another key or namespace")
    if len(head) != hdr.body_offset or len(payload) != hdr.payload_len:
        raise CorruptValue("torn", "value length disagrees with its header")
    h = xxhash.xxh3_64()
    mv = memoryview(head)
    h.update(mv[:HEAD_SIZE - 8])
    h.update(mv[HEAD_SIZE:])
    h.update(payload)
    if h.intdigest() != hdr.checksum:
        raise CorruptValue("checksum", "checksum mismatch")


def header_size(prefix: bytes | bytearray | memoryview) -> int:
    """Bytes of header (through the namespace) of a value starting with `prefix`, which
    holds at least HEAD_SIZE bytes; the values are checked later by `decode_header`."""
    _magic, _version, _code, ndim, klen, _plen, _csum = _HEAD.unpack_from(prefix, 0)
    return HEAD_SIZE + 4 * ndim + klen + NS_SIZE


def decode(buf: bytes | bytearray | memoryview, key: bytes, ns: bytes) -> torch.Tensor:
    """The tensor stored in `buf` for (key, ns), viewing `buf` (no copy); or CorruptValue.
    From a writable `buf` (bytearray, writable memoryview) the tensor is an ordinary one;
    from immutable `bytes` (straight from a socket) it must only be read, e.g. copied into
    a device block or an output buffer: writing to it is undefined."""
    hdr = decode_header(buf)
    verify(buf, hdr, key, ns)
    return payload_tensor(buf, hdr, hdr.body_offset)


def payload_tensor(buf: bytes | bytearray | memoryview, hdr: Header, offset: int = 0
                   ) -> torch.Tensor:
    """The tensor `hdr` describes, viewing its payload in `buf` from `offset` (no copy)."""
    if hdr.payload_len == 0:
        return torch.empty(hdr.shape, dtype=hdr.dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=hdr.payload_len)
    return raw.view(hdr.dtype).view(hdr.shape)
