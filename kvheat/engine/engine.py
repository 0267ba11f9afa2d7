"""LLMEngine: requests in, tokens out, one continuous-batching step at a time.

`add_request` queues a prompt; `step` runs one scheduler step (one forward pass over the
batch), samples a token for every sequence whose prompt is done, and returns those
tokens; `stream(request_id)` yields one request's tokens as they are produced (driving
`step`, so the other requests progress too); `generate` runs a list of prompts to the end.
Sampling is greedy at temperature 0, else temperature / top-k / top-p from a generator
seeded per request, so a run is reproducible.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..cache import (
    CacheConfig,
    CacheError,
    EvictionPolicy,
    KVCacheManager,
    make_policy,
    policy_names,
)
from ..tiers.device import DeviceKVPool
from ..tiers.spec import TierSpec, build_tiers
from .runner import ModelRunner, SeqBatchItem
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SeqStatus
from .scheduler import Sequence as SchedSequence

if TYPE_CHECKING:
    from ..tiers.hierarchy import TieredCache


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: derived from the engine seed and the request number
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")


@dataclass(slots=True)
class TokenOutput:
    request_id: str
    token_id: int
    index: int  # 0 for the first generated token
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished


@dataclass(slots=True)
class RequestMetrics:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # the same, by tier
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def mean_itl(self) -> float | None:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    text: str | None = None


@dataclass(slots=True)
class EngineConfig:
    num_blocks: int | None = 512  # device KV blocks; or size the pool by kv_memory_bytes
    kv_memory_bytes: int | None = None
    block_size: int = 16
    policy: str = "kvheat"  # eviction policy of the block cache (kvheat.heat's scale-free heat)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    swap_space_blocks: int = 0  # host blocks for swap preemption (with preemption="swap")
    # Lower KV tiers under the device cache (kvheat.tiers.TierSpec): host memory, local
    # disk (survives a restart), Redis (shared by replicas).
    tiers: TierSpec = field(default_factory=TierSpec)
    # Names the KV on disk and in Redis: None: a fingerprint of the weights, so KV of other
    # weights is never served.
    model_id: str | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks is None and self.kv_memory_bytes is None:
            raise ValueError("give num_blocks or kv_memory_bytes")
        if self.scheduler.preemption == "swap" and self.swap_space_blocks <= 0:
            raise ValueError("preemption='swap' needs swap_space_blocks > 0")


class HostSwapSpace:
    """Preempted sequences' blocks, copied to host memory (a bounded number of blocks)."""

    def __init__(self, pool: DeviceKVPool, capacity_blocks: int) -> None:
        self.pool = pool
        self.capacity_blocks = capacity_blocks
        self.saved: dict[str, list[torch.Tensor]] = {}
        self.num_blocks = 0
        self.swapped_out = 0
        self.swapped_in = 0

    def swap_out(self, seq_id: str, block_ids: list[int]) -> int:
        self.discard(seq_id)
        n = min(len(block_ids), self.capacity_blocks - self.num_blocks)
        copies = [self.pool.block_view(b).to("cpu", copy=True) for b in block_ids[:n]]
        if copies:
            self.saved[seq_id] = copies
            self.num_blocks += n
            self.swapped_out += n
        return n

    def swap_in(self, seq_id: str, first_block: int, block_ids: list[int]) -> None:
        copies = self.saved.pop(seq_id)
        self.num_blocks -= len(copies)
        for src, dst in zip(copies[first_block:], block_ids, strict=False):
            self.pool.write_block(dst, src)
            self.swapped_in += 1

    def discard(self, seq_id: str) -> None:
        copies = self.saved.pop(seq_id, None)
        if copies is not None:
            self.num_blocks -= len(copies)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0  # whole steps: scheduling, forward pass, sampling
    schedule_seconds: float = 0.0  # the scheduler with the block cache's bookkeeping
    other_seconds: float = 0.0  # batch building, sampling, finishing (frees blocks)
    forward_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    preemptions: int = 0
    failed_steps: int = 0  # forward passes that raised (their requests ended with "error")
    unschedulable: int = 0  # requests that could never get their blocks (ended with "error")
    # For "KV memory saved": blocks the running sequences hold, summed over steps, as
    # logical references and as distinct physical blocks.
    logical_blocks: int = 0
    physical_blocks: int = 0

    @property
    def kv_memory_saved(self) -> float:
        return 1.0 - self.physical_blocks / self.logical_blocks if self.logical_blocks else 0.0


class _Req:
    __slots__ = ("seq", "params", "metrics", "generator", "eos", "stalled_at")

    def __init__(self, seq: SchedSequence, params: SamplingParams, metrics: RequestMetrics,
                 generator: torch.Generator | None, eos: set[int]) -> None:
        self.seq = seq
        self.params = params
        self.metrics = metrics
        self.generator = generator
        self.eos = eos
        self.stalled_at = -1  # output tokens when it last stalled alone (one retry each)


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any = None,
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
            pool = DeviceKVPool.from_memory_budget(self.model_config, cfg.kv_memory_bytes,
                                                   cfg.block_size, cfg.dtype, cfg.device)
        self.kv_pool = pool
        self.runner = ModelRunner(model, pool)
        if policy is None:
            policy = make_policy(_policy_name(cfg.policy))
        self.cache = KVCacheManager(CacheConfig(pool.num_blocks, cfg.block_size, cfg.policy),
                                    policy=policy)
        self.swap_space = (HostSwapSpace(pool, cfg.swap_space_blocks)
                           if cfg.scheduler.preemption == "swap" else None)
        self._prefill_speed: float | None = None  # tokens/s, a moving average
        self.tiers: TieredCache | None = build_tiers(
            cfg.tiers, self.cache, pool, cfg.model_id or model_fingerprint(model),
            self.prefill_tokens_per_s) if cfg.tiers.enabled else None
        self.clock = clock
        self.scheduler = Scheduler(cfg.scheduler, self.cache, self.swap_space, clock,
                                   self.tiers)
        self.requests: dict[str, _Req] = {}
        self.stats = EngineStats()
        self._counter = itertools.count()
        eos = self.model_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._failed: BaseException | None = None
        self.ended: list[str] = []  # ended inside `step` without a token: see pop_ended

    # ---- tenants (the admin API calls these between steps) -------------------------------
    def flush_tenant(self, tenant: str | None) -> dict[str, int]:
        """Delete a tenant's KV everywhere: its unreferenced device blocks (deleted, not
        demoted) and what every lower tier holds of it. Returns the entries deleted per
        tier ("device", then the tiers' names)."""
        out = {"device": self.cache.flush_tenant(tenant)}
        if self.tiers is not None:
            out.update(self.tiers.purge_tenant(tenant))
        return out

    def set_tenant_quota(self, tenant: str | None, blocks: int | None) -> int:
        """Set or lift a quota; returns the device blocks deleted to meet it."""
        return self.cache.set_tenant_quota(tenant, blocks)

    def pin_prefix(self, tokens: Sequence[int], tenant: str | None = None) -> int:
        """Pin the cached prefix of `tokens` as this engine's scheduler keys it (a whole
        prompt in "exact" mode); returns tokens pinned."""
        return self.cache.pin_prefix(tokens, tenant, scope=self.scheduler.prompt_scope(tokens))

    def unpin_prefix(self, tokens: Sequence[int], tenant: str | None = None) -> int:
        return self.cache.unpin_prefix(tokens, tenant, scope=self.scheduler.prompt_scope(tokens))

    def prefill_tokens_per_s(self) -> float | None:
        """Measured prompt throughput of the forward pass (a moving average over steps
        that prefill at least 32 tokens); None before the first such step."""
        return self._prefill_speed

    def close(self) -> None:
        """Stop the tiers' background threads (pending demotions are written first)."""
        if self.tiers is not None:
            self.tiers.close()

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
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary of {vocab}")
        max_pos = self.model_config.max_position_embeddings
        if len(prompt) + params.max_tokens > max_pos:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"the model's {max_pos} positions")
        now = self.clock()
        seq = SchedSequence(rid, prompt, params.max_tokens, tenant, session, lora, arrival=now)
        self.scheduler.add(seq)  # validates the size against the pool
        gen = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + n
            gen = torch.Generator(device=self.kv_pool.device).manual_seed(seed)
        eos = set() if params.ignore_eos else self._eos
        self.requests[rid] = _Req(seq, params, RequestMetrics(now, len(prompt)), gen,
                                  eos | set(params.stop_token_ids))
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed now (full ones stay cached)."""
        r = self.requests.get(request_id)
        if r is None:
            raise KeyError(f"unknown request {request_id!r}")
        if r.seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(r.seq, "abort")
            r.metrics.finished = self.clock()

    def release(self, request_id: str) -> RequestOutput:
        """The finished request's output; the engine forgets it."""
        r = self.requests[request_id]
        if r.seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.requests[request_id]
        return self._output(r)

    def _output(self, r: _Req) -> RequestOutput:
        seq = r.seq
        out = list(seq.output_token_ids)
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return RequestOutput(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens], out,
                             seq.finish_reason, r.metrics, text)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
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
        self._count_memory()
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

    def _count_memory(self) -> None:
        st = self.stats
        st.steps += 1
        st.logical_blocks += sum(len(s.cache_req.blocks) for s in self.scheduler.running
                                 if s.cache_req is not None)
        st.physical_blocks += self.cache.num_referenced

    def _sample_and_finish(self, out: SchedulerOutput, logits: torch.Tensor) -> list[TokenOutput]:
        rows = [i for i, it in enumerate(out.items) if it.sample]
        for it in out.items:  # decode: one token after the whole prompt's KV
            if it.num_computed >= it.seq.num_prompt_tokens and len(it.token_ids) == 1:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += len(it.token_ids)
        if not rows:
            return []
        reqs = [self.requests[out.items[i].seq.seq_id] for i in rows]
        tokens = self._sample(logits[rows], reqs)
        now = self.clock()
        results: list[TokenOutput] = []
        for r, tok in zip(reqs, tokens, strict=True):
            seq, m = r.seq, r.metrics
            seq.token_ids.append(tok)
            if m.first_token is None:
                m.first_token = now
                m.num_cached_tokens = seq.num_cached_tokens
                m.cached_by_tier = dict(seq.cached_by_tier)
            m.token_times.append(now)
            m.num_preemptions = seq.num_preemptions
            reason = None
            if tok in r.eos:
                reason = "stop"
            elif seq.num_output_tokens >= r.params.max_tokens:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(seq, reason)
                m.finished = now
            results.append(TokenOutput(seq.seq_id, tok, seq.num_output_tokens - 1,
                                       reason is not None, reason))
        return results

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: list[_Req]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            if p.temperature < 1e-5:  # below this, dividing logits overflows: greedy
                out.append(int(greedy[i]))
                continue
            row = logits[i].float() / p.temperature
            if p.top_k:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sp, idx = torch.sort(probs, descending=True)
                # keep the smallest set whose mass reaches top_p (the first token always)
                drop = sp.cumsum(0) - sp >= p.top_p
                drop[0] = False  # a top_p below float32's smallest value must keep one token
                sp = sp.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, idx, sp)
            out.append(int(torch.multinomial(probs, 1, generator=r.generator).item()))
        return out

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
        self.scheduler.check_accounting()


def _policy_name(name: str) -> str:
    if name not in policy_names():
        with contextlib.suppress(ImportError):  # heat policies register on import
            import kvheat.heat  # noqa: F401
    return name


def model_fingerprint(model: torch.nn.Module, sample_bytes: int = 1 << 16) -> str:
    """A short digest naming these weights: every tensor's name, shape and dtype, and its
    first, middle and last `sample_bytes`. KV stored on disk or in Redis under one
    fingerprint is never read by an engine running other weights."""
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
