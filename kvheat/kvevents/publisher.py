"""Publishing a cache's KV events over ZMQ, off the engine loop.

The cache calls `record` from whatever thread changes it (the engine loop, a tier's
demotion thread): each call appends one tuple to a deque and returns; nothing is encoded,
sent or locked there. A full queue drops the event and counts it, never blocks; the next
turn of the publisher thread then sends a resync (AllBlocksCleared and a snapshot of what
the cache holds), so a subscriber's view is whole again. The publisher thread coalesces
consecutive stores of one chain into one `BlockStored`, encodes a `KVEventBatch` per arm,
sends it on a PUB socket as (topic, sequence, payload) and keeps the last `buffer_steps`
batches for replay on a ROUTER socket, as vLLM's `ZmqEventPublisher` does; a replay
request for sequence `SNAPSHOT_SEQ` asks for a resync instead.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import zmq

from ..checks.bounds import Overflow
from .schema import (
    END_SEQ,
    SNAPSHOT_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    tier_place,
)
from .secret import EventSecret, is_private_endpoint

log = logging.getLogger("kvheat.kvevents")

# Queue items: (rank, stored?, place, key, parent, block_size, token bytes or None);
# (rank, None, ...) is a clear. `place` is a tier name ("device", "host", "disk", "redis").
_Item = tuple[int, bool | None, str, bytes, "bytes | None", int, "bytes | None"]
Snapshot = Callable[[], Iterable[_Item]]


@dataclass(slots=True)
class PublisherConfig:
    """Where and how a publisher sends its events, and how much it keeps for replay."""

    endpoint: str = "tcp://*:5557"  # the PUB socket's address, bound here
    connect: bool = False  # connect the PUB socket to `endpoint` instead (a broker's)
    replay_endpoint: str | None = None  # ROUTER for replay and snapshot requests (bound)
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    buffer_bytes: int = 256 << 20  # and at most their bytes (the oldest go first)
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000  # events waiting for the publisher thread
    # Operator mode: stores carry the blocks' token ids (vLLM-style consumers that hash
    # tokens themselves need them). Off: keys only, so a subscriber learns which tenant
    # prefixes exist where, never their text. Turn it on only where the event port is
    # reachable by the operator alone.
    token_ids: bool = False
    interval_s: float = 0.005  # how often the thread drains the queue
    snapshot_timeout_s: float = 5.0
    # Keys every published hash and, when configured, authenticates and encrypts both
    # sockets with CURVE (kvevents/secret.py); None: a random per-process secret.
    secret: EventSecret | None = None
    # Snapshots asked for on the replay socket are served at most this often (a later ask
    # waits for the next slot): each one is a whole resync for every subscriber.
    snapshot_min_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer_steps < 1 or self.hwm < 1 or self.max_queue_size < 1 or \
                self.buffer_bytes < 1:
            raise ValueError("buffer_steps, buffer_bytes, hwm and max_queue_size must be "
                             "positive")
        if not 0 < self.interval_s <= 1:
            raise ValueError("interval_s must be in (0, 1]")
        if not self.endpoint:
            raise ValueError("the event endpoint is empty")
        if not self.snapshot_min_interval_s >= 0:
            raise ValueError("snapshot_min_interval_s must be >= 0")


@dataclass(slots=True)
class PublisherStats:
    """A publisher's counters: events and batches sent, dropped, resynced, replayed."""

    events: int = 0  # events sent (a coalesced store of k blocks counts k)
    batches: int = 0
    dropped: int = 0  # events dropped on a full queue
    resyncs: int = 0  # snapshots sent (after drops, or asked for)
    replays: int = 0  # replay requests served
    snapshot_asks: int = 0  # snapshot requests on the replay socket (served or deferred)
    errors: int = 0  # failures in the publisher thread (it carries on)
    trimmed: int = 0  # batches the replay buffer let go early, over its bytes


class KVEventPublisher:
    """Publishes a cache's KV events over ZMQ from its own thread, with replay and resync."""

    def __init__(self, config: PublisherConfig | None = None,
                 snapshot: Snapshot | None = None,
                 context: zmq.Context | None = None) -> None:
        self.config = cfg = config or PublisherConfig()
        self.snapshot = snapshot
        self.stats = PublisherStats()
        self._queue: deque[_Item] = deque()
        self._max = cfg.max_queue_size
        self._overflow = False
        self._resync_asked = False
        self.ranks: set[int] = {0}  # ranks a resync clears (see `record`)
        # Sent batches for replays: at most `buffer_steps` of them (the oldest go first, as
        # a ring does) and `buffer_bytes` bytes (a trim before then is an overflow).
        self._buffer: deque[tuple[int, bytes]] = deque()
        self.buffer_bytes = 0
        self._trims = Overflow(log, "the KV event replay buffer's bytes (oldest batches let "
                               "go early: a subscriber that needs them resyncs)",
                               on_count=self._count_trim)
        self._seq = itertools.count()
        self._topic = cfg.topic.encode()
        self.secret = cfg.secret or EventSecret.resolve(None)
        self._event_key = self.secret.event_key
        self._snapshot_at = -float("inf")  # when the last asked-for snapshot was served
        self._snapshot_pending = False
        self.authenticated = self.secret.configured
        self._auth: Any = None
        # CURVE needs an authenticator (ZAP) on the sockets' context: a context of our own,
        # so nothing else in the process is affected by it.
        self._own_ctx = context is None and self.authenticated
        self._ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if self.authenticated:
                self._start_auth()
                self.secret.curve_server(self._pub)
            if cfg.connect:
                self._pub.connect(cfg.endpoint)
            else:
                self._pub.bind(cfg.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or cfg.endpoint
            self.replay_endpoint: str | None = None
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                if self.authenticated:
                    self.secret.curve_server(self._replay)
                self._replay.bind(cfg.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot open the KV event sockets ({cfg.endpoint}, "
                             f"{cfg.replay_endpoint}): {e}") from None
        open_ = [ep for ep in (cfg.endpoint, cfg.replay_endpoint)
                 if ep and not cfg.connect and not is_private_endpoint(ep)]
        if open_ and not self.authenticated:
            log.warning("KV event sockets %s are open to anyone who reaches them (no events "
                        "secret: set kv_events_secret or KVHEAT_EVENTS_SECRET on the replicas "
                        "and the router for CURVE, or bind to 127.0.0.1)%s",
                        ", ".join(open_), "; token ids ON: prompts are readable there"
                        if cfg.token_ids else "")
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvheat-kv-events", daemon=True)
        self._thread.start()

    # ---- recording (any thread; never blocks) ---------------------------------------------
    def record(self, item: _Item) -> None:
        """Queue one event (never blocks); on a full queue drop it and resync later."""
        q = self._queue
        if len(q) >= self._max:
            self.stats.dropped += 1
            self._overflow = True
            return
        q.append(item)

    def add_rank(self, rank: int) -> None:
        """Add `rank` to the ranks a resync clears."""
        self.ranks.add(rank)

    def request_resync(self) -> None:
        """Ask the publisher thread to send a resync on its next turn."""
        self._resync_asked = True

    def _start_auth(self) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        allowed = self.secret.client_public

        class _OneKey:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == allowed

        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("kvheat.kvevents.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_OneKey())

    # ---- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        wait_ms = max(1, int(self.config.interval_s * 1000))
        while self._running:
            try:
                if self._replay is not None:
                    if poller.poll(wait_ms):
                        self._serve_replay()
                else:
                    time.sleep(self.config.interval_s)
                self._flush()
                if self._snapshot_pending and time.monotonic() - self._snapshot_at >= \
                        self.config.snapshot_min_interval_s:
                    self._snapshot_pending = False
                    self._snapshot_at = time.monotonic()
                    self._resync_asked = True
                if self._overflow or self._resync_asked:
                    self._resync()
            except Exception:  # the thread must outlive any one bad event or socket error
                self.stats.errors += 1
                log.exception("KV event publisher")
                time.sleep(0.05)
        with contextlib.suppress(Exception):
            self._flush()

    def _flush(self) -> None:
        q = self._queue
        if not q:
            return
        items: list[_Item] = []
        with contextlib.suppress(IndexError):
            for _ in range(len(q)):
                items.append(q.popleft())
        self._send_items(items)

    def _send_items(self, items: list[_Item]) -> None:
        by_rank: dict[int, list[Any]] = {}
        last: dict[int, tuple[BlockStored, str, bytes]] = {}  # rank -> open store, place, tail
        with_tokens = self.config.token_ids
        ek = self._event_key
        n_events = 0
        for rank, stored, place, key, parent, block_size, tokens in items:
            if stored is not None:
                key = ek(key)
                if parent is not None:
                    parent = ek(parent)
            events = by_rank.setdefault(rank, [])
            if stored is None:
                events.append(AllBlocksCleared())
                last.pop(rank, None)
                continue
            n_events += 1
            if stored:
                token_ids = _token_list(tokens) if with_tokens and tokens else []
                open_ = last.get(rank)
                if open_ is not None and open_[1] == place and open_[2] == parent and \
                        open_[0].block_size == block_size and \
                        bool(open_[0].token_ids) == bool(token_ids):
                    ev = open_[0]
                    ev.block_hashes.append(key)
                    ev.token_ids.extend(token_ids)
                    last[rank] = (ev, place, key)
                    continue
                medium, locality, ownership = tier_place(place)
                ev = BlockStored(block_hashes=[key], parent_block_hash=parent,
                                 token_ids=token_ids, block_size=block_size, lora_id=None,
                                 medium=medium, lora_name=None, locality=locality,
                                 ownership=ownership)
                events.append(ev)
                last[rank] = (ev, place, key)
            else:
                last.pop(rank, None)
                prev = events[-1] if events else None
                medium, locality, ownership = tier_place(place)
                if isinstance(prev, BlockRemoved) and prev.medium == medium and \
                        prev.locality == locality and prev.ownership == ownership:
                    prev.block_hashes.append(key)
                else:
                    events.append(BlockRemoved(block_hashes=[key], medium=medium,
                                               locality=locality, ownership=ownership))
        now = time.time()
        for rank, events in by_rank.items():
            self._send(KVEventBatch(ts=now, events=events, data_parallel_rank=rank))
        self.stats.events += n_events

    def _count_trim(self, n: int) -> None:
        self.stats.trimmed += n

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        seq = next(self._seq)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        buf = self._buffer
        buf.append((seq, payload))
        self.buffer_bytes += len(payload)
        cfg = self.config
        while len(buf) > cfg.buffer_steps or self.buffer_bytes > cfg.buffer_bytes:
            if len(buf) <= cfg.buffer_steps:
                self._trims()
            self.buffer_bytes -= len(buf.popleft()[1])
        self.stats.batches += 1

    def _resync(self) -> None:
        """AllBlocksCleared, then what the cache holds now, on the PUB socket. Events
        queued meanwhile follow it; each is a set or an unset of one key, so applied after
        the snapshot they leave each key as the cache has it."""
        self._overflow = self._resync_asked = False
        self._flush()
        if self.snapshot is None:
            items: list[_Item] = []
            ranks = {0}
        else:
            try:
                items = list(self.snapshot())
            except BaseException:
                self._resync_asked = True  # tried again on the next turn
                raise
            ranks = {it[0] for it in items} | {0} | self.ranks
        clears: list[_Item] = [(r, None, "device", b"", None, 0, None) for r in sorted(ranks)]
        self._send_items(clears + items)
        self.stats.resyncs += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: ignored
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.stats.replays += 1
            if start_seq == SNAPSHOT_SEQ:
                self.stats.snapshot_asks += 1
                self._snapshot_pending = True  # served by the thread, rate-limited
            else:
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        self._replay.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # ---- lifecycle ------------------------------------------------------------------------
    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the publisher thread and close its sockets."""
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout_s)
        self._close_sockets()
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
        if self._own_ctx:
            with contextlib.suppress(Exception):
                self._ctx.term()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                with contextlib.suppress(Exception):
                    s.close(linger=0)

    @property
    def queued(self) -> int:
        """Events waiting for the publisher thread."""
        return len(self._queue)


def _token_list(raw: bytes) -> list[int]:
    from array import array

    a = array("I")
    a.frombytes(raw)
    return a.tolist()
