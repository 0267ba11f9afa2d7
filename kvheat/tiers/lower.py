"""The lower tiers together: the stores below the device, the one index of what they hold
(`index.KeyIndex`), their counters, and the lock that guards the index. Demotion, loads
and flushes go through the methods here; the index itself is pure bookkeeping."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..cache.eviction import EvictionPolicy, make_policy
from ..cache.hashing import NO_TENANT, BlockKey, Namespace
from ..cache.hints import Outcome, check_reason, check_session
from ..cache.node import Node
from ..cache.request import hit_rate
from .counters import TierCounters
from .index import UNKNOWN_OWNER, Deletion, IndexListener, KeyIndex, TierEntry, TierIndex
from .store import KVStore

__all__ = ["Deletion", "IndexListener", "LowerTiers"]


class LowerTiers:
    """The stores below the device, top first, with the one index of what they hold.

    `stores[i]`, top first, with `key_index`, the index of what each holds (`indexes[i]`:
    tier i's eviction order); `lock` guards the index. Methods not marked "lock held"
    take the lock themselves and delete from the stores after releasing it."""

    def __init__(self, stores: list[KVStore], block_bytes: int, block_tokens: int,
                 policy: str, clock: Callable[[], float],
                 known_namespaces: Callable[[], Iterable[Namespace]] | None = None) -> None:
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
        self.key_index = KeyIndex(self.indexes, [st.name for st in stores], self.counters)
        # Called under the lock, from the thread doing it: keep them quick (KV events
        # queue and return).
        self.listeners: list[IndexListener] = self.key_index.listeners
        # Keys other replicas put in a shared tier (tiers.shared.SharedTierFeed): found
        # after our own indexes, loaded like ours, never deleted or evicted by us.
        self.peers: Any = None
        # tenant -> flushes so far: a demotion queued before a flush of its tenant is
        # dropped when its turn comes (one entry per tenant ever flushed).
        self.flushes: dict[object, int] = {}
        # Tiers the operator (the self-healer) skips as if down: no loads, no demotions,
        # while their stores' own calls still work for probes.
        self.bypassed: set[int] = set()
        known = list(known_namespaces()) if known_namespaces is not None else []
        for i, st in enumerate(stores):
            slot = getattr(st, "slot_bytes", None)
            if slot is not None and slot < block_bytes:
                raise ValueError(f"{st.name} tier slots hold {slot} bytes; a device block "
                                 f"has {block_bytes}")
            pol = make_policy(policy)
            if pol.needs_future:  # an offline oracle cannot order a live tier
                pol = make_policy("lru")
            # Only the bottom tier's victims leave the hierarchy (in write-through mode the
            # upper tiers' copies are on the bottom one too): there, leaves go first.
            self.indexes.append(TierIndex(pol, st.capacity_bytes // max(1, block_bytes),
                                          leaf_first=i == n - 1))
            self._restore(i, known)

    def _restore(self, tier: int, known: list[Namespace]) -> None:
        """Index the entries that survived a restart: those of known tenants in their
        namespace, others in `Namespace.stored` of their digest (still evictable). A store
        keeps no parent: each is a root, never dropped with an ancestor."""
        st = self.stores[tier]
        now = self.clock()
        by_digest = {st.ns(ns): ns for ns in [NO_TENANT, *known]}
        for key, digest in st.stored():
            # An unknown namespace stays its digest (`KVStore.ns` passes it through).
            ns = by_digest.get(digest)
            if ns is None:
                ns = Namespace.stored(digest)
            self.key_index.add(tier, key, ns, self.block_tokens, self.block_bytes, now,
                               UNKNOWN_OWNER, None)

    # ---- lookups (lock held) --------------------------------------------------------------
    def tier_of(self, name: str) -> int | None:
        """The index of the tier named `name`, or None."""
        return next((i for i, st in enumerate(self.stores) if st.name == name), None)

    def up(self, tier: int) -> bool:
        """Whether `tier` is in use: reachable and not bypassed.

        Callers skip a tier not in use and recompute."""
        return tier not in self.bypassed and self.stores[tier].reachable()

    def flushed(self, owner: object) -> int:
        """How many times `owner`'s KV was flushed so far."""
        return self.flushes.get(owner, 0)

    def find(self, key: BlockKey, ns: Namespace) -> tuple[int, TierEntry] | None:
        """The first tier that is up and holds `key` in namespace `ns` (lock held)."""
        rec = self.key_index.record(key)
        if rec is None:
            return None
        for t, idx in enumerate(self.indexes):
            e = idx.get(key)
            st = self.stores[t]
            if e is not None and st.ns(rec.ns) == st.ns(ns) and self.up(t):
                return t, e
        return None

    def pin(self, tier: int, e: TierEntry) -> None:
        """Hold `e` while it is loaded (a hit for its policy; lock held)."""
        self.indexes[tier].pin(e, self.clock())

    def unpin(self, tier: int, e: TierEntry, now: float) -> None:
        """Drop one pin of `e` on `tier` (see `pin`; lock held)."""
        self.indexes[tier].unpin(e, now)

    def touch(self, tier: int, key: BlockKey) -> bool:
        """Refresh `key` on `tier` (a hit); False when the tier does not hold it."""
        with self.lock:
            e = self.indexes[tier].get(key)
            if e is not None:
                self.indexes[tier].touch(e, self.clock())
            return e is not None

    # ---- blocks coming down (demotion) ------------------------------------------------------
    def hold(self, key: BlockKey, parent: BlockKey | None, ns: Namespace,
             owner: object) -> None:
        """A copy of `key` is on its way down: it counts as held until `release`."""
        with self.lock:
            self.key_index.hold(key, parent, ns, owner)

    def settle(self, key: BlockKey, ns: Namespace, leaving_device: bool) -> bool:
        """After a demotion of `key`, tell whether it is held below in namespace `ns`.

        If it is held nowhere, nor on the device, its descendants below go (deleted
        here)."""
        with self.lock:
            rec = self.key_index.record(key)
            # A key found at start-up keeps its namespace digest: that tenant's or not,
            # a read checks it. Another namespace's key of the same name is not this block.
            held = rec is not None and (rec.ns == ns or not rec.ns.known)
            dels = self.key_index.settle(key, leaving_device=leaving_device)
        self.delete(dels)
        return held

    def placeable(self, tier: int, key: BlockKey, parent: BlockKey | None, owner: object,
                  gen: int) -> bool:
        """Tell whether a block coming down should be written to `tier`.

        Not when its tenant was flushed since it left the device (`gen`: the flush count
        then), when its parent left meanwhile (counted), or when the tier has it already
        (a key names its KV: refreshed; rewriting would hide it from readers while the
        store replaces it)."""
        with self.lock:
            if self.flushed(owner) != gen:
                return False
            if self.key_index.orphan(parent):
                self.counters.orphans_dropped += 1
                return False
            e = self.indexes[tier].get(key)
            if e is not None:
                self.indexes[tier].touch(e, self.clock())
                return False
        return True

    def commit(self, tier: int, key: BlockKey, ns: Namespace, tokens: int, size: int,
               owner: object, parent: BlockKey | None, gen: int) -> bool:
        """Index a block just written to `tier`; False (counted) when it must not stay.

        That is when its parent or its tenant's KV left while it was written: the caller
        deletes it."""
        with self.lock:
            if self.key_index.orphan(parent) or self.flushed(owner) != gen:
                self.counters.orphans_dropped += 1
                return False
            self.key_index.add(tier, key, ns, tokens, size, self.clock(), owner, parent)
        self.demotions[tier] += 1
        self.counters.demotions += 1
        return True

    def evict_for(self, tier: int, key: BlockKey, need: int
                  ) -> list[tuple[BlockKey, int, Namespace, BlockKey | None, object]]:
        """Unindex `tier`'s coldest entries until `need` more bytes fit; return them.

        The room is for `key`, whose own old entry's bytes count as free. Returns (key,
        tokens, namespace, parent, owner) of each; it stays held until the caller hands
        it down or drops it (`release`)."""
        st, idx = self.stores[tier], self.indexes[tier]
        out: list[tuple[BlockKey, int, Namespace, BlockKey | None, object]] = []
        with self.lock:
            freed = 0
            held = idx.sizes.get(key, 0)
            while st.used_bytes() - held - freed + need > st.capacity_bytes:
                v = self.key_index.victim(tier)
                rec = self.key_index.record(v.key) if v is not None and v.key is not None else None
                if v is None or v.key is None or rec is None:
                    break
                freed += idx.sizes.get(v.key, 0)
                self.key_index.remove(tier, v.key)
                out.append((v.key, v.num_tokens, rec.ns, rec.parent, rec.owner))
        return out

    # ---- entries leaving --------------------------------------------------------------------
    def delete(self, dels: list[Deletion]) -> None:
        """Delete from the stores what the index gave up (called unlocked)."""
        for t, key, ns in dels:
            self.stores[t].delete(key, ns)

    def release(self, key: BlockKey) -> None:
        """Drop one holding of `key` below, deleting what leaves with it."""
        with self.lock:
            dels = self.key_index.release(key)
        self.delete(dels)

    def forget(self, tier: int, key: BlockKey) -> None:
        """Unindex `key` from `tier`, which no longer holds it (stale or corrupt).

        Its descendants go too when nothing else holds it."""
        with self.lock:
            dels = self.key_index.release(key) if self.key_index.remove(tier, key) else []
        self.delete(dels)

    def take_out(self, tier: int, keys: Sequence[BlockKey], ns: Namespace) -> None:
        """Remove `keys` from `tier`: they were loaded and live on the device now.

        Their children below stay reachable through the device's copies. One lock and one
        store call for the batch: a load moves tens of blocks."""
        dels: list[Deletion] = []
        with self.lock:
            idx = self.key_index
            for key in keys:
                if idx.remove(tier, key):
                    dels += idx.release(key)
        self.stores[tier].delete_many(keys, ns)
        self.delete(dels)

    def drop_key(self, key: BlockKey, ns: Namespace) -> list[Deletion]:
        """Delete `key` of namespace `ns` from every tier, with its descendants.

        For a device block deleted on purpose (flush, quota cut). Returns what was
        deleted."""
        dels: list[Deletion] = []
        with self.lock:
            rec = self.key_index.record(key)
            for t in self.key_index.where(key) if rec is not None else []:
                st = self.stores[t]
                assert rec is not None
                if st.ns(rec.ns) == st.ns(ns):
                    self.key_index.remove(t, key)
                    dels.append((t, key, rec.ns))
                    dels += self.key_index.release(key, leaving_device=True)
            dels += self.key_index.settle(key, leaving_device=True)
        self.delete(dels)
        self.count_deleted(dels)
        return dels

    def drop_tenant(self, tenant: str | None, ns: Namespace, shared: bool) -> list[Deletion]:
        """Count a flush of `tenant` and unindex its entries on every tier (lock held).

        The count drops its demotions queued before the flush. In a share group only the
        entries it filled go, and those found at start-up. Returns what to delete from the
        stores."""
        self.flushes[tenant] = self.flushed(tenant) + 1
        dels: list[Deletion] = []
        records = self.key_index.records
        for t, idx in enumerate(self.indexes):
            st = self.stores[t]
            digest = st.ns(ns)
            mine = [k for k in idx.entries if st.ns(records[k].ns) == digest
                    and (not shared or records[k].owner in (tenant, UNKNOWN_OWNER))]
            for k in mine:
                rec = records.get(k)  # None: gone with an ancestor just now
                if rec is not None and self.key_index.remove(t, k) is not None:
                    dels.append((t, k, rec.ns))
                    dels += self.key_index.release(k)
        return dels

    def count_loaded(self, tiers: Sequence[int], est_load_s: float,
                     est_recompute_s: float) -> None:
        """Count blocks written into the device out of `tiers` (one entry per block).

        Also adds the estimated seconds of a plan that loaded whole."""
        c = self.counters
        c.loaded_blocks += len(tiers)
        c.promoted_bytes += len(tiers) * self.block_bytes
        for t in tiers:
            self.load_blocks[t] += 1
        c.est_load_s += est_load_s
        c.est_recompute_saved_s += est_recompute_s

    def count_hit(self, name: str, tokens: int) -> None:
        """A prompt got `tokens` from tier `name` (the engine's prompt count)."""
        t = self.tier_of(name)
        if t is not None:
            self.hit_tokens[t] += tokens
            self.hit_blocks[t] += -(-tokens // self.block_tokens)  # a partial one at most

    def count_deleted(self, dels: list[Deletion]) -> None:
        """Count `dels` in their tiers' `deleted` figures (flushes, quota cuts)."""
        for t, _key, _ns in dels:
            self.deleted[t] += 1

    # ---- request hints (kvheat/cache/hints.py) ----------------------------------------------
    def begin(self, session: str) -> None:
        """Tell each tier's policy that a request of `session` starts (`on_session`).

        They hear it before the request's loads and saves, as the device cache tells its
        own policy."""
        if not isinstance(check_session(session), str):
            raise ValueError("begin needs a session")
        with self.lock:
            now = self.clock()
            for idx in self.indexes:
                idx.policy.on_session(session, now)

    def finish(self, keys: Sequence[BlockKey], session: str | None, outcome: Outcome | str,
               reason: str | None) -> int:
        """Tell each tier's policy that a request whose blocks are `keys` ended (`on_finish`).

        `keys` are in prefix order. Each policy hears how it ended, with the request's
        entries it holds, and re-files those entries as the device cache re-files a
        request's blocks at its end (acquired before, then released tail-first). A policy
        that takes no finish hint is left untouched: its order is exactly as without the
        call. Returns how many entries the policies were told of."""
        outcome = Outcome.parse(outcome)
        reason = check_reason(reason)
        check_session(session)
        told = 0
        with self.lock:
            now = self.clock()
            for idx in self.indexes:
                pol = idx.policy
                if type(pol).on_finish is EvictionPolicy.on_finish:
                    continue  # no use for it: no re-filing either (LRU would move them)
                entries: list[Node] = [e for k in keys if (e := idx.get(k)) is not None]
                free = [e for e in entries if e.ref_cnt == 0]  # a pinned one: at its unpin
                pol.on_acquire_all(free)
                pol.on_finish(entries, session, outcome, reason, now)
                free.reverse()
                pol.on_release_all(free, now)
                told += len(entries)
        return told

    # ---- introspection ----------------------------------------------------------------------
    def entries(self) -> list[tuple[str, BlockKey, BlockKey | None, int]]:
        """(tier name, key, parent key, tokens) of every entry held below now."""
        with self.lock:
            return [(st.name, key, self.key_index.parent(key), e.num_tokens)
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
