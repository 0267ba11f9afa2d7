"""Drive the real block cache with a trace and count token-weighted prefix hits.

Default mode: requests one at a time in trace order (match, allocate the rest, free).
`hold=True` instead keeps each request's blocks until its modelled finish time.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal

from ..cache import (
    CacheConfig,
    EvictionPolicy,
    KVCacheManager,
    Outcome,
    OutOfBlocks,
    Request,
    hit_rate,
    make_policy,
)
from ..cache.hashing import BlockKey, root_key, tenant_salt, trace_block_keys
from ..cache.misses import CACHED, MISS_KINDS, MissClassifier
from .spool import STATIC_KINDS, Spool, SpooledRequest
from .traces import TraceRequest

PolicySpec = str | Callable[[], EvictionPolicy]
# Block keys the lookahead's window holds at most (`replay(lookahead=N)`): each queued
# request is a `Request` with its key list, about 100 bytes a key, so 4M keys ~ 0.4 GB.
LOOKAHEAD_KEYS = 1 << 22


@dataclass(slots=True)
class MissBreakdown:
    """Why missed prompt tokens missed (token counts)."""

    compulsory: int = 0  # first use of that prefix block
    capacity: int = 0  # seen before (same tenant), evicted since
    sub_block: int = 0  # a partial block never seen before: the shared prefix ends inside it
    isolation: int = 0  # cached for another tenant only
    too_long: int = 0  # the request did not fit the whole cache

    def as_dict(self) -> dict[str, int]:
        """The counts by kind, as a dict."""
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class ReplayResult:
    """What one replay of a trace through the cache counted."""

    policy: str
    capacity_tokens: int
    block_tokens: int
    num_blocks: int
    requests: int
    total_tokens: int
    hit_tokens: int
    evictions: int
    seconds: float
    misses: MissBreakdown = field(default_factory=MissBreakdown)
    policy_stats: dict[str, float] = field(default_factory=dict)
    # What an adaptive policy decided while it ran (`KVHeat.explain`): its rounds, in order
    explain: list[dict[str, float | bool]] = field(default_factory=list)
    # Turns whose lookahead queued fewer requests than asked: their keys were over
    # `LOOKAHEAD_KEYS` (0 unless a lookahead that long was asked for)
    lookahead_short: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens (`hit_rate`)."""
        return hit_rate(self.hit_tokens, self.total_tokens)

    def as_dict(self) -> dict:
        """The result as the JSON report writes it."""
        return {
            "policy": self.policy, "capacity_tokens": self.capacity_tokens,
            "hit_rate": self.hit_rate, "hit_tokens": self.hit_tokens,
            "total_tokens": self.total_tokens, "requests": self.requests,
            "num_blocks": self.num_blocks, "evictions": self.evictions,
            "seconds": round(self.seconds, 3), "misses": self.misses.as_dict(),
            "policy_stats": self.policy_stats,
            **({"explain": self.explain} if self.explain else {}),
            **({"lookahead_short": self.lookahead_short} if self.lookahead_short else {}),
        }


class PreparedTrace:
    """A trace in memory with every request's chained keys computed once, as the cache names them.

    The keys are `trace_block_keys` under each tenant's root, share groups included, for the
    oracle, the bound and the cluster simulation. `spool` is the same trace as a `Spool`,
    what `replay` walks (made on first use, from these keys)."""

    def __init__(self, trace: list[TraceRequest], block_tokens: int = 512,
                 share_groups: dict[str, str] | None = None) -> None:
        self.trace = trace
        self.block_tokens = block_tokens
        self.share_groups = dict(share_groups or {})
        self.keys: list[list[BlockKey]] = []
        self.block_tokens_of: list[list[int]] = []
        roots: dict[str | None, bytes] = {}
        for r in trace:
            root = roots.get(r.tenant)
            if root is None:
                root = roots[r.tenant] = root_key(tenant_salt(r.tenant, self.share_groups))
            ks = trace_block_keys(root, r.hash_ids)[0]
            n = len(r.hash_ids)
            self.keys.append(ks)
            self.block_tokens_of.append([block_tokens] * (n - 1) + [r.input_length - (n - 1) * block_tokens])
        self._spool: Spool | None = None

    @property
    def spool(self) -> Spool:
        """The trace as a `Spool` (made on first use, from the keys)."""
        if self._spool is None:
            self._spool = Spool.build(self.trace, self.block_tokens, self.share_groups,
                                      keys=self.keys)
        return self._spool

    def footprint_blocks(self, hold: bool = False) -> int:
        """The most blocks a replay of this trace can ever have in use, at any capacity.

        Each distinct (tenant-salted) prefix block cached once, plus the private copies
        requests in flight may hold (one request at a time, or with `hold` all of them). A
        cache of more blocks never runs out of free ones, so never evicts."""
        return self.spool.footprint_blocks(hold)

    @property
    def sessions(self) -> list[str]:
        """Each request's session: the trace's own, else one derived from the prompts.

        The trace's `session_id`, else the session of the earlier request whose whole prompt
        (its full blocks) this one extends, the longest such, else a session of its own
        ("prompt:<index>"). A prompt is continued once: a second request extending it
        (another conversation on a shared system prompt, a branch) opens a session of its
        own. A hint a server has too: the chat history's own prefix names the conversation.
        (Derived by the spool's forward pass.)"""
        return [r.session for r in self.spool.requests()]

    def infinite_hit_rate(self) -> float:
        """The hit rate of a cache that never evicts."""
        return self.spool.infinite_hit_rate()


MAX_TOKENS = 10**15  # a token count beyond any cache: a typo, not a size


def parse_tokens(text: str) -> int:
    """A token count from text: '1M' -> 1_000_000, '512K' -> 512_000, '3.5M', '1G', '1e6'.

    Or a plain integer: a whole, positive, finite number of tokens (at most `MAX_TOKENS`),
    read exactly."""
    s = text.strip().upper() if isinstance(text, str) else ""
    mult = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(s[-1:], 1)
    num = s[:-1] if mult > 1 else s
    try:
        d = Decimal(num)
        finite = d.is_finite()
        huge = finite and d != 0 and d.adjusted() > 20
        v = d * mult if finite and not huge else d
        whole = finite and not huge and v >= 1 and v == v.to_integral_value()
    except ArithmeticError:  # decimal's InvalidOperation (not a number), Overflow
        raise ValueError(f"not a token count: {text!r} (use e.g. 1M, 512K, 3000000)") from None
    if not finite:
        raise ValueError(f"token count must be finite: {text!r}")
    if d <= 0:
        raise ValueError(f"token count must be positive: {text!r}")
    if huge or v > MAX_TOKENS:
        raise ValueError(f"token count too large: {text!r} (at most 1e15)")
    if not whole:
        raise ValueError(f"not a whole number of tokens: {text!r}")
    return int(v)


# What one cache block costs in this process's memory, estimated from above: the `Block`
# (about 230 bytes), its key, content, index entry and policy node once cached.
BLOCK_BYTES = 512


def available_memory() -> int | None:
    """Bytes this process can still allocate, as best the OS tells.

    MemAvailable, capped by a cgroup's limit; None when the OS does not tell."""
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


def pool_blocks(trace: PreparedTrace | Spool, capacity_tokens: int, hold: bool = False) -> int:
    """Blocks a replay at `capacity_tokens` allocates.

    The capacity's, clamped to the trace's `footprint_blocks` (more could never be used)."""
    return min(capacity_tokens // trace.block_tokens, max(trace.footprint_blocks(hold), 1))


def _policy(spec: PolicySpec) -> EvictionPolicy:
    return make_policy(spec) if isinstance(spec, str) else spec()


def as_spool(trace: Spool | PreparedTrace | list[TraceRequest], block_tokens: int = 512) -> Spool:
    """The spool a replay walks: `trace` itself, a prepared trace's, or a list's, made here."""
    if isinstance(trace, Spool):
        return trace
    if isinstance(trace, PreparedTrace):
        return trace.spool
    return Spool.build(trace, block_tokens)


def replay(trace: Spool | PreparedTrace | list[TraceRequest], policy: PolicySpec,
           capacity_tokens: int, block_tokens: int = 512, hold: bool = False,
           prefill_tps: float = 20_000.0, decode_tps: float = 50.0,
           progress: Callable[[int], None] | None = None, time_scale: float = 1.0,
           hints: bool | None = None, lookahead: int = 0) -> ReplayResult:
    """Replay `trace` through a `KVCacheManager` of `capacity_tokens // block_tokens` blocks.

    The pool is allocated only up to the trace's `footprint_blocks`: the results are the
    same.

    `time_scale` multiplies every timestamp: the same requests in the same order, with
    traffic `1 / time_scale` times as fast (0.1: ten times the request rate).

    `hints` (kvheat/cache/hints.py): each request carries its session to the cache
    (the trace's `session_id`, else the one derived from the earlier prompt it extends,
    `PreparedTrace.sessions`), ends as finished with the trace's finish reason (`stop`)
    when it has one, and, with `hold`, a request waiting for room is queued (`kvheat
    replay` does this unless --no-hints). False replays the prompts alone, exactly as
    before hints existed. None (the default here, so every bench replays as it did)
    passes the trace's own session ids only, as the replayer always did.

    `lookahead` N > 0: the next N requests wait in the cache's queue (`KVCacheManager.queue`,
    the queued-blocks hint) while each request is served, as a server's waiting queue would
    hold them; each leaves it when its turn comes (`allocate`). 0 (the default) queues none.

    The trace is walked as a stream (`Spool.requests`): memory is the cache's and the
    trace's distinct keys, whatever its length."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    if type(lookahead) is not int or lookahead < 0:
        raise ValueError(f"lookahead must be an integer >= 0 (requests), got {lookahead!r}")
    sp = as_spool(trace, block_tokens)
    bt = sp.block_tokens
    num_blocks = capacity_tokens // bt
    if num_blocks <= 0:
        raise ValueError(f"capacity {capacity_tokens} tokens holds no {bt}-token block")
    pol = _policy(policy)
    now = [0.0]
    # A cache larger than the trace can fill holds only the blocks it can (it never evicts
    # either way); the policy is still told the whole capacity, as its sizing reads it.
    allocated = pool_blocks(sp, capacity_tokens, hold)
    mgr = KVCacheManager(CacheConfig(num_blocks=allocated, block_size=bt,
                                     share_groups=sp.share_groups), policy=pol,
                         clock=lambda: now[0])
    if allocated < num_blocks:
        pol.bind(num_blocks)
    next_use = getattr(pol, "next_use", None) if pol.needs_future else None
    by_kind = dict.fromkeys(MISS_KINDS, 0)
    classifier = MissClassifier(bt, bits=None)
    count_misses = classifier.count
    own_sessions = hints is None

    def finish(req: Request, reason: str | None) -> None:
        if hints:
            mgr.free(req, Outcome.FINISHED, reason)
        else:
            mgr.free(req)

    def make(r: SpooledRequest) -> Request:
        session = r.session if hints else r.own_session if own_sessions else None
        return mgr.make_keyed_request(str(r.position), r.keys, r.input_length, r.tenant, session)

    source = sp.requests(next_use=next_use is not None)
    # The request served and the ones after it, `lookahead + 1` in all while their keys fit
    # `LOOKAHEAD_KEYS` (a request waits for room in `carry`; the first always fits).
    window: deque[SpooledRequest] = deque(maxlen=lookahead + 1)
    window_keys = 0
    carry: list[SpooledRequest] = []  # at most one
    short = 0  # turns the window was cut short by the key budget

    def refill() -> list[SpooledRequest]:
        nonlocal window_keys
        added = []
        while len(window) < lookahead + 1:
            nxt = carry.pop() if carry else next(source, None)
            if nxt is None:
                break
            if window and window_keys + len(nxt.keys) > LOOKAHEAD_KEYS:
                carry.append(nxt)
                break
            window.append(nxt)
            window_keys += len(nxt.keys)
            added.append(nxt)
        return added

    refill()
    ahead: dict[int, Request] = {}  # requests queued by the lookahead, by index
    running: list[tuple[float, int, Request, str | None]] = []
    too_long = 0
    first = True
    t0 = time.perf_counter()
    while window:
        r = window.popleft()
        window_keys -= len(r.keys)
        added = refill()
        if carry:
            short += 1
        i = r.position
        now[0] = r.timestamp_ms * time_scale / 1000.0  # (this rounding: the results of before)
        if hold:
            while running and running[0][0] <= now[0]:
                _, _, done, why = heapq.heappop(running)
                finish(done, why)
        req = ahead.pop(i, None) if lookahead else None
        if req is None:
            req = make(r)
        if lookahead:
            # next in line: queued until its turn (a longer one never fits), each once, as
            # it enters the window (the first window's at the first turn)
            for q in (list(window) if first else added):
                qr = ahead[q.position] = make(q)
                if len(qr.block_tokens) <= num_blocks:
                    mgr.queue(qr)
            first = False
        if next_use is not None and r.next_use is not None:
            for k, nu in zip(req.keys, r.next_use):
                next_use[k] = nu
        n = len(req.block_tokens)
        if n > num_blocks:
            too_long += r.input_length
            mgr.record_prompt(r.input_length, 0, 0)
        else:
            matched = mgr.match_prefix(req)
            at_arrival = len(matched)  # cached when it came (a prefix of its keys)
            while True:
                try:
                    mgr.allocate(req, matched)
                    break
                except OutOfBlocks:  # hold mode: wait for the earliest running request
                    if hints and req.request_id not in mgr.queued:
                        mgr.queue(req)  # waiting: the policy may keep what it will need
                    _, _, done, why = heapq.heappop(running)
                    finish(done, why)
                    matched = mgr.match_prefix(req)
            n_hit = len(matched)
            if n_hit < n:
                kinds = [CACHED] * at_arrival + [STATIC_KINDS[c] for c in r.kinds[at_arrival:]]
                count_misses(kinds, req.block_tokens, n_hit, by_kind)
            if hold:
                dur = r.input_length / prefill_tps + r.output_length / decode_tps
                heapq.heappush(running, (now[0] + dur, i, req, r.finish_reason))
            else:
                finish(req, r.finish_reason)
        if progress is not None:
            progress(i)
    misses = MissBreakdown(too_long=too_long)
    for kind, count in by_kind.items():
        setattr(misses, kind, count)
    st = mgr.stats
    return ReplayResult(pol.name, capacity_tokens, bt, num_blocks, st.requests, st.query_tokens,
                        st.hit_tokens, st.evicted_blocks, time.perf_counter() - t0, misses,
                        pol.stats(), _explain(pol), short)


def _explain(pol: EvictionPolicy) -> list[dict[str, float | bool]]:
    """An adaptive policy's decisions (`explain`), or none."""
    explain = getattr(pol, "explain", None)
    return explain() if callable(explain) else []


def replay_grid(trace: PreparedTrace, policies: Iterable[str], capacities: Iterable[int],
                **kw) -> list[ReplayResult]:
    """`replay` of every policy at every capacity, capacities outermost."""
    return [replay(trace, p, c, trace.block_tokens, **kw) for c in capacities for p in policies]
