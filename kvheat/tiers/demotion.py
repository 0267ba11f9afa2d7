"""Demotion: the blocks the device evicts go down to the lower tiers.

Its bytes go to the first lower tier that is up (inline for the host tier: a memory copy,
so the device block can be reused at once). A tier that must make room evicts its own
coldest entry, in the order of the same policy family as the device, down to the next tier
through a background thread with a bounded queue (a full queue drops the demotion,
counted, never blocks serving). Exclusive by default: a block lives in one tier; with
`write_through` a demoted block goes to every lower tier and keeps its copies when
promoted. The bottom tier evicts leaves first (entries with no child held below), and a
parent, with its descendants, only when it holds no leaf.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ..cache.hashing import BlockKey, Namespace
from .lower import LowerTiers

log = logging.getLogger("kvheat.tiers")


@dataclass(slots=True)
class Move:
    """One block on its way to a lower tier (demoted, or handed down by a full tier)."""

    tier: int
    key: BlockKey
    ns: Namespace
    tokens: int
    kv: torch.Tensor
    parent: BlockKey | None
    owner: object  # the tenant that filled it (`UNKNOWN_OWNER`: found at start-up)
    gen: int  # the owner's flush count when it left the device

    def to(self, tier: int, kv: torch.Tensor) -> Move:
        """The same move, to `tier` with `kv`."""
        return Move(tier, self.key, self.ns, self.tokens, kv, self.parent, self.owner,
                    self.gen)


class Demoter:
    """Places demoted blocks on the lower tiers, inline or through its queue and thread."""

    def __init__(self, lower: LowerTiers, write_through: bool, queue_size: int,
                 background: bool) -> None:
        self.lower = lower
        self.write_through = write_through
        self.queue: queue.Queue[Move | None] = queue.Queue(queue_size)
        self.worker: threading.Thread | None = None
        if background:
            self.worker = threading.Thread(target=self._work, name="kvheat-demote", daemon=True)
            self.worker.start()

    def demote(self, key: BlockKey, ns: Namespace, tokens: int, kv: torch.Tensor,
               parent: BlockKey | None, owner: object, leaving_device: bool) -> bool:
        """Put one block's KV on the lower tiers; returns whether a tier holds or takes it.

        The first one up (exclusive), or every one (write-through). `kv` may view a device block: it is copied before this
        returns. `parent`: the key before it in its prefix (None for a first block);
        `owner`: the tenant that filled it (flushes); `leaving_device`: the device is
        evicting it now (else the device's own answer counts, see `KeyIndex`).
        In namespace `ns`: a key is stored once, in the namespace it came with first."""
        low = self.lower
        if not low.stores:
            return False
        m = Move(0, key, ns, tokens, kv, parent, owner, low.flushed(owner))
        if self.write_through:
            copy: torch.Tensor | None = None
            for i, st in enumerate(low.stores):
                if low.touch(i, key):  # already there: a hit
                    continue
                if st.inline:
                    self.place(m.to(i, kv), cascade=False)
                else:
                    if copy is None:
                        copy = _private(kv)
                    self.enqueue(m.to(i, copy))
        else:
            first = next((i for i in range(len(low.stores)) if low.up(i)), None)
            if first is None:
                low.counters.demote_refused += 1
            elif low.stores[first].inline:
                self.place(m.to(first, kv), cascade=True)
            else:
                self.enqueue(m.to(first, _private(kv)))
        # Refused or dropped: the key leaves with the device block, and its children below.
        return low.settle(key, ns, leaving_device)

    def enqueue(self, m: Move) -> None:
        """Hand a demotion to the background thread.

        The item holds `key` below from now
        until it is placed, so a key moving between tiers is never taken for gone."""
        low = self.lower
        low.hold(m.key, m.parent, m.ns, m.owner)
        if self.worker is None:
            try:
                self.place(m, cascade=not self.write_through, owned=True)
            finally:
                low.release(m.key)
            return
        try:
            self.queue.put_nowait(m)
        except queue.Full:
            low.counters.demote_dropped += 1
            low.release(m.key)

    def _work(self) -> None:
        low = self.lower
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self.place(item, cascade=not self.write_through, owned=True)
            except Exception:  # the demotion thread must outlive any one bad block
                low.counters.worker_errors += 1
                log.exception("tier demotion failed")
            finally:
                if item is not None:
                    try:
                        low.release(item.key)
                    except Exception:
                        low.counters.worker_errors += 1
                        log.exception("tier cleanup failed")
                self.queue.task_done()

    def place(self, m: Move, cascade: bool, owned: bool = False) -> None:
        """Put one block into `m.tier`, making room by evicting that tier's coldest entries.

        They go down to the next tier when `cascade`; a refused block itself goes too.
        `owned`: `m.kv` is a private copy; otherwise it may view a device block that is
        reused as soon as this returns, so anything queued is copied first. The caller
        holds the key meanwhile and settles it after (a refused key may be gone)."""
        low = self.lower
        st = low.stores[m.tier]
        nxt = m.tier + 1 if cascade and m.tier + 1 < len(low.stores) else None
        if not low.placeable(m.tier, m.key, m.parent, m.owner, m.gen):
            return
        if not low.up(m.tier):
            self._pass_down(m, nxt, owned)
            return
        need = st.entry_bytes(m.kv, m.key)
        self._make_room(m.tier, m.key, need, nxt)
        if not st.put(m.key, m.kv, m.ns):
            self._pass_down(m, nxt, owned)
            return
        # Checked again: making room above may have dropped the parent meanwhile, and a
        # flush of its tenant may have run while it was written.
        if not low.commit(m.tier, m.key, m.ns, m.tokens, need, m.owner, m.parent, m.gen):
            st.delete(m.key, m.ns)

    def _pass_down(self, m: Move, nxt: int | None, owned: bool) -> None:
        """`m.tier` refused the block: the next tier gets it, if there is one."""
        if nxt is not None:
            self.enqueue(m.to(nxt, m.kv if owned else _private(m.kv)))
        else:
            self.lower.counters.demote_refused += 1

    def _make_room(self, tier: int, key: BlockKey, need: int, nxt: int | None) -> None:
        """Evict `tier`'s coldest entries until `need` more bytes fit (for `key`, whose
        own old entry's bytes count as free), handing them to `nxt` when it is up."""
        low = self.lower
        st = low.stores[tier]
        for vkey, tokens, ns, parent, owner in low.evict_for(tier, key, need):
            try:
                if nxt is not None and low.up(nxt):
                    t = st.take(vkey, ns)
                    if t is not None:
                        self.enqueue(Move(nxt, vkey, ns, tokens, t, parent, owner,
                                          low.flushed(owner)))
                elif tier == len(low.stores) - 1:
                    low.counters.dropped_bottom += 1
                st.delete(vkey, ns)
                low.evictions[tier] += 1
            finally:
                low.release(vkey)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued demotions are written (tests, benchmarks, shutdown)."""
        if self.worker is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def close(self) -> None:
        """Write what is queued and stop the thread."""
        if self.worker is not None:
            self.flush()
            self.queue.put(None)
            self.worker.join(timeout=5)
            self.worker = None


def _private(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares no memory with `kv` (a device block view)."""
    return kv.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
