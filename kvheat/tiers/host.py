"""Host tier: a preallocated byte pool cut into fixed, cache-line-aligned slots (pinned when
CUDA is present, so device<->host copies can run asynchronously), placed on NUMA nodes
(`numa.py`). Puts and gets are copies into and out of a slot (`torch` copies; a memmove by
address for a small contiguous CPU block); nothing is allocated per block. Every get re-checks the slot's xxh3-64 checksum taken at put time, so a stray
write into the pool is a counted miss: right after each copy while the slot is in cache,
or, for reads of 4 MiB and more, on a thread beside the copy (`side_check.py`).

Per-slot metadata is kept as parallel lists (struct of arrays) indexed by slot, and the
hot `put`/`get` are written out in full here rather than through `KVStore`'s wrappers:
at 64 KiB a copy takes about 3 us, so every microsecond of bookkeeping shows.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable, Sequence
from itertools import repeat

import torch
import xxhash

from .numa import NumaNode, alloc_on_node, numa_nodes, placement
from .side_check import CHECKER
from .store import KVStore, copy_out

_ALIGN = 64  # slot starts stay aligned for any dtype and for cache lines
_hash = xxhash.xxh3_64_intdigest
# A CPU copy of one small block between a slot and a contiguous tensor of its dtype and
# shape is a memmove by address: about 0.5 us at 8 KiB, where `copy_`'s dispatch alone is
# about 1 us. From about 128 KiB `copy_` is faster (it splits the copy over threads).
_memmove = ctypes.memmove
_BY_ADDRESS_MAX = 64 << 10
_TIME_EVERY = 8
# A batched get copies runs of at most this many bytes at once, then checks them while
# they are still in cache (a core's L2 holds it on any current CPU).
_RUN_BYTES = 256 << 10


class _SlotView:
    """A slot's typed tensor view and its byte view, kept while the entry layout is the
    same (every block of one model has the same), so a put or get builds no new views."""

    __slots__ = ("dtype", "shape", "nbytes", "tensor", "raw", "addr", "small")

    def __init__(self, row: torch.Tensor, nbytes: int, dtype: torch.dtype,
                 shape: torch.Size) -> None:
        self.dtype, self.shape, self.nbytes = dtype, shape, nbytes
        self.tensor = row[:nbytes].view(dtype).view(shape)
        self.raw = row[:nbytes].numpy().data
        self.addr = row.data_ptr()
        self.small = nbytes <= _BY_ADDRESS_MAX

    def fits(self, t: torch.Tensor) -> bool:
        """`t` can be copied to or from the slot by address (`_memmove`)."""
        return (self.small and t.is_cpu and t.dtype is self.dtype and t.shape == self.shape
                and t.is_contiguous())


class HostStore(KVStore):
    name = "host"
    inline = True

    def __init__(self, capacity_bytes: int, slot_bytes: int, model: str = "model",
                 layout: str = "kv", pin: bool | None = None, verify: bool = True,
                 numa: str | int | None = "auto",
                 topology: Sequence[NumaNode] | None = None) -> None:
        """`numa`: "auto", "interleave", "off"/None or a node id (see `numa.placement`);
        `topology` replaces the machine's nodes read from sysfs (tests)."""
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be positive")
        slot = -(-slot_bytes // _ALIGN) * _ALIGN
        n_slots = capacity_bytes // slot
        if n_slots < 1:
            raise ValueError(f"{capacity_bytes} bytes hold no slot of {slot} bytes")
        super().__init__(n_slots * slot, model, layout)
        self.slot_bytes = slot
        self.num_slots = n_slots
        self.verify = verify
        pin = torch.cuda.is_available() if pin is None else pin
        nodes = placement(numa, numa_nodes() if topology is None else topology)
        # One segment per node; slot s lives in segment s % n (interleaved), row s // n.
        n = len(nodes)
        self.segments = [alloc_on_node(len(range(i, n_slots, n)), slot, node, pin)
                         for i, node in enumerate(nodes)]
        self.segment_nodes = [None if node is None else node.id for node in nodes]
        self.pool = self.segments[0]
        seg_rows = [list(s.unbind(0)) for s in self.segments]
        self._rows = [seg_rows[s % n][s // n] for s in range(n_slots)]
        self.free_slots = list(range(n_slots - 1, -1, -1))
        self.entries: dict[bytes, int] = {}  # key -> slot
        self._views: list[_SlotView | None] = [None] * n_slots
        self._slot_ns: list[bytes] = [b""] * n_slots
        self._slot_sum: list[int] = [0] * n_slots
        self._lock = threading.Lock()
        self._calls = -1  # the first single call is timed

    def slot_node(self, slot: int) -> int | None:
        """NUMA node holding `slot` (None when unbound)."""
        return self.segment_nodes[slot % len(self.segments)]

    def used_bytes(self) -> int:
        return len(self.entries) * self.slot_bytes

    def entry_bytes(self, kv: torch.Tensor, key: bytes) -> int:
        return self.slot_bytes

    # put/get and their batch forms share the locked bodies below; the batch forms take the
    # lock and the clock once per batch (a promoted prefix, a run of demoted blocks).
    def put(self, key: bytes, kv: torch.Tensor, salt: str | None = None) -> bool:
        # Single calls time one in _TIME_EVERY (the fit needs samples, not all of them):
        # at 64 KiB the clock and the record cost 5% of a put.
        self._calls += 1
        t0 = time.perf_counter() if not self._calls % _TIME_EVERY else 0.0
        ns = self.ns(salt)
        with self._lock:
            n = self._put_locked(key, kv, ns)
        if n and t0:
            self.write_model.record(n, time.perf_counter() - t0)
        return n > 0

    def put_many(self, items: Sequence[tuple[bytes, torch.Tensor]],
                 salt: str | None = None) -> list[bool]:
        """Store each (key, kv) of a batch; a True/False per item, as `put`."""
        t0 = time.perf_counter()
        ns = self.ns(salt)
        with self._lock:
            sizes = [self._put_locked(key, kv, ns) for key, kv in items]
        if total := sum(sizes):
            self.write_model.record(total, time.perf_counter() - t0)
        return [n > 0 for n in sizes]

    def get(self, key: bytes, salt: str | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
        self._calls += 1
        t0 = time.perf_counter() if not self._calls % _TIME_EVERY else 0.0
        ns = self.ns(salt)
        with self._lock:
            t = self._get_locked(key, ns, out)
        if t is not None and t0:
            self.read_model.record(t.nbytes, time.perf_counter() - t0)
        return t

    def take(self, key: bytes, salt: str | None = None) -> torch.Tensor | None:
        """`KVStore.take`: a private copy of the entry, counted, not timed."""
        ns = self.ns(salt)
        with self._lock:
            return self._get_locked(key, ns, None)

    def get_many(self, keys: Sequence[bytes], salt: str | None = None,
                 outs: Sequence[torch.Tensor | None] | None = None,
                 readonly_ok: bool = False) -> list[torch.Tensor | None]:
        """`get` for each key (into `outs[i]` when given), under one lock. Results are
        always private copies (a slot may be reused as soon as the lock is released)."""
        t0 = time.perf_counter()
        ns = self.ns(salt)
        outs = outs if outs is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
        with self._lock:
            got, nbytes = self._get_batch_locked(keys, ns, outs)
        if nbytes:
            self.read_model.record(nbytes, time.perf_counter() - t0)
        return got

    def _get_batch_locked(self, keys: Sequence[bytes], ns: bytes,
                          outs: Sequence[torch.Tensor | None]
                          ) -> tuple[list[torch.Tensor | None], int]:
        """`_get_locked` for a batch whose outputs all match their slots, with the bytes
        read: the copies in one `_foreach_copy_` per run (one dispatch instead of one per
        block: at 8 KiB the dispatch costs as much as the copy), then each slot's checksum,
        the counters once per batch. Anything else goes one by one.

        The checks compare dtype and size, not shape (a shape compare costs twice as much):
        a copy between tensors of one dtype and size either keeps the bytes in order or
        raises, and a raise sends the batch one by one, where a wrong shape is the caller's
        ValueError."""
        entries, views, slot_ns = self.entries, self._views, self._slot_ns
        slots: list[int] = []
        srcs: list[_SlotView] = []
        for key, out in zip(keys, outs, strict=True):
            slot = entries.get(key)
            if slot is None or out is None or slot_ns[slot] != ns:
                break
            v = views[slot]
            if v is None or out.dtype is not v.dtype or out.nbytes != v.nbytes:
                break
            slots.append(slot)
            srcs.append(v)
        if keys and len(slots) == len(keys):
            try:
                return self._copy_checked_locked(keys, slots, srcs, outs)
            except RuntimeError:  # shapes that do not broadcast: one by one, below
                pass
        got = [self._get_locked(k, ns, o) for k, o in zip(keys, outs, strict=True)]
        return got, sum(t.nbytes for t in got if t is not None)

    def _copy_checked_locked(self, keys: Sequence[bytes], slots: list[int],
                             srcs: list[_SlotView], outs: Sequence[torch.Tensor | None]
                             ) -> tuple[list[torch.Tensor | None], int]:
        got: list[torch.Tensor | None] = list(outs)
        sums = self._slot_sum
        nbytes = sum([v.nbytes for v in srcs])
        bad: list[int] = []
        if self.verify and CHECKER.worth_it(nbytes):
            # A large read: checked on the side thread while this one copies.
            job = CHECKER.submit([v.raw for v in srcs], [sums[s] for s in slots])
            torch._foreach_copy_(got, [v.tensor for v in srcs])  # type: ignore[arg-type]
            bad = job.result()
        else:
            # Runs that stay in cache (a core's L2), each checked right after its copy: one
            # pass over memory, as in `_get_locked`.
            per_run = max(1, _RUN_BYTES // srcs[0].nbytes)
            for i in range(0, len(slots), per_run):
                run = srcs[i:i + per_run]
                torch._foreach_copy_(got[i:i + per_run], [v.tensor for v in run])  # type: ignore[arg-type]
                if self.verify:
                    bad += [j for j, v in enumerate(run, i) if _hash(v.raw) != sums[slots[j]]]
        for j in bad:  # `outs[j]` holds bytes nobody may use
            self._count_corrupt("checksum", keys[j], "host slot changed since put")
            del self.entries[keys[j]]
            self.free_slots.append(slots[j])
            got[j] = None
            nbytes -= srcs[j].nbytes
        st = self.stats
        st.gets += len(keys)
        st.hits += len(keys) - len(bad)
        st.misses += len(bad)
        st.get_bytes += nbytes
        return got, nbytes

    def _put_locked(self, key: bytes, kv: torch.Tensor, ns: bytes) -> int:
        """Bytes stored, or 0 when the pool is full (counted)."""
        nbytes = kv.nbytes
        if nbytes > self.slot_bytes:
            raise ValueError(f"a value of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        st = self.stats
        slot = self.entries.pop(key, None)
        if slot is None:
            if not self.free_slots:
                st.put_refused += 1
                return 0
            slot = self.free_slots.pop()
        v = self._views[slot]
        if v is None or v.dtype != kv.dtype or v.shape != kv.shape:
            v = self._views[slot] = _SlotView(self._rows[slot], nbytes, kv.dtype, kv.shape)
        if v.fits(kv):
            _memmove(v.addr, kv.data_ptr(), nbytes)
        else:
            v.tensor.copy_(kv)
        # Hashed right after the copy, while the slot is in cache.
        self._slot_sum[slot] = _hash(v.raw) if self.verify else 0
        self._slot_ns[slot] = ns
        self.entries[key] = slot
        st.puts += 1
        st.put_bytes += nbytes
        return nbytes

    def _get_locked(self, key: bytes, ns: bytes, out: torch.Tensor | None) -> torch.Tensor | None:
        st = self.stats
        st.gets += 1
        slot = self.entries.get(key)
        if slot is None:
            st.misses += 1
            return None
        if self._slot_ns[slot] != ns:
            self._count_corrupt("key", key, "stored for another namespace")
            st.misses += 1
            return None
        v = self._views[slot]
        assert v is not None
        side = (CHECKER.submit([v.raw], [self._slot_sum[slot]])
                if self.verify and CHECKER.worth_it(v.nbytes) else None)
        try:
            if out is not None and v.fits(out):
                _memmove(out.data_ptr(), v.addr, v.nbytes)
                t = out
            else:
                t = copy_out(v.tensor, out)  # a fresh tensor, or the ValueError
        finally:
            # Checked beside the copy (large), or after it while the slot is still in
            # cache: one pass over memory instead of two. On a mismatch `out` holds bytes
            # nobody may use.
            ok = (not self.verify or (side.result() == [] if side is not None
                                      else _hash(v.raw) == self._slot_sum[slot]))
        if not ok:
            self._count_corrupt("checksum", key, "host slot changed since put")
            del self.entries[key]
            self.free_slots.append(slot)
            st.misses += 1
            return None
        st.hits += 1
        st.get_bytes += v.nbytes
        return t

    def contains(self, key: bytes, salt: str | None = None) -> bool:
        slot = self.entries.get(key)
        return slot is not None and self._slot_ns[slot] == self.ns(salt)

    def delete(self, key: bytes, salt: str | None = None) -> bool:
        return self.delete_many((key,), salt) == 1

    def delete_many(self, keys: Sequence[bytes], salt: str | None = None) -> int:
        with self._lock:
            slots = [s for s in map(self.entries.pop, keys, repeat(None)) if s is not None]
            self.free_slots += slots
            self.stats.deletes += len(slots)
            return len(slots)

    def stored(self) -> Iterable[tuple[bytes, bytes]]:
        with self._lock:
            return [(k, self._slot_ns[s]) for k, s in self.entries.items()]
