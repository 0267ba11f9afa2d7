"""The one face of the lower KV tiers: what an engine's scheduler and workers ask of the
stores below its device pool, kvheat's own engine and vLLM's KV connector
(`kvheat.integrations.vllm_connector`) alike.

Scheduler side, index only, no I/O: `lookup` finds how many blocks right after the
device's prefix the tiers hold in a tenant's namespace (`Namespace`), decides how many are worth loading
(`cost.LoadCost`) and pins them in a `LoadPlan` until `load` or `release`; given a request
id the plan is kept under it across admissions (`prefetch`, `cancel`).
Worker side: `load` writes a plan's blocks into device slots (every value checked by its
store; the first missing, corrupt or unreachable block ends the loaded prefix: the rest is
recomputed), `save` copies device blocks down (`demotion.Demoter`), `evict` takes one
leaving the device. Operations: `health`, `set_bypass`, `probe`, `recalibrate`, `purge`.
`index_listeners` hears every key a tier takes or loses (KV events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from ..cache.hashing import BlockKey, Namespace
from ..cache.hints import Outcome
from ..cache.request import hit_rate
from .cost import LoadCost, PrefillSpeed
from .counters import TierCounters
from .demotion import Demoter
from .loads import LoadPlan, Reads, Step
from .lower import IndexListener, LowerTiers
from .spec import TierSpec
from .store import DeviceBlocks, KVStore

__all__ = ["IndexListener", "LoadPlan", "TierHealth", "TierManager"]

_NS = object()  # `save`'s default owner: the namespace itself


@dataclass(frozen=True, slots=True)
class TierHealth:
    """One tier as an operator (the self-healer) sees it."""

    name: str
    up: bool  # reachable and not bypassed
    bypassed: bool
    slow: bool  # read off the engine's thread (disk, Redis); host copies never are
    drift: float | None  # latest reads' time over the transfer model's estimate


class TierManager:
    """The lower tiers of one device pool, built from `spec`.

    `block_bytes` / `block_tokens`: one device block's size. `model` names the weights and
    `layout` the stored format (`store_layout` of the device: "gqa-b16-bfloat16"): KV
    stored under other names is never read. `policy`: the tiers' eviction policy (the
    spec's wins). `device_holds(key)`: does the device hold `key` now (an entry whose
    parent neither a tier nor the device holds can never be matched, so it is dropped);
    without one, the device may hold any key. `known_namespaces`: the namespaces whose
    entries found in a store at start-up are indexed in them (others stay in their stored
    digest's until their tenant asks). `stores`: stores made by the
    caller instead of the spec's (fault injection in tests; not closed with the tiers).
    A spec that names no tier gives tiers with none (every lookup finds nothing)."""

    def __init__(self, spec: TierSpec, *, block_bytes: int, block_tokens: int,
                 model: str = "", layout: str = "", policy: str = "lru",
                 clock: Callable[[], float] = time.monotonic,
                 prefill_tokens_per_s: PrefillSpeed = None,
                 device_holds: Callable[[BlockKey], bool] | None = None,
                 known_namespaces: Callable[[], Iterable[Namespace]] | None = None,
                 stores: list[KVStore] | None = None) -> None:
        if block_bytes <= 0 or block_tokens <= 0:
            raise ValueError("block_bytes and block_tokens must be positive")
        self.spec = spec
        self._own_stores = stores is None  # closed with the tiers
        self.stores = stores = spec.stores_for(block_bytes, model, layout) \
            if stores is None else stores
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.clock = clock
        self.lower = low = LowerTiers(stores, block_bytes, block_tokens, spec.policy or policy,
                                      clock, known_namespaces)
        # Without a view of the device, any key may be there: a saved block whose parent
        # the tiers do not hold is kept (its parent may be a device hit), and a key that
        # leaves the tiers takes no descendants with it (unreachable ones age out).
        low.key_index.on_device = device_holds or (lambda key: True)
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
        # back down (kvheat's, in exclusive mode). Tiers that only save keep copies.
        self.move_on_load = False
        self.plans: dict[str, LoadPlan] = {}  # request id -> the plan kept for it
        if (slow if spec.calibrate is None else spec.calibrate) and \
                prefill_tokens_per_s is not None:
            self.cost.calibrate()

    # ---- the tiers ------------------------------------------------------------------------
    def tier_of(self, name: str) -> int | None:
        """The index (top first) of the tier named `name`, or None."""
        return self.lower.tier_of(name)

    # ---- scheduler side -------------------------------------------------------------------
    def lookup(self, ns: Namespace, keys: Sequence[BlockKey], start: int,
               block_tokens: Sequence[int] | None = None, owner: object = None,
               request_id: str | None = None) -> LoadPlan:
        """Plan the blocks `keys[start:]` that the tiers hold in namespace `ns`.

        Up to the first one missing, cut to the prefix worth loading; pinned until `load`
        or `release`. `block_tokens[i]`: tokens of block i (default: full blocks);
        `owner`: the tenant it is for, kept on the plan. With a `request_id`, the plan
        kept for it since a `prefetch` or an earlier admission is fitted to a device
        prefix now `start` blocks long (its reads in flight or done kept), and a plan
        with blocks to load stays kept until `load` or `cancel`; its slow reads start
        now. Without one, no I/O until `load` (or `start_reads`)."""
        if not 0 <= start <= len(keys):
            raise ValueError(f"start {start} is outside the {len(keys)} keys")
        tokens = block_tokens if block_tokens is not None else [self.block_tokens] * len(keys)
        if request_id is None:
            with self.lower.lock:
                return self.plan(keys, tokens, start, ns, owner)
        plan = self._prepare(request_id, keys, tokens, start, ns, owner)
        if plan.steps:
            self.counters.prefetch_used += 1
        return plan

    def prefetch(self, request_id: str, ns: Namespace, keys: Sequence[BlockKey],
                 start: int, block_tokens: Sequence[int] | None = None,
                 owner: object = None) -> int:
        """Plan a waiting request's loads and start the slow ones; returns the tokens planned.

        `lookup` with the same id picks the plan up; `cancel` drops it."""
        tokens = block_tokens if block_tokens is not None else [self.block_tokens] * len(keys)
        return self._prepare(request_id, keys, tokens, start, ns, owner).tokens

    def cancel(self, request_id: str) -> None:
        """Drop the plan kept for `request_id` (its pins and reads), if any."""
        with self.lower.lock:
            plan = self.plans.pop(request_id, None)
        if plan is not None:
            self.release(plan)

    def release(self, plan: LoadPlan) -> None:
        """Let go of a plan not loaded: its entries are unpinned, its reads dropped.

        Once: a plan loaded or released already is left as it is."""
        if plan.pinned:
            plan.pinned = False
            self.reads.release(plan.steps)
            plan.set_steps([])

    def holds(self, ns: Namespace, key: BlockKey) -> str | None:
        """The name of the first tier (up) holding `key` in namespace `ns`, or None."""
        low = self.lower
        with low.lock:
            found = low.find(key, ns)
        if found is not None:
            return low.stores[found[0]].name
        if low.peers is not None:
            peer = low.peers.lookup(key)
            if peer is not None and low.up(peer[0]):
                return low.stores[peer[0]].name
        return None

    def _prepare(self, request_id: str, keys: Sequence[BlockKey], tokens: Sequence[int],
                 hit: int, ns: Namespace, owner: object) -> LoadPlan:
        """The request's plan after the device's `hit` blocks: the one kept, fitted to
        `hit`, or a new one; kept while it has blocks to load, its slow reads started."""
        low = self.lower
        with low.lock:
            plan = self.plans.pop(request_id, None)
            front = self._refit(plan, keys, tokens, hit) if plan is not None else None
            if plan is not None and front is not None:
                self.plans[request_id] = plan  # its reads in flight or done stay
            else:
                if plan is not None:
                    self.counters.prefetch_replanned += 1
                plan = self.plan(keys, tokens, hit, ns, owner)
                plan.request_id = request_id
                front = None
                if plan.steps:
                    self.plans[request_id] = plan
                    self.counters.prefetch_plans += 1
        if plan.steps:
            self.reads.start(plan, front)
        return plan

    def _refit(self, plan: LoadPlan, keys: Sequence[BlockKey], tokens: Sequence[int],
               hit: int) -> list[Step] | None:
        """Fit a kept plan to the device prefix now `hit` blocks long: blocks the device
        gained meanwhile need no load; blocks it lost (a gap before the plan) are added in
        front when the tiers hold them, so the planned reads are never done again. Returns
        the added steps, or None when the plan no longer fits (released then). Lock held."""
        if not plan.pinned:  # released meanwhile (a flush of its tenant)
            return None
        self.reads.release([s for s in plan.steps if s.index < hit])
        plan.set_steps([s for s in plan.steps if s.index >= hit])
        if not plan.steps or plan.steps[0].index == hit:
            plan.start = hit
            if plan.steps:
                return []
            plan.pinned = False
            return None
        front = self.find(keys, tokens, hit, plan.steps[0].index, plan.ns)
        if hit + len(front) != plan.steps[0].index:
            self.reads.release(front + plan.steps)
            plan.pinned = False
            plan.set_steps([])
            return None
        plan.set_steps(front + plan.steps)
        plan.start = hit
        plan.found_blocks += len(front)
        plan.found_tokens += sum(s.tokens for s in front)
        return front

    def plan(self, keys: Sequence[BlockKey], tokens: Sequence[int], start: int,
             ns: Namespace, owner: object) -> LoadPlan:
        """Pin the blocks found below after the first `start`; keep the prefix worth loading.

        Called with the lock held."""
        plan = LoadPlan(ns, block_tokens=self.block_tokens, start=start, owner=owner)
        steps = self.find(keys, tokens, start, len(keys), ns)
        plan.found_blocks = len(steps)
        plan.found_tokens = sum(s.tokens for s in steps)
        plan.steps = steps  # decide reads them
        k = self.cost.decide(plan, self.reads.backlog_s())
        self.reads.release(steps[k:])
        plan.set_steps(steps[:k])
        plan.pinned = True
        return plan

    def find(self, keys: Sequence[BlockKey], tokens: Sequence[int], start: int, stop: int,
             ns: Namespace) -> list[Step]:
        """Pin blocks `start` .. `stop` - 1 held below, up to the first one missing.

        Called with the lock held."""
        low = self.lower
        steps: list[Step] = []
        for i in range(start, stop):
            key = keys[i]
            found = low.find(key, ns)
            if found is None and low.peers is not None:
                peer = low.peers.lookup(key)
                if peer is not None and low.up(peer[0]):
                    steps.append(Step(i, key, peer[0], low.stores[peer[0]].name, peer[1],
                                      tokens[i], peer=True))
                    continue
            if found is None:
                break
            low.pin(found[0], found[1])
            steps.append(Step(i, key, found[0], low.stores[found[0]].name, found[1], tokens[i]))
        return steps

    def trim(self, plan: LoadPlan, stop: int) -> None:
        """Let go of the plan's blocks from index `stop` on.

        A chunked prefill's head loads what it covers."""
        beyond = [s for s in plan.steps if s.index >= stop]
        if beyond:
            self.reads.release(beyond)
            plan.set_steps(plan.steps[:len(plan.steps) - len(beyond)])

    def start_reads(self, plan: LoadPlan) -> None:
        """Start the plan's slow reads (disk, Redis) on the loader threads now.

        They overlap whatever runs before `load`."""
        self.reads.start(plan)

    # ---- worker side ----------------------------------------------------------------------
    def load(self, plan: LoadPlan, slots: Sequence[int], device: DeviceBlocks) -> int:
        """Write the plan's blocks into device slots, in order, up to the first bad one.

        `plan.keys[i]`'s KV goes into slot `slots[i]` (`device.write_block`); the first
        block that is missing, fails its MAC/checksum or whose store is down ends it.
        Returns the number loaded (a prefix of the plan); unpins the plan. Slots past the
        loaded prefix may have been written (host reads go straight into them): their KV is to be
        recomputed. A plan built by hand (keys, no pins: made by another process) is
        looked up first."""
        low = self.lower
        with low.lock:
            if plan.request_id is not None and self.plans.get(plan.request_id) is plan:
                del self.plans[plan.request_id]
            if plan.keys and not plan.steps:
                tokens = [plan.block_tokens or self.block_tokens] * len(plan.keys)
                plan.set_steps(self.find(plan.keys, tokens, 0, len(plan.keys), plan.ns))
                plan.pinned = True
            elif plan.steps and not plan.pinned:
                raise ValueError("this plan was loaded or released already")
        plan.pinned = False  # unpinned below, whatever happens
        steps = plan.steps
        if steps and device.bytes_per_block != self.block_bytes:
            self.reads.release(steps)
            raise ValueError(f"device blocks have {device.bytes_per_block} bytes; these "
                             f"tiers hold blocks of {self.block_bytes}")
        if len(slots) < len(steps):
            self.reads.release(steps)
            raise ValueError(f"{len(steps)} blocks to load into {len(slots)} slots")
        if not steps:
            _count_plan(self.counters, plan)
            return 0
        dst = {id(s): slot for s, slot in zip(steps, slots, strict=False)}
        got: dict[int, torch.Tensor | None] = {}
        # Slow reads not prefetched run here, in this thread, in prefix order.
        sync = [s for s in steps if s.result is None and not low.stores[s.tier].inline]
        if sync:
            got.update(zip((id(s) for s in sync), self.reads.fetch(sync, plan.ns),
                           strict=False))
        for tier, st in enumerate(low.stores):  # host: one batched read per tier, in place
            run = [s for s in steps if s.tier == tier] if st.inline else []
            if not run:
                continue
            views = [device.block_view(dst[id(s)]) for s in run]
            try:
                vals = st.get_many([s.key for s in run], plan.ns, outs=views)
            except ValueError:  # a stored layout that is not this pool's
                low.counters.shape_mismatch += 1
                vals = [None] * len(run)
            low.counters.read_bytes += sum(v.nbytes for v in vals if v is not None)
            got.update(zip((id(s) for s in run), vals, strict=True))
        done: list[Step] = []
        for s in steps:
            t = s.result.get() if s.result is not None else got.get(id(s))
            if t is not None and not low.stores[s.tier].inline:
                view = device.block_view(dst[id(s)])
                if tuple(t.shape) != tuple(view.shape) or t.dtype != view.dtype:
                    low.counters.shape_mismatch += 1
                    t = None
                else:
                    device.write_block(dst[id(s)], t)
            if t is None:
                low.counters.load_failed += 1
                if s.peer:  # the other replica evicted it meanwhile
                    low.peers.forget(s.key)
                else:
                    low.forget(s.tier, s.key)  # stale or corrupt (descendants, if orphaned)
                break
            s.done = True
            done.append(s)
        whole = len(done) == len(steps)
        low.count_loaded([s.tier for s in done], plan.est_load_s if whole else 0.0,
                         plan.est_recompute_s if whole else 0.0)
        if self.move_on_load:  # the blocks now live on the device only
            for tier in range(len(low.stores)):
                # (another replica's block stays there for everyone)
                moved = [s.key for s in done if s.tier == tier and not s.peer]
                if moved:
                    low.take_out(tier, moved, plan.ns)
        # Unpinned after the move: an entry taken out is not handed back to its policy's
        # eviction order only to be pulled out of it again.
        self.reads.release(steps)
        _count_plan(self.counters, plan)
        return len(done)

    def save(self, ns: Namespace, keys: Sequence[BlockKey],
             parents: Sequence[BlockKey | None], slots: Sequence[int], device: DeviceBlocks,
             owner: object = _NS) -> int:
        """Copy device blocks down to the tiers now; returns the blocks accepted.

        `slots[i]` holds a full block keyed `keys[i]` whose prefix's previous key is
        `parents[i]`; slow tiers may be written on a background thread. A key is stored
        once, in the namespace it first came with: keys must differ between namespaces
        (kvheat's do: the tenant salt seeds the first block's key). `owner`: the tenant
        whose flush deletes them (default: the namespace)."""
        if not len(keys) == len(parents) == len(slots):
            raise ValueError(f"{len(keys)} keys, {len(parents)} parents, {len(slots)} slots")
        if device.bytes_per_block != self.block_bytes:
            raise ValueError(f"device blocks have {device.bytes_per_block} bytes; these "
                             f"tiers hold blocks of {self.block_bytes}")
        who = ns if owner is _NS else owner
        return sum(self.demoter.demote(key, ns, device.block_size, device.block_view(slot),
                                       parent, who, leaving_device=False)
                   for key, parent, slot in zip(keys, parents, slots, strict=True))

    def evict(self, key: BlockKey, ns: Namespace, tokens: int, kv: torch.Tensor,
              parent: BlockKey | None, owner: object) -> bool:
        """Take one block leaving the device (its eviction) down to the tiers."""
        return self.demoter.demote(key, ns, tokens, kv, parent, owner, True)

    def drop(self, key: BlockKey, ns: Namespace) -> None:
        """Delete `key` from every tier with its descendants.

        A device block deleted on purpose: a flush, a quota cut (write-through copies
        included)."""
        self.lower.drop_key(key, ns)

    def purge(self, tenant: str | None, ns: Namespace, shared: bool) -> dict[str, int]:
        """Delete what the tiers hold of `tenant` (a flush); returns entries per tier.

        `ns` is its namespace.

        Its entries on every tier, durable ones included, its queued demotions and its
        requests' kept plans. In a share group (`shared`) only what it filled (entries
        found at start-up, whose filler is unknown, go with any member's flush)."""
        low = self.lower
        out = {st.name: 0 for st in self.stores}
        with low.lock:
            mine = [rid for rid, p in self.plans.items() if p.owner == tenant]
            plans = [self.plans.pop(rid) for rid in mine]
            dels = low.drop_tenant(tenant, ns, shared)
        for plan in plans:
            self.release(plan)
        low.delete(dels)
        low.count_deleted(dels)
        for t, _k, _s in dels:
            out[self.stores[t].name] += 1
        if not shared:  # entries other processes put there (replicas on one Redis)
            for t, st in enumerate(self.stores):
                n = st.purge(ns)
                out[st.name] += n
                low.deleted[t] += n
        return out

    def record_prompt(self, num_tokens: int, cached_by_tier: Mapping[str, int]) -> int:
        """Count one prompt's hits by the tier that held them; returns the lower tiers'.

        `cached_by_tier`: tokens served by "device" or a store's name (a token recomputed
        is in none). Every prompt, loads or not, so the tiers' hit rates and the device
        cache's (which the caller counts with the sum) are one figure."""
        low = self.lower
        c = low.counters
        lower = 0
        for name, n in cached_by_tier.items():
            if name != "device" and n > 0:
                low.count_hit(name, n)
                lower += n
        c.requests += 1
        c.query_tokens += num_tokens
        c.device_hit_tokens += cached_by_tier.get("device", 0)
        c.lower_hit_tokens += lower
        return lower

    # ---- request hints (kvheat/cache/hints.py) ----------------------------------------------
    def begin(self, session: str) -> None:
        """Tell each tier's policy a request of `session` starts (`on_session`)."""
        self.lower.begin(session)

    def finish(self, keys: Sequence[BlockKey], session: str | None,
               outcome: Outcome | str = Outcome.FINISHED, reason: str | None = None) -> int:
        """Tell each tier's policy how a request whose blocks are `keys` ended.

        Each policy that takes finish hints hears it (`on_finish`) with the request's
        entries it holds, re-filed as the device cache re-files a request's blocks at its
        end. Returns the entries the policies were told of."""
        return self.lower.finish(keys, session, outcome, reason)

    # ---- operations: load or recompute, health ---------------------------------------------
    def prefill_speed(self) -> float | None:
        """The engine's measured prefill speed in tokens/s (None: not known yet)."""
        return self.cost.prefill_speed()

    def estimate_load_s(self, tier: int, n_blocks: int) -> float | None:
        """Estimated seconds to load `n_blocks` from `tier` (its transfer model)."""
        return self.cost.estimate_load_s(tier, n_blocks)

    def calibrate(self, rounds: int = 3) -> dict[str, dict[str, float | None]]:
        """Time real puts and gets of probe blocks on every tier (deleted after)."""
        return self.cost.calibrate(rounds)

    def health(self) -> list[TierHealth]:
        """Each tier's state, top first."""
        low = self.lower
        return [TierHealth(st.name, low.up(t), t in low.bypassed, not st.inline,
                           st.read_model.drift())
                for t, st in enumerate(self.stores)]

    def set_bypass(self, name: str, on: bool) -> bool:
        """Skip tier `name` or use it again; False when there is no such tier.

        A skipped tier gets no loads and no demotions: its blocks are recomputed."""
        t = self.tier_of(name)
        if t is None:
            return False
        if on:
            self.lower.bypassed.add(t)
        else:
            self.lower.bypassed.discard(t)
        return True

    def probe(self, name: str) -> tuple[bool, float | None]:
        """Probe tier `name` now; returns (healthy, read seconds).

        A probe block is written, read back and checked, and the read is no slower than recomputing one block (any good read
        while no prefill speed is known)."""
        t = self.tier_of(name)
        seconds = self.cost.probe(t) if t is not None else None
        if seconds is None:
            return False, None
        speed = self.prefill_speed()
        return speed is None or seconds <= self.block_tokens / speed, seconds

    def recalibrate(self, name: str, rounds: int = 3) -> bool:
        """Re-measure tier `name`'s transfers from scratch (`LoadCost.recalibrate`)."""
        t = self.tier_of(name)
        if t is None:
            return False
        self.cost.recalibrate(t, rounds)
        return True

    # ---- introspection and lifecycle ------------------------------------------------------
    def entries(self) -> list[tuple[str, BlockKey, BlockKey | None, int]]:
        """Every entry held now, as (tier name, key, parent key, tokens).

        For KV event snapshots."""
        return self.lower.entries()

    def stats(self) -> dict[str, object]:
        """The counters, hit rates, the demotion queue's depth and each tier's figures.

        Per tier ("0:host", ...): its store's figures (hits, get_bytes, used_bytes,
        corrupt_*, io_errors...) with `load_blocks` / `load_bytes` (loaded into the
        device) and `faults` (reads that failed a check or the network)."""
        c = self.counters
        q = c.query_tokens
        return {**asdict(c), "queue_depth": self.demoter.queue.qsize(),
                "tiers": self.lower.describe(q),
                "device_hit_rate": hit_rate(c.device_hit_tokens, q),
                "total_hit_rate": hit_rate(c.device_hit_tokens + c.lower_hit_tokens, q),
                "prefill_tokens_per_s": self.prefill_speed()}

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued demotions are written (tests, benchmarks, shutdown)."""
        self.demoter.flush(timeout_s)

    def close(self) -> None:
        """Write what is queued, stop the threads; close the stores the spec made."""
        self.demoter.close()
        self.reads.close()
        if self._own_stores:
            for st in self.stores:
                st.close()
            self._own_stores = False


def _count_plan(c: TierCounters, plan: LoadPlan) -> None:
    """Count the load-or-recompute decision of one plan loaded."""
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
