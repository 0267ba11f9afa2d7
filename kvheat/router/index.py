"""The router's global prefix index, built from the replicas' KV events.

For every prefix key it knows which replicas hold it and where: on the device (the
engine's pool), on a lower tier of that replica (host memory, local disk), or in the
shared tier (Redis) that every replica can load from. Replicas are bits of an int mask,
so a lookup walks the request's keys once with a few integer operations per key.

Keys are kvheat's chained keys: tenant-salted, so a lookup for one tenant never matches
another's blocks. Replicas whose events use other hashes (vLLM's) are indexed by content:
their stores carry token ids (vLLM always sends them), from which the index recomputes
kvheat's key of each block (the root salted by the request's `cache_salt`, which the
router sets to the tenant's salt), and it keeps the replica's own hash only to resolve
parents and removals.

Everything here is filled from the replicas' events, so all of it is bounded: a unit
holds at most `max_blocks` keys (over its places, tiers and ranks) and, for a foreign
unit, as many hash aliases (an alias goes when no set of its rank holds its key any
more). A foreign unit past the bound forgets its oldest blocks (as if removed); a kvheat
unit is cleared and resynced from its publisher's snapshot. Tier names, (place, tier,
rank) sets per unit and ranks per replica are bounded too; each overflow is counted
(`overflow.count`) and logged at most once per interval.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..cache.hashing import chain_key, root_key, tokens_to_bytes
from ..checks.bounds import Overflow
from ..kvevents.schema import (
    MEDIUM_GPU,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from ..kvevents.subscriber import ResyncNeeded

log = logging.getLogger("kvheat.router")
DEVICE, LOCAL_TIER, SHARED_TIER = 0, 1, 2
# Keys (and, for a foreign unit, hash aliases) one unit may hold: about 250 bytes each,
# so the default bounds a unit near 500 MiB; far above a replica's device pool and host
# tier (a 80 GB GPU holds some 10^5 blocks of 16 tokens).
MAX_BLOCKS = 1 << 21
MAX_TIER_NAME = 64  # characters of an event's `ownership` (a tier's name)
MAX_SETS = 256  # (place, tier, rank) sets of one unit
MAX_RANKS = 64  # units (data-parallel ranks, A/B arms) of one kvheat replica

_AliasMap = OrderedDict[tuple[bytes | int, int], tuple[bytes, bytes]]


@dataclass(slots=True)
class Match:
    """What one replica holds of a request, in blocks from the start of the prompt."""

    device_blocks: int = 0
    local_blocks: int = 0  # after the device prefix, on this replica's lower tiers
    shared_blocks: int = 0  # after those, in the shared tier
    device_tokens: int = 0
    local_tokens: int = 0
    shared_tokens: int = 0
    # The prefix this replica holds or evicted lately (its eviction policy still has a
    # history of those keys): where a prefix lived, when nobody holds it now.
    recent_blocks: int = 0

    @property
    def blocks(self) -> int:
        """Blocks of the prompt the replica holds anywhere: device, lower tiers, shared tier."""
        return self.device_blocks + self.local_blocks + self.shared_blocks


def place_of(medium: str | None, locality: str | None) -> int:
    """Where an event's block lives: the shared tier, the device, or a local lower tier."""
    if locality == REMOTE:
        return SHARED_TIER
    if medium is None or medium == MEDIUM_GPU:
        return DEVICE
    return LOCAL_TIER


class PrefixIndex:
    """Which replicas hold each prefix key, and where, from their KV events.

    Replicas are indexed per arm: a kvheat replica's A/B arms (its events'
    `data_parallel_rank`) are caches of their own, and a request reaches one of them (the
    user's), so each (replica, rank) is a unit with its own bit. A foreign (vLLM) replica's
    data-parallel ranks are one unit (vLLM picks the rank), whose key stays while any rank
    holds it."""

    def __init__(self, ghost_factor: float = 12.0,
                 keyer: Callable[[bytes], bytes] | None = None,
                 max_blocks: int = MAX_BLOCKS) -> None:
        if not 0 <= ghost_factor <= 64:
            raise ValueError("ghost_factor is a multiple of the keys held, in [0, 64]")
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.overflow = Overflow(log, "the router's prefix index (blocks, aliases, tiers or "
                                 "ranks of one replica)")
        self._lock = threading.Lock()
        # The published form of a kvheat key (the events secret's `event_key`): the keys of
        # foreign stores, recomputed from token ids, are indexed in that form.
        self.keyer = keyer
        self._units: dict[str, dict[int, int]] = {}  # replica -> rank -> bit
        self._free_bits: list[int] = []
        self._next_bit = 0
        # key -> mask of units, per place; a unit's keys per (place, tier name, rank), so a
        # key on two of its tiers (write-through) or ranks stays until all lose it.
        self.masks: tuple[dict[bytes, int], dict[bytes, int], dict[bytes, int]] = ({}, {}, {})
        self._held: dict[int, dict[tuple[int, str | None, int], set[bytes]]] = {}
        self._count: dict[int, int] = {}  # bit -> keys over its sets (for `max_blocks`)
        # Units indexed by content (foreign hashes): (their hash, rank) -> (kvheat's chain
        # key, its indexed form), oldest store first.
        self._alias: dict[int, _AliasMap] = {}
        self.foreign: set[str] = set()
        self.unresolved = 0  # foreign stores whose parent was unknown (not indexed)
        # Keys replicas evicted from their devices lately: key -> mask, oldest first, as
        # many as `ghost_factor` x the keys held. 12: a kvheat replica remembers its last
        # 2/3 to 4/3 of 8x capacity evictions (kvheat/heat/counts.py), up to 10.7x, and
        # replicas evict at slightly different rates; the index forgets none it may still
        # remember, so a prefix sent back to where it lived finds its count there, where one
        # elsewhere would start from nothing (docs/cluster.md). About 150 bytes a ghost.
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_factor = ghost_factor
        # Keys of requests routed and not finished, per unit (a count each): they count
        # as on its device until their own events arrive, so a burst on one new prefix
        # lands together. key -> mask, and (bit, key) -> requests expecting it.
        self.expected: dict[bytes, int] = {}
        self._expect_counts: dict[tuple[int, bytes], int] = {}

    # ---- replicas -------------------------------------------------------------------------
    def add_replica(self, name: str, foreign_hashes: bool = False) -> int:
        """Index replica `name` (`foreign_hashes`: a vLLM one); returns its rank 0 unit's bit."""
        with self._lock:
            if name in self._units:
                return self._units[name][0]
            self._units[name] = {}
            if foreign_hashes:
                self.foreign.add(name)
            return self._unit(name, 0)

    def _unit(self, name: str, rank: int) -> int:
        """The bit of (name, rank), made on first sight (lock held)."""
        ranks = self._units[name]
        if name in self.foreign:
            rank = 0
        bit = ranks.get(rank)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else self._next_bit
            if bit == self._next_bit:
                self._next_bit += 1
            ranks[rank] = bit
            self._held[bit] = {}
            self._count[bit] = 0
            if name in self.foreign:
                self._alias[bit] = OrderedDict()
        return bit

    def remove_replica(self, name: str) -> None:
        """Forget replica `name` and everything it held."""
        with self._lock:
            ranks = self._units.pop(name, None)
            if ranks is None:
                return
            for bit in ranks.values():
                self._clear(bit)
                del self._held[bit]
                del self._count[bit]
                self._alias.pop(bit, None)
                for (b, k) in [x for x in self._expect_counts if x[0] == bit]:
                    del self._expect_counts[(b, k)]
                    v = self.expected.get(k, 0) & ~(1 << bit)
                    if v:
                        self.expected[k] = v
                    else:
                        self.expected.pop(k, None)
                self._free_bits.append(bit)
            self.foreign.discard(name)

    def clear_replica(self, name: str) -> None:
        """Forget what `name` holds, on every rank, and what it evicted.

        It restarted, or its events are lost: a snapshot refills it."""
        with self._lock:
            for bit in self._units.get(name, {}).values():
                self._clear(bit)

    def bit_of(self, name: str, rank: int = 0) -> int | None:
        """The bit of replica `name`'s arm `rank` (rank 0 for a foreign one); None if unknown."""
        ranks = self._units.get(name)
        if ranks is None:
            return None
        return ranks.get(0 if name in self.foreign else rank)

    @property
    def replicas(self) -> list[str]:
        """The indexed replicas' names."""
        return list(self._units)

    def blocks_of(self, name: str, place: int = DEVICE) -> int:
        """Distinct keys replica `name` holds at `place`, over its ranks and tiers."""
        bits = self._units.get(name, {}).values()
        return len(set().union(*(s for b in bits for (p, _t, _r), s in self._held[b].items()
                                 if p == place)))

    def aliases_of(self, name: str) -> int:
        """The foreign hashes kept for `name` (to resolve parents and removals)."""
        return sum(len(self._alias.get(b, ())) for b in self._units.get(name, {}).values())

    # ---- updates --------------------------------------------------------------------------
    def stored(self, name: str, keys: Iterable[bytes], place: int = DEVICE,
               tier: str | None = None, rank: int = 0) -> None:
        """Record that `name`'s arm `rank` holds `keys` at `place` (on `tier`)."""
        with self._lock:
            if name in self._units:
                self._store(self._unit(name, rank), keys, place, tier, rank)

    def removed(self, name: str, keys: Iterable[bytes], place: int = DEVICE,
                tier: str | None = None, rank: int = 0) -> None:
        """Record that `name`'s arm `rank` no longer holds `keys` at `place` (on `tier`)."""
        with self._lock:
            if name in self._units:
                self._remove(self._unit(name, rank), keys, place, tier, rank)

    def apply(self, name: str, batch: KVEventBatch) -> None:
        """Apply one publisher's batch (kvheat's or vLLM's), to the unit of its rank."""
        with self._lock:
            if name not in self._units:
                return
            rank = batch.data_parallel_rank or 0
            if not 0 <= rank < 1 << 16:
                raise ValueError(f"data_parallel_rank {rank} out of range")
            if name not in self.foreign and rank not in self._units[name] and \
                    len(self._units[name]) >= MAX_RANKS:
                self.overflow(why=f"{name}: more than {MAX_RANKS} ranks")
                return
            bit = self._unit(name, rank)
            alias = self._alias.get(bit)
            for ev in batch.events:
                if isinstance(ev, AllBlocksCleared):
                    # A resync (or a restart) of this rank: what it held goes, what it
                    # evicted stays remembered (a resync does not make it forget).
                    self._clear(bit, rank, ghosts=False)
                    continue
                if ev.ownership is not None and len(ev.ownership) > MAX_TIER_NAME:
                    self.overflow(why=f"{name}: a tier name over {MAX_TIER_NAME} characters")
                    continue
                place = place_of(ev.medium, ev.locality)
                if isinstance(ev, BlockStored):
                    keys = _own_keys(ev.block_hashes) if alias is None else \
                        self._translate(alias, ev, rank)
                    self._store(bit, keys, place, ev.ownership, rank)
                    if self._count[bit] > self.max_blocks or \
                            (alias is not None and len(alias) > self.max_blocks):
                        self._over(name, bit, rank, alias)
                elif not isinstance(ev, BlockRemoved):
                    continue
                elif alias is None:
                    self._remove(bit, _own_keys(ev.block_hashes), place, ev.ownership, rank)
                else:
                    got = [(hk, alias[hk]) for hk in ((h, rank) for h in ev.block_hashes)
                           if hk in alias]
                    self._remove(bit, [v[1] for _, v in got], place, ev.ownership, rank)
                    # An alias goes with the last copy of its block on this rank.
                    sets = [s for (_p, _t, r), s in self._held[bit].items() if r == rank]
                    for hk, (_c, k) in got:
                        if not any(k in s for s in sets):
                            alias.pop(hk, None)

    def _over(self, name: str, bit: int, rank: int, alias: _AliasMap | None) -> None:
        """Unit `bit` holds more than `max_blocks` keys (lock held). A foreign unit
        forgets its oldest stores (as if removed, without a ghost: vLLM evicts its
        oldest first too); a kvheat unit's rank is cleared and resynced from a snapshot."""
        if alias is None:
            self._clear(bit, rank, ghosts=False)
            self.overflow(why=f"{name}: more than {self.max_blocks} blocks; resyncing")
            raise ResyncNeeded(f"{name} holds more than {self.max_blocks} blocks")
        n = 0
        sets = self._held[bit]
        while (self._count[bit] > self.max_blocks or len(alias) > self.max_blocks) and alias:
            (_h, r), (_c, k) = alias.popitem(last=False)
            n += 1
            for (p, t, r2), s in list(sets.items()):
                if r2 == r and k in s:
                    self._remove(bit, [k], p, t, r2, ghost=False)
        if n:
            self.overflow(n, f"{name}: more than {self.max_blocks} blocks; the oldest "
                          "forgotten")

    def _translate(self, alias: _AliasMap, ev: BlockStored, rank: int) -> list[bytes]:
        """kvheat keys of a foreign store, from its token ids."""
        n = len(ev.block_hashes)
        bs = ev.block_size
        if bs <= 0 or len(ev.token_ids) != n * bs:
            self.unresolved += n
            return []
        if ev.parent_block_hash is None:
            parent = root_key(_cache_salt_in(ev))
        else:
            got = alias.get((ev.parent_block_hash, rank))
            if got is None:
                self.unresolved += n
                return []
            parent = got[0]
        out = []
        raw = tokens_to_bytes(ev.token_ids)
        keyer = self.keyer
        for i, h in enumerate(ev.block_hashes):
            parent = chain_key(parent, raw[4 * bs * i:4 * bs * (i + 1)])
            key = parent if keyer is None else keyer(parent)
            hk = (h, rank)
            alias[hk] = (parent, key)
            alias.move_to_end(hk)  # stored again (another tier): the newest
            out.append(key)
        return out

    def _store(self, bit: int, keys: Iterable[bytes], place: int, tier: str | None,
               rank: int = 0) -> None:
        if not isinstance(keys, list):
            keys = list(keys)
        if not keys:
            return
        sets = self._held[bit]
        held = sets.get((place, tier, rank))
        if held is None:
            if len(sets) >= MAX_SETS:
                self.overflow(why=f"more than {MAX_SETS} (place, tier, rank) sets of a "
                              "replica; a store to a new one is dropped")
                return
            held = sets[(place, tier, rank)] = set()
        before = len(held)
        m = self.masks[place]
        flag = 1 << bit
        ghosts = self.ghosts if place == DEVICE else None
        for k in keys:
            m[k] = m.get(k, 0) | flag
            held.add(k)
            if ghosts:
                g = ghosts.get(k)
                if g is not None and g & flag:
                    if g == flag:
                        del ghosts[k]
                    else:
                        ghosts[k] = g & ~flag
        self._count[bit] += len(held) - before

    def _remove(self, bit: int, keys: Iterable[bytes], place: int, tier: str | None,
                rank: int = 0, ghost: bool = True) -> None:
        """Drop `keys` from one of `bit`'s sets, and from the place's mask where no other
        set of the unit there holds them; on the device, remembered as evicted (a ghost)
        unless `ghost` is False (a key forgotten, not evicted)."""
        m = self.masks[place]
        sets = self._held[bit]
        held = sets.get((place, tier, rank))
        if held is None:
            return
        before = len(held)
        flag = 1 << bit
        others = [s for (p, t, r), s in sets.items() if p == place and (t, r) != (tier, rank)]
        ghosts = self.ghosts if place == DEVICE and ghost else None
        for k in keys:
            if k not in held:
                continue
            held.discard(k)
            if any(k in s for s in others):
                continue
            v = m.get(k, 0) & ~flag
            if v:
                m[k] = v
            else:
                m.pop(k, None)
            if ghosts is not None:
                ghosts[k] = ghosts.get(k, 0) | flag
                ghosts.move_to_end(k)
        self._count[bit] -= before - len(held)
        if not held:  # an empty set is one less toward MAX_SETS
            del sets[(place, tier, rank)]
        if ghosts is not None:
            cap = int(self.ghost_factor * max(len(m), 1024))
            while len(ghosts) > cap:
                ghosts.popitem(last=False)

    def _clear(self, bit: int, rank: int | None = None, ghosts: bool = True) -> None:
        """Forget the unit's keys (of one rank's sets only, when given), and, with
        `ghosts`, its eviction memory."""
        flag = 1 << bit
        sets = self._held[bit]
        gone = [pk for pk in sets if rank is None or pk[2] == rank]
        for pk in gone:
            keys = sets.pop(pk)
            self._count[bit] -= len(keys)
            m = self.masks[pk[0]]
            rest = [s for (p, _t, _r), s in sets.items() if p == pk[0]]
            for k in keys:
                if any(k in s for s in rest):
                    continue
                v = m.get(k, 0) & ~flag
                if v:
                    m[k] = v
                else:
                    m.pop(k, None)
        if ghosts:
            for k in [k for k, g in self.ghosts.items() if g & flag]:
                g = self.ghosts[k] & ~flag
                if g:
                    self.ghosts[k] = g
                else:
                    del self.ghosts[k]
        alias = self._alias.get(bit)
        if alias is not None:
            if rank is None:
                alias.clear()
            else:
                for hk in [hk for hk in alias if hk[1] == rank]:
                    del alias[hk]

    def expect(self, name: str, keys: Iterable[bytes], rank: int = 0) -> None:
        """Count `keys` as on `name`'s device until their own events arrive.

        For a request routed there: a burst on one new prefix then lands together."""
        with self._lock:
            bit = self.bit_of(name, rank)
            if bit is None:
                return
            flag = 1 << bit
            exp, counts = self.expected, self._expect_counts
            for k in keys:
                c = counts.get((bit, k), 0)
                counts[(bit, k)] = c + 1
                if not c:
                    exp[k] = exp.get(k, 0) | flag

    def unexpect(self, name: str, keys: Iterable[bytes], rank: int = 0) -> None:
        """Undo one `expect` of `keys` on `name` (the request finished)."""
        with self._lock:
            bit = self.bit_of(name, rank)
            if bit is None:
                return
            flag = 1 << bit
            exp, counts = self.expected, self._expect_counts
            for k in keys:
                c = counts.get((bit, k), 0)
                if c > 1:
                    counts[(bit, k)] = c - 1
                    continue
                counts.pop((bit, k), None)
                v = exp.get(k, 0) & ~flag
                if v:
                    exp[k] = v
                else:
                    exp.pop(k, None)

    # ---- lookup ---------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], block_tokens: Sequence[int],
              names: Sequence[str], rank: int = 0) -> list[Match]:
        """For each replica in `names` (its arm `rank`), how much of `keys` it holds, and where.

        Its device prefix of `keys`, then what its lower tiers hold after that, then what
        the shared tier holds after that."""
        with self._lock:
            dev, loc, shr = self.masks
            bits = [self.bit_of(n, rank) for n in names]
            n = len(keys)
            want = 0
            for b in bits:
                if b is not None:
                    want |= 1 << b
            # One walk for every replica's device prefix.
            dev_len: dict[int, int] = {}
            alive = want
            i = 0
            exp = self.expected
            while alive and i < n:
                k = keys[i]
                m = (dev.get(k, 0) | exp.get(k, 0)) & alive
                gone = alive & ~m
                while gone:
                    low = gone & -gone
                    dev_len[low.bit_length() - 1] = i
                    gone ^= low
                alive = m
                i += 1
            while alive:
                low = alive & -alive
                dev_len[low.bit_length() - 1] = n
                alive ^= low
            out = []
            for b in bits:
                if b is None:
                    out.append(Match())
                    continue
                flag = 1 << b
                d = dev_len.get(b, 0)
                j = d
                while j < n and loc.get(keys[j], 0) & flag:
                    j += 1
                s = j
                while s < n and shr.get(keys[s], 0):
                    s += 1
                g = d
                ghosts = self.ghosts
                while g < n and (ghosts.get(keys[g], 0) | dev.get(keys[g], 0)) & flag:
                    g += 1
                out.append(Match(d, j - d, s - j, sum(block_tokens[:d]),
                                 sum(block_tokens[d:j]), sum(block_tokens[j:s]), g))
            return out

    def __len__(self) -> int:
        return len(self.masks[DEVICE])


def _own_keys(hashes: list[bytes | int]) -> list[bytes]:
    """kvheat's keys are 16 bytes; anything else in a kvheat batch is a bad batch."""
    keys = [h for h in hashes if isinstance(h, bytes) and len(h) == 16]
    if len(keys) != len(hashes):
        raise ValueError("a kvheat block hash is 16 bytes")
    return keys


def _cache_salt_in(ev: BlockStored) -> str | None:
    """The `cache_salt` a vLLM store names for its first block (its extra keys hold the
    LoRA name, multimodal pairs, then the salt string): read back, never derived here; the
    router sent it, as `PromptKeys.salt` derives it from the tenant."""
    if not ev.extra_keys or ev.extra_keys[0] is None:
        return None
    strs = [x for x in ev.extra_keys[0] if isinstance(x, str) and x != ev.lora_name]
    return strs[-1] if strs else None
