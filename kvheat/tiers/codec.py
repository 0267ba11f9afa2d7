"""The value format every byte-holding tier shares (disk files, Redis values).

A value is a fixed header, the shape, the block key, the namespace digest, then the raw
tensor bytes. A keyed 128-bit MAC under the deployment's tier key covers every byte but
itself, so a flipped bit anywhere (dtype, shape, key or payload) makes the value
unreadable rather than wrong, and a value written by anyone without the key (KV planted in
a shared Redis) never verifies. The format version names the MAC: 3 is keyed BLAKE3
(about 3-6 GB/s here, what every store writes where the `blake3` wheel is installed), 2
keyed BLAKE2b (0.3-0.9 GB/s: the format before BLAKE3, and the fallback without the
wheel). Both are read, so values written before the switch stay readable until they age
out; the version byte is under the MAC, so it cannot be changed to pick the other one.
Reading never trusts a value: magic, version, lengths, key, namespace and MAC are all
checked, and any failure is a `CorruptValue` the caller counts as a miss. Tensors are
rebuilt with `torch.frombuffer`; nothing is unpickled.

The tier key comes from a secret in config or `KVHEAT_TIER_SECRET` (`tier_key`); it also
keys the namespace digests and the names values are stored under, so neither tenant names
nor the model fingerprint can be read from, or used to compute, a key name.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch


def _import_blake3() -> ModuleType | None:
    """The `blake3` module (a binary wheel: no compiler needed), or None where it is not
    installed: values are then written with BLAKE2b (tests force this by setting
    `_blake3 = None`)."""
    try:
        import blake3
    except ImportError:
        return None
    return blake3


_blake3 = _import_blake3()

MAGIC = b"KVT1"
# The format version says which MAC a value carries (1, an unkeyed xxh3-64 checksum, is
# refused: anyone could write it).
BLAKE2B_VERSION = 2
BLAKE3_VERSION = 3
VERSION = BLAKE3_VERSION  # the newest format
MAC_NAMES = {BLAKE2B_VERSION: "blake2b", BLAKE3_VERSION: "blake3"}
MAC_ENV = "KVHEAT_TIER_MAC"
# BLAKE3's derive_key mode turns the tier key into the value-MAC key, so the MAC never
# shares a key with the BLAKE2b digests of namespaces and key names (`keyed_digest`).
_BLAKE3_CONTEXT = "kvheat 2026-12 tier value MAC v3"
# magic, version, dtype code, ndim, key length, payload length, MAC
MAC_SIZE = 16
_HEAD = struct.Struct(f"<4sBBBBQ{MAC_SIZE}s")
HEAD_SIZE = _HEAD.size
NS_SIZE = 16
SECRET_ENV = "KVHEAT_TIER_SECRET"
MIN_SECRET = 16
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


def tier_key(secret: str | bytes | None = None) -> bytes | None:
    """Derive the 32-byte MAC key from a deployment secret; None without a secret.

    The secret is `secret`, else the `KVHEAT_TIER_SECRET` environment variable; None when
    neither is set."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET:
        raise ValueError(f"the tier secret must have at least {MIN_SECRET} bytes (it keys "
                         "the MAC of every value read back from disk or Redis)")
    return hashlib.blake2b(raw, digest_size=32, person=b"kvheat-tierkey").digest()


def blake3_available() -> bool:
    """Whether the `blake3` module is installed (format 3 values can be written and read)."""
    return _blake3 is not None


def value_mac_version(choice: str | None = None) -> int:
    """Pick the format version (so the MAC) new values are written with.

    It is `choice` ("blake3" or "blake2b"), else the `KVHEAT_TIER_MAC` environment
    variable, else BLAKE3 where the `blake3` module imports and BLAKE2b where it does not.
    Every store reads both."""
    if choice is None:
        choice = os.environ.get(MAC_ENV) or None
    if choice is None:
        return BLAKE3_VERSION if _blake3 is not None else BLAKE2B_VERSION
    if choice == "blake2b":
        return BLAKE2B_VERSION
    if choice == "blake3":
        if _blake3 is None:
            raise ValueError(f"{MAC_ENV}=blake3 but the blake3 module is not installed "
                             "(pip install blake3, or leave it unset for BLAKE2b)")
        return BLAKE3_VERSION
    raise ValueError(f"tier MAC must be 'blake3' or 'blake2b', not {choice!r}")


@functools.lru_cache(maxsize=64)
def _blake3_key(mac_key: bytes) -> bytes:
    assert _blake3 is not None
    return _blake3.blake3(mac_key, derive_key_context=_BLAKE3_CONTEXT).digest()


def keyed_digest(mac_key: bytes, *parts: bytes, size: int = 16) -> bytes:
    """BLAKE2b under `mac_key` of the parts (length-prefixed, so they cannot run together).

    Names and namespace digests: short inputs, so BLAKE2b's speed does not matter, and they
    stay the same whichever MAC a store writes (values written before BLAKE3 keep their
    names). Domains stay apart: a namespace digest's first part is the 12-byte tag
    `kvheat-ns/v2`, a key name's the 16-byte namespace digest, a prefix's a 14- or 15-byte
    tag, and the length prefixes make those inputs differ; the value MAC is BLAKE2b with
    its own personalisation or BLAKE3 under a derived key."""
    h = hashlib.blake2b(key=mac_key, digest_size=size)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()


def namespace_digest(model: str, layout: str, salt: str | None, mac_key: bytes) -> bytes:
    """Return the 16 bytes naming (model, layout, tenant salt), keyed by `mac_key`.

    They are stored with every value and checked on read, so one tenant or model never
    reads another's bytes under the same key. Keyed: without the tier key they cannot be
    computed from a tenant name and a fingerprint."""
    return keyed_digest(mac_key, b"kvheat-ns/v2", model.encode(), layout.encode(),
                        (salt or "").encode())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 and fp8 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


@dataclass(slots=True)
class Header:
    """A value's parsed header: dtype, shape, key, namespace digest, payload length, MAC."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    key: bytes
    ns: bytes
    payload_len: int
    mac: bytes
    body_offset: int  # where the payload starts in the value
    version: int = VERSION  # which MAC (BLAKE3_VERSION or BLAKE2B_VERSION)


def _meta(dtype: torch.dtype, shape: tuple[int, ...], key: bytes, ns: bytes) -> tuple[int, bytes]:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"dtype {dtype} cannot be stored")
    if len(key) > MAX_KEY or len(shape) > MAX_NDIM or len(ns) != NS_SIZE:
        raise ValueError("key, shape or namespace too long for the value header")
    tail = struct.pack(f"<{len(shape)}I", *shape) + key + ns
    return code, tail


def _mac(version: int, mac_key: bytes, head_wo_mac: bytes | memoryview,
         tail: bytes | memoryview, payload: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte MAC of format `version` over a value's bytes but the MAC itself."""
    if version == BLAKE3_VERSION:
        if _blake3 is None:
            raise CorruptValue("format", "value carries a BLAKE3 MAC and the blake3 module "
                                         "is not installed here")
        h3 = _blake3.blake3(key=_blake3_key(mac_key))
        h3.update(head_wo_mac)
        h3.update(tail)
        h3.update(payload)
        return h3.digest(MAC_SIZE)
    h = hashlib.blake2b(key=mac_key, digest_size=MAC_SIZE, person=b"kvheat-value")
    h.update(head_wo_mac)
    h.update(tail)
    h.update(payload)
    return h.digest()


def encode_prefix(t: torch.Tensor, key: bytes, ns: bytes, mac_key: bytes,
                  version: int | None = None) -> tuple[bytes, memoryview]:
    """Encode `t` as (header bytes, payload view); the value is their concatenation.

    `version` picks the MAC (`value_mac_version()` when None)."""
    version = value_mac_version() if version is None else version
    if version not in MAC_NAMES:
        raise ValueError(f"no value format version {version}")
    if version == BLAKE3_VERSION and _blake3 is None:
        raise ValueError("format 3 needs the blake3 module, which is not installed")
    t = t.contiguous() if t.device.type == "cpu" else t.cpu().contiguous()
    payload = tensor_bytes(t)
    code, tail = _meta(t.dtype, tuple(t.shape), key, ns)
    head_wo_mac = _HEAD.pack(MAGIC, version, code, t.dim(), len(key), len(payload),
                             b"")[:-MAC_SIZE]
    head = head_wo_mac + _mac(version, mac_key, head_wo_mac, tail, payload)
    return head + tail, payload


def encode(t: torch.Tensor, key: bytes, ns: bytes, mac_key: bytes,
           version: int | None = None) -> bytes:
    """Encode `t` as one value for (key, ns): `encode_prefix`'s two parts joined."""
    head, payload = encode_prefix(t, key, ns, mac_key, version)
    return head + bytes(payload)


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse and sanity-check the header (not the checksum: see `verify`)."""
    if len(buf) < HEAD_SIZE:
        raise CorruptValue("torn", f"{len(buf)} bytes is shorter than a header")
    magic, version, code, ndim, klen, plen, mac = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptValue("format", "bad magic")
    if version not in MAC_NAMES:
        raise CorruptValue("format", f"format version {version}, this reader knows "
                                     f"{sorted(MAC_NAMES)}")
    if version == BLAKE3_VERSION and _blake3 is None:
        # Refused before anything trusts the header: this process cannot check it.
        raise CorruptValue("format", "value carries a BLAKE3 MAC and the blake3 module "
                                     "is not installed here")
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
    return Header(dtype, tuple(shape), key, ns, plen, mac, off, version)


def verify(buf: bytes | bytearray | memoryview, hdr: Header, key: bytes, ns: bytes,
           mac_key: bytes) -> None:
    """Raise CorruptValue unless `buf` holds exactly the value stored for (key, ns).

    The value must have been stored by a holder of `mac_key`."""
    if len(buf) != hdr.body_offset + hdr.payload_len:
        raise CorruptValue("torn", f"{len(buf)} bytes, header says "
                                   f"{hdr.body_offset + hdr.payload_len}")
    mv = memoryview(buf)
    verify_parts(mv[:hdr.body_offset], mv[hdr.body_offset:], hdr, key, ns, mac_key)


def verify_parts(head: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview,
                 hdr: Header, key: bytes, ns: bytes, mac_key: bytes) -> None:
    """`verify` for a value received in two places: its header bytes and its payload.

    The header bytes run through the namespace; the payload may have been received
    elsewhere (e.g. straight into an output tensor)."""
    if hdr.key != key or hdr.ns != ns:
        raise CorruptValue("key", "value was stored under another key or namespace")
    if len(head) != hdr.body_offset or len(payload) != hdr.payload_len:
        raise CorruptValue("torn", "value length disagrees with its header")
    mv = memoryview(head)
    want = _mac(hdr.version, mac_key, mv[:HEAD_SIZE - MAC_SIZE], mv[HEAD_SIZE:], payload)
    if not hmac.compare_digest(want, hdr.mac):
        # Counted as "checksum": a flipped bit and a value forged without the key alike.
        raise CorruptValue("checksum", "MAC mismatch (altered, or not written with this "
                                       "deployment's tier key)")


def header_size(prefix: bytes | bytearray | memoryview) -> int:
    """Return the header's length (through the namespace) of a value starting with `prefix`.

    `prefix` holds at least HEAD_SIZE bytes; the header's values are checked later, by
    `decode_header`."""
    _magic, _version, _code, ndim, klen, _plen, _mac_ = _HEAD.unpack_from(prefix, 0)
    return HEAD_SIZE + 4 * ndim + klen + NS_SIZE


def decode(buf: bytes | bytearray | memoryview, key: bytes, ns: bytes,
           mac_key: bytes) -> torch.Tensor:
    """The tensor stored in `buf` for (key, ns), viewing `buf` (no copy); or CorruptValue.

    From a writable `buf` (bytearray, writable memoryview) the tensor is an ordinary one;
    from immutable `bytes` (straight from a socket) it must only be read, e.g. copied into
    a device block or an output buffer: writing to it is undefined."""
    hdr = decode_header(buf)
    verify(buf, hdr, key, ns, mac_key)
    return payload_tensor(buf, hdr, hdr.body_offset)


def payload_tensor(buf: bytes | bytearray | memoryview, hdr: Header, offset: int = 0
                   ) -> torch.Tensor:
    """The tensor `hdr` describes, viewing its payload in `buf` from `offset` (no copy)."""
    if hdr.payload_len == 0:
        return torch.empty(hdr.shape, dtype=hdr.dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=hdr.payload_len)
    return raw.view(hdr.dtype).view(hdr.shape)
