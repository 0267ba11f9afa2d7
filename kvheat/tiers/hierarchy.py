"""Tier placement under one policy: the device pool of a real `KVCacheManager` on top,
then host, disk and Redis stores below it (docs/tiers.md).

`TieredCache` wires the parts, each in its own module:
- `client.TierClient`: the narrow interface (lookup, load, save) over `lower.LowerTiers`,
  the stores with the one index of what they hold (`index.KeyIndex`: per key its tiers,
  parent, salt and owner; per tier its eviction order, `index.TierIndex`);
- `demotion.Demoter`: blocks the device evicts go down, through a queue and its thread;
- `cost.LoadCost`: load or recompute, from measured transfers and the prefill speed;
- `loads.Reads` and `promotion.Promoter`: prefetch plans, loader threads, and the loads
  that fill a request's new device blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..cache.block import Block
from ..cache.manager import KVCacheManager, Request
from ..cache.request import hit_rate
from .client import TierClient
from .cost import PrefillSpeed
from .counters import TierCounters
from .index import TierIndex
from .loads import LoadPlan
from .lower import IndexListener
from .promotion import Promoter
from .spec import TierSpec
from .store import DeviceBlocks, KVStore


class TieredCache:
    """A device `KVCacheManager` + its KV pool with lower tiers below it. `spec` gives how
    blocks move (its store settings are for `spec.build_tiers`, which makes `tiers`)."""

    def __init__(self, mgr: KVCacheManager, device: DeviceBlocks, tiers: list[KVStore],
                 spec: TierSpec | None = None, prefill_tokens_per_s: PrefillSpeed = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.mgr = mgr
        self.device = device
        self.tiers = tiers
        self.spec = spec = spec or TierSpec()
        self.clock = clock or mgr.clock
        self.block_bytes = device.bytes_per_block
        probe = device.block_view(0)
        self.block_shape = tuple(probe.shape)
        self.block_dtype = probe.dtype
        self.client = client = TierClient(
            tiers, spec, block_bytes=self.block_bytes, block_tokens=mgr.block_size,
            policy=mgr.config.policy, clock=self.clock,
            prefill_tokens_per_s=prefill_tokens_per_s,
            device_holds=lambda key: key in mgr.cached,
            known_salts=lambda: [mgr.salt_of(t) for t in mgr.known_tenants()])
        # The device's evictions come back down: a loaded block lives on the device only.
        client.move_on_load = spec.mode == "exclusive"
        self.lower = low = client.lower
        self.indexes: list[TierIndex] = low.indexes
        self.keys = low.keys  # the one index of what lies below
        self.counters: TierCounters = low.counters
        self.tier_hit_blocks = low.hit_blocks
        self.tier_demotions = low.demotions
        self.tier_deleted = low.deleted
        # Called with (tier name, key, parent key, tokens, True) when a tier takes a key and
        # (tier name, key, None, 0, False) when it loses it.
        self.index_listeners: list[IndexListener] = low.listeners
        self.cost = client.cost
        self.reads = client.reads
        self.demoter = client.demoter
        self.promoter = Promoter(client, mgr, device)
        mgr.evict_listeners.append(self._on_device_evict)
        mgr.drop_listeners.append(self._on_device_drop)

    # Keys other replicas put in a shared tier (tiers.shared.SharedTierFeed sets itself).
    @property
    def peers(self) -> Any:
        return self.lower.peers

    @peers.setter
    def peers(self, feed: Any) -> None:
        self.lower.peers = feed

    def tier_of(self, name: str) -> int | None:
        return self.lower.tier_of(name)

    # ---- the scheduler's calls ----------------------------------------------------------
    def prefetch(self, req: Request) -> int:
        """Plan a waiting request's lower-tier loads and start the slow ones now; returns
        the tokens planned. `lookup` picks the plan up; `cancel_prefetch` drops it."""
        return self.promoter.prefetch(req)

    def lookup(self, req: Request, hit_blocks: int) -> LoadPlan:
        """What the tiers load for `req` after the device's first `hit_blocks` (a plan,
        pinned under the request's id until `load` or `cancel_prefetch`)."""
        return self.promoter.lookup(req, hit_blocks)

    def load(self, req: Request, plan: LoadPlan) -> int:
        """Fill `req`'s new device blocks from `plan` (`req` was just allocated with the
        device prefix the plan follows); returns the blocks loaded, a prefix of it."""
        return self.promoter.load(req, plan)

    def cancel_prefetch(self, request_id: str) -> None:
        self.promoter.cancel_prefetch(request_id)

    def allocate(self, req: Request, count_stats: bool = True) -> list[int]:
        """`mgr.allocate` plus lower-tier hits loaded into the new device blocks, in one
        call (tests, replays; `count_stats`: see `Promoter.allocate`)."""
        return self.promoter.allocate(req, count_stats)

    def record_prompt(self, num_tokens: int, cached_by_tier: Mapping[str, int]) -> None:
        """Count one prompt's hits by tier, here and in the device cache's stats at once
        (`Promoter.record_prompt`): the engine's scheduler calls it for every prompt."""
        self.promoter.record_prompt(num_tokens, cached_by_tier)

    # ---- load or recompute --------------------------------------------------------------
    def prefill_speed(self) -> float | None:
        return self.cost.prefill_speed()

    def estimate_load_s(self, tier: int, n_blocks: int) -> float | None:
        return self.cost.estimate_load_s(tier, n_blocks)

    def calibrate(self, rounds: int = 3) -> dict[str, dict[str, float | None]]:
        """Time real puts and gets of probe blocks on every tier (deleted after)."""
        return self.cost.calibrate(rounds)

    # ---- a tier's health (the server's self-healer) ---------------------------------------
    def set_bypass(self, name: str, on: bool) -> bool:
        """Skip tier `name` (no loads, no demotions: its blocks are recomputed) or use it
        again; False when there is no such tier."""
        t = self.tier_of(name)
        if t is None:
            return False
        self.tiers[t].bypassed = on
        return True

    def probe(self, name: str) -> tuple[bool, float | None]:
        """(healthy, read seconds) of tier `name` now: a probe block is written, read back
        and checked, and the read is no slower than recomputing one block (the cost
        model's test of a load; any good read with no prefill speed known)."""
        t = self.tier_of(name)
        if t is None:
            return False, None
        seconds = self.cost.probe(t)
        speed = self.prefill_speed()
        if seconds is None:
            return False, None
        return speed is None or seconds <= self.mgr.block_size / speed, seconds

    def recalibrate(self, name: str, rounds: int = 3) -> bool:
        """Re-measure tier `name`'s transfers from scratch (`LoadCost.recalibrate`)."""
        t = self.tier_of(name)
        if t is None:
            return False
        self.cost.recalibrate(t, rounds)
        return True

    def backlog_s(self) -> float:
        """Estimated seconds until the loader threads are through the reads queued now."""
        return self.reads.backlog_s()

    # ---- the device's evictions and deletions ---------------------------------------------
    def _on_device_evict(self, b: Block) -> None:
        """The manager's eviction listener: `b` is about to lose its KV; it goes down."""
        if not self.tiers or b.key is None:
            return
        # The device evicts leaves first, so the parent is still cached there now.
        parent = b.parent.key if b.parent is not None else None
        self.client.demote(b.key, self.mgr.salt_of(b.tenant), b.num_tokens,
                           self.device.block_view(b.block_id), parent, b.tenant)

    def _on_device_drop(self, b: Block) -> None:
        """A device block deleted on purpose (flush, quota cut): its key goes from every
        tier (write-through copies included), and so do its descendants below."""
        if self.tiers and b.key is not None:
            self.lower.drop_key(b.key, self.mgr.salt_of(b.tenant))

    def purge_tenant(self, tenant: str | None) -> dict[str, int]:
        """Delete what the tiers hold of `tenant` (a flush): its entries on every tier,
        durable ones included, its queued demotions and its requests' load plans. Only its
        own: in a share group, the entries other members filled stay (entries found at
        start-up, whose filler is unknown, go with any member's flush). Returns the
        entries deleted per tier name."""
        low = self.lower
        salt = self.mgr.salt_of(tenant)
        shared = tenant is not None and tenant in self.mgr.config.share_groups
        out = {st.name: 0 for st in self.tiers}
        with low.lock:
            plans = self.promoter.drop_plans_of(tenant)
            dels = low.drop_tenant(tenant, salt, shared)
        for plan in plans:
            self.reads.release(plan.steps)
        low.delete(dels)
        low.count_deleted(dels)
        for t, _k, _s in dels:
            out[self.tiers[t].name] += 1
        if not shared:  # entries other processes put there (replicas on one Redis)
            for t, st in enumerate(self.tiers):
                n = st.purge(salt)
                out[st.name] += n
                self.tier_deleted[t] += n
        return out

    # ---- lifecycle and introspection ------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued demotions are written (tests, benchmarks, shutdown)."""
        self.demoter.flush(timeout_s)

    def close(self) -> None:
        self.client.close()
        if self._on_device_evict in self.mgr.evict_listeners:
            self.mgr.evict_listeners.remove(self._on_device_evict)
        if self._on_device_drop in self.mgr.drop_listeners:
            self.mgr.drop_listeners.remove(self._on_device_drop)

    def entries(self) -> list[tuple[str, bytes, bytes | None, int]]:
        """(tier name, key, parent key, tokens) of every entry held below now (KV event
        snapshots)."""
        return self.lower.entries()

    def stats(self) -> dict[str, object]:
        """Plain counters and measured figures (the server turns them into metrics)."""
        c = self.counters
        q = c.query_tokens
        return {
            **self.client.stats(),
            "device_hit_rate": hit_rate(c.device_hit_tokens, q),
            "total_hit_rate": hit_rate(c.device_hit_tokens + c.lower_hit_tokens, q),
            "prefill_tokens_per_s": self.prefill_speed(),
        }
