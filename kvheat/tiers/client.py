"""The narrow tier interface: what an engine's scheduler and workers ask of the tiers
below its device pool, kvheat's own engine (`hierarchy.TieredCache`) and vLLM's KV
connector (`kvheat.integrations.vllm_connector`) alike.

Scheduler side, index only, no I/O: `lookup` finds how many blocks right after the
device's prefix the tiers hold for a tenant salt, decides how many are worth loading
(`cost.LoadCost`) and pins them in a `LoadPlan` until `load` or `release`.
Worker side: `load` writes a plan's blocks into device slots (every value checked by its
store; the first missing, corrupt or unreachable block ends the loaded prefix: the rest is
recomputed), `save` copies device blocks down to the tiers (`demotion.Demoter`).
`index_listeners` hears every key a tier takes or loses (KV events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from ..cache.eviction import EvictionPolicy
from ..cache.hints import Outcome, check_reason, check_session
from ..cache.node import Node
from .cost import LoadCost, PrefillSpeed
from .counters import TierCounters
from .demotion import Demoter
from .loads import LoadPlan, Reads, Step
from .lower import IndexListener, LowerTiers
from .spec import TierSpec
from .store import DeviceBlocks, KVStore

__all__ = ["IndexListener", "LoadPlan", "TierClient"]

_SALT = object()  # `save`'s default owner: the salt itself


class TierClient:
    """The lower tiers of one device pool, behind lookup / load / save.

    `stores`: the tiers, top first (`TierSpec.stores_for` builds them). `policy`: the
    tiers' eviction policy. `device_holds(key)`: does the device hold `key` now (an entry
    whose parent neither a tier nor the device holds can never be matched, so it is
    dropped); without one, the device may hold any key. `known_salts`: the salts whose entries
    found in a store at start-up are indexed under their salt (others stay keyed by their
    namespace digest, found all the same)."""

    def __init__(self, stores: list[KVStore], spec: TierSpec | None = None, *,
                 block_bytes: int, block_tokens: int, policy: str = "lru",
                 clock: Callable[[], float] = time.monotonic,
                 prefill_tokens_per_s: PrefillSpeed = None,
                 device_holds: Callable[[bytes], bool] | None = None,
                 known_salts: Callable[[], Iterable[str | None]] | None = None,
                 own_stores: bool = False) -> None:
        spec = spec or TierSpec()
        if block_bytes <= 0 or block_tokens <= 0:
            raise ValueError("block_bytes and block_tokens must be positive")
        self.spec = spec
        self.stores = stores
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.clock = clock
        self.own_stores = own_stores  # close them with the client
        self.lower = low = LowerTiers(stores, block_bytes, block_tokens, spec.policy or policy,
                                      clock, known_salts)
        # Without a view of the device, any key may be there: a saved block whose parent
        # the tiers do not hold is kept (its parent may be a device hit), and a key that
        # leaves the tiers takes no descendants with it (unreachable ones age out).
        low.keys.on_device = device_holds or (lambda key: True)
        self.counters: TierCounters = low.counters
        # (tier name, key, parent key, tokens, True) when a tier takes a key and
        # (tier name, key, None, 0, False) when it loses it; called under the tiers' lock.
        self.index_listeners: list[IndexListener] = low.listeners
        slow = any(not st.inline for st in stores)
        background = slow if spec.async_io is None else spec.async_io
        self.cost = LoadCost(stores, block_bytes, prefill_tokens_per_s, spec.remeasure_s,
                             low.counters)
        self.reads = Reads(low, self.cost.estimate_load_s, spec.load_workers if background else 0)
        self.demoter = Demoter(low, spec.mode == "write_through", spec.queue_size, background)
        # A loaded block leaves its tier: set by an engine whose device evictions come
        # back down (kvheat's, in exclusive mode). A client that only saves keeps copies.
        self.move_on_load = False
        if (slow if spec.calibrate is None else spec.calibrate) and \
                prefill_tokens_per_s is not None:
            self.cost.calibrate()

    @classmethod
    def from_spec(cls, spec: TierSpec, *, block_bytes: int, block_tokens: int, model: str,
                  layout: str, clock: Callable[[], float] = time.monotonic,
                  policy: str = "lru", prefill_tokens_per_s: PrefillSpeed = None,
                  device_holds: Callable[[bytes], bool] | None = None) -> TierClient:
        """The tiers `spec` names, for blocks of `block_bytes` bytes and `block_tokens`
        tokens. `model` names the weights and `layout` the stored format (`store_layout`
        of the device: "gqa-b16-bfloat16"): KV stored under other names is never read.
        A spec that names no tier gives a client with none (every lookup finds nothing)."""
        stores = spec.stores_for(block_bytes, model, layout)
        return cls(stores, spec, block_bytes=block_bytes, block_tokens=block_tokens,
                   policy=policy, clock=clock, prefill_tokens_per_s=prefill_tokens_per_s,
                   device_holds=device_holds, own_stores=True)

    # ---- the tiers ------------------------------------------------------------------------
    def tier_of(self, name: str) -> int | None:
        return self.lower.tier_of(name)

    @property
    def peers(self) -> Any:
        """Keys other replicas put in a shared tier (`shared.SharedTierFeed` sets itself)."""
        return self.lower.peers

    @peers.setter
    def peers(self, feed: Any) -> None:
        self.lower.peers = feed

    # ---- scheduler side -------------------------------------------------------------------
    def lookup(self, salt: str | None, keys: Sequence[bytes], start: int,
               block_tokens: Sequence[int] | None = None, owner: object = None) -> LoadPlan:
        """The blocks `keys[start:]` that the tiers hold in `salt`'s namespace, up to the
        first one missing, cut to the prefix worth loading; pinned until `load` or
        `release`. No I/O (`start_reads` starts the slow reads early; else `load` does
        them). `block_tokens[i]`: tokens of block i (default: full blocks); `owner`: the
        tenant it is for, kept on the plan."""
        if not 0 <= start <= len(keys):
            raise ValueError(f"start {start} is outside the {len(keys)} keys")
        tokens = block_tokens if block_tokens is not None else [self.block_tokens] * len(keys)
        with self.lower.lock:
            return self.plan(keys, tokens, start, salt, owner)

    def release(self, plan: LoadPlan) -> None:
        """Let go of a plan not loaded: its entries are unpinned, its reads dropped (once:
        a plan loaded or released already is left as it is)."""
        if plan.pinned:
            plan.pinned = False
            self.reads.release(plan.steps)
            plan.set_steps([])

    def holds(self, salt: str | None, key: bytes) -> str | None:
        """The name of the first tier (up) holding `key` in `salt`'s namespace, or None."""
        low = self.lower
        with low.lock:
            found = low.find(key, salt)
        if found is not None:
            return low.stores[found[0]].name
        if low.peers is not None:
            peer = low.peers.lookup(key)
            if peer is not None and low.stores[peer[0]].available():
                return low.stores[peer[0]].name
        return None

    # ---- plans (the engine's promoter shares these; called with the lock held) ---------------
    def plan(self, keys: Sequence[bytes], tokens: Sequence[int], start: int,
             salt: str | None, owner: object) -> LoadPlan:
        """Pin the blocks found below after the first `start`, then keep the prefix worth
        loading (lock held)."""
        plan = LoadPlan(salt, block_tokens=self.block_tokens, start=start, owner=owner)
        steps = self.find(keys, tokens, start, len(keys), salt)
        plan.found_blocks = len(steps)
        plan.found_tokens = sum(s.tokens for s in steps)
        plan.steps = steps  # decide reads them
        k = self.cost.decide(plan, self.reads.backlog_s())
        self.reads.release(steps[k:])
        plan.set_steps(steps[:k])
        plan.pinned = True
        return plan

    def find(self, keys: Sequence[bytes], tokens: Sequence[int], start: int, stop: int,
             salt: str | None) -> list[Step]:
        """Pin blocks `start` .. `stop` - 1 held below, up to the first one missing (lock
        held)."""
        low = self.lower
        steps: list[Step] = []
        for i in range(start, stop):
            key = keys[i]
            found = low.find(key, salt)
            if found is None and low.peers is not None:
                peer = low.peers.lookup(key)
                if peer is not None and low.stores[peer[0]].available():
                    steps.append(Step(i, key, peer[0], low.stores[peer[0]].name, peer[1],
                                      tokens[i], peer=True))
                    continue
            if found is None:
                break
            low.pin(found[0], found[1])
            steps.append(Step(i, key, found[0], low.stores[found[0]].name, found[1], tokens[i]))
        return steps

    def start_reads(self, plan: LoadPlan, steps: list[Step] | None = None) -> None:
        """Start the plan's slow reads (disk, Redis) on the loader threads now, so they
        overlap whatever runs before `load`."""
        self.reads.start(plan, steps)

    # ---- worker side ----------------------------------------------------------------------
    def load(self, plan: LoadPlan, slots: Sequence[int], device: DeviceBlocks) -> int:
        """Write `plan.keys[i]`'s KV into device slot `slots[i]` (`device.write_block`), in
        order; stop at the first block that is missing, fails its MAC/checksum or whose
        store is down. Returns the number loaded (a prefix of the plan); unpins the plan.
        Slots past that prefix may have been written (host reads go straight into them):
        their KV is to be recomputed. A plan built by hand (keys, no pins: made by another process) is looked up first."""
        if plan.keys and not plan.steps:
            with self.lower.lock:
                tokens = [plan.block_tokens or self.block_tokens] * len(plan.keys)
                steps = self.find(plan.keys, tokens, 0, len(plan.keys), plan.salt)
            plan.set_steps(steps)
            plan.pinned = True
        elif plan.steps and not plan.pinned:
            raise ValueError("this plan was loaded or released already")
        plan.pinned = False  # unpinned below, whatever happens
        if len(slots) < len(plan.steps):
            self.reads.release(plan.steps)
            raise ValueError(f"{len(plan.steps)} blocks to load into {len(slots)} slots")
        if plan.steps and device.bytes_per_block != self.block_bytes:
            self.reads.release(plan.steps)
            raise ValueError(f"device blocks have {device.bytes_per_block} bytes; these "
                             f"tiers hold blocks of {self.block_bytes}")
        n = self._load(plan, slots, device)
        self._count_plan(plan)
        return n

    def save(self, salt: str | None, keys: Sequence[bytes], parents: Sequence[bytes | None],
             slots: Sequence[int], device: DeviceBlocks, owner: object = _SALT) -> int:
        """Copy device blocks `slots[i]` (full blocks, keyed `keys[i]`, whose prefix's
        previous key is `parents[i]`) down to the tiers now; slow tiers may be written on
        a background thread. Returns the blocks accepted. A key is stored once, under the
        salt it first came with: keys must differ between salts (kvheat's do: the salt
        seeds the first block's key). `owner`: the tenant whose flush deletes them
        (default: the salt)."""
        if not len(keys) == len(parents) == len(slots):
            raise ValueError(f"{len(keys)} keys, {len(parents)} parents, {len(slots)} slots")
        if device.bytes_per_block != self.block_bytes:
            raise ValueError(f"device blocks have {device.bytes_per_block} bytes; these "
                             f"tiers hold blocks of {self.block_bytes}")
        who = salt if owner is _SALT else owner
        return sum(self.demote(key, salt, device.block_size, device.block_view(slot), parent,
                               who, leaving_device=False)
                   for key, parent, slot in zip(keys, parents, slots, strict=True))

    def demote(self, key: bytes, salt: str | None, tokens: int, kv: torch.Tensor,
               parent: bytes | None, owner: object, leaving_device: bool = True) -> bool:
        """One block down to the tiers (`Demoter.demote`): the engine's device evictions."""
        return self.demoter.demote(key, salt, tokens, kv, parent, owner, leaving_device)

    def _read_inline(self, plan: LoadPlan, dst: dict[int, int],
                     device: DeviceBlocks) -> dict[int, torch.Tensor | None]:
        """Inline (host) loads: one batched call per tier, straight into the device blocks.
        Keyed by id(step)."""
        low = self.lower
        out: dict[int, torch.Tensor | None] = {}
        for tier, st in enumerate(low.stores):
            run = [s for s in plan.steps if s.tier == tier] if st.inline else []
            if not run:
                continue
            views = [device.block_view(dst[id(s)]) for s in run]
            try:
                got = st.get_many([s.key for s in run], plan.salt, outs=views)
            except ValueError:  # a stored layout that is not this pool's
                low.counters.shape_mismatch += 1
                got = [None] * len(run)
            low.counters.read_bytes += sum(g.nbytes for g in got if g is not None)
            out.update(zip((id(s) for s in run), got, strict=True))
        return out

    def _load(self, plan: LoadPlan, slots: Sequence[int], device: DeviceBlocks) -> int:
        """Fill `slots` from the plan, in order, stopping at the first block that is
        missing or fails its check. Returns the blocks loaded."""
        low, steps = self.lower, plan.steps
        if not steps:
            return 0
        dst = {id(s): slot for s, slot in zip(steps, slots, strict=False)}
        # Slow loads not prefetched run here, in this thread.
        sync_needed = [s for s in steps if s.result is None and not low.stores[s.tier].inline]
        sync_results = dict(zip((id(s) for s in sync_needed),
                                self.reads.fetch(sync_needed, plan.salt),
                                strict=False)) if sync_needed else {}
        inline_results = self._read_inline(plan, dst, device)
        done: list[Step] = []
        failed = False
        for s in steps:
            slot = dst[id(s)]
            if low.stores[s.tier].inline:
                t = inline_results.get(id(s))
            else:
                t = s.result.get() if s.result is not None else sync_results.get(id(s))
                if t is not None:
                    view = device.block_view(slot)
                    if tuple(t.shape) != tuple(view.shape) or t.dtype != view.dtype:
                        low.counters.shape_mismatch += 1
                        t = None
                    else:
                        device.write_block(slot, t)
            if t is None:
                failed = True
                low.counters.load_failed += 1
                if s.peer:  # the other replica evicted it meanwhile
                    low.peers.forget(s.key)
                    break
                low.forget(s.tier, s.key)  # stale or corrupt (descendants, if orphaned)
                break
            s.done = True
            done.append(s)
        c = low.counters
        c.loaded_blocks += len(done)
        c.promoted_bytes += len(done) * low.block_bytes
        for s in done:
            low.load_blocks[s.tier] += 1
        if not failed:
            c.est_load_s += plan.est_load_s
            c.est_recompute_saved_s += plan.est_recompute_s
        if self.move_on_load:  # the blocks now live on the device only
            for tier in range(len(low.stores)):
                # (another replica's block stays there for everyone)
                moved = [s.key for s in done if s.tier == tier and not s.peer]
                if moved:
                    low.take_out(tier, moved, plan.salt)
        # Unpinned after the move: an entry taken out is not handed back to its policy's
        # eviction order only to be pulled out of it again.
        self.reads.release(steps)
        return len(done)

    def _count_plan(self, plan: LoadPlan) -> None:
        """The load-or-recompute decision of one plan loaded."""
        c = self.counters
        c.found_tokens += plan.found_tokens
        if plan.found_blocks:
            n_load = len(plan.steps)
            if n_load == 0:
                c.decisions_recompute += 1
            elif n_load < plan.found_blocks:
                c.decisions_partial += 1
            else:
                c.decisions_load += 1
            c.recompute_chosen_blocks += plan.found_blocks - n_load
            c.recompute_chosen_tokens += plan.found_tokens - sum(s.tokens for s in plan.steps)

    # ---- request hints (kvheat/cache/hints.py) ----------------------------------------------
    def begin(self, session: str) -> None:
        """A request of `session` starts: each tier's policy hears it (`on_session`) before
        the request's loads and saves, as the device cache tells its own policy."""
        if not isinstance(check_session(session), str):
            raise ValueError("begin needs a session")
        low = self.lower
        with low.lock:
            now = low.clock()
            for idx in low.indexes:
                idx.policy.on_session(session, now)

    def finish(self, keys: Sequence[bytes], session: str | None,
               outcome: Outcome | str = Outcome.FINISHED, reason: str | None = None) -> int:
        """A request whose blocks are `keys` (prefix order) ended: each tier's policy hears
        how (`on_finish`, with the request's entries it holds) and re-files those entries
        as the device cache re-files a request's blocks at its end (acquired before, then
        released tail-first). A policy that takes no finish hint is left untouched: its
        order is exactly as without the call. Returns the entries the policies were told of."""
        outcome = Outcome.parse(outcome)
        reason = check_reason(reason)
        check_session(session)
        low = self.lower
        told = 0
        with low.lock:
            now = low.clock()
            for idx in low.indexes:
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

    # ---- introspection and lifecycle ------------------------------------------------------
    def entries(self) -> list[tuple[str, bytes, bytes | None, int]]:
        """(tier name, key, parent key, tokens) of every entry held now (KV event
        snapshots)."""
        return self.lower.entries()

    def stats(self) -> dict[str, object]:
        """The counters, the demotion queue's depth and, per tier ("0:host", ...), its
        store's figures (hits, get_bytes, used_bytes, corrupt_*, io_errors...) with
        `load_blocks` / `load_bytes` (loaded into the device) and `faults` (reads that
        failed a check or the network)."""
        c = self.counters
        return {**asdict(c), "queue_depth": self.demoter.queue.qsize(),
                "tiers": self.lower.describe(c.query_tokens)}

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued demotions are written (tests, benchmarks, shutdown)."""
        self.demoter.flush(timeout_s)

    def close(self) -> None:
        """Write what is queued, stop the threads; close the stores `from_spec` made."""
        self.demoter.close()
        self.reads.close()
        if self.own_stores:
            for st in self.stores:
                st.close()
            self.own_stores = False
