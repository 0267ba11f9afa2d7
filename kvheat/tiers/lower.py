"""The lower tiers together: the stores below the device, each with its index, the
prefix links across them, their counters and the one lock, shared by demotion, promotion
and flushes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..cache.policy import make_policy
from ..cache.request import hit_rate
from .counters import TierCounters
from .index import UNKNOWN_OWNER, TierEntry, TierIndex
from .links import Deletion, PrefixLinks
from .store import KVStore

# (tier name, key, parent key, tokens, stored): a tier took a key (True) or lost it.
IndexListener = Callable[[str, bytes, bytes | None, int, bool], None]


class LowerTiers:
    """`stores[i]` with `indexes[i]`, top first; `links` across them; `lock` guards both."""

    def __init__(self, stores: list[KVStore], block_bytes: int, block_tokens: int,
                 policy: str, clock: Callable[[], float],
                 known_salts: Callable[[], Iterable[str | None]] | None = None) -> None:
        self.stores = stores
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.clock = clock
        self.lock = threading.RLock()
        self.counters = TierCounters()
        n = len(stores)
        self.hit_tokens = [0] * n
        self.hit_blocks = [0] * n
        self.demotions = [0] * n
        self.evictions = [0] * n
        self.deleted = [0] * n  # entries deleted by flushes and quota cuts
        self.load_blocks = [0] * n  # blocks loaded out of each tier into the device
        self.indexes: list[TierIndex] = []
        # `links.on_device`: does the device hold this key now? (TierClient sets it.)
        self.links = PrefixLinks(self.indexes, lambda key: True, self.counters)
        # Called under the lock, from the thread doing it: keep them quick (KV events
        # queue and return).
        self.listeners: list[IndexListener] = []
        # Keys other replicas put in a shared tier (tiers.shared.SharedTierFeed): found
        # after our own indexes, loaded like ours, never deleted or evicted by us.
        self.peers: Any = None
        # tenant -> flushes so far: a demotion queued before a flush of its tenant is
        # dropped when its turn comes (one entry per tenant ever flushed).
        self.flushes: dict[object, int] = {}
        self.known_salts = known_salts
        name = policy
        for i, st in enumerate(stores):
            slot = getattr(st, "slot_bytes", None)
            if slot is not None and slot < block_bytes:
                raise ValueError(f"{st.name} tier slots hold {slot} bytes; a device block "
                                 f"has {block_bytes}")
            pol = make_policy(name)
            if pol.needs_future:  # an offline oracle cannot order a live tier
                pol = make_policy("lru")
            # Only the bottom tier's victims leave the hierarchy (in write-through mode the
            # upper tiers' copies are on the bottom one too): there, leaves go first.
            idx = TierIndex(pol, st.capacity_bytes // max(1, block_bytes),
                            leaf_first=i == n - 1)
            idx.listener = self._index_listener(st.name)
            self.indexes.append(idx)
            self._restore(st, idx)

    def _restore(self, st: KVStore, idx: TierIndex) -> None:
        """Index the entries that survived a restart: known tenants by salt, others by
        namespace digest (still evictable). A store keeps no parent: each is a root, never
        dropped with an ancestor."""
        now = self.clock()
        for key, ns in st.stored():
            salt = self._salt_of_ns(st, ns)
            # An unknown namespace stays keyed by its digest (`KVStore.ns` takes it back).
            if idx.insert(key, ns if salt is UNKNOWN_OWNER else salt,  # type: ignore[arg-type]
                          self.block_tokens, self.block_bytes, now, owner=UNKNOWN_OWNER):
                self.links.hold(key, None)

    def _salt_of_ns(self, store: KVStore, ns: bytes) -> str | None | object:
        """The salt whose namespace digest is `ns`, among the salts known at start-up."""
        if ns == store.ns(None):
            return None
        for salt in self.known_salts() if self.known_salts is not None else ():
            if store.ns(salt) == ns:
                return salt
        return UNKNOWN_OWNER

    def _index_listener(self, name: str) -> Callable[[TierEntry, bytes | None, bool], None]:
        def changed(e: TierEntry, parent: bytes | None, stored: bool) -> None:
            assert e.key is not None
            for listener in self.listeners:
                listener(name, e.key, parent, e.num_tokens, stored)
        return changed

    def tier_of(self, name: str) -> int | None:
        return next((i for i, st in enumerate(self.stores) if st.name == name), None)

    def flushed(self, owner: object) -> int:
        """How many times `owner`'s KV was flushed so far."""
        return self.flushes.get(owner, 0)

    def find(self, key: bytes, salt: str | None) -> tuple[int, TierEntry] | None:
        """The first tier that is up and holds `key` in `salt`'s namespace (lock held)."""
        for t, idx in enumerate(self.indexes):
            e = idx.get(key)
            st = self.stores[t]
            if e is not None and st.ns(e.salt) == st.ns(salt) and st.available():
                return t, e
        return None

    def delete(self, dels: list[Deletion]) -> None:
        """Delete from the stores what the links gave up (called unlocked)."""
        for t, key, salt in dels:
            self.stores[t].delete(key, salt)

    def release(self, key: bytes) -> None:
        """Drop one holding of `key` below, deleting what leaves with it."""
        with self.lock:
            dels = self.links.release(key)
        self.delete(dels)

    def forget(self, tier: int, key: bytes) -> None:
        """`tier` no longer holds `key` (loaded out of it, or found stale): unindex it;
        its descendants go too when nothing else holds it."""
        with self.lock:
            dels = self.links.release(key) if self.indexes[tier].remove(key) else []
        self.delete(dels)

    def drop_key(self, key: bytes, salt: str | None) -> list[Deletion]:
        """Delete `key` of `salt`'s namespace from every tier (a device block deleted on
        purpose: flush, quota cut), with its descendants. Returns what was deleted."""
        dels: list[Deletion] = []
        with self.lock:
            for t, idx in enumerate(self.indexes):
                e = idx.get(key)
                st = self.stores[t]
                if e is not None and st.ns(e.salt) == st.ns(salt):
                    idx.remove(key)
                    dels.append((t, key, e.salt))
                    dels += self.links.release(key, leaving_device=True)
            dels += self.links.settle(key, leaving_device=True)
        self.delete(dels)
        self.count_deleted(dels)
        return dels

    def drop_tenant(self, tenant: str | None, salt: str | None, shared: bool) -> list[Deletion]:
        """Unindex `tenant`'s entries on every tier (lock held; in a share group only those
        it filled, and those found at start-up). Returns what to delete from the stores."""
        dels: list[Deletion] = []
        for t, idx in enumerate(self.indexes):
            st = self.stores[t]
            ns = st.ns(salt)
            mine = [k for k, e in idx.entries.items() if st.ns(e.salt) == ns
                    and (not shared or idx.owners.get(k) in (tenant, UNKNOWN_OWNER))]
            for k in mine:
                e = idx.remove(k)
                if e is not None:
                    dels.append((t, k, e.salt))
                    dels += self.links.release(k)
        return dels

    def count_deleted(self, dels: list[Deletion]) -> None:
        for t, _key, _salt in dels:
            self.deleted[t] += 1

    def entries(self) -> list[tuple[str, bytes, bytes | None, int]]:
        """(tier name, key, parent key, tokens) of every entry held below now."""
        with self.lock:
            parents = self.links.parent
            return [(st.name, key, parents.get(key), e.num_tokens)
                    for st, idx in zip(self.stores, self.indexes, strict=True)
                    for key, e in idx.entries.items()]

    def describe(self, query_tokens: int) -> dict[str, object]:
        """Each tier's store figures with its index size and counts."""
        out: dict[str, object] = {}
        for i, st in enumerate(self.stores):
            d = st.describe()
            sst = st.stats
            d.update(entries=len(self.indexes[i]), hit_tokens=self.hit_tokens[i],
                     hit_blocks=self.hit_blocks[i], demotions=self.demotions[i],
                     evictions=self.evictions[i], deleted=self.deleted[i],
                     hit_rate=hit_rate(self.hit_tokens[i], query_tokens),
                     load_blocks=self.load_blocks[i],
                     load_bytes=self.load_blocks[i] * self.block_bytes,
                     faults=sst.corrupt_checksum + sst.corrupt_key + sst.corrupt_torn
                     + sst.corrupt_format + sst.io_errors)
            out[f"{i}:{st.name}"] = d
        return out
