"""Prefix hashes chained over (parent hash, block tokens), salted per tenant and adapter.

The first block's parent is a root digest of the extra keys (tenant salt, LoRA id), so the
salt is carried by the whole chain: two tenants with different salts never produce the
same key, and a key identifies the entire prefix, not one block.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

import xxhash

_digest = xxhash.xxh3_128_digest


def root_key(salt: str | None = None, lora: str | None = None) -> bytes:
    """The parent of every first block: a digest of the extra keys."""
    extra = f"kvheat/v1\0{salt or ''}\0{lora or ''}".encode()
    return _digest(extra)


def chain_key(parent: bytes, content: bytes) -> bytes:
    """The key of a block: the digest of its parent's key and its own content."""
    return _digest(parent + content)


def tokens_to_bytes(tokens: list[int]) -> bytes:
    """Token ids as little-endian uint32; negative or non-integer ids are a clear error."""
    try:
        return array("I", tokens).tobytes()
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t < 2**32)
        raise ValueError(f"token id out of range: {bad} (ids must be in [0, 2**32))") from None
    except TypeError:
        bad = next(t for t in tokens if not isinstance(t, int))
        raise ValueError(f"token id is not an integer: {bad!r}") from None


def block_keys(
    tokens: list[int] | bytes, block_size: int, root: bytes, start: int = 0,
    parent: bytes | None = None,
) -> tuple[list[bytes], list[bytes]]:
    """Keys and contents of the full blocks of `tokens`, from block index `start` on.

    `parent` is the key of block `start - 1` (or the root when start is 0).
    """
    raw = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    stride = 4 * block_size
    n_full = len(raw) // stride
    keys: list[bytes] = []
    contents: list[bytes] = []
    h = root if parent is None else parent
    for i in range(start, n_full):
        c = raw[i * stride:(i + 1) * stride]
        h = _digest(h + c)
        keys.append(h)
        contents.append(c)
    return keys, contents


def tenant_salt(tenant: str | None, share_groups: Mapping[str, str]) -> str | None:
    """The salt of a tenant's keys: its share group's when it has one, else its own.

    Tenants of a group see each other's blocks. None for no tenant."""
    if tenant is None:
        return None
    group = share_groups.get(tenant)
    return "group:" + group if group is not None else "tenant:" + tenant


def trace_block_keys(root: bytes, block_ids: Sequence[int]) -> tuple[list[bytes], list[bytes]]:
    """Keys and contents of a trace's blocks, chained under `root` like tokens.

    A trace names every prefix block by an integer: that block id is the block's content."""
    keys: list[bytes] = []
    contents: list[bytes] = []
    h = root
    for bid in block_ids:
        c = int(bid).to_bytes(8, "little", signed=False)
        h = _digest(h + c)
        keys.append(h)
        contents.append(c)
    return keys, contents


def prompt_scope(prompt: Sequence[int] | bytes) -> bytes:
    """The scope of one whole prompt, given as token ids or their bytes.

    "Exact" prefix caching keys a prompt's blocks in it, so they match only the very same prompt."""
    return _digest(prompt if isinstance(prompt, bytes) else tokens_to_bytes(list(prompt)))


def scoped_root(root: bytes, scope: bytes | None) -> bytes:
    """The root of a scope within a tenant's keys (`root`); None: the root itself."""
    return root if scope is None else chain_key(root, b"kvheat-scope\0" + scope)
