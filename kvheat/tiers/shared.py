"""One Redis tier shared by many replicas: each tells the others which keys it put there.

A replica's Redis tier indexes only what it wrote itself (its budget, its evictions), so
without this a block another replica demoted to the same Redis is never found. Here each
`TierManager` announces the keys its Redis tier takes and loses on a Redis pub/sub
channel (named from the store's keyed prefix: only replicas of the same model, layout and
tier secret listen), and keeps the keys the others announce as peer entries: found after
its own indexes, loaded like its own (the value's MAC is checked against the request's
tenant as always), never evicted or deleted by it; the writer's eviction removes them.

Announcements carry keys and token counts, never KV or token ids. A missed announcement
costs a missed hit, or a load that finds nothing (counted, recomputed); never wrong KV.
Messages: repeated (op: 1 byte, tokens: 4 bytes, key length: 1 byte, key), after an
8-byte writer id; no pickle.

Bounded: at most `max_peer_keys` peer entries (the oldest announced go first) of keys of
at most `MAX_KEY_BYTES`, and `MAX_QUEUED` announcements of this replica waiting to be
sent (more are dropped); each overflow counted and logged at most once per interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque

from ..cache.hashing import BlockKey, stored_key
from ..checks.bounds import Overflow
from .index import PeerEntry
from .manager import TierManager
from .redis_store import RedisStore

log = logging.getLogger("kvheat.tiers")
_REC = struct.Struct("!BIB")
_PUT, _DEL = 1, 2
MAX_QUEUED = 100_000  # this replica's announcements waiting for the publishing thread
MAX_KEY_BYTES = 64  # a peer's announced key (kvheat's keys are 16 bytes); longer: bad


def encode_announcements(writer: bytes, items: list[tuple[int, bytes, int]]) -> bytes:
    """One pub/sub message: the writer's id, then each (op, key, tokens)."""
    out = [writer]
    for op, key, tokens in items:
        out.append(_REC.pack(op, tokens, len(key)))
        out.append(key)
    return b"".join(out)


def decode_announcements(data: bytes) -> tuple[bytes, list[tuple[int, bytes, int]]]:
    """(writer, [(op, key, tokens)]); a malformed message raises ValueError."""
    if len(data) < 8:
        raise ValueError("announcement too short")
    writer, pos, out = data[:8], 8, []
    while pos < len(data):
        if pos + _REC.size > len(data):
            raise ValueError("truncated announcement")
        op, tokens, klen = _REC.unpack_from(data, pos)
        pos += _REC.size
        key = data[pos:pos + klen]
        if len(key) != klen or op not in (_PUT, _DEL):
            raise ValueError("bad announcement record")
        pos += klen
        out.append((op, key, tokens))
    return writer, out


class SharedTierFeed:
    """Other replicas' keys in one shared Redis tier, heard over pub/sub; ours announced."""

    def __init__(self, tiers: TierManager, tier_name: str = "redis",
                 max_peer_keys: int = 1 << 20, flush_s: float = 0.01) -> None:
        t = tiers.tier_of(tier_name)
        if t is None:
            raise ValueError(f"no {tier_name} tier to share")
        self.tiers = tiers
        self.tier = t
        store = tiers.stores[t]
        if not isinstance(store, RedisStore):
            raise ValueError(f"the {tier_name} tier is not a Redis store")
        self.store = store
        self.client = self.store.client
        self.channel = self.store.prefix + "shared"
        self.writer = os.urandom(8)
        self.max_peer_keys = max_peer_keys
        self.flush_s = flush_s
        self.peers: OrderedDict[BlockKey, int] = OrderedDict()  # key -> tokens
        self._lock = threading.Lock()
        self._out: deque[tuple[int, bytes, int]] = deque()
        self.sent = self.received = self.bad = self.errors = 0
        self.queue_overflow = Overflow(log, "the shared tier's announcement queue "
                                       "(announcements dropped: peers miss those keys)")
        self.peer_overflow = Overflow(log, "the shared tier's peer keys (the oldest "
                                      "announced forgotten: a missed hit, never wrong KV)")
        self._running = True
        tiers.index_listeners.append(self._on_local)
        tiers.lower.peers = self
        self._pub = threading.Thread(target=self._publish_loop, name="kvheat-shared-pub",
                                     daemon=True)
        self._sub = threading.Thread(target=self._subscribe_loop, name="kvheat-shared-sub",
                                     daemon=True)
        self._pub.start()
        self._sub.start()

    # ---- this replica's changes (called under the tiers' lock: queue and return) ----------
    def _on_local(self, name: str, key: BlockKey, parent: BlockKey | None, tokens: int,
                  stored: bool) -> None:
        if name != self.store.name:
            return
        if len(self._out) >= MAX_QUEUED:
            self.queue_overflow()
            return
        self._out.append((_PUT if stored else _DEL, key, tokens))

    def _publish_loop(self) -> None:
        while self._running:
            time.sleep(self.flush_s)
            if not self._out:
                continue
            items = []
            with contextlib.suppress(IndexError):
                for _ in range(min(len(self._out), 4096)):
                    items.append(self._out.popleft())
            try:
                self.client.publish(self.channel, encode_announcements(self.writer, items))
                self.sent += len(items)
            except Exception as e:  # Redis down: announcements are lost, not retried
                self.errors += 1
                log.debug("shared tier announce failed: %s", e)

    # ---- the others' ------------------------------------------------------------------------
    def _subscribe_loop(self) -> None:
        while self._running:
            ps = None
            try:
                ps = self.client.pubsub(ignore_subscribe_messages=True)
                ps.subscribe(self.channel)
                while self._running:
                    msg = ps.get_message(timeout=0.5)
                    if msg is None or msg.get("type") != "message":
                        continue
                    self._apply(msg["data"])
            except Exception as e:
                self.errors += 1
                log.debug("shared tier subscription: %s", e)
                time.sleep(0.5)
            finally:
                if ps is not None:
                    with contextlib.suppress(Exception):
                        ps.close()

    def _apply(self, data: bytes) -> None:
        try:
            writer, items = decode_announcements(data)
        except ValueError:
            self.bad += 1
            return
        if writer == self.writer:
            return
        n = 0
        with self._lock:
            for op, key, tokens in items:
                self.received += 1
                if len(key) > MAX_KEY_BYTES:
                    self.bad += 1
                elif op == _PUT:
                    k = stored_key(key)  # a key another replica put in the shared store
                    self.peers[k] = tokens
                    self.peers.move_to_end(k)
                    if len(self.peers) > self.max_peer_keys:  # never past it, even within
                        self.peers.popitem(last=False)
                        n += 1
                else:
                    self.peers.pop(stored_key(key), None)
        if n:
            self.peer_overflow(n)

    # ---- lookups (TierManager.find) -----------------------------------------------------------
    def lookup(self, key: BlockKey) -> tuple[int, PeerEntry] | None:
        """(tier, entry) of `key` when another replica put it in the shared tier."""
        with self._lock:
            tokens = self.peers.get(key)
        if tokens is None:
            return None
        return self.tier, PeerEntry(key, tokens)

    def forget(self, key: BlockKey) -> None:
        """Drop `key` from the peers' keys (its load failed: gone there)."""
        with self._lock:
            self.peers.pop(key, None)

    @property
    def dropped(self) -> int:
        """This replica's announcements dropped on a full queue."""
        return self.queue_overflow.count

    def __len__(self) -> int:
        return len(self.peers)

    def close(self) -> None:
        """Stop listening and announcing."""
        self._running = False
        if self._on_local in self.tiers.index_listeners:
            self.tiers.index_listeners.remove(self._on_local)
        if self.tiers.lower.peers is self:
            self.tiers.lower.peers = None
        self._pub.join(1.0)
        self._sub.join(1.0)
