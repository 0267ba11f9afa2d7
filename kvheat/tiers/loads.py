"""Reads from the lower tiers: load plans, and the loader threads that fetch their slow
blocks (disk, Redis) ahead of the allocation, each block read once however many waiting
plans need it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..cache.hashing import BlockKey, Namespace
from .index import PeerEntry, TierEntry
from .lower import LowerTiers

log = logging.getLogger("kvheat.tiers")


@dataclass(slots=True)
class Step:
    """One block of a load plan: the tier that holds it, and how far its load got."""

    index: int  # block index in the request (in the keys looked up)
    key: BlockKey
    tier: int
    name: str  # the tier's name
    entry: TierEntry | PeerEntry  # a peer's only when `peer`
    tokens: int
    result: Slot | None = None  # set when a loader thread fetches it
    done: bool = False  # written into its device block
    peer: bool = False  # another replica's entry in a shared tier (not in our index)


@dataclass(slots=True)
class LoadPlan:
    """What the tiers can supply right after the device's prefix.

    `keys[i]`, held by tier `tier_names[i]`, in prefix order from block `start`. Made by
    `TierManager.lookup`, which pins its entries until `TierManager.load` or `release`
    (the client's own bookkeeping is in `steps`; `keys` and `tier_names` follow it)."""

    ns: Namespace  # the namespace the keys live in (its tenant's: cache/hashing.py)
    keys: list[BlockKey] = field(default_factory=list)
    tier_names: list[str] = field(default_factory=list)
    block_tokens: int = 0  # tokens per block
    start: int = 0  # block index of keys[0] (the device prefix's length when made)
    owner: object = None  # the tenant of the request it is for (flushes drop its plans)
    request_id: str | None = None  # kept under it by `TierManager.lookup`
    steps: list[Step] = field(default_factory=list, repr=False)
    pinned: bool = False  # its entries are held for it (until loaded or released)
    found_blocks: int = 0  # continuation blocks found on lower tiers before deciding
    found_tokens: int = 0
    est_load_s: float = 0.0
    est_recompute_s: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens the plan's blocks hold (`keys` times `block_tokens`)."""
        return len(self.keys) * self.block_tokens

    def set_steps(self, steps: list[Step]) -> None:
        """Replace the plan's steps, with `keys` and `tier_names` to match."""
        self.steps = steps
        self.keys = [s.key for s in steps]
        self.tier_names = [s.name for s in steps]


class Slot:
    """One step's tensor out of a batch future, shared by the plans that need that block.

    `refs`: how many plans share it; `used`: one wrote it into a device block."""

    __slots__ = ("fut", "pos", "tier", "refs", "used")

    def __init__(self, fut: Future[list[torch.Tensor | None]], pos: int, tier: int) -> None:
        self.fut = fut
        self.pos = pos
        self.tier = tier
        self.refs = 1
        self.used = False

    def get(self) -> torch.Tensor | None:
        """Wait for the batch and return this step's tensor; None on a miss or failed load."""
        try:
            res = self.fut.result()
        except Exception:  # a loader failure is a miss, never an error to the caller
            log.exception("tier load failed")
            return None
        return res[self.pos] if self.pos < len(res) else None


class Reads:
    """Fetches plan steps from their tiers, on loader threads or inline.

    There are `workers` loader threads; 0: none, every read runs in the caller's thread."""

    def __init__(self, lower: LowerTiers, estimate_load_s: Callable[[int, int], float | None],
                 workers: int) -> None:
        self.lower = lower
        self.estimate_load_s = estimate_load_s
        self.workers = workers
        self.pool = (ThreadPoolExecutor(workers, thread_name_prefix="kvheat-load")
                     if workers else None)
        # key -> the read of it in flight or done for plans not finished yet (shared).
        self.inflight: dict[BlockKey, Slot] = {}
        self._backlog_s = 0.0  # estimated seconds of submitted reads not finished yet

    def fetch(self, steps: list[Step], ns: Namespace) -> list[torch.Tensor | None]:
        """Load `steps` from their tiers, up to the first one missing.

        Runs of a pipelined tier are read in one round trip."""
        low = self.lower
        out: list[torch.Tensor | None] = []
        i = 0
        while i < len(steps):
            st = low.stores[steps[i].tier]
            if st.pipelined:
                j = i
                while j < len(steps) and steps[j].tier == steps[i].tier:
                    j += 1
                # Only copied into device blocks: views of the received bytes will do.
                got = st.get_many([s.key for s in steps[i:j]], ns, readonly_ok=True)
                low.counters.read_bytes += sum(g.nbytes for g in got if g is not None)
                out.extend(got)
                if any(g is None for g in got):
                    break
                i = j
            else:
                t = st.get(steps[i].key, ns)
                if t is not None:
                    low.counters.read_bytes += t.nbytes
                out.append(t)
                if t is None:
                    break
                i += 1
        return out

    def start(self, plan: LoadPlan, steps: list[Step] | None = None) -> None:
        """Submit the plan's slow loads to the loader threads.

        Slow: not on inline tiers; of `steps` when given. A block another waiting plan is
        reading already is read once: both plans take the same result."""
        if self.pool is None:
            return
        low = self.lower
        slow = [s for s in (plan.steps if steps is None else steps)
                if not low.stores[s.tier].inline and s.result is None]
        with low.lock:
            # A block another waiting request's plan is reading already is read once:
            # both plans take the same result (a burst of requests on one prefix).
            for s in slow:
                shared = self.inflight.get(s.key)
                if shared is not None and shared.tier == s.tier:
                    shared.refs += 1
                    s.result = shared
            slow = [s for s in slow if s.result is None]
        if not slow:
            return
        est = sum(self.estimate_load_s(s.tier, 1) or 0.0 for s in slow)
        with low.lock:
            self._backlog_s += est
        fut = self.pool.submit(self.fetch, slow, plan.ns)
        fut.add_done_callback(lambda _f: self._job_done(est))
        with low.lock:
            for pos, s in enumerate(slow):
                s.result = self.inflight[s.key] = Slot(fut, pos, s.tier)

    def _job_done(self, est: float) -> None:
        with self.lower.lock:
            self._backlog_s = max(0.0, self._backlog_s - est)

    def backlog_s(self) -> float:
        """Estimate the seconds until the loader threads are through the reads queued now.

        0 without loader threads: reads run in the caller's thread."""
        return self._backlog_s / self.workers if self.pool is not None else 0.0

    def release(self, steps: list[Step]) -> None:
        """Release `steps` for a plan: unpin their entries, drop reads no plan needs any more.

        A dropped read is counted as unused when never written to the device."""
        low = self.lower
        now = low.clock()
        with low.lock:
            for s in steps:
                if isinstance(s.entry, TierEntry):  # (a peer's entry is not ours to pin)
                    low.unpin(s.tier, s.entry, now)
                slot = s.result
                if slot is None:
                    continue
                slot.used = slot.used or s.done
                slot.refs -= 1
                if slot.refs == 0:
                    if self.inflight.get(s.key) is slot:
                        del self.inflight[s.key]
                    if not slot.used:  # read (or being read), never written to the device
                        low.counters.unused_read_bytes += low.block_bytes

    def close(self) -> None:
        """Shut the loader threads down once every read submitted to them is done."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
