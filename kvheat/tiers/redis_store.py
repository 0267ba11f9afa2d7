"""Redis tier: values in a real Redis (single node or Cluster) through redis-py.

Keys are `kvheat:<model>:<layout>:<namespace>:<block key>`, the namespace digest covering
model, layout and tenant salt; the value carries the `codec.py` header (format version,
dtype, shape, key, namespace, checksum), checked on every read, so a value written for
another tenant, model or key, or altered in Redis, is a counted miss and never served.

A connection error or timeout marks the tier down: operations return at once (a miss, a
refused put) until a retry time that backs off exponentially; the first success after
that marks it up again. Callers never see the exception.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
import redis.exceptions as rexc
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from .codec import (
    HEAD_SIZE,
    MAX_KEY,
    MAX_NDIM,
    NS_SIZE,
    CorruptValue,
    decode,
    decode_header,
    encode_prefix,
)
from .store import KVStore, log

T = TypeVar("T")
_DOWN_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError,
                rexc.BusyLoadingError, rexc.MasterDownError, rexc.TryAgainError,
                rexc.SlotNotCoveredError, OSError)
_MAX_HEADER = HEAD_SIZE + 4 * MAX_NDIM + MAX_KEY + NS_SIZE


def connect(url: str = "redis://127.0.0.1:6379/0", cluster: bool = False,
            timeout_s: float = 0.25) -> Any:
    """A client that fails fast (no client-side retries: the tier does its own backoff)."""
    kw: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if cluster:
        return redis.cluster.RedisCluster.from_url(url, **kw)
    # The pure-Python packer sends large values as their own buffers; hiredis's packer
    # copies every value into one string first (measured 1.5x slower SETs of 64 KiB).
    try:
        from redis._parsers.encoders import Encoder
        from redis.connection import PythonRespSerializer

        kw["command_packer"] = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)
    except (ImportError, TypeError):  # a redis-py without these internals: its default
        kw.pop("command_packer", None)
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)


class RedisStore(KVStore):
    name = "redis"
    pipelined = True

    def __init__(self, client: Any, capacity_bytes: int, model: str = "model",
                 layout: str = "kv", backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity_bytes, model, layout)
        self.client = client
        self.cluster = isinstance(client, redis.cluster.RedisCluster)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model}:{layout}")
        self.prefix = f"kvheat:{safe}:"
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.down = False
        self.retry_at = 0.0
        self._backoff = 0.0
        # What this process stored (the tier's used bytes and its eviction index).
        self.sizes: dict[str, int] = {}
        self._used = 0
        self._lock = threading.Lock()

    def rkey(self, key: bytes, salt: str | None) -> str:
        return f"{self.prefix}{self.ns(salt).hex()[:16]}:{key.hex()}"

    # ---- up/down ----------------------------------------------------------------------
    def available(self) -> bool:
        return not self.down or self.clock() >= self.retry_at

    def _call(self, fn: Callable[[], T], fallback: T) -> T:
        if self.down and self.clock() < self.retry_at:
            self.stats.skipped_down += 1
            return fallback
        try:
            result = fn()
        except _DOWN_ERRORS as e:
            self.stats.io_errors += 1
            if not self.down:
                self.stats.went_down += 1
                log.warning("redis tier down (%s); recomputing until it answers again", e)
            self.down = True
            self._backoff = min(self.backoff_max_s, max(self.backoff_initial_s,
                                                        2 * self._backoff))
            self.retry_at = self.clock() + self._backoff
            return fallback
        except rexc.RedisError as e:  # e.g. OOM from maxmemory: this op failed, tier is up
            self.stats.io_errors += 1
            log.warning("redis tier: %s", e)
            return fallback
        if self.down:
            self.down = False
            self._backoff = 0.0
            self.stats.came_back += 1
            log.warning("redis tier is back")
        return result

    # ---- interface --------------------------------------------------------------------
    def used_bytes(self) -> int:
        return self._used

    def entry_bytes(self, kv: torch.Tensor, key: bytes) -> int:
        return kv.numel() * kv.element_size() + HEAD_SIZE + 4 * kv.dim() + len(key) + NS_SIZE

    def _put(self, key: bytes, kv: torch.Tensor, salt: str | None) -> bool:
        return self.put_many([key], [kv], salt) == 1

    def put_many(self, keys: Sequence[bytes], kvs: Sequence[torch.Tensor],
                 salt: str | None = None) -> int:
        """Stores a batch in one round trip; returns how many were stored (all or none)."""
        ns = self.ns(salt)
        values: list[tuple[str, bytes]] = []
        with self._lock:
            used = self._used
            for key, kv in zip(keys, kvs, strict=True):
                head, payload = encode_prefix(kv, key, ns)
                rk = self.rkey(key, salt)
                size = len(head) + len(payload)
                if used - self.sizes.get(rk, 0) + size > self.capacity_bytes:
                    break
                used += size - self.sizes.get(rk, 0)
                values.append((rk, head + payload))
        if not values:
            return 0

        def run() -> bool:
            # One MSET per batch (split by slot on a cluster): fewer commands to pack and
            # parse than a pipeline of SETs, same single round trip.
            if self.cluster:
                self.client.mset_nonatomic(dict(values))
            else:
                self.client.mset(dict(values))
            return True

        if not self._call(run, False):
            return 0
        with self._lock:
            for rk, v in values:
                self._used += len(v) - self.sizes.get(rk, 0)
                self.sizes[rk] = len(v)
        return len(values)

    def _get(self, key: bytes, salt: str | None, out: torch.Tensor | None) -> torch.Tensor | None:
        t = self._fetch([key], salt)[0]
        if t is not None and out is not None:
            out.copy_(t)
            return out
        return t

    def get_many(self, keys: Sequence[bytes], salt: str | None = None) -> list[torch.Tensor | None]:
        """One round trip (MGET) for all keys; each value verified on its own."""
        t0 = time.perf_counter()
        res = self._fetch(keys, salt)
        n = 0
        for t in res:
            self.stats.gets += 1
            if t is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                n += t.numel() * t.element_size()
        self.stats.get_bytes += n
        if n:
            self.read_model.record(n, time.perf_counter() - t0)
        return res

    def _fetch(self, keys: Sequence[bytes], salt: str | None) -> list[torch.Tensor | None]:
        rks = [self.rkey(k, salt) for k in keys]

        def run() -> list[bytes | None]:
            if self.cluster:
                return self.client.mget_nonatomic(rks)
            return self.client.mget(rks)

        raw = self._call(run, None)
        if raw is None:
            return [None] * len(keys)
        ns = self.ns(salt)
        out: list[torch.Tensor | None] = []
        for key, rk, v in zip(keys, rks, raw, strict=True):
            if v is None:
                self._forget(rk)
                out.append(None)
                continue
            try:
                out.append(decode(bytearray(v), key, ns))
            except CorruptValue as e:
                self._count_corrupt(e.kind, key, str(e))
                out.append(None)
        return out

    def contains(self, key: bytes, salt: str | None = None) -> bool:
        rk = self.rkey(key, salt)
        if rk in self.sizes:
            return self.available()
        return bool(self._call(lambda: self.client.exists(rk), 0))

    def delete(self, key: bytes, salt: str | None = None) -> bool:
        rk = self.rkey(key, salt)
        self._forget(rk)
        n = self._call(lambda: self.client.delete(rk), 0)
        if n:
            self.stats.deletes += 1
        return bool(n)

    def stored(self) -> Iterable[tuple[bytes, bytes]]:
        """Entries of this model and layout already in Redis (from another process or an
        earlier run): found with SCAN, headers read with GETRANGE and checked."""

        def run() -> list[tuple[bytes, bytes, str, int]]:
            found: list[tuple[bytes, bytes, str, int]] = []
            names = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
            for i in range(0, len(names), 512):
                chunk = names[i:i + 512]
                pipe = self.client.pipeline(transaction=False)
                for n in chunk:
                    pipe.getrange(n, 0, _MAX_HEADER - 1)
                    pipe.strlen(n)
                res = pipe.execute()
                for j, n in enumerate(chunk):
                    head, size = res[2 * j], res[2 * j + 1]
                    try:
                        hdr = decode_header(head)
                    except CorruptValue:
                        continue
                    name = n.decode() if isinstance(n, bytes) else n
                    if size == hdr.body_offset + hdr.payload_len and name.endswith(hdr.key.hex()):
                        found.append((hdr.key, hdr.ns, name, size))
            return found

        found = self._call(run, [])
        with self._lock:
            for _k, _ns, name, size in found:
                self._used += size - self.sizes.get(name, 0)
                self.sizes[name] = size
        return [(k, ns) for k, ns, _, _ in found]

    def _forget(self, rk: str) -> None:
        with self._lock:
            self._used -= self.sizes.pop(rk, 0)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a dead connection must not fail shutdown
            self.client.close()
