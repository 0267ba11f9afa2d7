"""Disk tier: one file per entry under a directory, with a size cap.

Files are written atomically (temp file, fsync, rename, directory fsync), in the raw format
of `codec.py` (header with format version, dtype, shape, key, namespace, checksum). On
start the index is rebuilt from the directory: leftover temp files, files whose size
disagrees with their header (torn), and files whose name does not match the key inside are
deleted, never indexed. Every read checks the whole value again before serving it.
A full disk (ENOSPC, EDQUOT, EFBIG) or the cap refuses the put; demotion stops for a while
and nothing raises.

The cap holds for the folder: processes sharing one (two servers of one model) each count
every file of their model and layout, not just their own, and a store opened over more
than its cap deletes the oldest files down to it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from ..cache.hashing import NO_TENANT, BlockKey, Namespace, stored_key
from .codec import (
    HEAD_SIZE,
    MAX_KEY,
    MAX_NDIM,
    NS_SIZE,
    CorruptValue,
    decode,
    decode_header,
    encode_prefix,
    keyed_digest,
)
from .store import KVStore, copy_out, log

_SUFFIX = ".kv"
_TMP = ".tmp-"
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_MAX_HEADER = HEAD_SIZE + 4 * MAX_NDIM + MAX_KEY + NS_SIZE
_KEY_FILE = ".kvheat-tier-key"


class DiskStore(KVStore):
    """The disk tier: one file per entry under `root`, capped at `capacity_bytes`."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, model: str = "model",
                 layout: str = "kv", fsync: bool = True, full_backoff_s: float = 5.0,
                 secret: str | bytes | None = None, folder_scan_s: float = 1.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        super().__init__(capacity_bytes, model, layout, secret)
        self.prefix = keyed_digest(self.mac_key, b"kvheat-disk/v2", model.encode(),
                                   layout.encode(), size=8).hex() + "-"
        # The folder's bytes of this model and layout, other processes' files included,
        # measured at most this often (on the demotion thread's puts).
        self.folder_scan_s = folder_scan_s
        self._others_bytes = 0  # other processes' files of this model and layout, at the last scan
        self._folder_at = float("-inf")
        self.trimmed_on_open = 0
        self.fsync = fsync
        self.full_backoff_s = full_backoff_s
        self.write_blocked_until = 0.0
        self.full_events = 0  # times the file system itself said full
        # file name digest -> (key, namespace, file size)
        self.index: dict[str, tuple[BlockKey, bytes, int]] = {}
        self._used = 0
        self._lock = threading.Lock()
        self.rejected_on_open = 0
        self._rebuild_index()

    # ---- naming -----------------------------------------------------------------------
    # Files are named <model+layout digest>-<namespace+key digest>.kv. The first part lets
    # stores of several models or layouts share a directory without reading, counting or
    # deleting each other's files (each has its own cap).
    def _name(self, key: bytes, ns: bytes) -> str:
        return self.prefix + keyed_digest(self.mac_key, ns, key).hex()

    def _default_key(self) -> bytes:
        """No secret configured: the folder's own key file (created once, mode 0600), so
        a restart, and every store on this folder, verifies what the others wrote."""
        path = self.root / _KEY_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            for _ in range(100):  # another process may be writing it right now
                data = path.read_bytes()
                if len(data) == 32:
                    return data
                time.sleep(0.01)
            raise ValueError(f"{path} is not a kvheat tier key (32 bytes); remove it or "
                             "configure a tier secret") from None
        key = os.urandom(32)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        return key

    def _path(self, name: str) -> Path:
        return self.root / (name + _SUFFIX)

    def _rebuild_index(self) -> None:
        for entry in os.scandir(self.root):
            if entry.name.startswith(_TMP + self.prefix):  # a write never finished
                self._unlink(Path(entry.path))
                continue
            if not entry.name.startswith(self.prefix) or not entry.name.endswith(_SUFFIX):
                continue  # another model's or layout's, or not ours at all
            name = entry.name[:-len(_SUFFIX)]
            try:
                with open(entry.path, "rb") as f:
                    head = f.read(_MAX_HEADER)
                    size = os.fstat(f.fileno()).st_size
                hdr = decode_header(head)
                if size != hdr.body_offset + hdr.payload_len:
                    raise CorruptValue("torn", f"file has {size} bytes, header says "
                                               f"{hdr.body_offset + hdr.payload_len}")
                if self._name(hdr.key, hdr.ns) != name:
                    raise CorruptValue("key", "file name does not match the key inside")
            except CorruptValue as e:
                self.rejected_on_open += 1
                self._count_corrupt(e.kind, name[len(self.prefix):].encode(), f"on open: {e}")
                self._unlink(Path(entry.path))
                continue
            except OSError as e:
                self.stats.io_errors += 1
                log.warning("disk tier: cannot read %s on open (%s); skipped", entry.path, e)
                continue
            self.index[name] = (stored_key(hdr.key), hdr.ns, size)
            self._used += size
        if self._used > self.capacity_bytes:
            self._trim_to_cap()

    def _trim_to_cap(self) -> None:
        """Opened over its cap (a smaller cap, or files of another process): the oldest
        files go until the rest fit."""
        by_age = []
        for name in self.index:
            try:
                by_age.append((os.stat(self._path(name)).st_mtime, name))
            except OSError:
                by_age.append((0.0, name))
        for _mtime, name in sorted(by_age):
            if self._used <= self.capacity_bytes:
                break
            self._drop(name, remove_file=True)
            self.trimmed_on_open += 1
    # ---- interface --------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes against the cap.

        This store's files, or the folder's files of its model and layout when other
        processes add to them."""
        return self._used + self._others()

    def _others(self) -> int:
        """Bytes of other processes' files here, rescanned at most every `folder_scan_s`
        (kept apart from this store's own bytes, which count at once)."""
        now = time.monotonic()
        if now - self._folder_at >= self.folder_scan_s:
            total = 0
            try:
                for entry in os.scandir(self.root):
                    n = entry.name
                    if n.endswith(_SUFFIX) and n.startswith(self.prefix):
                        with contextlib.suppress(OSError):  # deleted meanwhile
                            total += entry.stat().st_size
            except OSError:
                total = 0
            with self._lock:
                self._others_bytes = max(0, total - self._used)
            self._folder_at = now
        return self._others_bytes

    def entry_bytes(self, kv: torch.Tensor, key: BlockKey) -> int:
        return kv.numel() * kv.element_size() + HEAD_SIZE + 4 * kv.dim() + len(key) + NS_SIZE

    def writable(self) -> bool:
        """Whether the store takes writes now: False while paused after the disk was full."""
        return time.monotonic() >= self.write_blocked_until

    def describe(self) -> dict[str, object]:
        """The store's state and counters, with whether it takes writes and its own counts."""
        # A full disk is readable (up) but takes no writes: say so, with its own counters.
        return {**super().describe(), "writable": self.writable(),
                "full_events": self.full_events, "rejected_on_open": self.rejected_on_open,
                "trimmed_on_open": self.trimmed_on_open}

    def _put(self, key: BlockKey, kv: torch.Tensor, ns: Namespace) -> bool:
        if not self.writable():
            self.stats.skipped_down += 1
            return False
        d = self.ns(ns)
        head, payload = encode_prefix(kv, key, d, self.mac_key, self.mac_version)
        size = len(head) + len(payload)
        name = self._name(key, d)
        others = self._others()
        with self._lock:
            old = self.index.get(name)
            if others + self._used - (old[2] if old else 0) + size > self.capacity_bytes:
                return False  # the cap: the caller makes room first
            # Reserve the bytes now so concurrent writers cannot overshoot the cap. A value
            # being rewritten stays readable: the rename swaps whole files atomically.
            self._used += size - (old[2] if old else 0)
        tmp = self.root / f"{_TMP}{name}-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(head)
                f.write(payload)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self._path(name))
            if self.fsync:
                self._fsync_dir()
        except OSError as e:
            self._unlink(tmp)
            with self._lock:
                self._used -= size - (old[2] if old else 0)  # the old file is untouched
            self.stats.io_errors += 1
            if e.errno in _FULL_ERRNOS:
                self.full_events += 1
                self.write_blocked_until = time.monotonic() + self.full_backoff_s
            log.warning("disk tier: write failed (%s); demotion to disk paused", e)
            return False
        with self._lock:
            if old is not None and self.index.get(name) is not old:
                self._used += old[2]  # deleted meanwhile: its bytes were taken off already
            self.index[name] = (key, d, size)
        return True

    def _get(self, key: BlockKey, ns: Namespace,
             out: torch.Tensor | None) -> torch.Tensor | None:
        d = self.ns(ns)
        name = self._name(key, d)
        if name not in self.index:
            return None
        path = self._path(name)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                # torch.empty, not bytearray: no zero-fill pass over the buffer
                buf = torch.empty(size, dtype=torch.uint8).numpy().data
                n = f.readinto(buf)
            if n != size:
                raise CorruptValue("torn", f"read {n} of {size} bytes")
            t = decode(buf, key, d, self.mac_key)
        except FileNotFoundError:
            self._drop(name, remove_file=False)
            return None
        except CorruptValue as e:
            self._count_corrupt(e.kind, key, str(e))
            self._drop(name, remove_file=True)
            return None
        except OSError as e:
            self.stats.io_errors += 1
            log.warning("disk tier: read failed (%s); served as a miss", e)
            return None
        return t if out is None else copy_out(t, out)

    def contains(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Whether (key, ns) has a file in the index (the file itself is not read)."""
        return self._name(key, self.ns(ns)) in self.index

    def delete(self, key: BlockKey, ns: Namespace = NO_TENANT) -> bool:
        """Delete the entry for (key, ns) and its file; False when there was none."""
        name = self._name(key, self.ns(ns))
        if name not in self.index:
            return False
        self._drop(name, remove_file=True)
        self.stats.deletes += 1
        return True

    def stored(self) -> Iterable[tuple[BlockKey, bytes]]:
        with self._lock:
            return [(k, ns) for k, ns, _ in self.index.values()]

    # ---- helpers ----------------------------------------------------------------------
    def _drop(self, name: str, remove_file: bool) -> None:
        with self._lock:
            e = self.index.pop(name, None)
            if e is not None:
                self._used -= e[2]
        if remove_file:
            self._unlink(self._path(name))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier: cannot remove %s (%s)", path, e)

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
