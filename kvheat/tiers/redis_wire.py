"""Talking to Redis: a fail-fast redis-py client (`connect`), SCAN-based listing and
deletion by name pattern (node or cluster), and direct socket I/O for large values on a
single node (`raw_socket`, `send_buffers`, `ReplyReader`), which the Redis tier
(`redis_store.py`) uses for MSET and large MGETs.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.retry import Retry

from .codec import HEAD_SIZE, MAX_KEY, MAX_NDIM, NS_SIZE, CorruptValue, decode_header, header_size

# Errors that mean the tier is unreachable (not one failed command).
DOWN_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError,
               rexc.BusyLoadingError, rexc.MasterDownError, rexc.TryAgainError,
               rexc.SlotNotCoveredError, OSError)
MAX_HEADER = HEAD_SIZE + 4 * MAX_NDIM + MAX_KEY + NS_SIZE


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


def scan_names(client: Any, match: str) -> list[str]:
    """Every key name matching `match` (SCAN; all nodes of a cluster)."""
    return [n.decode() if isinstance(n, bytes) else n
            for n in client.scan_iter(match=match, count=1000)]


def delete_names(client: Any, names: list[str], cluster: bool) -> int:
    """Delete `names` in batches; returns how many existed."""
    n = 0
    for i in range(0, len(names), 512):
        chunk = names[i:i + 512]
        # A cluster's keys live on several nodes: one DEL each.
        n += sum(client.delete(k) for k in chunk) if cluster else client.delete(*chunk)
    return n


def scan_headers(client: Any, prefix: str, name_of: Callable[[bytes, bytes], str]
                 ) -> list[tuple[bytes, bytes, str, int]]:
    """(key, namespace, name, size) of each checked value under `prefix`.

    Those whose header checks out and whose name is `name_of(key, namespace)`: headers read
    with GETRANGE, pipelined."""
    found: list[tuple[bytes, bytes, str, int]] = []
    names = scan_names(client, prefix + "*")
    for i in range(0, len(names), 512):
        chunk = names[i:i + 512]
        pipe = client.pipeline(transaction=False)
        for n in chunk:
            pipe.getrange(n, 0, MAX_HEADER - 1)
            pipe.strlen(n)
        res = pipe.execute()
        for j, name in enumerate(chunk):
            head, size = res[2 * j], res[2 * j + 1]
            try:
                hdr = decode_header(head)
            except CorruptValue:
                continue
            if size == hdr.body_offset + hdr.payload_len and name == name_of(hdr.key, hdr.ns):
                found.append((hdr.key, hdr.ns, name, size))
    return found


# Direct I/O on a single node (a cluster always goes through redis-py). redis-py packs
# commands and parses replies well, but moves large values slowly: it sends each value
# with its own `sendall` and turns every reply value into a `bytes` copy. So an MSET is
# sent here as one scatter-gather `sendmsg` of the header and tensor buffers, and values
# of at least DIRECT_MIN_BYTES are received straight into their destination tensors.
# Measured on 2 cores: about 2.2x redis-py's MSET throughput at 64 KiB and 1 MiB, and 2x
# its MGET at 1 MiB; below 256 KiB hiredis parses MGET replies faster than Python can.
# Connections still come from (and go back to) redis-py's pool, which connects, AUTHs and
# SELECTs; one that fails mid-command is disconnected, never reused.
DIRECT_MIN_BYTES = 256 << 10
_IOV_MAX = 1024


@contextlib.contextmanager
def raw_socket(client: Any) -> Iterator[socket.socket]:
    """Lend the socket of a connection from `client`'s pool, for direct I/O.

    The connection goes back to the pool after; one that failed inside the body is
    disconnected first (it may be mid-command), never reused."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.connect()  # no-op when connected
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise ConnectionError("redis-py connection has no socket")
        yield sock
    except BaseException:
        conn.disconnect()  # the stream may be mid-command: never reuse it
        raise
    finally:
        pool.release(conn)


def bulk(data: bytes) -> bytes:
    """`data` as a RESP bulk string (`$<length>`, CRLF, the bytes, CRLF)."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


def send_buffers(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Send every buffer, in order, with as few `sendmsg` calls as the kernel allows."""
    i = 0
    while i < len(bufs):
        n = sock.sendmsg(bufs[i:i + _IOV_MAX])
        while n and i < len(bufs):
            if n >= len(bufs[i]):
                n -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


class ReplyReader:
    """Reads Redis replies (RESP2 or RESP3) from a socket, payloads straight into buffers.

    A status line, or an MGET array of bulk strings and nils whose payloads are received
    straight into destination buffers (an output tensor's bytes, e.g. a device block)
    instead of through hiredis, a `bytes` object and a copy.

    Each value comes back as (header bytes, payload view) for the codec to verify; a value
    whose header cannot be parsed is drained from the socket and returned as raw bytes,
    so the stream stays in step and the codec reports it as corrupt."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise ConnectionError("connection closed inside a reply")
            self.buf += chunk

    def _line(self) -> bytes:
        start = 0
        while (i := self.buf.find(b"\r\n", start)) < 0:
            start = max(0, len(self.buf) - 1)
            self._fill(len(self.buf) + 1)
        line = bytes(self.buf[:i])
        del self.buf[:i + 2]
        return line

    def _read_into(self, dst: memoryview) -> None:
        """Exactly len(dst) bytes of the stream into dst: what is buffered, then the socket."""
        k = min(len(self.buf), len(dst))
        dst[:k] = self.buf[:k]
        del self.buf[:k]
        while k < len(dst):
            n = self.sock.recv_into(dst[k:])
            if n == 0:
                raise ConnectionError("connection closed inside a value")
            k += n

    def status(self) -> None:
        """Read a `+OK`-style reply; raise on an error reply."""
        line = self._line()
        if line[:1] == b"-":
            raise rexc.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"+":
            raise rexc.InvalidResponse(f"unexpected reply {line[:32]!r}")

    def read_array(self, dests: Sequence[memoryview | None]) -> list[tuple[bytes, memoryview] | None]:
        """Read an MGET reply of `len(dests)` values: (header bytes, payload view) or None.

        A payload goes into `dests[i]` when that has its size, else into a fresh buffer; a
        nil is None. Raises on an error reply or an array of another length."""
        line = self._line()
        if line[:1] == b"-":
            raise rexc.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"*" or int(line[1:]) != len(dests):
            raise rexc.InvalidResponse(f"unexpected MGET reply {line[:32]!r}")
        return [self._value(d) for d in dests]

    def _value(self, dest: memoryview | None) -> tuple[bytes, memoryview] | None:
        line = self._line()
        if line == b"_":  # RESP3 null (redis-py may speak either protocol)
            return None
        if line[:1] != b"$":
            raise rexc.InvalidResponse(f"unexpected bulk header {line[:32]!r}")
        n = int(line[1:])
        if n < 0:  # RESP2 null
            return None
        first = min(n, HEAD_SIZE)
        self._fill(first)
        head_len = header_size(self.buf) if first == HEAD_SIZE else n
        if not HEAD_SIZE <= head_len <= min(n, MAX_HEADER):
            head_len = n  # not our format: keep all of it for the codec to reject
        self._fill(min(n, head_len))
        head = bytes(self.buf[:head_len])
        del self.buf[:head_len]
        size = n - head_len
        body = dest if dest is not None and len(dest) == size else memoryview(bytearray(size))
        self._read_into(body)
        self._fill(2)
        del self.buf[:2]  # the bulk string's CRLF
        return head, body
