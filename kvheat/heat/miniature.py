"""Miniature simulations (Waldspurger et al., ATC'17, on SHARDS sampling): the heat
policy's half-life multiple, chosen online by which of two candidates, an octave either
side of it, serves more hits on a spatial sample of the traffic it sees, and whether it
protects a stable subset (protect.py), chosen the same way by a third.

The multiple (half-life = multiple × the measured reuse gap) decides how much a block's
history outweighs its recency. No one value wins everywhere: long agentic sessions want a
longer memory than short chats, a small cache than a large one. So nothing fixes it:

- A key is in the sample when its second byte is below `rate × 256` (and its third
  below `rate × 65536` under 1/256; keys are hashes, so this is SHARDS' spatial
  sampling; the reuse-gap estimator samples the first byte, and vLLM's offload keys end
  in their KV group). The rate is the smallest power of two down to 2^-16 that leaves
  each miniature at least `MINI_BLOCKS` blocks: the sampling error shrinks with the
  miniature's size, not with the rate.
- Two miniature caches of `rate × capacity` blocks, each a `KVCacheManager` running this
  same policy with the multiple set an octave below and an octave above the live one,
  see every request's sampled blocks (in prefix order, as one request, with the session
  and finish hints the live cache got). Their hit tokens are compared request by
  request: both share every access, so the paired difference measures the multiples,
  not the sample.
- Every round (`ROUND_FILLS` miniature cache-fills of sampled accesses) the summed
  difference is read against its standard error: beyond `Z` (3) either way the live multiple
  moves an octave towards the winner and both candidates with it (they keep what they
  cache; their keys change); otherwise the sums fade by 1 − 1/`MEMORY`, so older rounds
  count less. At the best multiple neither neighbour leads and the live policy stays:
  a hill climb on the hit rate, one octave a step, between a quarter and sixteen reuse
  gaps. (A third candidate at the live multiple itself, tried first, gave the same hit
  rates at half again the cost: docs/heat.md, "Tried and not kept".)
- A third miniature runs the live multiple in the other mode: protection of a stable
  subset (protect.py) on where the live policy has it off, and back. Its hit tokens are
  paired with the mean of the two candidates' per request and read the same way at every
  round: beyond `Z` the live policy switches mode, the candidates with it. Where it loses
  by `Z` it rests for 1, 2, 4 … `MEMORY` rounds (doubling with each loss since it last
  won), then refills for a round before its sums count again.

Every constant is dimensionless (blocks of a miniature, cache-fills, standard errors, octaves):
the rule is the same at every traffic rate, capacity and block size. The live cache never
waits on the miniatures: they are fed from the policy's own hooks, so the engine, the
tiers and vLLM's offload tier get them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..cache.eviction import EvictionPolicy
from ..cache.hashing import BlockKey, node_key
from ..cache.hints import Outcome
from ..cache.manager import KVCacheManager
from ..cache.node import Node
from ..cache.request import CacheConfig, CacheError


class Candidate(Protocol):
    """What a miniature asks of its own policy (a `KVHeat` whose multiple it holds)."""

    def set_multiple(self, mult: float, half_life: float, mode: str) -> None:
        """Hold the multiple `mult` at this half-life and regime."""

    def set_protect(self, on: bool) -> None:
        """Switch protection of a stable subset (protect.py) on or off."""


class Live(Protocol):
    """What the selector reads and moves of the live policy (`KVHeat`)."""

    @property
    def half_life(self) -> float:
        """The half-life, in block accesses."""

    @property
    def mode(self) -> str:
        """The entropy regime."""

    @property
    def accesses(self) -> int:
        """Block accesses so far (the policy's clock)."""

    def follow_multiple(self, mult: float) -> None:
        """Move the half-life's multiple to `mult`."""

    @property
    def protecting(self) -> bool:
        """Whether protection (protect.py) is on."""

    def set_protect(self, on: bool) -> None:
        """Switch protection on or off."""

MINI_BLOCKS = 64  # blocks each miniature holds at least, by default (or the rate is 1)
MEMORY = 16.0  # rounds: the leads' sums fade by 1 - 1/MEMORY a round without a move
MIN_CAPACITY = 64  # below this many blocks the live cache adapts without miniatures
ROUND_FILLS = 2.0  # a round: this many miniature cache-fills of sampled accesses
# A lead counts beyond this many standard errors of the paired differences: the sums are
# read at every round, and at 2 the repeated looks moved the multiple on noise during a
# short trace's first rounds (synthetic 2M: one move at z = 2.01, back the wrong way);
# at 3 no trace here moved on one.
Z = 3.0
LOG_LO, LOG_HI = -2.0, 4.0  # log2 bounds of the multiple: a quarter to sixteen gaps
MIN_RATE = 2.0 ** -16  # the key's second and third bytes: one in 65,536 at the least
MAX_PENDING = 1 << 16  # sampled accesses one pending request keeps at most


def sample_rate(capacity_blocks: int, mini_blocks: int = MINI_BLOCKS) -> float:
    """The sampling rate of the miniatures of a live cache of `capacity_blocks`.

    A power of two, at least 2^-16, leaving each miniature at least `mini_blocks` blocks (1
    for a small cache)."""
    rate = 1.0
    while rate > MIN_RATE and capacity_blocks * rate / 2 >= mini_blocks:
        rate /= 2
    return rate


@dataclass
class Miniature:
    """One candidate: a small cache of its own whose policy keeps `log_mult` fixed."""

    manager: KVCacheManager
    policy: Candidate
    log_mult: float
    hits: int = 0  # hit tokens since it was made
    requests: int = 0

    def serve(self, keys: list[BlockKey], num_tokens: int, session: str | None,
              outcome: Outcome, reason: str | None, rid: str) -> int:
        """Serve one request of sampled keys, allocated and released at once.

        Returns the hit tokens (0 when the miniature cannot hold it)."""
        mgr = self.manager
        try:
            req = mgr.make_keyed_request(rid, keys, num_tokens, session=session)
            mgr.allocate(req)
        except CacheError:
            return 0
        mgr.free(req, outcome, reason)
        self.requests += 1
        self.hits += req.num_cached_tokens
        return req.num_cached_tokens


@dataclass
class Decision:
    """A round's outcome, kept for `kvheat replay --explain` and `/metrics`."""

    accesses: int  # the live policy's block accesses when it was made
    mult: float  # the multiple followed from then on
    lead: float  # the high candidate's lead over the low one, in standard errors
    moved: bool
    protect: bool = False  # protection on from then on
    alt_lead: float = 0.0  # the other mode's lead over the two candidates' mean, likewise
    switched: bool = False  # protection switched at this round


@dataclass
class Pending:
    """The sampled accesses of the request being served, until it ends."""

    now: float = math.nan
    keys: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> depth, tokens
    session: str | None = None


class MultipleSelector:
    """Chooses the live heat policy's half-life multiple by miniature simulation.

    `make_policy()` builds a candidate: the policy a miniature runs, and its handle on the
    multiple (set by `sync`); `live` is the policy that follows the winner
    (`follow_multiple`). The live policy calls `boundary`
    before each block it sees hit or inserted, `access` for the sampled ones, `session`
    and `finish` with the request hints it gets."""

    def __init__(self, live: Live, make_policy: Callable[[], tuple[EvictionPolicy, Candidate]],
                 capacity_blocks: int,
                 block_tokens: int, log_mult: float = 0.0,
                 mini_blocks: int = MINI_BLOCKS, alternate: bool = True) -> None:
        self.capacity = capacity_blocks
        self.rate = sample_rate(capacity_blocks, mini_blocks)
        # The live policy tests the second byte against `threshold` (every block it
        # sees); below 1/256 `access` tests the third byte too.
        self.threshold = max(1, round(self.rate * 256))
        self.threshold2 = round(self.rate * 65536) if self.rate < 1 / 256 else 256
        blocks = max(1, int(capacity_blocks * self.rate))
        self.live = live
        self.log_mult = self.start_log = log_mult
        self.block_tokens = block_tokens
        self.pending = Pending()
        self.minis: list[Miniature] = []  # the octave below the live multiple, and above
        for step in (-1.0, 1.0):
            pol, cand = make_policy()
            mgr = KVCacheManager(CacheConfig(num_blocks=blocks, block_size=block_tokens),
                                 policy=pol, clock=self._now)
            cand.set_protect(live.protecting)
            self.minis.append(Miniature(mgr, cand, log_mult + step))
        # The other mode (protection on where the live policy has it off, and back), at the
        # live multiple: `decide` switches the live mode when it leads the two candidates.
        self.alt: Miniature | None = None
        if alternate:
            pol, cand = make_policy()
            mgr = KVCacheManager(CacheConfig(num_blocks=blocks, block_size=block_tokens),
                                 policy=pol, clock=self._now)
            cand.set_protect(not live.protecting)
            self.alt = Miniature(mgr, cand, log_mult)
        self.alt_lead = 0.0  # the other mode's hit tokens over the candidates' mean, summed
        self.alt_square = 0.0
        # Where the other mode loses, it rests (1 round, doubling with each loss since it
        # last won, up to MEMORY), then serves a round that counts nothing (its cache
        # refills) before its sums count again: it costs its share of the miniatures'
        # work only where it might win.
        self.alt_rest = 0  # rounds left resting
        self.alt_pause = 0  # the last rest's length
        self.alt_warming = False
        self.round_len = max(1, int(ROUND_FILLS * blocks))
        self.round_accesses = 0
        self.lead = 0.0  # the high candidate's hit tokens over the low one's, summed
        self.square = 0.0  # and the squares of the per-request differences
        self.served = 0
        self.dropped = 0  # sampled accesses beyond `MAX_PENDING` in one request
        self.decisions: list[Decision] = []
        self.max_decisions = 4096
        self._alt_z, self._switched = 0.0, False  # this round's, for its record
        self.switches = 0

    def _now(self) -> float:
        return self.pending.now

    # -- the feed --------------------------------------------------------------------
    def access(self, key: bytes, b: Node) -> None:
        """Add sampled block `b` (`key[1] < threshold`), hit or inserted, to the pending request.

        Called after `boundary` saw its timestamp and depth."""
        self.access_key(key, b.depth, b.num_tokens)

    def access_key(self, key: bytes, depth: int, tokens: int) -> None:
        """`access` of a key at `depth` in its request, holding `tokens`."""
        if self.threshold2 < 256 and key[2] >= self.threshold2:
            return
        keys = self.pending.keys
        if key not in keys:
            if len(keys) >= MAX_PENDING:
                self.dropped += 1
                return
            keys[key] = (depth, tokens)

    def boundary(self, now: float) -> None:
        """Start another request when a block is met at depth 0 or at a new timestamp.

        The caller checks before each block it sees, sampled or not."""
        if self.pending.keys:
            self.flush(Outcome.FINISHED, None)
        self.pending.now = now

    def session(self, session: str) -> None:
        """The next request's session (a request still pending ends first)."""
        if self.pending.keys:
            self.flush(Outcome.FINISHED, None)
        self.pending.session = session

    def finish(self, outcome: Outcome, reason: str | None) -> None:
        """End the pending request with `outcome` and `reason`."""
        if self.pending.keys:
            self.flush(outcome, reason)
        else:
            self.pending.session = None

    def flush(self, outcome: Outcome, reason: str | None) -> None:
        """Serve the pending request in every miniature and score it."""
        p = self.pending
        items = sorted(p.keys.items(), key=lambda kv: kv[1][0])  # prefix order: by depth
        self.pending = Pending(now=p.now)
        keys = [node_key(k) for k, _ in items]
        bt = self.block_tokens
        last = items[-1][1][1]
        num_tokens = (len(keys) - 1) * bt + min(max(last, 1), bt)
        self.served += 1
        rid = f"m{self.served}"
        lo, hi = (m.serve(keys, num_tokens, p.session, outcome, reason, rid)
                  for m in self.minis)
        d = hi - lo
        self.lead += d
        self.square += d * d
        if self.alt is not None and not self.alt_rest:
            da = self.alt.serve(keys, num_tokens, p.session, outcome, reason, rid) - (lo + hi) / 2
            if not self.alt_warming:
                self.alt_lead += da
                self.alt_square += da * da
        self.round_accesses += len(keys)
        if self.round_accesses >= self.round_len:
            self.round_accesses = 0
            self.decide()

    # -- the decision ----------------------------------------------------------------
    def decide(self) -> None:
        """End a round: move the multiple toward a leader, switch modes if the other leads.

        The live multiple moves an octave toward a candidate that leads; the live mode
        switches where the other one leads both candidates' mean. Each must lead by more
        than `Z` standard errors (the multiple within its bounds), the candidates moving
        with it; otherwise its sums fade."""
        switched = False
        zs = 0.0
        if self.alt is not None:
            zs = self._alt_round()
            switched = zs > Z
        self._alt_z, self._switched = zs, switched
        z = self.lead / math.sqrt(self.square) if self.square > 0 else 0.0
        step = 1.0 if z > Z else -1.0 if z < -Z else 0.0
        if step == 0.0 or not LOG_LO <= self.log_mult + step <= LOG_HI:
            keep = 1 - 1 / MEMORY
            self.lead *= keep
            self.square *= keep
            self.sync()  # the live half-life may have moved with the reuse gap
            self._record(z, False)
            return
        self.log_mult += step
        lo, hi = self.minis
        lo.log_mult, hi.log_mult = self.log_mult - 1.0, self.log_mult + 1.0
        self.live.follow_multiple(2.0 ** self.log_mult)
        self.sync()
        self.lead = self.square = 0.0
        self._record(z, True)

    def _alt_round(self) -> float:
        """The other mode's round: switch where it leads, rest where it loses.

        Returns its lead in standard errors (0 while resting or refilling)."""
        if self.alt_rest:
            self.alt_rest -= 1
            self.alt_warming = not self.alt_rest  # back next round, counting nothing yet
            return 0.0
        if self.alt_warming:
            self.alt_warming = False
            return 0.0
        z = self.alt_lead / math.sqrt(self.alt_square) if self.alt_square > 0 else 0.0
        if z > Z:
            self._switch()
            self.alt_pause = 0
        elif z < -Z:
            self.alt_pause = min(max(2 * self.alt_pause, 1), int(MEMORY))
            self.alt_rest = self.alt_pause
            self.alt_lead = self.alt_square = 0.0
        else:
            keep = 1 - 1 / MEMORY
            self.alt_lead *= keep
            self.alt_square *= keep
        return z

    def _switch(self) -> None:
        """The other mode led: the live policy and the candidates take it, the alternative
        the mode they leave (each keeps what it caches)."""
        on = not self.live.protecting
        self.live.set_protect(on)
        self.switches += 1
        for m in self.minis:
            m.policy.set_protect(on)
        assert self.alt is not None
        self.alt.policy.set_protect(not on)
        self.alt_lead = self.alt_square = 0.0

    def sync(self) -> None:
        """Set each miniature's policy to its multiple and to the live half-life.

        The half-life scaled to the miniature's clock (its accesses are `rate` of the live
        ones)."""
        hl, mode = self.live.half_life, self.live.mode
        for m in self.minis:
            m.policy.set_multiple(2.0 ** m.log_mult,
                                  self.rate * hl * 2.0 ** (m.log_mult - self.log_mult), mode)
        if self.alt is not None:
            self.alt.log_mult = self.log_mult
            self.alt.policy.set_multiple(2.0 ** self.log_mult, self.rate * hl, mode)

    def _record(self, lead: float, moved: bool) -> None:
        d = self.decisions
        while len(d) >= self.max_decisions:  # keep the first half and the latest
            del d[self.max_decisions // 2]
        d.append(Decision(self.live.accesses, 2.0 ** self.log_mult, lead, moved,
                          self.live.protecting, self._alt_z, self._switched))
        self._alt_z, self._switched = 0.0, False

    def stats(self) -> dict[str, float]:
        """The selector's counters and each miniature's multiple and hits, for reports."""
        out = {"mini_rate": self.rate, "mini_start_mult": 2.0 ** self.start_log, "mini_requests": float(self.served),
               "mini_moves": float(sum(d.moved for d in self.decisions)),
               "mini_dropped": float(self.dropped), "mini_switches": float(self.switches),
               "mini_alt_resting": float(self.alt_rest > 0)}
        minis = [*self.minis, *([self.alt] if self.alt is not None else [])]
        for name, m in zip(("lo", "hi", "alt"), minis):
            n = max(m.requests, 1)
            out[f"mini_{name}_mult"] = 2.0 ** m.log_mult
            out[f"mini_{name}_hit_tokens_per_request"] = m.hits / n
        return out

    def explain(self) -> list[dict[str, float | bool]]:
        """The rounds' decisions, oldest first."""
        return [{"accesses": d.accesses, "multiple": d.mult, "lead_z": d.lead, "moved": d.moved,
                 "protect": d.protect, "alt_lead_z": d.alt_lead, "switched": d.switched}
                for d in self.decisions]

