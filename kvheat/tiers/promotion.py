"""Promotion: on a device miss, `allocate` keeps matching the request's next keys on the
lower tiers, decides how many of them to load (`cost.LoadCost`), allocates the device
blocks and fills them, so loaded tokens count as cached (`req.num_cached_tokens`).
`record_prompt` counts a prompt's hits, by tier, in the tiers' counters and the device
cache's stats at once (one count, one hit rate: `kvheat.cache.hit_rate`).
`prefetch` plans and starts the slow loads (disk, Redis) when a request arrives, before the
scheduler allocates it. Stores verify every read; a failed or missing load ends the loaded
prefix there (the engine recomputes the rest), counted. Down tiers are skipped."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..cache.manager import Request
from .cost import LoadCost
from .loads import Plan, Reads, Step
from .lower import LowerTiers
from .store import DeviceBlocks


class Promoter:
    """Load plans of waiting requests, and the loads that fill their device blocks."""

    def __init__(self, lower: LowerTiers, device: DeviceBlocks, cost: LoadCost, reads: Reads,
                 exclusive: bool) -> None:
        self.lower = lower
        self.device = device
        self.cost = cost
        self.reads = reads
        self.exclusive = exclusive  # a loaded block leaves its tier
        self.plans: dict[str, Plan] = {}  # request id -> its prefetched plan
        # (tier name, tokens) of each block the latest `allocate` loaded, in block order:
        # read right after it, on the same thread, to credit a request's hits to tiers.
        self.last_loaded: list[tuple[str, int]] = []

    # ---- plans (called with the lock held) --------------------------------------------
    def _make_plan(self, req: Request, start: int) -> Plan:
        """Pin the request's blocks found on lower tiers after the first `start`, then keep
        the prefix worth loading."""
        salt = self.lower.mgr.salt_of(req.tenant)
        plan = Plan(start, salt, req.tenant)
        plan.steps = self._find(req, start, len(req.keys), salt)
        plan.found_blocks = len(plan.steps)
        plan.found_tokens = sum(s.tokens for s in plan.steps)
        k = self.cost.decide(plan, self.reads.backlog_s())
        self.reads.release(plan.steps[k:])
        plan.steps = plan.steps[:k]
        return plan

    def _find(self, req: Request, start: int, stop: int, salt: str | None) -> list[Step]:
        """Pin the request's blocks `start` .. `stop` - 1 held below, up to the first one
        missing."""
        low = self.lower
        steps: list[Step] = []
        now = low.clock()
        for i in range(start, stop):
            key = req.keys[i]
            found = low.find(key, salt)
            if found is None and low.peers is not None:
                peer = low.peers.lookup(key)
                if peer is not None and low.stores[peer[0]].available():
                    steps.append(Step(i, key, peer[0], peer[1], req.block_tokens[i], peer=True))
                    continue
            if found is None:
                break
            low.indexes[found[0]].pin(found[1], now)
            steps.append(Step(i, key, found[0], found[1], req.block_tokens[i]))
        return steps

    def _refit(self, req: Request, plan: Plan, hit: int) -> list[Step] | None:
        """Fit a kept plan to the device prefix now `hit` blocks long: blocks the device
        gained meanwhile need no load; blocks it lost (a gap before the plan) are added
        in front when the tiers hold them, so the planned reads are never done again.
        Returns the added steps (not submitted yet), or None when the plan no longer fits
        (it is unpinned then)."""
        self.reads.release([s for s in plan.steps if s.index < hit])
        plan.steps = [s for s in plan.steps if s.index >= hit]
        if not plan.steps or plan.steps[0].index == hit:
            plan.start = hit
            return [] if plan.steps else None
        front = self._find(req, hit, plan.steps[0].index, plan.salt)
        if hit + len(front) != plan.steps[0].index:
            self.reads.release(front + plan.steps)
            return None
        plan.steps = front + plan.steps
        plan.start = hit
        plan.found_blocks += len(front)
        plan.found_tokens += sum(s.tokens for s in front)
        return front

    # ---- the scheduler's calls ----------------------------------------------------------
    def prefetch(self, req: Request) -> int:
        """Plan a waiting request's lower-tier loads and start the slow ones now; returns
        the tokens planned. `allocate` picks the plan up; `cancel_prefetch` drops it."""
        low = self.lower
        with low.lock:
            hit = len(low.mgr.match_prefix(req))
            old = self.plans.pop(req.request_id, None)
            front = self._refit(req, old, hit) if old is not None else None
            if old is not None and front is not None:
                # Planned earlier (on arrival, or an admission that found no blocks): keep
                # it, and its reads in flight or done.
                self.plans[req.request_id] = old
                plan = old
            else:
                plan = None
        if plan is not None:
            self.reads.start(plan, front)
            return sum(s.tokens for s in plan.steps)
        with low.lock:
            plan = self._make_plan(req, hit)
            if not plan.steps:
                return 0
            self.plans[req.request_id] = plan
            low.counters.prefetch_plans += 1
        self.reads.start(plan)
        return sum(s.tokens for s in plan.steps)

    def cancel_prefetch(self, request_id: str) -> None:
        with self.lower.lock:
            plan = self.plans.pop(request_id, None)
        if plan is not None:
            self.reads.release(plan.steps)

    def drop_plans_of(self, tenant: str | None) -> list[Plan]:
        """Take out the tenant's plans (a flush: their loads would bring the KV back); the
        caller releases them after, unlocked. Called with the lock held."""
        mine = [rid for rid, plan in self.plans.items() if plan.owner == tenant]
        return [self.plans.pop(rid) for rid in mine]

    def allocate(self, req: Request, count_stats: bool = True) -> list[int]:
        """`mgr.allocate` plus lower-tier hits loaded into the new device blocks.
        `count_stats`: count `req` as a whole prompt, every token it got from a tier a hit
        (`record_prompt`); an engine passes False, allocates a prompt in pieces and
        records it once, the last token it recomputes not a hit."""
        low = self.lower
        self.last_loaded = []
        with low.lock:
            hit = low.mgr.match_prefix(req)
            plan = self.plans.pop(req.request_id, None)
            if plan is not None:
                # Blocks the device gained meanwhile need no load; a gap it cannot fill
                # means replanning. Added front steps are read below, in this thread.
                if self._refit(req, plan, len(hit)) is None:
                    low.counters.prefetch_replanned += 1
                    plan = None
                else:
                    low.counters.prefetch_used += 1
            if plan is None:
                plan = self._make_plan(req, len(hit))
        try:
            table = low.mgr.allocate(req, matched=hit, count_stats=False)
        except Exception:
            # No blocks now: the plan, its pins and its reads (in flight or done) wait for
            # the next try, so a block is read once however long its request waits.
            if plan.steps:
                with low.lock:
                    self.plans[req.request_id] = plan
            raise
        # A chunked prefill allocates a head of the prefetched request: load what fits.
        beyond = [s for s in plan.steps if s.index >= len(req.keys)]
        if beyond:
            self.reads.release(beyond)
            plan.steps = plan.steps[:len(plan.steps) - len(beyond)]
        device_tokens = req.num_cached_tokens
        req.num_cached_tokens += self._load(req, plan)
        self._count_plan(plan)
        if count_stats:
            by_tier = {"device": device_tokens}
            for name, n in self.last_loaded:
                by_tier[name] = by_tier.get(name, 0) + n
            self.record_prompt(req.num_tokens, by_tier,
                               len(hit) + len(self.last_loaded))
        return table

    def record_prompt(self, num_tokens: int, cached_by_tier: Mapping[str, int],
                      hit_blocks: int | None = None) -> None:
        """Count one prompt of `num_tokens` tokens, of which `cached_by_tier` were served
        from cache, by the tier that held them ("device", or a store's name): in the
        tiers' counters, each tier's hit count and the device cache's stats, so the
        tiers' hit rates and the cache's are one figure over the same prompts. Every
        prompt, loads or not; a token recomputed is not in `cached_by_tier`.
        `hit_blocks`: blocks served (None: the full blocks of the tokens served)."""
        low = self.lower
        c = low.counters
        bs = low.mgr.block_size
        device = cached_by_tier.get("device", 0)
        lower = 0
        for name, n in cached_by_tier.items():
            if name == "device" or n <= 0:
                continue
            t = low.tier_of(name)
            if t is not None:
                low.hit_tokens[t] += n
                low.hit_blocks[t] += -(-n // bs)  # one partial block at most: the last
            lower += n
        c.requests += 1
        c.query_tokens += num_tokens
        c.device_hit_tokens += device
        c.lower_hit_tokens += lower
        low.mgr.record_prompt(num_tokens, device + lower,
                              (device + lower) // bs if hit_blocks is None else hit_blocks)

    def _count_plan(self, plan: Plan) -> None:
        """The load-or-recompute decision of one allocation (each admission's own)."""
        c = self.lower.counters
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

    # ---- loading ------------------------------------------------------------------------
    def _read_inline(self, req: Request, plan: Plan) -> dict[int, torch.Tensor | None]:
        """Inline (host) loads: one batched call per tier, straight into the device blocks.
        Keyed by id(step)."""
        low = self.lower
        out: dict[int, torch.Tensor | None] = {}
        for tier, st in enumerate(low.stores):
            run = [s for s in plan.steps if s.tier == tier] if st.inline else []
            if not run:
                continue
            views = [self.device.block_view(req.blocks[s.index].block_id) for s in run]
            try:
                got = st.get_many([s.key for s in run], plan.salt, outs=views)
            except ValueError:  # a stored layout that is not this pool's
                low.counters.shape_mismatch += 1
                got = [None] * len(run)
            low.counters.read_bytes += sum(g.nbytes for g in got if g is not None)
            out.update(zip((id(s) for s in run), got, strict=True))
        return out

    def _load(self, req: Request, plan: Plan) -> int:
        """Fill the request's new device blocks from the plan, in order, stopping at the
        first block that is missing or fails its check. Returns the tokens loaded."""
        low, steps = self.lower, plan.steps
        if not steps:
            return 0
        # Slow loads not prefetched run here, in this thread.
        sync_needed = [s for s in steps if s.result is None and not low.stores[s.tier].inline]
        sync_results = dict(zip((id(s) for s in sync_needed),
                                self.reads.fetch(sync_needed, plan.salt),
                                strict=False)) if sync_needed else {}
        inline_results = self._read_inline(req, plan)
        shape, dtype = self.cost.block_shape, self.cost.block_dtype
        loaded = 0
        done: list[Step] = []
        failed = False
        for s in steps:
            dst = req.blocks[s.index]
            if low.stores[s.tier].inline:
                t = inline_results.get(id(s))
            else:
                t = s.result.get() if s.result is not None else sync_results.get(id(s))
                if t is not None:
                    if tuple(t.shape) != shape or t.dtype != dtype:
                        low.counters.shape_mismatch += 1
                        t = None
                    else:
                        self.device.write_block(dst.block_id, t)
            if t is None:
                failed = True
                low.counters.load_failed += 1
                if s.peer:  # the other replica evicted it meanwhile
                    low.peers.forget(s.key)
                    break
                low.forget(s.tier, s.key)  # stale or corrupt (descendants, if orphaned)
                break
            loaded += s.tokens
            s.done = True
            done.append(s)
        self.last_loaded = [(low.stores[s.tier].name, s.tokens) for s in done]
        c = low.counters
        c.loaded_blocks += len(done)
        c.promoted_bytes += len(done) * low.block_bytes
        if not failed:
            c.est_load_s += plan.est_load_s
            c.est_recompute_saved_s += plan.est_recompute_s
        self.reads.release(steps)
        if self.exclusive:
            for s in done:  # the block now lives on the device only
                if s.peer:  # another replica's: it stays there for everyone
                    continue
                # On the device now, so its children below stay reachable (no cascade
                # unless the manager kept the block private).
                with low.lock:
                    dels = low.links.release(s.key) if low.indexes[s.tier].remove(s.key) else []
                low.stores[s.tier].delete(s.key, plan.salt)
                low.delete(dels)
        return loaded
