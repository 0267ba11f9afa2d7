"""Prefix hashes chained over (parent hash, block tokens), salted per tenant and adapter.

The first block's parent is a root digest of the extra keys (tenant salt, LoRA id), so the
salt is carried by the whole chain: two tenants with different salts never produce the
same key, and a key identifies the entire prefix, not one block.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NewType, cast

import xxhash

_digest = xxhash.xxh3_128_digest

# Keys are made here and nowhere else: a `BlockKey` comes from the functions that chain
# one (`chain_key`, `block_keys`, `trace_block_keys`), or is a key a store read back
# (`stored_key`), a tier's probe block's (`probe_key`) or one a miniature cache replays
# (`node_key`). A root (`root_key`, `scoped_root`) is the parent of a first block, not a
# block key. Below the device a key lives in a `Namespace`.

# A block's chained prefix key (16 bytes as made here; a stored one may be up to
# MAX_KEY_BYTES): the digest of its parent's key (or root) and its content.
BlockKey = NewType("BlockKey", bytes)
# That digest, typed as the key it is (no call per key: `block_keys` makes thousands).
_key_digest = cast(Callable[[bytes], BlockKey], xxhash.xxh3_128_digest)

# The longest key a stored value can hold (its header keeps the length in one byte).
MAX_KEY_BYTES = 255


@dataclass(frozen=True, slots=True)
class Namespace:
    """The namespace block keys live in below the device (lower tiers).

    A tenant salt (`of`; `NO_TENANT` for none), or, for an entry a store kept from before
    a restart whose tenant is not known yet, the namespace digest it was stored under
    (`stored`).
    A store names its values by the namespace's digest (`KVStore.ns`): a stored digest
    passes through, so such an entry is found again once its tenant's namespace asks."""

    salt: str | None = None
    digest: bytes | None = None  # set only for an entry found at start-up (`stored`)

    def __post_init__(self) -> None:
        if self.salt is not None and self.digest is not None:
            raise ValueError("a namespace is a tenant salt or a stored digest, not both")

    @staticmethod
    def of(salt: str | None) -> Namespace:
        """The namespace of a tenant salt (`tenant_salt`; None: no tenant)."""
        return NO_TENANT if salt is None else Namespace(salt)

    @staticmethod
    def stored(digest: bytes) -> Namespace:
        """The namespace of an entry found in a store whose tenant is not known yet.

        It is the namespace digest the entry was stored under."""
        return Namespace(None, bytes(digest))

    @property
    def known(self) -> bool:
        """True for a tenant's namespace, False for a stored digest whose tenant is unknown."""
        return self.digest is None


NO_TENANT = Namespace()  # the namespace of keys without a tenant


def stored_key(raw: bytes) -> BlockKey:
    """A key read back from a store (a value's header, a peer's announcement).

    A ValueError if it is longer than any stored value can hold."""
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"a stored key has at most {MAX_KEY_BYTES} bytes, not {len(raw)}")
    return BlockKey(bytes(raw))


def node_key(key: bytes) -> BlockKey:
    """A key an eviction policy saw on a node it orders, as a block key.

    A device block's, a lower tier entry's or a vLLM offload chunk's key, replayed as a block key by a miniature cache
    (kvheat/heat/miniature.py): whoever made it, it names one prefix there too."""
    return BlockKey(key)


def probe_key(name: str) -> BlockKey:
    """The key of a tier's probe block, never a chained key (it never names a prefix).

    Timing and health probes write, read and delete it."""
    return stored_key(name.encode())


def root_key(salt: str | None = None, lora: str | None = None) -> bytes:
    """The parent of every first block: a digest of the extra keys."""
    extra = f"kvheat/v1\0{salt or ''}\0{lora or ''}".encode()
    return _digest(extra)


def chain_key(parent: bytes, content: bytes) -> BlockKey:
    """The key of a block: the digest of its parent's key and its own content."""
    return _key_digest(parent + content)


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
) -> tuple[list[BlockKey], list[bytes]]:
    """Keys and contents of the full blocks of `tokens`, from block index `start` on.

    `parent` is the key of block `start - 1` (or the root when start is 0).
    """
    raw = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    stride = 4 * block_size
    n_full = len(raw) // stride
    keys: list[BlockKey] = []
    contents: list[bytes] = []
    h = root if parent is None else parent
    for i in range(start, n_full):
        c = raw[i * stride:(i + 1) * stride]
        k = _key_digest(h + c)
        keys.append(k)
        h = k
        contents.append(c)
    return keys, contents


def tenant_salt(tenant: str | None, share_groups: Mapping[str, str]) -> str | None:
    """The salt of a tenant's keys: its share group's when it has one, else its own.

    Tenants of a group see each other's blocks. None for no tenant."""
    if tenant is None:
        return None
    group = share_groups.get(tenant)
    return "group:" + group if group is not None else "tenant:" + tenant


def trace_block_keys(root: bytes, block_ids: Sequence[int]) -> tuple[list[BlockKey], list[bytes]]:
    """Keys and contents of a trace's blocks, chained under `root` like tokens.

    A trace names every prefix block by an integer: that block id is the block's content."""
    keys: list[BlockKey] = []
    contents: list[bytes] = []
    h = root
    for bid in block_ids:
        c = int(bid).to_bytes(8, "little", signed=False)
        k = _key_digest(h + c)
        keys.append(k)
        h = k
        contents.append(c)
    return keys, contents


def prompt_scope(prompt: Sequence[int] | bytes) -> bytes:
    """The scope of one whole prompt, given as token ids or their bytes.

    "Exact" prefix caching keys a prompt's blocks in it, so they match only the very same prompt."""
    return _digest(prompt if isinstance(prompt, bytes) else tokens_to_bytes(list(prompt)))


def scoped_root(root: bytes, scope: bytes | None) -> bytes:
    """The root of a scope within a tenant's keys (`root`); None: the root itself."""
    return root if scope is None else chain_key(root, b"kvheat-scope\0" + scope)
