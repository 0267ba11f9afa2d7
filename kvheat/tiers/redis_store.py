"""Redis tier: values in a real Redis (single node or Cluster) through redis-py.

Keys are `kvheat:<model digest>:<namespace digest>:<name digest>`, all three keyed by the
deployment's tier key (`codec.tier_key`), so a key name reveals neither the model
fingerprint nor a tenant, and cannot be computed without the key; the value carries the
`codec.py` header (format version, dtype, shape, key, namespace, MAC), checked on every
read, so a value written for another tenant, model or key, altered in Redis, or written by
anyone without the tier key, is a counted miss and never served.

A connection error or timeout marks the tier down: operations return at once (a miss, a
refused put) until a retry time that backs off exponentially; the first success after
that marks it up again. Callers never see the exception.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
import redis.exceptions as rexc
import torch

from ..cache.hashing import NO_TENANT, BlockKey, Namespace, stored_key
from .codec import (
    HEAD_SIZE,
    NS_SIZE,
    CorruptValue,
    decode,
    decode_header,
    encode_prefix,
    keyed_digest,
    payload_tensor,
    tensor_bytes,
    verify_parts,
)
from .redis_wire import (
    DIRECT_MIN_BYTES,
    DOWN_ERRORS,
    ReplyReader,
    bulk,
    connect,
    delete_names,
    raw_socket,
    scan_headers,
    scan_names,
    send_buffers,
)
from .store import KVStore, copy_out, log

__all__ = ["DIRECT_MIN_BYTES", "RedisStore", "connect"]

T = TypeVar("T")


class RedisStore(KVStore):
    """The Redis tier: verified values under keyed names in a Redis node or Cluster."""

    name = "redis"
    pipelined = True

    def __init__(self, client: Any, capacity_bytes: int, model: str = "model",
                 layout: str = "kv", backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 secret: str | bytes | None = None) -> None:
        super().__init__(capacity_bytes, model, layout, secret)
        self.client = client
        self.cluster = isinstance(client, redis.cluster.RedisCluster)
        self.prefix = "kvheat:" + keyed_digest(self.mac_key, b"kvheat-redis/v2", model.encode(),
                                               layout.encode(), size=8).hex() + ":"
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.down = False
        self.retry_at = 0.0
        self._backoff = 0.0
        # What this process stored (the tier's used bytes and its eviction index).
        self.sizes: dict[str, int] = {}
        self._used = 0
        # Direct I/O for MSET and large MGETs on a single node (see redis_wire.DIRECT_MIN_BYTES);
        # False keeps every command on redis-py.
        self.direct_io = not self.cluster
        self._lock = threading.Lock()

    def rkey(self, key: BlockKey, ns: Namespace) -> str:
        """The Redis key name of `key` in `ns`."""
        return self._rname(key, self.ns(ns))

    def _rname(self, key: bytes, ns: bytes) -> str:
        """The Redis key name of `key` under the namespace digest `ns`."""
        return f"{self.prefix}{ns.hex()[:16]}:{keyed_digest(self.mac_key, ns, key).hex()}"

    def _default_key(self) -> bytes:
        log.warning("redis tier: no tier secret configured (KVHEAT_TIER_SECRET or the "
                    "config's tier_secret); values are keyed for this process alone, so "
                    "replicas and restarts will not read them")
        return super()._default_key()

    # ---- up/down ----------------------------------------------------------------------
    def reachable(self) -> bool:
        return not self.down or self.clock() >= self.retry_at

    def _call(self, fn: Callable[[], T], fallback: T) -> T:
        if self.down and self.clock() < self.retry_at:
            self.stats.skipped_down += 1
            return fallback
        try:
            result = fn()
        except DOWN_ERRORS as e:
            self.stats.io_errors += 1
            with self._lock:  # several threads may fail at once: one outage, counted once
                went = not self.down
                self.down = True
                if went:
                    self.stats.went_down += 1
                if went or self.clock() >= self.retry_at:  # a first failure, or a retry's
                    self._backoff = min(self.backoff_max_s, max(self.backoff_initial_s,
                                                                2 * self._backoff))
                    self.retry_at = self.clock() + self._backoff
            if went:
                log.warning("redis tier down (%s); recomputing until it answers again", e)
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
        """Bytes of the values this process knows of in Redis (stored, or found by `stored`)."""
        return self._used

    def entry_bytes(self, kv: torch.Tensor, key: BlockKey) -> int:
        return kv.numel() * kv.element_size() + HEAD_SIZE + 4 * kv.dim() + len(key) + NS_SIZE

    def put_many(self, items: Sequence[tuple[BlockKey, torch.Tensor]],
                 ns: Namespace = NO_TENANT) -> list[bool]:
        """Store a batch in one round trip (one MSET); a True/False per item.

        The items that fit the capacity are stored, in order, all or none of them."""
        d = self.ns(ns)
        values: list[tuple[str, bytes, memoryview]] = []
        with self._lock:
            used = self._used
            for key, kv in items:
                head, payload = encode_prefix(kv, key, d, self.mac_key, self.mac_version)
                rk = self._rname(key, d)
                size = len(head) + len(payload)
                if used - self.sizes.get(rk, 0) + size > self.capacity_bytes:
                    break
                used += size - self.sizes.get(rk, 0)
                values.append((rk, head, payload))

        def run() -> bool:
            # One MSET per batch (split by slot on a cluster): fewer commands to pack and
            # parse than a pipeline of SETs, same single round trip.
            if self.cluster:
                self.client.mset_nonatomic({rk: head + bytes(payload)
                                            for rk, head, payload in values})
            elif not self.direct_io:
                self.client.mset({rk: head + bytes(payload) for rk, head, payload in values})
            else:
                bufs = [memoryview(b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(values)))]
                for rk, head, payload in values:
                    bufs += [memoryview(bulk(rk.encode()) + b"$%d\r\n" % (len(head) + len(payload))
                                        + head), payload, memoryview(b"\r\n")]
                with raw_socket(self.client) as sock:
                    send_buffers(sock, bufs)
                    ReplyReader(sock).status()
            return True

        ok = bool(values) and self._call(run, False)
        stored = len(values) if ok else 0
        if ok:
            with self._lock:
                for rk, head, payload in values:
                    size = len(head) + len(payload)
                    self._used += size - self.sizes.get(rk, 0)
                    self.sizes[rk] = size
            self.stats.puts += stored
            self.stats.put_bytes += sum(kv.nbytes for _, kv in items[:stored])
        self.stats.put_refused += len(items) - stored
        return [i < stored for i in range(len(items))]

    def put(self, key: BlockKey, kv: torch.Tensor, ns: Namespace = NO_TENANT) -> bool:
        """Store `kv` under (key, ns) as a batch of one; False (counted) when it cannot."""
        t0 = time.perf_counter()
        ok = self.put_many([(key, kv)], ns)[0]
        if ok:
            self.write_model.record(kv.nbytes, time.perf_counter() - t0)
        return ok

    def _get(self, key: BlockKey, ns: Namespace,
             out: torch.Tensor | None) -> torch.Tensor | None:
        return self._fetch([key], ns, [out], readonly_ok=False)[0]

    def get_many(self, keys: Sequence[BlockKey], ns: Namespace = NO_TENANT,
                 outs: Sequence[torch.Tensor | None] | None = None,
                 readonly_ok: bool = False) -> list[torch.Tensor | None]:
        """Read all keys in one round trip (MGET), each value verified on its own.

        Each is then copied into `outs[i]` when given. `readonly_ok`: the caller only copies
        from the tensors, so they may view the received bytes (no copy at all)."""
        if outs is not None and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
        t0 = time.perf_counter()
        res = self._fetch(keys, ns, outs, readonly_ok)
        n = 0
        for t in res:
            self.stats.gets += 1
            if t is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                n += t.nbytes
        self.stats.get_bytes += n
        if n:
            self.read_model.record(n, time.perf_counter() - t0)
        return res

    def _fetch(self, keys: Sequence[BlockKey], ns: Namespace,
               outs: Sequence[torch.Tensor | None] | None,
               readonly_ok: bool) -> list[torch.Tensor | None]:
        d = self.ns(ns)
        rks = [self._rname(k, d) for k in keys]
        if not self.cluster and self.direct_io and any(
                (o.nbytes if o is not None else self.sizes.get(rk, 0)) >= DIRECT_MIN_BYTES
                for o, rk in zip(outs or [None] * len(keys), rks, strict=True)):
            return self._fetch_direct(keys, rks, d, outs)

        def run() -> list[bytes | None]:
            if self.cluster:
                return self.client.mget_nonatomic(rks)
            return self.client.mget(rks)

        raw = self._call(run, None)
        if raw is None:
            return [None] * len(keys)
        res: list[torch.Tensor | None] = []
        for i, (key, rk, v) in enumerate(zip(keys, rks, raw, strict=True)):
            if v is None:
                self._forget(rk)
                res.append(None)
                continue
            try:
                # Checked in place in the received bytes, then copied once to where it goes.
                t = decode(v, key, d, self.mac_key)
            except CorruptValue as e:
                self._count_corrupt(e.kind, key, str(e))
                res.append(None)
                continue
            out = outs[i] if outs is not None else None
            if out is not None:
                res.append(copy_out(t, out))
            else:
                res.append(t if readonly_ok else t.clone())
        return res

    def _fetch_direct(self, keys: Sequence[BlockKey], rks: list[str], ns: bytes,
                      outs: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """`_fetch` with each payload received straight into its output tensor (or a
        private buffer), then verified there; see `ReplyReader`."""
        outs = outs if outs is not None else [None] * len(keys)
        dests = [tensor_bytes(o) if o is not None and o.device.type == "cpu"
                 and o.is_contiguous() else None for o in outs]

        def run() -> list[tuple[bytes, memoryview] | None]:
            args = [b"MGET", *(rk.encode() for rk in rks)]
            with raw_socket(self.client) as sock:
                send_buffers(sock, [memoryview(b"*%d\r\n" % len(args) + b"".join(map(bulk, args)))])
                reader = ReplyReader(sock)
                got = reader.read_array(dests)
                if reader.buf:
                    raise rexc.InvalidResponse("bytes after the MGET reply")
                return got

        raw = self._call(run, None)
        if raw is None:
            return [None] * len(keys)
        res: list[torch.Tensor | None] = []
        for key, rk, item, out, dest in zip(keys, rks, raw, outs, dests, strict=True):
            if item is None:
                self._forget(rk)
                res.append(None)
                continue
            head, body = item
            try:
                hdr = decode_header(head)
                verify_parts(head, body, hdr, key, ns, self.mac_key)
            except CorruptValue as e:  # `out` may hold the rejected bytes: not served
                self._count_corrupt(e.kind, key, str(e))
                res.append(None)
                continue
            t = payload_tensor(body, hdr)
            if out is not None and body is dest and out.dtype == t.dtype and out.shape == t.shape:
                res.append(out)  # received in place
            else:
                res.append(copy_out(t, out) if out is not None else t)
        return res

    def contains(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Whether (key, ns) is in Redis: known here and the tier up, else asked (EXISTS)."""
        rk = self.rkey(key, ns)
        if rk in self.sizes:
            return self.reachable()
        return bool(self._call(lambda: self.client.exists(rk), 0))

    def delete(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Delete the value for (key, ns) in Redis; False when it was not there."""
        return self.delete_many((key,), ns) == 1

    def delete_many(self, keys: Sequence[BlockKey], ns: Namespace = NO_TENANT) -> int:
        """One DEL for the batch (a cluster client splits it by slot)."""
        if not keys:
            return 0
        d = self.ns(ns)
        rks = [self._rname(k, d) for k in keys]
        for rk in rks:
            self._forget(rk)
        n = self._call(lambda: self.client.delete(*rks), 0)
        self.stats.deletes += n
        return int(n)

    def stored(self) -> Iterable[tuple[BlockKey, bytes]]:
        """Entries of this model and layout already in Redis, as (key, namespace digest).

        From another process or an earlier run: found with SCAN, headers read with GETRANGE
        and checked. Their sizes count in `used_bytes` from then on."""
        found: list[tuple[bytes, bytes, str, int]] = self._call(
            lambda: scan_headers(self.client, self.prefix, self._rname), [])
        with self._lock:
            for _k, _ns, name, size in found:
                self._used += size - self.sizes.get(name, 0)
                self.sizes[name] = size
        return [(stored_key(k), d) for k, d, _, _ in found]

    def purge(self, ns: Namespace) -> int:
        """Delete every value of namespace `ns` in Redis; returns how many.

        Also those other processes wrote, e.g. replicas sharing this Redis."""
        match = f"{self.prefix}{self.ns(ns).hex()[:16]}:*"

        def run() -> int:
            names = scan_names(self.client, match)
            n = delete_names(self.client, names, self.cluster)
            for k in names:
                self._forget(k)
            return n

        n = self._call(run, 0)
        self.stats.deletes += n
        return n

    def _forget(self, rk: str) -> None:
        with self._lock:
            self._used -= self.sizes.pop(rk, 0)

    def close(self) -> None:
        """Close the client (any error ignored: a dead connection must not fail shutdown)."""
        with contextlib.suppress(Exception):  # a dead connection must not fail shutdown
            self.client.close()
