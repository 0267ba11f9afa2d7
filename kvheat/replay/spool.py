"""A trace read once, as a stream, into compact files: what every replay walks.

The one forward pass takes requests one at a time (from any format's reader), names each
block by its chained key as the cache does (`trace_block_keys` under the tenant's root),
and interns the key to a dense id, ids in first-appearance order. Per request it writes a
fixed record; per block reference, the key's id and the class the block would have if it
missed (`MissClassifier`'s: the trace alone decides compulsory, capacity and isolation).
Only the distinct keys (one 16-byte key each) stay in memory; the records, 5 bytes a
reference, live in files in a spool folder and are read back in bounded chunks. Belady's
next use comes from one backward pass over the id file, into a file of its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..cache.hashing import BlockKey, root_key, tenant_salt, trace_block_keys
from ..cache.misses import MISS_KINDS
from .stack import mix64
from .traces import TraceRequest

# A request's fixed record. `session`: the session a hint names (the trace's own, else
# the one derived from the prompt it extends): an index into `Spool.session_names`, or
# -(i + 1) for "prompt:<i>", a session of request i's own. `own`: 1 when it is the
# trace's own session id. `tenant`, `reason`: indexes into their tables, -1 for none.
RECORD = np.dtype([("ts", "<f8"), ("input", "<i8"), ("output", "<i8"), ("n", "<u4"),
                   ("session", "<i4"), ("own", "u1"), ("tenant", "<i4"), ("reason", "<i4")])
# Static miss classes of a block reference, by code (`MissClassifier.prepare_keys` with
# nothing cached). The replay adds "cached at arrival", which depends on the policy.
STATIC_KINDS = ("compulsory", "capacity", "isolation")
assert set(STATIC_KINDS) <= set(MISS_KINDS)
COMPULSORY, CAPACITY, ISOLATION = range(3)
NEVER = np.inf  # next use of a key no later request names
CHUNK_REFS = 1 << 20  # block references read back at a time (about 5-13 MB)


class SpooledRequest(NamedTuple):
    """One request as a spool gives it back: its keys, their static miss classes and its hints."""

    position: int  # in the trace (the request id a replay gives it)
    timestamp_ms: float
    input_length: int
    output_length: int
    keys: list[BlockKey]
    kinds: list[int]  # static miss class codes of the keys (STATIC_KINDS)
    session: str  # the hint's session (the trace's own, else derived)
    own_session: str | None  # the trace's own session id
    tenant: str | None
    finish_reason: str | None
    next_use: list[float] | None  # per key: index of the next request naming it (inf: none)


@dataclass(slots=True)
class SpoolSummary:
    """What the forward pass learns of a whole trace."""

    requests: int = 0
    refs: int = 0
    distinct: int = 0
    max_blocks: int = 0
    total_tokens: int = 0
    infinite_hit_tokens: int = 0  # prefix tokens an unbounded cache serves
    first_ms: float = 0.0
    last_ms: float = 0.0
    max_ms: float = 0.0


class _Table:
    """Strings (sessions, tenants, finish reasons) as small integers."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def code(self, name: str | None) -> int:
        if name is None:
            return -1
        c = self.index.get(name)
        if c is None:
            c = self.index[name] = len(self.names)
            self.names.append(name)
        return c


class Spool:
    """A trace as spool files plus its distinct keys; `requests()` streams it back.

    Build one with `Spool.build(requests, block_tokens)`; the folder is a fresh temporary
    one (removed when the spool is collected or `close`d) unless `folder` is given."""

    def __init__(self, folder: Path, block_tokens: int, share_groups: dict[str, str],
                 keys: list[BlockKey], summary: SpoolSummary, session_names: list[str],
                 tenants: list[str], reasons: list[str], owned: bool) -> None:
        self.folder = folder
        self.block_tokens = block_tokens
        self.share_groups = share_groups
        self.keys = keys  # id -> chained key
        self.summary = summary
        self.session_names = session_names
        self.tenants = tenants
        self.reasons = reasons
        self._has_next = False
        self._finalizer = (weakref.finalize(self, _remove_folder, folder, os.getpid())
                           if owned else None)

    # ---- building -----------------------------------------------------------------------
    @classmethod
    def build(cls, requests: Iterable[TraceRequest], block_tokens: int,
              share_groups: dict[str, str] | None = None, folder: str | Path | None = None,
              keys: Iterable[Sequence[BlockKey]] | None = None) -> Spool:
        """Spool `requests` (read once, in order).

        `keys`: each request's chained keys, when the caller has them already
        (`PreparedTrace.keys`)."""
        owned = folder is None
        path = Path(tempfile.mkdtemp(prefix="kvheat-spool-")) if folder is None else Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        groups = dict(share_groups or {})
        try:
            with ExitStack() as files:
                writer = _Writer(path, block_tokens, groups, files)
                key_iter = iter(keys) if keys is not None else None
                for r in requests:
                    writer.add(r, next(key_iter) if key_iter is not None else None)
                writer.close()
        except BaseException:
            if owned:
                shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, block_tokens, groups, writer.table, writer.summary,
                   writer.sessions.names, writer.tenants.names, writer.reasons.names, owned)

    def close(self) -> None:
        """Remove the spool's folder (when the spool made it)."""
        if self._finalizer is not None:
            self._finalizer()

    # ---- what replays read --------------------------------------------------------------
    def footprint_blocks(self, hold: bool = False) -> int:
        """As `PreparedTrace.footprint_blocks`: the most blocks a replay can have in use."""
        s = self.summary
        return s.distinct + (s.refs if hold else s.max_blocks)

    def infinite_hit_rate(self) -> float:
        """The hit rate of a cache that never evicts."""
        s = self.summary
        return s.infinite_hit_tokens / s.total_tokens if s.total_tokens else 0.0

    def session_name(self, code: int) -> str:
        """The session of code `code` (a derived one for a negative code)."""
        return self.session_names[code] if code >= 0 else f"prompt:{-code - 1}"

    def requests(self, next_use: bool = False) -> Iterator[SpooledRequest]:
        """Every request, in order, with its keys, read back chunk by chunk.

        With `next_use`, Belady's next use of each key too."""
        if next_use:
            self.prepare_next_use()
        table = self.keys
        lookup = table.__getitem__
        sname, tenants, reasons = self.session_name, self.tenants, self.reasons
        index = 0
        for recs, ids, kinds, nexts in self._chunks(next_use):
            ids_l = ids.tolist()
            kinds_l = kinds.tolist()
            next_l = nexts.tolist() if nexts is not None else None
            off = 0
            for ts, inp, out, n, sess, own, ten, rea in recs.tolist():
                end = off + n
                session = sname(sess)
                yield SpooledRequest(
                    index, ts, inp, out, list(map(lookup, ids_l[off:end])), kinds_l[off:end],
                    session, session if own else None, tenants[ten] if ten >= 0 else None,
                    reasons[rea] if rea >= 0 else None,
                    next_l[off:end] if next_l is not None else None)
                off = end
                index += 1

    def sample(self, rate: float, seed: int = 0) -> Spool:
        """A miniature of the trace: only the blocks whose key falls in `rate` of the key space.

        SHARDS' spatial sampling, by `seed`: every request keeps the same kept keys and the
        reuse among them is intact; a request keeps its kept blocks, in order, as its prompt
        (one left with none is dropped). Replayed through a cache `rate` times the size, it
        estimates that cache's hit rate. Vectorized over chunks: a pass costs seconds
        however long the trace."""
        if not 0 < rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {rate}")
        if rate == 1:
            return self
        bt = self.block_tokens
        keep_id = key_hash(self.keys, seed) < np.uint64(min(int(rate * 2**32), 2**32 - 1))
        new_id = np.full(len(self.keys), -1, dtype=np.int64)
        table: list[BlockKey] = []
        summary = SpoolSummary()
        path = Path(tempfile.mkdtemp(prefix="kvheat-spool-"))
        try:
            with open(path / "requests.bin", "wb") as rf, open(path / "ids.bin", "wb") as idf, \
                    open(path / "kinds.bin", "wb") as kf, open(path / "chunks.bin", "wb") as cf:
                for recs, ids, kinds, _ in self._chunks(False):
                    n = recs["n"].astype(np.int64)
                    starts = np.concatenate(([0], np.cumsum(n)[:-1]))
                    m = keep_id[ids]
                    kept_n = np.add.reduceat(m.astype(np.int64), starts)
                    short = bt - (recs["input"] - (n - 1) * bt)  # the last block's shortfall
                    last_kept = m[starts + n - 1]
                    inputs = kept_n * bt - np.where(last_kept, short, 0)
                    k = ids[m]
                    fresh_pos = np.nonzero(new_id[k] < 0)[0]
                    uniq, first = np.unique(k[fresh_pos], return_index=True)
                    order = np.argsort(first, kind="stable")
                    born = uniq[order]
                    new_id[born] = np.arange(len(table), len(table) + len(born))
                    table.extend(self.keys[i] for i in born.tolist())
                    out_ids = new_id[k]
                    # Tokens each kept block holds, and the unbounded cache's prefix hits.
                    tokens = np.full(len(k), bt, dtype=np.int64)
                    last_of = (starts + n - 1)[last_kept]  # positions of kept last blocks
                    tokens[np.searchsorted(np.nonzero(m)[0], last_of)] -= short[last_kept]
                    new = np.zeros(len(k), dtype=np.int64)
                    new[fresh_pos[first]] = 1
                    keep_req = kept_n > 0
                    seg = np.concatenate(([0], np.cumsum(kept_n[keep_req])[:-1]))
                    before_new = np.cumsum(new) - new  # new refs before each, in the chunk
                    seen_prefix = (before_new - np.repeat(before_new[seg] if len(seg) else
                                                          seg, kept_n[keep_req])) == 0
                    seen_prefix &= new == 0
                    # a ref is a prefix hit while no new ref came before it in its request
                    hit = int(tokens[seen_prefix].sum())
                    out = recs[keep_req].copy()
                    out["n"] = kept_n[keep_req]
                    out["input"] = inputs[keep_req]
                    out.tofile(rf)
                    out_ids.astype("<u4").tofile(idf)
                    kinds[m].tofile(kf)
                    np.array([len(out), len(k)], dtype="<i8").tofile(cf)
                    if len(out):
                        if not summary.requests:
                            summary.first_ms = float(out["ts"][0])
                        summary.last_ms = float(out["ts"][-1])
                        summary.max_ms = max(summary.max_ms, float(out["ts"].max()))
                        summary.max_blocks = max(summary.max_blocks, int(out["n"].max()))
                    summary.requests += len(out)
                    summary.refs += len(k)
                    summary.total_tokens += int(out["input"].sum())
                    summary.infinite_hit_tokens += hit
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        summary.distinct = len(table)
        return Spool(path, bt, self.share_groups, table, summary, self.session_names,
                     self.tenants, self.reasons, owned=True)

    def id_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(records, key ids) chunk by chunk: for one-pass analyses (stack distances)."""
        for recs, ids, _, _ in self._chunks(False):
            yield recs, ids

    def _chunks(self, with_next: bool
                ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
        with open(self.folder / "requests.bin", "rb") as rf, \
                open(self.folder / "ids.bin", "rb") as idf, \
                open(self.folder / "kinds.bin", "rb") as kf, \
                (open(self.folder / "next.bin", "rb") if with_next else nullcontext()) as nf:
            for n_req, n_ref in self._chunk_sizes():
                recs = np.fromfile(rf, RECORD, n_req)
                ids = np.fromfile(idf, "<u4", n_ref)
                kinds = np.fromfile(kf, "u1", n_ref)
                nexts = np.fromfile(nf, "<f8", n_ref) if nf is not None else None
                yield recs, ids, kinds, nexts

    def _chunk_sizes(self) -> list[tuple[int, int]]:
        data = np.fromfile(self.folder / "chunks.bin", "<i8").reshape(-1, 2)
        return [(int(a), int(b)) for a, b in data]

    def prepare_next_use(self) -> None:
        """Compute Belady's next use of every reference, by one backward pass over the ids.

        Chunk by chunk (memory: one float per distinct key and one chunk)."""
        if self._has_next:
            return
        sizes = self._chunk_sizes()
        last = np.full(max(self.summary.distinct, 1), NEVER)
        starts_req = np.cumsum([0] + [a for a, _ in sizes])
        starts_ref = np.cumsum([0] + [b for _, b in sizes])
        path = self.folder / "next.bin"
        with open(self.folder / "ids.bin", "rb") as idf, \
                open(self.folder / "requests.bin", "rb") as rf, open(path, "wb") as nf:
            nf.truncate(int(starts_ref[-1]) * 8)
            for c in range(len(sizes) - 1, -1, -1):
                n_req, n_ref = sizes[c]
                if not n_ref:
                    continue
                rf.seek(int(starts_req[c]) * RECORD.itemsize)
                idf.seek(int(starts_ref[c]) * 4)
                recs = np.fromfile(rf, RECORD, n_req)
                ids = np.fromfile(idf, "<u4", n_ref)
                req_of = np.repeat(np.arange(starts_req[c], starts_req[c] + n_req,
                                             dtype=np.float64), recs["n"])
                order = np.argsort(ids, kind="stable")  # each key's uses, in time order
                s = ids[order]
                later = np.empty(n_ref)
                same = s[:-1] == s[1:]
                later[:-1] = np.where(same, req_of[order[1:]], last[s[:-1]])
                later[-1] = last[s[-1]]
                out = np.empty(n_ref)
                out[order] = later
                first = np.ones(n_ref, dtype=bool)
                first[1:] = ~same
                last[s[first]] = req_of[order[first]]
                nf.seek(int(starts_ref[c]) * 8)
                out.astype("<f8").tofile(nf)
        self._has_next = True


def key_hash(keys: Sequence[bytes], seed: int = 0) -> np.ndarray:
    """A uniform 32-bit hash of each key for `seed` (SHARDS' filter).

    Bytes 8..15 of the key (KVHeat samples by byte 0, so a sample stays independent of it)
    through splitmix64's finalizer with the seed mixed in."""
    x = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16)[:, 8:16].copy()
    with np.errstate(over="ignore"):
        h = mix64(x.view("<u8").ravel() + np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64))
    return h >> np.uint64(32)


def _remove_folder(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # never from a forked worker (`--jobs`): the parent owns it
        shutil.rmtree(folder, ignore_errors=True)


class _Writer:
    """The forward pass: requests in, records out, keys interned."""

    def __init__(self, folder: Path, block_tokens: int, share_groups: dict[str, str],
                 files: ExitStack) -> None:
        self.bt = block_tokens
        self.groups = share_groups
        self.summary = SpoolSummary()
        self.arrived = 0
        self.table: list[BlockKey] = []
        self.ids: dict[bytes, int] = {}
        self.plain_seen: set[bytes] = set()  # plain keys of tenants' requests
        self.roots: dict[str | None, bytes] = {}
        self.plain_root = root_key(None)
        self.ends: dict[bytes, int] = {}  # key of a prompt's last full block -> its session
        self.sessions, self.tenants, self.reasons = _Table(), _Table(), _Table()
        self.files = {name: files.enter_context((folder / f"{name}.bin").open("wb"))
                      for name in ("requests", "ids", "kinds", "chunks")}
        self._recs: list[tuple] = []
        self._ids: list[int] = []
        self._kinds = bytearray()

    def add(self, r: TraceRequest, keys: Sequence[BlockKey] | None) -> None:
        bt = self.bt
        root = self.roots.get(r.tenant)
        if root is None:
            root = self.roots[r.tenant] = root_key(tenant_salt(r.tenant, self.groups))
        ks = list(keys) if keys is not None else trace_block_keys(root, r.hash_ids)[0]
        n = len(ks)
        last_tokens = r.input_length - (n - 1) * bt
        index = self.arrived  # the request's index in the whole trace (sampled or not)
        self.arrived += 1
        # The session hint, as `PreparedTrace.sessions` derives it (on the whole prompt).
        n_full = n if last_tokens == bt else n - 1
        own = r.session is not None
        if own:
            session = self.sessions.code(r.session)
        else:
            for j in range(n_full - 1, -1, -1):
                found = self.ends.pop(ks[j], None)
                if found is not None:
                    session = found
                    break
            else:
                session = -index - 1
        if n_full:
            self.ends[ks[n_full - 1]] = session
        plain: list[BlockKey] | None = None
        if r.tenant is not None:
            plain = trace_block_keys(self.plain_root, r.hash_ids)[0]
        tokens = [bt] * (n - 1) + [last_tokens]
        ids, kinds, table, seen_plain = self.ids, self._kinds, self.table, self.plain_seen
        hit = 0
        prefix = True
        for j, k in enumerate(ks):
            kid = ids.get(k)
            if kid is None:
                kid = ids[k] = len(table)
                table.append(k)
                prefix = False
                p = plain[j] if plain is not None else k
                kinds.append(ISOLATION if p in seen_plain or (plain is not None and p in ids)
                             else COMPULSORY)
            else:
                kinds.append(CAPACITY)
                if prefix:
                    hit += tokens[j]
            self._ids.append(kid)
        if plain is not None:
            seen_plain.update(plain)
        s = self.summary
        input_tokens = sum(tokens)
        if not s.requests:
            s.first_ms = r.timestamp_ms
        s.last_ms = r.timestamp_ms
        s.max_ms = max(s.max_ms, r.timestamp_ms)
        s.requests += 1
        s.refs += n
        s.max_blocks = max(s.max_blocks, n)
        s.total_tokens += input_tokens
        s.infinite_hit_tokens += hit
        self._recs.append((r.timestamp_ms, input_tokens, r.output_length, n, session, own,
                           self.tenants.code(r.tenant), self.reasons.code(r.finish_reason)))
        if len(self._ids) >= CHUNK_REFS:
            self._flush()

    def _flush(self) -> None:
        if not self._recs:
            return
        f = self.files
        np.array(self._recs, dtype=RECORD).tofile(f["requests"])
        np.array(self._ids, dtype="<u4").tofile(f["ids"])
        f["kinds"].write(self._kinds)
        np.array([len(self._recs), len(self._ids)], dtype="<i8").tofile(f["chunks"])
        self._recs, self._ids, self._kinds = [], [], bytearray()

    def close(self) -> None:
        self._flush()
        self.summary.distinct = len(self.table)
        if self.summary.distinct >= 2**32:
            raise ValueError("more than 2**32 distinct blocks in one trace")
        self.ids = {}
        self.plain_seen = set()
        self.ends = {}
