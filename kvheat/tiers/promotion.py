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

from ..cache.manager import KVCacheManager, Request
from .client import TierClient
from .loads import LoadPlan, Step
from .store import DeviceBlocks


class Promoter:
    """Load plans of waiting requests, and the loads that fill their device blocks."""

    def __init__(self, client: TierClient, mgr: KVCacheManager, device: DeviceBlocks) -> None:
        self.client = client
        self.lower = client.lower
        self.mgr = mgr
        self.device = device
        self.reads = client.reads
        self.plans: dict[str, LoadPlan] = {}  # request id -> its prefetched plan

    # ---- plans (called with the lock held) --------------------------------------------
    def _make_plan(self, req: Request, start: int) -> LoadPlan:
        return self.client.plan(req.keys, req.block_tokens, start,
                                self.mgr.salt_of(req.tenant), req.tenant)

    def _refit(self, req: Request, plan: LoadPlan, hit: int) -> list[Step] | None:
        """Fit a kept plan to the device prefix now `hit` blocks long: blocks the device
        gained meanwhile need no load; blocks it lost (a gap before the plan) are added
        in front when the tiers hold them, so the planned reads are never done again.
        Returns the added steps (not submitted yet), or None when the plan no longer fits
        (it is unpinned then)."""
        self.reads.release([s for s in plan.steps if s.index < hit])
        plan.set_steps([s for s in plan.steps if s.index >= hit])
        if not plan.steps or plan.steps[0].index == hit:
            plan.start = hit
            return [] if plan.steps else None
        front = self.client.find(req.keys, req.block_tokens, hit, plan.steps[0].index,
                                 plan.salt)
        if hit + len(front) != plan.steps[0].index:
            self.reads.release(front + plan.steps)
            return None
        plan.set_steps(front + plan.steps)
        plan.start = hit
        plan.found_blocks += len(front)
        plan.found_tokens += sum(s.tokens for s in front)
        return front

    # ---- the scheduler's calls ----------------------------------------------------------
    def _prepare(self, req: Request, hit: int) -> LoadPlan:
        """The request's plan after the device's `hit` blocks: the one kept since an
        earlier call, fitted to `hit`, or a new one; kept under the request's id (pinned,
        its slow reads started) while it has blocks to load."""
        low = self.lower
        with low.lock:
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
            self.client.start_reads(plan, front)
            return plan
        with low.lock:
            plan = self._make_plan(req, hit)
            if not plan.steps:
                return plan
            self.plans[req.request_id] = plan
            low.counters.prefetch_plans += 1
        self.client.start_reads(plan)
        return plan

    def prefetch(self, req: Request) -> int:
        """Plan a waiting request's lower-tier loads and start the slow ones now; returns
        the tokens planned. `lookup` picks the plan up; `cancel_prefetch` drops it."""
        with self.lower.lock:
            hit = len(self.mgr.match_prefix(req))
        return self._prepare(req, hit).tokens

    def lookup(self, req: Request, hit: int) -> LoadPlan:
        """The blocks after the device's first `hit` that the tiers will load for `req`
        (the plan kept since its prefetch, or a new one). It stays pinned under the
        request's id until `load`, or `cancel_prefetch`: an admission that gets no
        blocks now keeps it, and its reads, for the next try."""
        plan = self._prepare(req, hit)
        if plan.steps:
            self.lower.counters.prefetch_used += 1
        return plan

    def load(self, req: Request, plan: LoadPlan) -> int:
        """Fill `req`'s new device blocks (it was just allocated, sharing the device
        prefix the plan follows) from `plan`; returns the blocks loaded, a prefix of the
        plan. A head of the request (a chunked prefill) loads what it covers."""
        with self.lower.lock:
            if self.plans.get(req.request_id) is plan:
                del self.plans[req.request_id]
        beyond = [s for s in plan.steps if s.index >= len(req.keys)]
        if beyond:
            self.reads.release(beyond)
            plan.set_steps(plan.steps[:len(plan.steps) - len(beyond)])
        return self.client.load(plan, [req.blocks[s.index].block_id for s in plan.steps],
                                self.device)

    def cancel_prefetch(self, request_id: str) -> None:
        with self.lower.lock:
            plan = self.plans.pop(request_id, None)
        if plan is not None:
            self.reads.release(plan.steps)

    def drop_plans_of(self, tenant: str | None) -> list[LoadPlan]:
        """Take out the tenant's plans (a flush: their loads would bring the KV back); the
        caller releases them after, unlocked. Called with the lock held."""
        mine = [rid for rid, plan in self.plans.items() if plan.owner == tenant]
        return [self.plans.pop(rid) for rid in mine]

    def allocate(self, req: Request, count_stats: bool = True) -> list[int]:
        """`mgr.allocate` plus lower-tier hits loaded into the new device blocks, counted
        as cached in `req.num_cached_tokens` (a whole prompt in one call: tests, replays;
        the engine's scheduler uses `lookup` and `load`). `count_stats`: count `req` as
        a whole prompt, every token it got from a tier a hit (`record_prompt`)."""
        low = self.lower
        with low.lock:
            hit = self.mgr.match_prefix(req)
            plan = self.plans.pop(req.request_id, None)
            if plan is not None:
                # Blocks the device gained meanwhile need no load; a gap it cannot fill
                # means replanning. Added front steps are read in `load`, in this thread.
                if self._refit(req, plan, len(hit)) is None:
                    low.counters.prefetch_replanned += 1
                    plan = None
                else:
                    low.counters.prefetch_used += 1
            if plan is None:
                plan = self._make_plan(req, len(hit))
            if plan.steps:
                # Kept if no blocks are free now: the plan, its pins and its reads (in
                # flight or done) wait for the next try, so a block is read once.
                self.plans[req.request_id] = plan
        table = self.mgr.allocate(req, matched=hit, count_stats=False)
        device_tokens = req.num_cached_tokens
        n = self.load(req, plan)
        loaded = plan.steps[:n]
        req.num_cached_tokens += sum(s.tokens for s in loaded)
        if count_stats:
            by_tier = {"device": device_tokens}
            for s in loaded:
                by_tier[s.name] = by_tier.get(s.name, 0) + s.tokens
            self.record_prompt(req.num_tokens, by_tier, len(hit) + n)
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
        bs = self.mgr.block_size
        device = cached_by_tier.get("device", 0)
        lower = 0
        for name, n in cached_by_tier.items():
            if name == "device" or n <= 0:
                continue
            low.count_hit(name, n)
            lower += n
        c.requests += 1
        c.query_tokens += num_tokens
        c.device_hit_tokens += device
        c.lower_hit_tokens += lower
        self.mgr.record_prompt(num_tokens, device + lower,
                              (device + lower) // bs if hit_blocks is None else hit_blocks)
