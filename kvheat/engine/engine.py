"""LLMEngine: requests in, tokens out, one continuous-batching step at a time.

`add_request` queues a prompt; `step` runs one scheduler step (one forward pass over the
batch), samples a token for every sequence whose prompt is done (sampling.py), and returns
those tokens; `stream(request_id)` yields one request's tokens as they are produced
(driving `step`, so the other requests progress too); `generate` runs a list of prompts to
the end. Settings are in config.py, what comes back in outputs.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..cache import (
    CacheConfig,
    CacheError,
    EvictionPolicy,
    KVCacheManager,
    make_policy,
)
from ..cache.hints import Outcome
from ..tiers.device import attach, purge, tiers_for
from ..tiers.manager import TierManager
from .config import EngineConfig
from .kv_pool import DeviceKVPool
from .llama import CausalLM
from .outputs import EngineStats, RequestMetrics, RequestOutput, TokenOutput
from .runner import ModelRunner, SeqBatchItem
from .sampling import RequestSampler, SamplingParams, sample
from .scheduler import Scheduler
from .sequence import SchedulerOutput, Seq, SeqStatus


class _Req:
    """The engine's record of one request: its sequence, sampler, metrics and stop tokens."""

    __slots__ = ("seq", "sampler", "metrics", "eos", "stalled_at")

    def __init__(self, seq: Seq, sampler: RequestSampler, metrics: RequestMetrics,
                 eos: set[int]) -> None:
        self.seq = seq
        self.sampler = sampler
        self.metrics = metrics
        self.eos = eos
        self.stalled_at = -1  # output tokens when it last stalled alone (one retry each)

    def append_token(self, tok: int, now: float) -> str | None:
        """Take a sampled token; returns why the request is done ("stop", "length"), or None."""
        seq, m = self.seq, self.metrics
        seq.token_ids.append(tok)
        if m.first_token is None:
            m.first_token = now
        m.token_times.append(now)
        m.num_preemptions = seq.num_preemptions
        if tok in self.eos:
            return "stop"
        if seq.num_output_tokens >= self.sampler.params.max_tokens:
            return "length"
        return None

    def output(self, tokenizer: Any) -> RequestOutput:
        seq, m = self.seq, self.metrics
        # Taken at its first admission, as the cache's hit count took them (a request
        # admitted, then aborted before its first token, counts there too).
        m.admitted = seq.admitted_seq > 0
        m.num_cached_tokens = seq.num_cached_tokens
        m.cached_by_tier = dict(seq.cached_by_tier)
        out = list(seq.output_token_ids)
        text = tokenizer.decode(out) if tokenizer is not None else None
        return RequestOutput(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens], out,
                             seq.finish_reason, self.metrics, text)


class LLMEngine:
    """A model, its paged KV pool, the block cache, the scheduler and the lower tiers."""

    def __init__(self, model: CausalLM, tokenizer: Any = None,
                 config: EngineConfig | None = None, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        cfg = config or EngineConfig()
        self.config = cfg
        self.model_config = model.config
        self.tokenizer = tokenizer
        if cfg.num_blocks is not None:
            pool = DeviceKVPool.for_model(self.model_config, cfg.num_blocks, cfg.block_size,
                                          cfg.dtype, cfg.device)
        else:
            assert cfg.kv_memory_bytes is not None  # EngineConfig checks one is given
            pool = DeviceKVPool.from_memory_budget(self.model_config, cfg.kv_memory_bytes,
                                                   cfg.block_size, cfg.dtype, cfg.device)
        self.kv_pool = pool
        self.runner = ModelRunner(model, pool)
        if policy is None:
            policy = make_policy(cfg.policy)
        self.cache = KVCacheManager(CacheConfig(pool.num_blocks, cfg.block_size, cfg.policy,
                                                dict(cfg.share_groups)), policy=policy)
        self._prefill_speed: float | None = None  # tokens/s, a moving average
        self.tiers: TierManager | None = None
        self._detach_tiers: Callable[[], None] | None = None
        if cfg.tiers.enabled:
            # Loads from host memory always beat recomputing; slow tiers are weighed.
            self.tiers = tiers_for(self.cache, pool, cfg.tiers,
                                   cfg.model_id or model_fingerprint(model),
                                   self.prefill_tokens_per_s if cfg.tiers.slow else None)
            self._detach_tiers = attach(self.tiers, self.cache, pool)
        self.clock = clock
        self.scheduler = Scheduler(cfg.scheduler, self.cache, clock, self.tiers, pool)
        self.requests: dict[str, _Req] = {}
        self.stats = EngineStats()
        self._counter = itertools.count()
        eos = self.model_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._failed: BaseException | None = None
        self.ended: list[str] = []  # ended inside `step` without a token: see pop_ended

    # ---- tenants (the admin API calls these between steps) -------------------------------
    def flush_tenant(self, tenant: str | None) -> dict[str, int]:
        """Delete a tenant's KV everywhere; returns the entries deleted per tier.

        Its unreferenced device blocks (deleted, not demoted) and what every lower tier
        holds of it; the counts are keyed "device", then the tiers' names."""
        out = {"device": self.cache.flush_tenant(tenant)}
        if self.tiers is not None:
            out.update(purge(self.tiers, self.cache, tenant))
        return out

    def set_tenant_quota(self, tenant: str | None, blocks: int | None) -> int:
        """Set or lift a quota; returns the device blocks deleted to meet it."""
        return self.cache.set_tenant_quota(tenant, blocks)

    def pin_prefix(self, tokens: Sequence[int], tenant: str | None = None) -> int:
        """Pin the cached prefix of `tokens`; returns the tokens pinned.

        The prefix is keyed as this engine's scheduler keys it (a whole prompt in "exact"
        mode)."""
        return self.cache.pin_prefix(tokens, tenant, scope=self.scheduler.prompt_scope(tokens))

    def unpin_prefix(self, tokens: Sequence[int], tenant: str | None = None) -> int:
        """Unpin a prefix `pin_prefix` pinned; returns the tokens unpinned."""
        return self.cache.unpin_prefix(tokens, tenant, scope=self.scheduler.prompt_scope(tokens))

    def prefill_tokens_per_s(self) -> float | None:
        """The forward pass's measured prompt throughput in tokens/s.

        A moving average over steps that prefill at least 32 tokens; None before the
        first such step."""
        return self._prefill_speed

    def close(self) -> None:
        """Stop the tiers' background threads (pending demotions are written first)."""
        if self.tiers is not None:
            self.tiers.close()
        if self._detach_tiers is not None:
            self._detach_tiers()
            self._detach_tiers = None

    @classmethod
    def from_pretrained(cls, path: str | None = None, family: str = "llama", seed: int = 0,
                        config: EngineConfig | None = None, **kw: Any) -> LLMEngine:
        """An engine on a local HF directory, or on the built-in tiny model of `family`."""
        from .loader import load_model

        cfg = config or EngineConfig()
        model, tok, _ = load_model(path, family, dtype=cfg.dtype, seed=seed, device=cfg.device)
        return cls(model, tok, cfg, **kw)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    tenant: str | None = None, session: str | None = None,
                    request_id: str | None = None, lora: str | None = None) -> str:
        """Queue a prompt; returns its request id. Bad input raises and queues nothing."""
        params = params or SamplingParams()
        n = next(self._counter)
        rid = request_id if request_id is not None else f"req-{n}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt = list(prompt_token_ids)
        _check_prompt(prompt, params.max_tokens, self.model_config)
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + n
        sampler = RequestSampler(params, self.model_config.vocab_size, self.kv_pool.device,
                                 seed)  # checks logit_bias
        now = self.clock()
        seq = Seq(rid, prompt, params.max_tokens, tenant, session, lora, arrival=now)
        self.scheduler.add(seq)  # validates the size against the pool
        eos = set() if params.ignore_eos else self._eos
        self.requests[rid] = _Req(seq, sampler, RequestMetrics(now, len(prompt)),
                                  eos | set(params.stop_token_ids))
        return rid

    def abort(self, request_id: str, reason: str = "abort",
              outcome: Outcome = Outcome.CANCELLED) -> None:
        """End a request now: its blocks are freed (full ones stay cached).

        By default it was cancelled (the client went away); a caller that ends it because the answer is
        complete (a stop string matched) says so: `reason` "stop", `outcome` FINISHED, which
        the cache policy sees as it sees a request the model ended."""
        r = self.requests.get(request_id)
        if r is None:
            raise KeyError(f"unknown request {request_id!r}")
        if r.seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(r.seq, reason, outcome)
            r.metrics.finished = self.clock()

    def release(self, request_id: str) -> RequestOutput:
        """The finished request's output; the engine forgets it."""
        r = self.requests[request_id]
        if r.seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.requests[request_id]
        return r.output(self.tokenizer)

    @property
    def has_unfinished(self) -> bool:
        """True while requests are waiting or running."""
        return self.scheduler.has_work

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one scheduled batch through the model; returns the tokens it made."""
        if self._failed is not None:
            raise RuntimeError("the engine failed in an earlier step; make a new one") \
                from self._failed
        sched = self.scheduler
        t_start = time.perf_counter()
        out = sched.schedule()
        t0 = time.perf_counter()
        self.stats.schedule_seconds += t0 - t_start
        self.stats.preemptions += len(out.preempted)
        if out.empty:
            if sched.has_work and not sched.running:
                self._end_unschedulable(out)
            return []
        self.stats.count_memory(self.scheduler.running, self.cache.num_referenced)
        batch = [SeqBatchItem(it.token_ids, it.num_computed, it.block_table) for it in out.items]
        t1 = time.perf_counter()
        try:
            logits = self.runner.forward(batch)
        except BaseException as e:
            self._abort_failed_step(out, e)
            raise
        t2 = time.perf_counter()
        self.stats.forward_seconds += t2 - t1
        prefill = sum(len(it.token_ids) for it in out.items
                      if it.num_computed < it.seq.num_prompt_tokens)
        if prefill >= 32:
            speed = prefill / max(t2 - t1, 1e-9)
            self._prefill_speed = speed if self._prefill_speed is None \
                else 0.8 * self._prefill_speed + 0.2 * speed
        sched.update(out)
        t3 = time.perf_counter()
        results = self._sample_and_finish(out, logits)  # finishing frees blocks: bookkeeping
        t4 = time.perf_counter()
        self.stats.schedule_seconds += t3 - t2
        self.stats.other_seconds += (t1 - t0) + (t4 - t3)
        self.stats.step_seconds += t4 - t_start
        return results

    def _end_unschedulable(self, out: SchedulerOutput) -> None:
        """Nothing runs and nothing could start. A sequence that was preempted in this very
        step (alone, by its own growth) gets one more try without progress: the blocks it
        freed (say, a private copy of a cached block) may be all it needs. Otherwise the
        oldest waiting request cannot get its blocks (a tenant quota below its size, a pool
        held by pinned prefixes): it can never run, so it ends with reason "error", is
        listed in `ended` for whoever drives the engine, and the others go on."""
        sched = self.scheduler
        head = out.preempted[-1] if out.preempted else sched.waiting[0]
        r = self.requests[head.seq_id]
        if out.preempted and r.stalled_at != head.num_output_tokens:
            r.stalled_at = head.num_output_tokens
            return
        sched.finish(head, "error")
        r.metrics.finished = self.clock()
        self.stats.unschedulable += 1
        self.ended.append(head.seq_id)

    def pop_ended(self) -> list[str]:
        """Requests that steps ended without a token (reason "error"), since the last call."""
        ended, self.ended = self.ended, []
        return ended

    def _abort_failed_step(self, out: SchedulerOutput, error: BaseException) -> None:
        """A forward pass raised: the blocks this step registered never got their KV.
        They leave the cache and this step's requests end with reason "error"; the
        engine goes on with the others. Only if that is impossible (a block shared
        after all) does it refuse further steps."""
        bs = self.kv_pool.block_size
        try:
            for it in out.items:
                req = it.seq.cache_req
                if req is not None:
                    self.cache.discard(req, it.num_computed // bs)
        except CacheError:
            self._failed = error
            return
        now = self.clock()
        for it in out.items:
            self.scheduler.finish(it.seq, "error")
            self.requests[it.seq.seq_id].metrics.finished = now
        self.scheduler.fresh.clear()
        self.stats.failed_steps += 1

    def _sample_and_finish(self, out: SchedulerOutput, logits: torch.Tensor) -> list[TokenOutput]:
        rows = [i for i, it in enumerate(out.items) if it.sample]
        self.stats.count_tokens(out.items)
        if not rows:
            return []
        reqs = [self.requests[out.items[i].seq.seq_id] for i in rows]
        tokens = sample(logits[rows], [r.sampler for r in reqs])  # logits[rows]: a copy
        now = self.clock()
        results: list[TokenOutput] = []
        for r, tok in zip(reqs, tokens, strict=True):
            seq = r.seq
            reason = r.append_token(tok, now)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                r.metrics.finished = now
            results.append(TokenOutput(seq.seq_id, tok, seq.num_output_tokens - 1,
                                       reason is not None, reason))
        return results

    # ---- driving ------------------------------------------------------------------------
    def stream(self, request_id: str) -> Iterator[TokenOutput]:
        """Yield one request's tokens as they are produced, stepping the engine."""
        r = self.requests.get(request_id)
        if r is None:
            raise KeyError(f"unknown request {request_id!r}")
        seq = r.seq
        sent = 0
        while True:
            produced = seq.num_output_tokens
            while sent < produced:
                done = seq.status is SeqStatus.FINISHED and sent == produced - 1
                yield TokenOutput(request_id, seq.output_token_ids[sent], sent, done,
                                  seq.finish_reason if done else None)
                sent += 1
            if seq.status is SeqStatus.FINISHED:
                return
            self.step()

    def run(self, progress: Callable[[], None] | None = None) -> None:
        """Step until every queued request has finished."""
        while self.has_unfinished:
            self.step()
            if progress is not None:
                progress()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 tenant: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion, batched; outputs in prompt order."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        ids = [self.add_request(p, sp, tenant=tenant) for p, sp in zip(prompts, plist, strict=True)]
        self.run()
        return [self.release(i) for i in ids]

    def check_accounting(self) -> None:
        """Raise when the blocks of the running sequences do not balance (tests)."""
        self.scheduler.check_accounting()


class ContextLengthExceeded(ValueError):
    """A request longer than the model's context.

    `param` names the request field at fault ("prompt" or "max_tokens"), for the server's
    400 `context_length_exceeded`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_context_length(num_prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """Check that a request fits the model's context.

    The one context-length check (`add_request` raises it, the server answers it with a
    400): the prompt leaves room for at least one new token, and the prompt plus
    `max_tokens` fits the context."""
    n, ctx = num_prompt_tokens, context_length
    if n >= ctx:
        raise ContextLengthExceeded(f"the prompt has {n} tokens; this model's context "
                                    f"length is {ctx}", "prompt")
    if n + max_tokens > ctx:
        raise ContextLengthExceeded(f"the prompt ({n} tokens) plus max_tokens "
                                    f"({max_tokens}) exceeds the context length of {ctx}",
                                    "max_tokens")


def _check_prompt(prompt: list[int], max_tokens: int, model_config: Any) -> None:
    vocab = model_config.vocab_size
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the vocabulary of {vocab}")
    check_context_length(len(prompt), max_tokens, model_config.max_position_embeddings)


def model_fingerprint(model: torch.nn.Module, sample_bytes: int = 1 << 16) -> str:
    """A short digest naming these weights.

    It covers every tensor's name, shape and dtype, and its first, middle and last
    `sample_bytes`. KV stored on disk or in Redis under one fingerprint is never read by
    an engine running other weights."""
    import xxhash

    h = xxhash.xxh3_128()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\0".encode())
        flat = t.detach().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0)
        n = flat.numel()
        mid = max(0, n // 2 - sample_bytes // 2)
        for part in (flat[:sample_bytes], flat[mid:mid + sample_bytes], flat[-sample_bytes:]):
            h.update(part.cpu().contiguous().numpy().tobytes())
    return "w" + h.hexdigest()[:24]
