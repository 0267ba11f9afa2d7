"""Host tier: a preallocated byte pool cut into fixed, cache-line-aligned slots (pinned when
CUDA is present, so device<->host copies can run asynchronously), placed on NUMA nodes
(`numa.py`). Puts and gets are copies into and out of a slot; nothing is allocated per block.
Every get re-checks the slot's xxh3-64 checksum taken at put time, so a stray write into the
pool is a counted miss.

A copy between a slot and a CPU tensor (contiguous, or a paged pool's block: runs at one
stride) is done by the C kernel `_copyhash`, which takes the checksum in the same pass, at
the cost of a plain copy or less (docs/tiers.md, Bandwidth). Anything else (a CUDA tensor,
other strides, a build without the extension) is a `torch` copy then an xxh3 pass: right
after the copy while the slot is in cache, or, for reads of 4 MiB and more, on a thread
beside the copy (`side_check.py`).

Per-slot metadata is kept as parallel lists (struct of arrays) indexed by slot, and the
hot `put`/`get` are written out in full here rather than through `KVStore`'s wrappers:
at 64 KiB a copy takes about 3 us, so every microsecond of bookkeeping shows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType

import torch
import xxhash

from ..cache.hashing import NO_TENANT, BlockKey, Namespace
from .numa import NumaNode, alloc_on_node, numa_nodes, placement
from .side_check import CHECKER
from .store import KVStore, copy_out

_copyhash: ModuleType | None
try:
    from . import _copyhash
except ImportError:  # built without a C compiler (setup.py): torch copies, xxhash checks
    _copyhash = None

_ALIGN = 64  # slot starts stay aligned for any dtype and for cache lines
_hash = xxhash.xxh3_64_intdigest
_TIME_EVERY = 8
# A batched get copies runs of at most this many bytes at once, then checks them while
# they are still in cache (a core's L2 holds it on any current CPU).
_RUN_BYTES = 256 << 10


_BUILT = _copyhash  # the extension as built; `copy_path("torch")` hides it for a while


def kernel() -> str:
    """The copy-and-check kernel host stores use: "avx2", "portable" (both C) or "torch"."""
    return _copyhash.kernel() if _copyhash is not None else "torch"


@contextlib.contextmanager
def copy_path(name: str) -> Iterator[None]:
    """Within it, every host store copies `name`'s way: "avx2", "portable" or "torch".

    "torch" copies as a build without the extension does. For benches and tests to compare
    them; ValueError for a kernel this CPU or build lacks. Process-wide: not for a serving
    process."""
    global _copyhash
    if name != "torch" and _BUILT is None:
        raise ValueError("kvheat.tiers._copyhash is not built (setup.py needs a C compiler)")
    before = _BUILT.kernel() if _BUILT is not None else None
    if _BUILT is not None and name != "torch":
        _BUILT.use_kernel(name)  # the ValueError, before anything changed
    _copyhash = None if name == "torch" else _BUILT
    try:
        yield
    finally:
        _copyhash = _BUILT
        if _BUILT is not None and before is not None:
            _BUILT.use_kernel(before)


def _runs(t: torch.Tensor) -> tuple[int, int, int] | None:
    """`t`'s bytes as `_copyhash` takes them, (rows, row bytes, stride in bytes): runs of
    contiguous bytes at one stride in CPU memory (a contiguous tensor is one run; a block of
    a paged GQA pool is K and V of each layer). None for anything else: torch copies it."""
    # Lazy conjugation (complex) or negation bits: the bytes are not the values.
    if _copyhash is None or not t.is_cpu or t.dtype.is_complex or t.is_neg():
        return None
    if t.is_contiguous():
        n = t.nbytes
        return 1, n, n
    dims = [(n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1]
    run = 1  # elements in one contiguous run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if run == 1 or not dims:
        return None
    rows, stride = dims.pop()
    if stride < run:  # rows that overlap (an expanded tensor): torch's rules apply
        return None
    while dims:  # the outer dimensions must step as one
        n, st = dims.pop()
        if st != rows * stride:
            return None
        rows *= n
    size = t.element_size()
    return rows, run * size, stride * size


class _SlotView:
    """A slot's typed tensor view, byte view and address, kept while the entry layout is
    the same (every block of one model has the same), so a put or get builds no new views."""

    __slots__ = ("dtype", "shape", "nbytes", "tensor", "raw", "addr", "whole")

    def __init__(self, row: torch.Tensor, nbytes: int, dtype: torch.dtype,
                 shape: torch.Size) -> None:
        self.dtype, self.shape, self.nbytes = dtype, shape, nbytes
        self.tensor = row[:nbytes].view(dtype).view(shape)
        self.raw = row[:nbytes].numpy().data
        self.addr = row.data_ptr()
        # `_runs` of a contiguous tensor of this dtype and shape (with the kernel built).
        self.whole = None if dtype.is_complex else (1, nbytes, nbytes)


class HostStore(KVStore):
    """The host tier: each entry in a fixed slot of a preallocated pool of host memory."""

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
        self.entries: dict[BlockKey, int] = {}  # key -> slot
        self._views: list[_SlotView | None] = [None] * n_slots
        self._slot_ns: list[bytes] = [b""] * n_slots
        self._slot_sum: list[int] = [0] * n_slots
        self._lock = threading.Lock()
        self._calls = -1  # single puts: the first is timed

    def used_bytes(self) -> int:
        """Bytes of the slots in use (a whole slot per entry)."""
        return len(self.entries) * self.slot_bytes

    def entry_bytes(self, kv: torch.Tensor, key: BlockKey) -> int:
        return self.slot_bytes

    # put/get and their batch forms share the locked bodies below; the batch forms take the
    # lock and the clock once per batch (a promoted prefix, a run of demoted blocks).
    def put(self, key: BlockKey, kv: torch.Tensor, ns: Namespace = NO_TENANT) -> bool:
        """Copy `kv` into a slot under (key, ns); False (counted) when the pool is full.

        ValueError when `kv` does not fit a slot."""
        # Single calls time one in _TIME_EVERY (the fit needs samples, not all of them):
        # at 64 KiB the clock and the record cost 5% of a put.
        self._calls += 1
        t0 = time.perf_counter() if not self._calls % _TIME_EVERY else 0.0
        d = self.ns(ns)
        with self._lock:
            n = self._put_locked(key, kv, d)
        if n and t0:
            self.write_model.record(n, time.perf_counter() - t0)
        return n > 0

    def put_many(self, items: Sequence[tuple[BlockKey, torch.Tensor]],
                 ns: Namespace = NO_TENANT) -> list[bool]:
        """Store each (key, kv) of a batch; a True/False per item, as `put`."""
        t0 = time.perf_counter()
        d = self.ns(ns)
        with self._lock:
            sizes = [self._put_locked(key, kv, d) for key, kv in items]
        if total := sum(sizes):
            self.write_model.record(total, time.perf_counter() - t0)
        return [n > 0 for n in sizes]

    def get(self, key: BlockKey, ns: Namespace = NO_TENANT,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The verified tensor for (key, ns), copied into `out` when given; None on a miss.

        A slot whose checksum no longer matches is dropped and counted: a miss too."""
        # Not timed: the read fit comes from `get_many` (loads and calibration read in
        # batches), and at 8 KiB a clock sample costs 5% of a read. Not `with`: 90 ns less.
        d = ns.digest or self._ns_cache.get(ns.salt) or self.ns(ns)
        self._lock.acquire()
        try:
            return self._get_locked(key, d, out)
        finally:
            self._lock.release()

    def take(self, key: BlockKey, ns: Namespace = NO_TENANT) -> torch.Tensor | None:
        """`KVStore.take`: a private copy of the entry, counted, not timed."""
        d = self.ns(ns)
        with self._lock:
            return self._get_locked(key, d, None)

    def get_many(self, keys: Sequence[BlockKey], ns: Namespace = NO_TENANT,
                 outs: Sequence[torch.Tensor | None] | None = None,
                 readonly_ok: bool = False) -> list[torch.Tensor | None]:
        """`get` for each key (into `outs[i]` when given), under one lock.

        Results are always private copies (a slot may be reused as soon as the lock is
        released)."""
        t0 = time.perf_counter()
        d = self.ns(ns)
        outs = outs if outs is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
        with self._lock:
            got, nbytes = self._get_batch_locked(keys, d, outs)
        if nbytes:
            self.read_model.record(nbytes, time.perf_counter() - t0)
        return got

    def _get_batch_locked(self, keys: Sequence[BlockKey], ns: bytes,
                          outs: Sequence[torch.Tensor | None]
                          ) -> tuple[list[torch.Tensor | None], int]:
        """`_get_locked` for a batch whose outputs all match their slots, with the bytes
        read: the copies and checks in one `_copyhash` call when every output has the
        first's shape and strides in CPU memory (a load into a paged pool), else one
        `_foreach_copy_` per run (one dispatch instead of one per block); the counters once
        per batch. Anything else goes one by one.

        The torch path's checks compare dtype and size, not shape (a shape compare costs
        twice as much): a copy between tensors of one dtype and size either keeps the
        bytes in order or raises, which sends the batch one by one, where a wrong shape is
        the caller's ValueError."""
        entries, views, slot_ns = self.entries, self._views, self._slot_ns
        slots: list[int] = []
        srcs: list[_SlotView] = []
        first = outs[0] if outs else None
        # (shape, strides) every output must have for the kernel; None: torch copies.
        same = ((first.shape, first.stride())
                if _copyhash is not None and first is not None and first.is_cpu else None)
        for key, out in zip(keys, outs, strict=True):
            slot = entries.get(key)
            if slot is None or out is None or slot_ns[slot] != ns:
                break
            v = views[slot]
            if v is None or out.dtype is not v.dtype:
                break
            if same is not None and (out.shape != same[0] or v.shape != same[0]
                                     or out.stride() != same[1] or not out.is_cpu
                                     or out.is_neg()):
                same = None
            if same is None and out.nbytes != v.nbytes:
                break
            slots.append(slot)
            srcs.append(v)
        if keys and len(slots) == len(keys):
            runs = _runs(first) if same is not None and first is not None else None
            if runs is not None:
                return self._kernel_batch_locked(keys, slots, srcs, outs, runs)
            try:
                return self._copy_checked_locked(keys, slots, srcs, outs)
            except RuntimeError:  # shapes that do not broadcast: one by one, below
                pass
        got = [self._get_locked(k, ns, o) for k, o in zip(keys, outs, strict=True)]
        return got, sum(t.nbytes for t in got if t is not None)

    def _kernel_batch_locked(self, keys: Sequence[BlockKey], slots: list[int],
                             srcs: list[_SlotView], outs: Sequence[torch.Tensor | None],
                             runs: tuple[int, int, int]
                             ) -> tuple[list[torch.Tensor | None], int]:
        assert _copyhash is not None
        rows, row_bytes, stride = runs
        got_sums = _copyhash.copy_many(rows, row_bytes, stride, row_bytes,
                                       [o.data_ptr() for o in outs if o is not None],
                                       [v.addr for v in srcs])
        sums = self._slot_sum
        expected = [sums[s] for s in slots]
        bad = ([] if not self.verify or got_sums == expected else
               [j for j, (a, b) in enumerate(zip(got_sums, expected, strict=True)) if a != b])
        return self._finish_batch(keys, slots, srcs, list(outs), bad)

    def _copy_checked_locked(self, keys: Sequence[BlockKey], slots: list[int],
                             srcs: list[_SlotView], outs: Sequence[torch.Tensor | None]
                             ) -> tuple[list[torch.Tensor | None], int]:
        got: list[torch.Tensor | None] = list(outs)
        sums = self._slot_sum
        bad: list[int] = []
        if self.verify and CHECKER.worth_it(sum([v.nbytes for v in srcs])):
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
        return self._finish_batch(keys, slots, srcs, got, bad)

    def _finish_batch(self, keys: Sequence[BlockKey], slots: list[int], srcs: list[_SlotView],
                      got: list[torch.Tensor | None], bad: list[int]
                      ) -> tuple[list[torch.Tensor | None], int]:
        """Drop the blocks at `bad` (their outputs hold bytes nobody may use) and count the
        batch; the results and the bytes read."""
        nbytes = sum([v.nbytes for v in srcs])
        for j in bad:
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

    def _put_locked(self, key: BlockKey, kv: torch.Tensor, ns: bytes) -> int:
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
        runs = _runs(kv)
        if runs is not None:
            rows, row_bytes, stride = runs
            self._slot_sum[slot] = _copyhash.copy(  # type: ignore[union-attr]
                rows, row_bytes, row_bytes, stride, v.addr, kv.data_ptr())
        else:
            v.tensor.copy_(kv)
            # Hashed right after the copy, while the slot is in cache.
            self._slot_sum[slot] = _hash(v.raw) if self.verify else 0
        self._slot_ns[slot] = ns
        self.entries[key] = slot
        st.puts += 1
        st.put_bytes += nbytes
        return nbytes

    def _get_locked(self, key: BlockKey, ns: bytes, out: torch.Tensor | None) -> torch.Tensor | None:
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
        v: _SlotView = self._views[slot]  # type: ignore[assignment]
        expected = self._slot_sum[slot]
        if out is None and _copyhash is not None:  # `take`, or a get without an output
            out = torch.empty(v.shape, dtype=v.dtype)
        # The kernel's case written out here (a call costs 5% of an 8 KiB read).
        if (_copyhash is not None and out is not None and out.dtype is v.dtype
                and out.shape == v.shape and out.is_cpu and not out.is_neg()
                and (runs := v.whole if out.is_contiguous() else _runs(out)) is not None):
            rows, row_bytes, stride = runs
            ok = (_copyhash.copy(rows, row_bytes, stride, row_bytes, out.data_ptr(), v.addr)
                  == expected or not self.verify)
            t = out
        else:
            t, ok = self._read_torch(v, out, expected)
        if not ok:  # `t` holds bytes nobody may use
            self._count_corrupt("checksum", key, "host slot changed since put")
            del self.entries[key]
            self.free_slots.append(slot)
            st.misses += 1
            return None
        st.hits += 1
        st.get_bytes += v.nbytes
        return t

    def _read_torch(self, v: _SlotView, out: torch.Tensor | None, expected: int
                    ) -> tuple[torch.Tensor, bool]:
        """What the kernel does not take: the slot's bytes copied by torch into `out` (or a
        fresh tensor), and whether they match `expected` (always True unless `verify`)."""
        side = (CHECKER.submit([v.raw], [expected])
                if self.verify and CHECKER.worth_it(v.nbytes) else None)
        try:
            t = copy_out(v.tensor, out)  # a fresh tensor, or the ValueError
        finally:
            # Checked beside the copy (large), or after it while the slot is still in
            # cache: one pass over memory instead of two.
            ok = (not self.verify or (side.result() == [] if side is not None
                                      else _hash(v.raw) == expected))
        return t, ok

    def contains(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Whether `key` has a slot here stored for the namespace `ns`."""
        slot = self.entries.get(key)
        return slot is not None and self._slot_ns[slot] == self.ns(ns)

    def delete(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Free `key`'s slot in namespace `ns`; False when there was none."""
        return self.delete_many((key,), ns) == 1

    def delete_many(self, keys: Sequence[BlockKey], ns: Namespace = NO_TENANT) -> int:
        """Free the slots of `keys` in namespace `ns` under one lock; returns how many.

        A slot another namespace stored stays (as on disk and in Redis, whose names carry
        the namespace)."""
        d = self.ns(ns)
        entries, slot_ns = self.entries, self._slot_ns
        with self._lock:
            slots: list[int] = []
            for k in keys:
                s = entries.get(k)
                if s is not None and slot_ns[s] == d:
                    del entries[k]
                    slots.append(s)
            self.free_slots += slots
            self.stats.deletes += len(slots)
            return len(slots)

    def stored(self) -> Iterable[tuple[BlockKey, bytes]]:
        with self._lock:
            return [(k, self._slot_ns[s]) for k, s in self.entries.items()]
