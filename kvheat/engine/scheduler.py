"""Continuous-batching scheduler over the kvheat block cache.

Every step it builds one batch of work under a token budget: one token for each running
sequence that decodes, then prefill chunks (continuations and new admissions) split among
the three load classes by weight (load_classes.py; docs/engine.md). Blocks come from `KVCacheManager`: a
sequence's manager request always covers exactly the tokens whose KV is computed or being
computed this step, so `allocate` shares the cached prefix and `append_tokens` takes (and
caches, once full) the blocks of each new chunk or decoded token. A finished sequence's
blocks stay cached, so the next turn of a conversation finds them.

Unwritten blocks. The manager registers a full block's key when it is allocated, before
the forward pass writes its KV. Blocks touched in the current step are kept in `fresh`;
a waiting sequence whose cached prefix includes a fresh block is not admitted in this
step but in the next one, when that KV is written (and it then shares it rather than
computing a copy). A sequence is never preempted in the step it was scheduled, so every
registered block of a freed sequence holds its KV. After the forward pass `update`
clears `fresh`.

Lower tiers. Given a `TierManager` (kvheat.tiers), admission also loads the blocks that
follow the device prefix from host/disk/remote into the new device blocks; they count
as cached.

Preemption. When blocks run out, the youngest running sequence not yet scheduled this
step is preempted (the one asking, when none is left). Its blocks are freed; the full
ones stay cached (or go down to the host tier when evicted, and load back from it), so
the resumed prefill mostly hits. There is no separate swap space (as in vLLM v1).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..cache import Block, KVCacheManager, OutOfBlocks, Request
from ..cache.hashing import prompt_scope, tokens_to_bytes
from ..cache.hints import Outcome
from ..cache.misses import MissClassifier
from ..tiers.device import lookup, prefetch, record_prompt
from .config import SchedulerConfig
from .load_classes import load_class, share_prefill_budget
from .sequence import ScheduledItem, SchedulerOutput, Seq, SeqStatus

if TYPE_CHECKING:
    from ..tiers.loads import LoadPlan
    from ..tiers.manager import TierManager
    from ..tiers.store import DeviceBlocks


class Scheduler:
    """Builds each step's batch of decodes and prefill chunks over the block cache."""

    def __init__(self, config: SchedulerConfig, cache: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic,
                 tiers: TierManager | None = None, device: DeviceBlocks | None = None) -> None:
        if tiers is not None and device is None:
            raise ValueError("lower tiers need the device pool they load into")
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.tiers = tiers  # lower KV tiers under the device cache
        self.device = device  # the pool their loads write into
        self.clock = clock
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []  # in admission order
        self.fresh: set[int] = set()  # block ids whose KV this step's forward writes
        self._admitted = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.preemptions_by_tenant: dict[str | None, int] = {}

    # ---- requests ---------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        """Queue a new sequence (a ValueError when it can never fit the pool)."""
        why = self.never_fits(seq.token_ids[:seq.num_prompt_tokens], seq.max_tokens,
                              seq.tenant, seq.lora, pool_only=True)
        if why is not None:
            raise ValueError(f"request {seq.seq_id!r}: {why}")
        if seq.num_prompt_tokens == 0:
            raise ValueError("empty prompt")
        tokens_to_bytes(seq.token_ids)  # bad token ids fail here, before anything changes
        cfg = self.config
        seq.load_class = load_class(seq.num_prompt_tokens + seq.max_tokens,
                                    cfg.short_max_tokens, cfg.long_min_tokens)
        if math.isnan(seq.arrival):
            seq.arrival = self.clock()
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._queued(seq)
        # Lower tiers: start loading the request's blocks from disk or Redis now, while it
        # waits, so the reads overlap the steps before its admission. Only near the head of
        # the queue: a plan pins its entries on the tiers until the request runs.
        if self.tiers is not None and cfg.prefix_caching == "block" \
                and len(self.waiting) <= cfg.prefetch_queue_depth:
            full = self._full_request(seq)
            prefetch(self.tiers, self.cache, full)

    def finish(self, seq: Seq, reason: str, outcome: Outcome | None = None) -> None:
        """End a sequence (done or aborted): its blocks are freed, full ones stay cached.

        `outcome`: whether its answer was delivered, for the cache policy; by default
        CANCELLED for the engine's own "abort" and "error", else FINISHED."""
        if seq.status is SeqStatus.FINISHED:
            return
        if outcome is None:
            outcome = Outcome.CANCELLED if reason in ("abort", "error") else Outcome.FINISHED
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq, outcome, reason)
        else:
            self.waiting.remove(seq)
            self._dequeued(seq)
            if self.tiers is not None:
                self.tiers.cancel(seq.seq_id)  # its pins, if a plan was made
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    @property
    def has_work(self) -> bool:
        """True while sequences are waiting or running."""
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's batch: a token per decoding sequence, then prefill chunks."""
        cfg = self.config
        now = self.clock()
        budget = cfg.max_num_batched_tokens
        items: list[ScheduledItem] = []
        preempted: list[Seq] = []
        scheduled: set[str] = set()
        self.fresh.clear()

        def emit(seq: Seq, n: int) -> None:
            req = seq.cache_req
            assert req is not None
            start = seq.num_computed
            toks = seq.token_ids[start:start + n]
            self.fresh.update(b.block_id for b in req.blocks[start // self.block_size:])
            items.append(ScheduledItem(seq, toks, start, req.block_table,
                                       start + n == len(seq.token_ids)))
            scheduled.add(seq.seq_id)

        def grow(seq: Seq, n: int) -> bool:
            """Take blocks for `n` more tokens of a running sequence, preempting the
            youngest unscheduled sequence while needed. False: `seq` itself was preempted."""
            assert seq.cache_req is not None
            toks = seq.token_ids[seq.num_computed:seq.num_computed + n]
            while True:
                try:
                    self.cache.append_tokens(seq.cache_req, toks)
                    return True
                except OutOfBlocks:
                    victim = _pick_victim(self.running, self.cache, scheduled, now,
                                          self.config.aging_s, seq.tenant)
                    if victim is None:
                        victim = seq
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        return False

        # 1. Decodes: one token each, oldest admission first.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.num_pending != 1 or not seq.prompt_done:
                continue
            if grow(seq, 1):
                emit(seq, 1)
                budget -= 1

        # 2. Prefill chunks, continuations and admissions, shared among load classes.
        if budget > 0:
            budget = self._schedule_prefills(budget, now, scheduled, preempted, emit, grow)
        self.num_steps += 1
        return SchedulerOutput(items, preempted, cfg.max_num_batched_tokens - budget)

    def _schedule_prefills(self, budget: int, now: float, scheduled: set[str],
                           preempted: list[Seq], emit: Callable[[Seq, int], None],
                           grow: Callable[[Seq, int], bool]) -> int:
        cfg = self.config
        admit_blocked = False  # an aged request is waiting for blocks: admit nobody younger

        def try_run(seq: Seq, limit: int) -> int:
            """Schedule up to `limit` tokens of `seq`; returns tokens scheduled."""
            nonlocal admit_blocked
            n = min(limit, seq.num_pending)
            if n <= 0 or seq.status is SeqStatus.FINISHED or seq.seq_id in scheduled \
                    or any(p is seq for p in preempted):
                return 0  # done, already run, or preempted this step: not again now
            if seq.status is SeqStatus.RUNNING:
                if not grow(seq, n):
                    return 0
                emit(seq, n)
                return n
            if admit_blocked or len(self.running) >= cfg.max_num_seqs:
                return 0
            n = self._admit(seq, limit)
            if n == 0:
                if now - seq.arrival >= cfg.aging_s:
                    admit_blocked = True
                return 0
            emit(seq, n)
            return n

        running = [s for s in self.running if s.seq_id not in scheduled and s.num_pending > 0
                   and s.status is SeqStatus.RUNNING]
        return share_prefill_budget(running, self.waiting, budget, now, cfg.class_weights,
                                    cfg.aging_s, try_run)

    def _admit(self, seq: Seq, limit: int) -> int:
        """Give a waiting sequence its cached prefix and blocks for its first chunk.
        Returns the chunk length, or 0 when it cannot start now (nothing changed)."""
        cfg = self.config
        cache = self.cache
        bs = self.block_size
        full = self._full_request(seq)
        match = self._match(full)
        if any(b.block_id in self.fresh for b in match):
            return 0  # its KV is written by this step's forward pass: start next step
        match = self._shareable(match, seq.num_prompt_tokens)
        whole = len(match) * bs >= len(seq.token_ids)
        if whole:
            match = match[:-1]  # compute at least the last token, for its logits
        hit = len(match) * bs
        start = hit
        # Lower tiers: blocks after the device prefix that host/disk/remote still hold are
        # loaded into the new device blocks right after allocation (they count as cached).
        plan: LoadPlan | None = None
        if self.tiers is not None and cfg.prefix_caching == "block" and not whole:
            plan = lookup(self.tiers, cache, full, len(match))
            # All of it below: load it all and run the last token again (its logits), its KV
            # rewritten into a block this request alone holds.
            start = min(hit + plan.tokens, len(seq.token_ids) - 1)
        elif self.tiers is not None:
            self.tiers.cancel(seq.seq_id)  # an early plan it does not need now
        n = min(limit, len(seq.token_ids) - start)
        if n <= 0:
            return 0
        part = full.head(start + n, bs)
        try:
            cache.allocate(part, matched=match, count_stats=False)
        except OutOfBlocks:
            # A lower-tier plan stays (pins and reads kept) until the request runs or ends:
            # planning again each step would read every block again.
            return 0
        loaded: list[tuple[str, int]] = []
        if plan is not None and plan.keys and self.tiers is not None:
            self.tiers.trim(plan, len(part.keys))
            slots = [b.block_id for b in part.blocks[plan.start:len(part.keys)]]
            assert self.device is not None
            n_loaded = self.tiers.load(plan, slots, self.device)
            loaded = [(name, plan.block_tokens) for name in plan.tier_names[:n_loaded]]
            start = min(hit + n_loaded * plan.block_tokens, start)  # less if a load failed
            n = part.num_tokens - start
        if seq.num_preemptions == 0 and not seq.prompt_done:
            # The whole prompt, once: its tokens served from cache, by tier (the last one,
            # run again for its logits, is not), in one count that the cache's hit rate and
            # the tiers' both read.
            seq.num_cached_tokens = start
            seq.cached_by_tier = _by_tier(min(hit, start), loaded, start)
            if self.tiers is not None:
                record_prompt(self.tiers, cache, seq.num_prompt_tokens, seq.cached_by_tier)
            else:
                cache.record_prompt(seq.num_prompt_tokens, start, start // bs)
        seq.cache_req = part
        seq.num_computed = start
        seq.status = SeqStatus.RUNNING
        self.waiting.remove(seq)
        self._admitted += 1
        seq.admitted_seq = self._admitted
        self.running.append(seq)
        return n

    def update(self, output: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens now have KV in the pool."""
        for it in output.items:
            seq = it.seq
            seq.num_computed = it.num_computed + len(it.token_ids)
            if not seq.prompt_done and seq.num_computed >= seq.num_prompt_tokens:
                seq.prompt_done = True
        self.fresh.clear()

    # ---- preemption -------------------------------------------------------------------
    def _preempt(self, seq: Seq) -> None:
        assert seq.cache_req is not None
        self.running.remove(seq)
        # Waiting again, for the very blocks it releases: queued before they are released
        # (the cache dequeues it when `_admit` allocates it again), and released with no
        # outcome: its turn has not ended.
        self._queued(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # By tenant, for the operator: who paid (one entry per tenant).
        self.preemptions_by_tenant[seq.tenant] = self.preemptions_by_tenant.get(seq.tenant, 0) + 1
        self.waiting.append(seq)

    def _release(self, seq: Seq, outcome: Outcome | None = None,
                 reason: str | None = None) -> None:
        """Free the sequence's blocks; `outcome` (with the finish `reason`) when it ended,
        None when it was preempted (it comes back: the blocks stay queued for it)."""
        req = seq.cache_req
        if req is not None:
            if outcome is None or not self.config.cache_hints:
                req.session = None  # no session: the cache calls no `on_finish`
                self.cache.free(req)
            else:
                self.cache.free(req, outcome, reason)
            seq.cache_req = None
        seq.num_computed = 0

    # ---- hints to the cache policy (SchedulerConfig.cache_hints) -----------------------
    def _queued(self, seq: Seq) -> None:
        """A waiting sequence will need its blocks: the policy keeps them (its keys are
        hashed here once, and admission reuses them, see `_full_request`)."""
        if self.config.cache_hints and self.config.prefix_caching != "off":
            self.cache.queue(self._full_request(seq))

    def _dequeued(self, seq: Seq) -> None:
        """It ended while waiting: its queued blocks are no longer owed (on admission the
        cache's `allocate` dequeues it)."""
        if self.config.cache_hints and self.config.prefix_caching != "off":
            self.cache.dequeue(seq.seq_id)

    def _full_request(self, seq: Seq) -> Request:
        """The cache's view of the whole sequence (keys of all its full blocks), hashed
        again only when tokens were added: a waiting request is looked at every step."""
        req = seq.full_req
        if req is None or req.num_tokens != len(seq.token_ids):
            req = seq.full_req = self.cache.make_request(
                seq.seq_id, seq.token_ids, seq.tenant, seq.lora,
                seq.session if self.config.cache_hints else None,
                scope=self.prompt_scope(seq.token_ids[:seq.num_prompt_tokens]))
        return req

    def _match(self, full: Request) -> list[Block]:
        """The cached prefix of a sequence's blocks, as this mode looks it up."""
        return [] if self.config.prefix_caching == "off" else self.cache.match_prefix(full)

    def _shareable(self, match: list[Block], num_prompt_tokens: int) -> list[Block]:
        """Of a sequence's cached prefix, the blocks its admission shares: "exact" takes
        all of the prompt's full blocks or nothing (a pinned prompt's blocks are all
        there). When they cover the whole sequence, `_admit` still runs its last token."""
        if self.config.prefix_caching == "exact" and \
                len(match) < num_prompt_tokens // self.block_size:
            return []
        return match

    def never_fits(self, prompt: Sequence[int], max_tokens: int, tenant: str | None = None,
                   lora: str | None = None, pool_only: bool = False) -> str | None:
        """Why a request for `prompt` + `max_tokens` can never be admitted, or None.

        The one check of `add` and the server. It needs blocks for prompt +
        max_tokens; it may use the whole pool but for blocks pinned by prefixes it does
        not share (the pinned blocks its admission shares, as this mode matches them, are
        its own: they need no new block), and no more than its tenant's quota (a tenant at
        its quota evicts only its own blocks). `pool_only`: the pool's size alone (what
        `add` refuses: quotas and pins change at run time, and a request they keep out is
        ended by the engine, see `LLMEngine._end_unschedulable`)."""
        cache = self.cache
        bs = self.block_size
        need = -(-(len(prompt) + max_tokens) // bs)
        what = f"the request needs up to {need} KV blocks (prompt {len(prompt)} + " \
               f"max_tokens {max_tokens} tokens, {bs} per block)"
        pool = len(cache.blocks)
        if need > pool:
            return f"{what}; the KV pool has {pool} blocks"
        if pool_only:
            return None
        quota = cache.quotas.get(tenant)
        if quota is not None and need > quota:
            return f"{what}; the tenant's quota is {quota} blocks"
        if cache.pins:
            pinned = {b.block_id for p in cache.pins.values() for b in p.blocks}
            probe = cache.make_request("", prompt, tenant, lora, scope=self.prompt_scope(prompt))
            shared = {b.block_id for b in self._shareable(self._match(probe), len(prompt))}
            held = len(pinned - shared)
            if need > pool - held:
                return f"{what}; pinned prefixes hold {held} of the pool's {pool} blocks"
        return None

    def prompt_scope(self, prompt: Sequence[int]) -> bytes | None:
        """The scope this mode keys a prompt's blocks in (None: the tenant's own keys).

        "exact" mode keys a prompt's blocks in a scope of the whole prompt, so they match
        only the very same prompt (a whole-prompt cache) and never another prompt's shared
        prefix. The tenant stays the tenant (quotas, flush, pins and usage see it), and the
        cache keeps nothing per prompt."""
        if self.config.prefix_caching != "exact":
            return None
        return prompt_scope(prompt)  # as a router keys it (kvheat.router.keys)

    def miss_kinds(self, classifier: MissClassifier, prompt: Sequence[int],
                   tenant: str | None) -> list[str]:
        """The class each of the prompt's full blocks would have if it missed.

        As `MissClassifier.prepare` gives it, the prompt keyed as this mode looks it up: in its own
        scope ("exact", `prompt_scope`), as is ("block"). "off" looks nothing up, so no
        block is ever served: each is a first sight (compulsory), never a capacity miss a
        larger pool would have served."""
        if self.config.prefix_caching == "off":
            return ["compulsory"] * (len(prompt) // self.block_size)
        return classifier.prepare(self.cache, prompt, tenant, scope=self.prompt_scope(prompt))

    # ---- checks -----------------------------------------------------------------------
    def check_accounting(self) -> None:
        """Raise unless the blocks balance (tests).

        Each running sequence holds exactly the blocks of its computed tokens, waiting ones hold none, and the pool's referenced blocks are theirs."""
        cache = self.cache
        cache.check_invariants()
        bs = self.block_size
        held: set[int] = set()
        for s in self.running:
            req = s.cache_req
            assert req is not None and s.status is SeqStatus.RUNNING, s
            assert req.num_tokens == s.num_computed, (s, req.num_tokens)
            assert len(req.blocks) == -(-s.num_computed // bs), s
            held.update(req.block_table)
        for s in self.waiting:
            assert s.cache_req is None and s.status is SeqStatus.WAITING, s
        for pin in cache.pins.values():  # pinned prefixes hold references of their own
            held.update(pin.block_table)
        assert held == {b.block_id for b in cache.blocks if b.ref_cnt > 0}
        assert len(cache.requests) == len(self.running)


def _by_tier(device: int, loaded: list[tuple[str, int]], total: int) -> dict[str, int]:
    """`total` cached tokens split by tier: the device prefix, then the loaded blocks in
    order, cut where `total` ends (the last prompt token is recomputed for its logits)."""
    out = {"device": device}
    left = total - device
    for name, n in loaded:
        take = min(n, left)
        if take <= 0:
            break
        out[name] = out.get(name, 0) + take
        left -= take
    return out


def _pick_victim(running: list[Seq], cache: KVCacheManager, scheduled: set[str],
                 now: float, aging_s: float, tenant: str | None = None) -> Seq | None:
    """The youngest running sequence not scheduled this step; aged ones last. For a
    `tenant` at its quota, only its own sequences: the blocks another tenant frees
    would go to it past its quota (it preempts itself, or waits, instead). Others
    take sequences of tenants over their quota first (they grew on free blocks)."""
    quotas, usage = cache.quotas, cache.usage

    def over(t: str | None) -> bool:
        return t in quotas and usage.get(t, 0) > quotas[t]

    own = tenant in quotas and usage.get(tenant, 0) >= quotas[tenant]
    best: Seq | None = None
    best_key: tuple[bool, bool, int] | None = None
    for s in running:
        if s.seq_id in scheduled or (own and s.tenant != tenant):
            continue
        key = (over(s.tenant), now - s.arrival < aging_s, s.admitted_seq)
        if best_key is None or key > best_key:
            best, best_key = s, key
    return best
