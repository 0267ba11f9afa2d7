"""The interface every KV tier below the device implements, its counters, the
transfer-time model that load-or-recompute decisions use, and what the hierarchy needs of
the device pool above them (`DeviceBlocks`).

A store holds real KV bytes (one block or one 256-token chunk per key) and never serves a
value it has not verified: a failed check is a miss, counted in `stats` and logged.
Keys are the cache's chained prefix keys (`BlockKey`); `ns` is the `Namespace` they live
in (`KVCacheManager.namespace_of(tenant)`: the tenant salt's), whose digest every value
is stored and checked under (`KVStore.ns`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from ..cache.hashing import NO_TENANT, BlockKey, Namespace
from .codec import MAC_NAMES, namespace_digest, tier_key, value_mac_version

log = logging.getLogger("kvheat.tiers")


@dataclass(slots=True)
class StoreStats:
    """Counters of one store's puts, gets, deletes, failed checks and outages."""

    puts: int = 0
    put_bytes: int = 0
    put_refused: int = 0  # no room (capacity cap) or tier down: not stored, nothing broken
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    deletes: int = 0
    corrupt_checksum: int = 0  # value read back with a wrong checksum: a miss
    corrupt_key: int = 0  # value stored under another key or namespace: a miss
    corrupt_torn: int = 0  # truncated / torn value: a miss
    corrupt_format: int = 0  # bad magic, version, dtype or shape: a miss
    io_errors: int = 0  # OS or network errors
    skipped_down: int = 0  # operations not tried because the tier is marked down
    went_down: int = 0  # times the tier was marked down
    came_back: int = 0  # times a retry found it up again

    def as_dict(self) -> dict[str, int]:
        """The counters as a dict of field name to count."""
        return asdict(self)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _trimmed_mean(xs: list[float], drop: float = 0.1) -> float:
    """Mean of `xs` without its largest `drop` share (rounded down; all of a short list)."""
    xs = sorted(xs)[:len(xs) - int(drop * len(xs))]
    return sum(xs) / len(xs)


class TransferModel:
    """Fits seconds = latency + bytes / bandwidth over a window of measured transfers.

    Robust to rare stalls: one transfer held up by a garbage-collection pause must not
    decide every load after it (with a plain mean, one 200 ms stall among 256 samples of
    100 us turned every later disk load into a recompute), while a cost that recurs (a
    page-cache miss every few reads) must count. So each estimate is a trimmed mean that
    drops the slowest tenth of the samples. Samples are grouped by size (powers of two);
    each group's median size and trimmed-mean time make one point, weighted by the group's
    size, for least squares. With one size group: latency 0 and the trimmed-mean
    throughput."""

    def __init__(self, window: int = 256) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self.last_at = float("-inf")  # time.monotonic() of the latest sample

    def record(self, nbytes: int, seconds: float) -> None:
        """Add one measured transfer: `nbytes` moved in `seconds`."""
        # No lock: deque.append and list(deque) are atomic under the GIL, and this runs
        # on every tier operation.
        self.samples.append((nbytes, seconds))
        self._fit = None
        self.last_at = time.monotonic()

    def reset(self) -> None:
        """Forget every sample (they describe a tier that has since changed speed)."""
        self.replace([])

    def replace(self, samples: list[tuple[int, float]]) -> None:
        """Keep only `samples` (the window's newest, if more)."""
        self.samples.clear()
        self.samples.extend(samples)
        self._fit = None

    def drift(self, recent: int = 8) -> float | None:
        """Compare the latest `recent` transfers with what the window's fit predicts.

        Returns how many times slower (above 1) or faster (below 1) the latest `recent`
        transfers were than the fit over the whole window predicts them (the median
        ratio); None with fewer samples. A tier that changed speed shows it here long
        before the trimmed mean of the window follows."""
        latest = [s for s in list(self.samples)[-recent:] if s[0] > 0 and s[1] > 0]
        if len(latest) < recent:
            return None
        ratios = [y / est for x, y in latest if (est := self.estimate(x)) and est > 0]
        return _median(ratios) if ratios else None

    def fit(self) -> tuple[float, float] | None:
        """(latency seconds, bandwidth bytes/s), or None before any sample."""
        if self._fit is not None:
            return self._fit
        samples = [s for s in list(self.samples) if s[0] > 0 and s[1] > 0]
        if not samples:
            return None
        groups: dict[int, list[tuple[int, float]]] = {}
        for x, y in samples:
            groups.setdefault(x.bit_length(), []).append((x, y))
        points = [(_median([x for x, _ in g]), _trimmed_mean([y for _, y in g]), len(g))
                  for g in groups.values()]
        lat, slope = 0.0, 0.0
        xs = [p[0] for p in points]
        if len(points) > 1 and max(xs) > 1.5 * min(xs):
            w = sum(p[2] for p in points)
            mx = sum(x * n for x, _, n in points) / w
            my = sum(y * n for _, y, n in points) / w
            sxx = sum(n * (x - mx) ** 2 for x, _, n in points)
            slope = sum(n * (x - mx) * (y - my) for x, y, n in points) / sxx
            lat = my - slope * mx
        if slope <= 0 or lat < 0:  # one size, or noise: throughput only
            lat, slope = 0.0, _trimmed_mean([y / x for x, y in samples])
        fit = (lat, 1.0 / slope)
        self._fit = fit
        return fit

    def estimate(self, nbytes: int, ops: int = 1) -> float | None:
        """Seconds to move `nbytes` in `ops` round trips; None when never measured."""
        f = self.fit()
        if f is None:
            return None
        return ops * f[0] + nbytes / f[1]


class DeviceBlocks(Protocol):
    """What the hierarchy needs of the device's paged KV pool (the engine's DeviceKVPool).

    One block's KV as a tensor view, written back whole."""

    bytes_per_block: int
    block_size: int  # tokens per block
    layout: str  # "gqa" or "mla": with the dtype, names the stored format
    dtype: torch.dtype

    def block_view(self, block_id: int) -> torch.Tensor:
        """The KV of block `block_id`, all layers, as one tensor."""
        ...

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Overwrite block `block_id`'s KV with `data`, shaped as `block_view` returns it."""
        ...


class KVStore:
    """Base class of a store that holds one tier's bytes.

    Subclasses implement `_put`, `_get`, `contains`, `delete`, `stored`, `used_bytes`.
    `put`/`get` wrap them with counters and timing."""

    name = "store"
    pipelined = False  # a batch of gets costs one round trip (Redis), not one each
    inline = False  # puts and gets are memory copies, cheap enough for the caller's thread

    @property
    def batched_reads(self) -> bool:
        """Whether a load reads this tier's blocks in one `get_many` call.

        It does on a pipelined tier (one round trip) and an inline one (one locked copy
        pass), so its read model's latency is paid once per load, not once per block
        (`cost.LoadCost`)."""
        return self.pipelined or self.inline

    def __init__(self, capacity_bytes: int, model: str = "model", layout: str = "kv",
                 secret: str | bytes | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.model = model
        self.layout = layout
        # Keys the MAC of every value and the namespace digests (codec.tier_key): from
        # the deployment's secret, else a store's own default (`_default_key`).
        self.mac_key = tier_key(secret) or self._default_key()
        # The format (so the MAC) values are written with: BLAKE3 where the wheel is
        # installed, else BLAKE2b, or as KVHEAT_TIER_MAC says (`codec.value_mac_version`).
        # Values of either are read. Set `mac` to change it (benches compare the two).
        self.mac_version = value_mac_version()
        self.stats = StoreStats()
        self.read_model = TransferModel()
        self.write_model = TransferModel()
        self._ns_cache: dict[str | None, bytes] = {}  # tenant salt -> its namespace digest

    @property
    def mac(self) -> str:
        """The MAC new values get: "blake3" or "blake2b"."""
        return MAC_NAMES[self.mac_version]

    @mac.setter
    def mac(self, choice: str) -> None:
        """Set the MAC new values get: "blake3" or "blake2b" (`codec.value_mac_version`)."""
        self.mac_version = value_mac_version(choice)

    def ns(self, ns: Namespace) -> bytes:
        """Return the namespace digest of `ns`: its tenant salt's, made once per salt.

        A stored digest passes through (entries found on restart whose tenant is not
        known yet)."""
        if ns.digest is not None:
            return ns.digest
        d = self._ns_cache.get(ns.salt)
        if d is None:
            d = self._ns_cache[ns.salt] = namespace_digest(self.model, self.layout, ns.salt,
                                                           self.mac_key)
        return d

    def _default_key(self) -> bytes:
        """The MAC key when no secret is configured: one of this process's own (values
        written now are readable by it alone)."""
        return os.urandom(32)

    # ---- the interface ----------------------------------------------------------------
    def reachable(self) -> bool:
        """False while the tier is marked down (a store that can go down overrides it)."""
        return True

    def used_bytes(self) -> int:
        """Bytes the stored entries take against `capacity_bytes` now."""
        raise NotImplementedError

    def entry_bytes(self, kv: torch.Tensor, key: BlockKey) -> int:
        """Bytes one entry holding `kv` under `key` takes against the capacity."""
        return kv.numel() * kv.element_size()

    def put(self, key: BlockKey, kv: torch.Tensor, ns: Namespace = NO_TENANT) -> bool:
        """Store `kv` under (key, ns); False (counted) when it cannot.

        Never raises for a full or failing tier."""
        t0 = time.perf_counter()
        if self._put(key, kv, ns):
            n = kv.numel() * kv.element_size()
            self.write_model.record(n, time.perf_counter() - t0)
            st = self.stats
            st.puts += 1
            st.put_bytes += n
            return True
        self.stats.put_refused += 1
        return False

    def get(self, key: BlockKey, ns: Namespace = NO_TENANT,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Return the verified tensor for (key, ns), copied into `out` when given.

        None on a miss, a failed check or a down tier."""
        t0 = time.perf_counter()
        t = self._counted(self._get(key, ns, out))
        if t is not None:
            self.read_model.record(t.nbytes, time.perf_counter() - t0)
        return t

    def take(self, key: BlockKey, ns: Namespace = NO_TENANT) -> torch.Tensor | None:
        """Read an entry's verified bytes on their way down to the next tier.

        The bytes are a private copy; the caller deletes the entry after. It is `get`,
        counted but not timed: the read model fits the reads a load makes into the
        device; a move's copy into a fresh tensor, one block at a time, is not one, and
        its samples would price loads wrongly."""
        return self._counted(self._get(key, ns, None))

    def _counted(self, t: torch.Tensor | None) -> torch.Tensor | None:
        st = self.stats
        st.gets += 1
        if t is None:
            st.misses += 1
            return None
        st.hits += 1
        st.get_bytes += t.nbytes
        return t

    def get_many(self, keys: Sequence[BlockKey], ns: Namespace = NO_TENANT,
                 outs: Sequence[torch.Tensor | None] | None = None,
                 readonly_ok: bool = False) -> list[torch.Tensor | None]:
        """`get` for each key, into `outs[i]` when given (stores that can batch override).

        `readonly_ok`: the caller only copies from the results, so a store may return
        views of its own read buffers instead of private copies."""
        if outs is None:
            return [self.get(k, ns) for k in keys]
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
        return [self.get(k, ns, o) for k, o in zip(keys, outs, strict=True)]

    def put_many(self, items: Sequence[tuple[BlockKey, torch.Tensor]],
                 ns: Namespace = NO_TENANT) -> list[bool]:
        """`put` for each (key, kv); stores that can batch override."""
        return [self.put(k, kv, ns) for k, kv in items]

    def contains(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Whether an entry of `key` in namespace `ns` is stored here."""
        raise NotImplementedError

    def delete(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Delete the entry of `key` in namespace `ns`; True when there was one."""
        raise NotImplementedError

    def delete_many(self, keys: Sequence[BlockKey], ns: Namespace = NO_TENANT) -> int:
        """`delete` for each key (stores that can batch override); return how many were there."""
        return sum(self.delete(k, ns) for k in keys)

    def stored(self) -> Iterable[tuple[BlockKey, bytes]]:
        """(key, namespace digest) of every stored entry (for rebuilding an index)."""
        raise NotImplementedError

    def purge(self, ns: Namespace) -> int:
        """Delete entries of `ns` that this process does not index; return how many.

        Those are another process's, on a shared store. Stores only this process writes
        (host memory, a disk folder it locks) have none."""
        return 0

    def close(self) -> None:
        """Release what the store holds open (a connection, files); the base holds nothing."""
        pass

    # ---- helpers ----------------------------------------------------------------------
    def _count_corrupt(self, kind: str, key: bytes, detail: str) -> None:
        field = {"checksum": "corrupt_checksum", "key": "corrupt_key",
                 "torn": "corrupt_torn"}.get(kind, "corrupt_format")
        setattr(self.stats, field, getattr(self.stats, field) + 1)
        log.warning("%s tier: value for key %s failed its %s check (%s); served as a miss",
                    self.name, key.hex()[:16], kind, detail)

    def _put(self, key: BlockKey, kv: torch.Tensor, ns: Namespace) -> bool:
        raise NotImplementedError

    def _get(self, key: BlockKey, ns: Namespace, out: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        """The store's figures: capacity, use, availability, fitted speeds and counters."""
        fit = self.read_model.fit()
        wfit = self.write_model.fit()
        return {
            "name": self.name, "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes(), "available": self.reachable(),
            "read_latency_s": fit[0] if fit else None,
            "read_bandwidth_Bps": fit[1] if fit else None,
            "write_latency_s": wfit[0] if wfit else None,
            "write_bandwidth_Bps": wfit[1] if wfit else None,
            **self.stats.as_dict(),
        }


def copy_out(src: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`src` copied into `out` (checked) or into a fresh tensor."""
    if out is None:
        return src.clone()
    if out.shape != src.shape or out.dtype != src.dtype:
        raise ValueError(f"out has {tuple(out.shape)} {out.dtype}, the value is "
                         f"{tuple(src.shape)} {src.dtype}")
    out.copy_(src)
    return out
