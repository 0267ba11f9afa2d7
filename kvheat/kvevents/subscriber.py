"""Subscribing to one publisher's KV events (kvheat's or vLLM's), with gap repair.

Two threads per publisher: one receives the live stream on a SUB socket into a bounded
inbox, the other applies it and holds a DEALER on the publisher's replay (ROUTER) socket.
Sequence numbers are checked: a gap is replayed from the publisher's buffer; what the
buffer no longer holds (or a replay with a hole) is answered by a reset (the consumer
forgets that publisher's blocks) and a snapshot request, which a kvheat publisher answers
with AllBlocksCleared and everything it holds (a vLLM publisher with nothing: the view
then refills as blocks are stored). A sequence that goes back means the publisher
restarted: a reset too.

Nothing a publisher sends can stop the thread: payloads are bounded in size (and in
nesting by the schema), a batch that does not decode is counted and skipped, a handler
that fails is counted and followed by a reset and a snapshot (its view may be half
applied), and any other failure closes the sockets, resets, and subscribes again after a
backoff, counted in `restarts`. With an `EventSecret` both sockets are CURVE clients.

Memory is bounded whatever the publisher sends and however slow the handler is: the
inbox holds at most `max_queue_messages` batches and `max_queue_bytes` bytes; a batch that
does not fit is dropped, counted in `overflows` and logged (at most once per interval),
and, events being a stream, repaired as a gap is: replayed from the publisher's buffer,
or a reset and a snapshot. Both sockets keep at most `_SOCKET_HWM` messages in ZMQ's own
queue (a full one stops reading from TCP: the publisher's high-water mark drops), so the
whole is bounded by the inbox, plus (`_SOCKET_HWM` + 1) x `MAX_BATCH_BYTES` per socket
(ZMQ's queue and the message it is reading), plus the one batch being applied.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ..checks.bounds import Overflow
from .schema import END_SEQ, MAX_BATCH_BYTES, SNAPSHOT_SEQ, KVEventBatch, decode_batch
from .secret import EventSecret

log = logging.getLogger("kvheat.kvevents")
# Batches received and not yet applied, per publisher: far above a live stream's (a batch
# per engine step, a few KB to a few MB), so only a handler that falls far behind, or a
# publisher that floods, meets them.
MAX_QUEUE_MESSAGES = 4096
MAX_QUEUE_BYTES = 64 << 20
# Messages ZMQ itself queues per socket (RCVHWM): the inbox is the queue, counted in bytes.
_SOCKET_HWM = 1


class ResyncNeeded(Exception):
    """Raised by a batch handler whose view went past one of its bounds (and was cut back).

    The subscriber resets and asks for a snapshot, without counting a handler error."""


class Inbox:
    """Received batches (their frames) waiting for the handler, bounded in messages and bytes.

    `put` refuses what does not fit (the caller counts it)."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("an inbox holds at least one message and one byte")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.bytes = 0
        self._q: deque[tuple[int, list[bytes]]] = deque()
        self._cond = threading.Condition()

    def put(self, frames: list[bytes]) -> bool:
        """Queue one batch's frames; False, queuing nothing, when they do not fit."""
        size = sum(len(f) for f in frames)
        with self._cond:
            if len(self._q) >= self.max_messages or self.bytes + size > self.max_bytes:
                return False
            self._q.append((size, frames))
            self.bytes += size
            self._cond.notify()
        return True

    def get(self, timeout_s: float) -> list[bytes] | None:
        """The oldest batch's frames, waiting up to `timeout_s` for one (None: none came)."""
        with self._cond:
            if not self._q:
                self._cond.wait(timeout_s)
                if not self._q:
                    return None
            size, frames = self._q.popleft()
            self.bytes -= size
            return frames

    def __len__(self) -> int:
        return len(self._q)


@dataclass(slots=True)
class SubscriberStats:
    """A subscriber's counters: batches, gaps, resets, bad payloads, errors, overflows."""

    batches: int = 0
    replayed: int = 0  # batches received through the replay socket
    gaps: int = 0
    resets: int = 0
    bad: int = 0  # payloads that were not a KVEventBatch (larger ones never arrive)
    handler_errors: int = 0
    restarts: int = 0  # the subscription failed and was opened again
    timeouts: int = 0  # replay or snapshot requests the publisher did not answer in time
    overflows: int = 0  # batches dropped because the inbox was full (then repaired)
    last_seq: int = -1
    last_batch_at: float | None = None  # time.monotonic() of the last batch applied


class KVEventSubscriber:
    """Follows one publisher's KV events, repairing gaps by replay or by a reset and snapshot."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None,
                 on_batch: Callable[[str, KVEventBatch], None],
                 on_reset: Callable[[str], None], topic: str = "",
                 replay_timeout_s: float = 2.0, context: zmq.Context | None = None,
                 secret: EventSecret | None = None, restart_backoff_s: float = 0.5,
                 max_queue_messages: int = MAX_QUEUE_MESSAGES,
                 max_queue_bytes: int = MAX_QUEUE_BYTES) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.topic = topic.encode()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.secret = secret
        self.restart_backoff_s = restart_backoff_s
        self.stats = SubscriberStats()
        self.inbox = Inbox(max_queue_messages, max_queue_bytes)
        self._overflow = Overflow(log, f"the KV event inbox of {name} (batches dropped, "
                                  "then replayed or resynced)", on_count=self._count_overflow)
        self._overflowed = False  # batches were dropped since the handler last caught up
        self._last: int | None = None
        self._resync = False  # asked for by `resync` or after a handler failed
        self._ctx = context or zmq.Context.instance()
        self._running = True
        self._synced = threading.Event()
        self._listening = threading.Event()  # the SUB socket is connected
        self._receiver = threading.Thread(target=self._receive, name=f"kvheat-sub-rx-{name}",
                                          daemon=True)
        self._thread = threading.Thread(target=self._run, name=f"kvheat-sub-{name}", daemon=True)
        self._receiver.start()
        self._thread.start()

    def wait_synced(self, timeout_s: float) -> bool:
        """True once the first catch-up (replay, snapshot request) is done."""
        return self._synced.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop both threads."""
        self._running = False
        self._thread.join(timeout_s)
        self._receiver.join(timeout_s)

    @property
    def alive(self) -> bool:
        """Whether both threads still run."""
        return self._thread.is_alive() and self._receiver.is_alive()

    def resync(self) -> None:
        """Forget this publisher's view and ask it for a snapshot (on the thread)."""
        self._resync = True

    def _count_overflow(self, n: int) -> None:
        self.stats.overflows += n

    # ---- the receiving thread ---------------------------------------------------------------
    def _receive(self) -> None:
        """The live stream into the inbox, as fast as it comes: a batch that does not fit
        is dropped and counted; the handler's thread repairs the gap."""
        while self._running:
            sub = None
            try:
                sub = self._socket(zmq.SUB, self.endpoint)
                self._listening.set()
                while self._running:
                    if not sub.poll(100):
                        continue
                    frames = sub.recv_multipart()
                    if not self.inbox.put(frames):
                        self._overflowed = True
                        self._overflow(why=f"{len(self.inbox)} batches, {self.inbox.bytes} "
                                       "bytes queued")
            except Exception:  # contained: counted, subscribed again (gaps are repaired)
                self.stats.restarts += 1
                log.exception("KV event receiver of %s failed; subscribing again", self.name)
                time.sleep(self.restart_backoff_s)
            finally:
                self._listening.set()
                if sub is not None:
                    with contextlib.suppress(Exception):
                        sub.close(linger=0)

    # ---- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while self._running:
            try:
                self._subscribe()
            except Exception:  # contained: counted, reset, subscribed again
                self.stats.restarts += 1
                log.exception("KV event subscriber %s failed; subscribing again", self.name)
                self._reset()
                time.sleep(self.restart_backoff_s)
            finally:
                self._synced.set()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer whose frame is larger than this (no allocation for it): the
        # one bound on a payload's size.
        s.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        # A full ZMQ queue stops reading from TCP: the inbox, counted in bytes, is the
        # queue (0, unbounded, let a flood grow the process by gigabytes).
        s.setsockopt(zmq.RCVHWM, _SOCKET_HWM)
        if self.secret is not None:
            self.secret.curve_client(s)
        if kind == zmq.SUB:
            s.setsockopt(zmq.SUBSCRIBE, self.topic)
        s.connect(endpoint)
        return s

    def _subscribe(self) -> None:
        self._listening.wait(5.0)  # the live stream first, so nothing falls between
        replay = self._socket(zmq.DEALER, self.replay_endpoint) if self.replay_endpoint \
            else None
        try:
            # Catch up: what the buffer holds, then a snapshot (kvheat answers on the PUB).
            if replay is not None:
                self._replay_from(replay, 0)
                self._ask_snapshot(replay)
            self._synced.set()
            while self._running:
                if self._resync:
                    self._resync = False
                    self._reset()
                    if replay is not None:
                        self._ask_snapshot(replay)
                frames = self.inbox.get(0.1)
                if frames is None:
                    if self._overflowed:  # the batches dropped may have been the last
                        self._overflowed = False
                        self._catch_up(replay)
                    continue
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.bad += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                last = self._last
                if last is not None and seq < last - 1:  # the publisher started over
                    self._reset()
                    self._apply(seq, frames[2])
                    continue
                if last is not None and seq <= last:
                    continue  # already applied (from a replay)
                if last is not None and seq > last + 1:
                    self.stats.gaps += 1
                    if replay is None or not self._replay_from(replay, last + 1, upto=seq):
                        self._reset()
                        if replay is not None:
                            self._ask_snapshot(replay)
                self._apply(seq, frames[2])
        finally:
            if replay is not None:
                with contextlib.suppress(Exception):
                    replay.close(linger=0)

    def _catch_up(self, replay: zmq.Socket | None) -> None:
        """After dropped batches: replay what followed the last one applied, or reset and
        ask for a snapshot where the publisher's buffer no longer has it."""
        if replay is not None and self._last is not None and \
                self._replay_from(replay, self._last + 1):
            return
        self._reset()
        if replay is not None:
            self._ask_snapshot(replay)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        self.stats.last_seq = seq
        try:
            batch = decode_batch(payload)
        except (ValueError, RecursionError, MemoryError):  # msgspec's errors are ValueErrors
            self.stats.bad += 1
            return
        self.stats.batches += 1
        self.stats.last_batch_at = time.monotonic()
        try:
            self.on_batch(self.name, batch)
        except ResyncNeeded:  # the handler's bound (counted and logged there)
            self._resync = True
        except Exception:
            self.stats.handler_errors += 1
            log.exception("KV event handler for %s; resyncing", self.name)
            self._resync = True

    def _reset(self) -> None:
        self.stats.resets += 1
        self._last = None
        try:
            self.on_reset(self.name)
        except Exception:
            self.stats.handler_errors += 1
            log.exception("KV event reset handler for %s", self.name)

    def _replay_from(self, sock: zmq.Socket, start: int, upto: int | None = None) -> bool:
        """Apply buffered batches from `start` (before `upto`); False when the buffer no
        longer reaches back to `start` or the publisher does not answer."""
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        whole = True
        first, expect = True, start
        while True:
            if not sock.poll(self.replay_timeout_ms):
                self._timed_out("replay")
                return False
            frames = sock.recv_multipart()
            if len(frames) != 4:
                continue
            _, _topic, seq_b, payload = frames
            if seq_b == END_SEQ:
                return whole
            seq = int.from_bytes(seq_b, "big")
            # (From 0: whatever the buffer holds first.) A later start than asked: the
            # buffer no longer reaches back; a hole: a batch went missing on the way.
            if seq != expect and (start or not first):
                whole = False
            first, expect = False, seq + 1
            if upto is not None and seq >= upto:
                continue
            if self._last is not None and seq <= self._last:
                continue
            self.stats.replayed += 1
            self._apply(seq, payload)

    def _ask_snapshot(self, sock: zmq.Socket) -> None:
        sock.send_multipart((b"", SNAPSHOT_SEQ.to_bytes(8, "big")))
        while sock.poll(self.replay_timeout_ms):
            frames = sock.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:
                return
        self._timed_out("snapshot")

    def _timed_out(self, what: str) -> None:
        self.stats.timeouts += 1
        log.warning("KV events of %s: the publisher's replay socket %s did not answer a %s "
                    "request in %.1f s (its view may be incomplete until a snapshot arrives)",
                    self.name, self.replay_endpoint, what, self.replay_timeout_ms / 1000)
