"""vLLM's own traffic as a replay trace: its KV events or its request log.

So a vLLM operator can replay what their server saw and pick an offload capacity and policy
(`kvheat replay FILE --format vllm-events|vllm-log`). Both readers return the Mooncake-form
`TraceRequest`s the replayer takes; neither needs vLLM installed.

KV events (`--kv-events-config`, the msgpack `KVEventBatch`es vLLM publishes on ZMQ), one
batch a line as JSON: `msgspec.json.encode(batch)` gives `[ts, [event, ...], dp_rank]`,
each event an object tagged `"type"`; `{"ts": ..., "events": [...]}` is read too.
`record_kv_events` writes such a file from a running server. A `BlockStored` names new
blocks and their parent, so the prompt behind it is the parent's chain plus those blocks:
that chain is one request. Stores that extend the tip of a chain stored within `merge_s`
seconds (the next prefill step, or decode filling blocks) join that request. Only the
GPU prefix cache's events (medium GPU or unset) of KV group 0 are read; removals and
clears are the replayed cache's own business. What the events cannot show: a request
served wholly from the prefix cache stores nothing, so it is missing from the trace (the
trace understates reuse).

Request log (`--enable-log-requests --log-level DEBUG`): each `Request ID details: ...
prompt_token_ids: [...]` line is a request at the line's timestamp; its tokens are hashed
into chained blocks of `block_tokens`, as the cache does. vLLM truncates logged prompts to
`--max-log-len`: leave that unset for a faithful trace.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from ..cache.hashing import chain_key, root_key, tokens_to_bytes
from .traces import (
    MAX_COUNT,
    MAX_LINE_CHARS,
    TraceError,
    TraceRequest,
    check_int,
    check_time,
    parse_json_line,
    positive_int,
    read_lines,
)


def detect_format(path: str | Path) -> str:
    """A trace file's format: 'vllm-log', 'vllm-events' or else 'mooncake'.

    'vllm-log' for a vLLM log, 'vllm-events' for a KV event file. Only the first non-blank
    line is read, and at most `MAX_LINE_CHARS` of it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            line = f.readline(MAX_LINE_CHARS)
            if not line:
                break
            s = line.strip()
            if not s:
                continue
            if s.startswith("["):
                return "vllm-events"
            if s.startswith("{"):
                return "vllm-events" if '"events"' in s and '"hash_ids"' not in s else "mooncake"
            return "vllm-log"
    return "mooncake"


def _hash(where: str, name: str, h: object) -> object:
    # JSON turns bytes hashes into base64 strings and leaves int hashes alone: both hash.
    # A list (of scalars) stands for a tuple.
    if isinstance(h, list) and all(_scalar_hash(x) for x in h):
        return tuple(h)
    if _scalar_hash(h):
        return h
    raise TraceError(f"{where}: {name} is not a block hash (an integer, a string or a list "
                     f"of them): {type(h).__name__}")


def _scalar_hash(h: object) -> bool:
    return type(h) is int or isinstance(h, str)


def _batches(path: str | Path) -> Iterator[tuple[int, float, list]]:
    for lineno, line in read_lines(path):
        where = f"{path}:{lineno}"
        d = parse_json_line(path, lineno, line)
        if isinstance(d, dict) and "ts" in d and "events" in d:
            ts, events = d["ts"], d["events"]
        elif isinstance(d, list) and len(d) >= 2:
            ts, events = d[0], d[1]
        else:
            raise TraceError(f"{where}: not a KV event batch ([ts, [event, ...], dp_rank] or "
                             '{"ts": ..., "events": [...]})')
        if not isinstance(events, list):
            raise TraceError(f"{where}: not a KV event batch (events must be a list, not "
                             f"{type(events).__name__})")
        yield lineno, check_time(where, "ts", ts), events


def load_kv_events(path: str | Path, block_tokens: int | None = None,
                   merge_s: float = 2.0) -> list[TraceRequest]:
    """Requests from a file of vLLM KV event batches (one JSON batch a line)."""
    if block_tokens is not None:
        block_tokens = positive_int(block_tokens, "block_tokens")
    parent: dict[object, object] = {}  # block hash -> parent hash (None: a first block)
    open_tips: dict[object, int] = {}  # chain tip -> index of its request in `reqs`
    reqs: list[tuple[float, list[object], float]] = []  # (first ts, chain, last ts)
    size = 0
    for lineno, ts, events in _batches(path):
        where = f"{path}:{lineno}"
        for ev in events:
            if not isinstance(ev, dict) or ev.get("type") != "BlockStored":
                continue
            if ev.get("medium") not in (None, "GPU") or ev.get("group_idx") not in (None, 0):
                continue
            for need in ("block_hashes", "block_size"):
                if need not in ev:
                    raise TraceError(f"{where}: not a BlockStored event (no {need})")
            raw = ev["block_hashes"]
            if not isinstance(raw, list):
                raise TraceError(f"{where}: block_hashes must be a list, not "
                                 f"{type(raw).__name__}")
            hashes = [_hash(where, f"block_hashes[{j}]", h) for j, h in enumerate(raw)]
            par = ev.get("parent_block_hash")
            if par is not None:
                par = _hash(where, "parent_block_hash", par)
            bs = check_int(where, "block_size", ev["block_size"], 1, MAX_COUNT)
            if not hashes:
                continue
            if size and bs != size:
                raise TraceError(f"{where}: block size {bs}, earlier {size}")
            size = bs
            p = par
            for h in hashes:
                parent.setdefault(h, p)
                p = h
            i = open_tips.pop(par, None) if par is not None else None
            if i is not None and ts - reqs[i][2] <= merge_s:
                first, chain, _ = reqs[i]
                chain.extend(hashes)
                reqs[i] = (first, chain, ts)
            else:
                chain = []
                h = par
                while h is not None and len(chain) < 1_000_000:
                    chain.append(h)
                    h = parent.get(h)
                chain.reverse()
                chain.extend(hashes)
                i = len(reqs)
                reqs.append((ts, chain, ts))
            open_tips[hashes[-1]] = i
    if not reqs:
        return []
    bt = block_tokens or size
    if bt % size:
        raise TraceError(f"{path}: block_tokens {bt} (--block-tokens) is not a multiple of "
                         f"vLLM's block size {size}")
    k = bt // size
    ids: dict[object, int] = {}
    out = []
    t0 = reqs[0][0]
    for first, chain, _ in sorted(reqs, key=lambda r: r[0]):
        # One replay block per k vLLM blocks, named by the hash that ends it (a prefix).
        ends = chain[k - 1::k]
        if len(chain) % k:
            ends.append(chain[-1])
        hids = [ids.setdefault(h, len(ids)) for h in ends]
        out.append(TraceRequest((first - t0) * 1000.0, len(chain) * size, 0, hids))
    return out


# A request line of vLLM's request logger: a timestamp, then `Request ID details:`, then
# `prompt_token_ids: [...]`. Matched piece by piece (each search linear in the line) as
# one regex `TS.*?Request (\S+) details:.*?prompt_token_ids: \[([\d,\s]*)\]` would match:
# that regex backtracks in time cubic in the line's length on a hostile line.
_LOG_TS = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[.,](\d+))? ")
_LOG_REQ = re.compile(r"Request (\S+) details:")
_LOG_PROMPT = "prompt_token_ids: ["
_LOG_TOKENS = re.compile(r"[\d,\s]*\]")


def _log_request(line: str) -> tuple[tuple[str | None, ...], str] | None:
    """(timestamp fields, token list text) of a request line, else None."""
    line = line.rstrip("\n")  # `.` in the regex above stops at the line's end
    ts = _LOG_TS.search(line)
    if ts is None:
        return None
    req = _LOG_REQ.search(line, ts.end())
    if req is None:
        return None
    pos = req.end()
    while (p := line.find(_LOG_PROMPT, pos)) >= 0:
        start = p + len(_LOG_PROMPT)
        toks = _LOG_TOKENS.match(line, start)
        if toks is not None:
            return ts.groups(), line[start:toks.end() - 1]
        pos = p + 1
    return None


def iter_vllm_log(path: str | Path, block_tokens: int = 512) -> Iterator[TraceRequest]:
    """Requests from a vLLM server log written with --enable-log-requests at DEBUG.

    Read as a stream (memory: one id per distinct block)."""
    block_tokens = positive_int(block_tokens, "block_tokens")
    root = root_key(None)
    ids: dict[bytes, int] = {}
    t0: datetime | None = None
    for lineno, line in read_lines(path, strict_utf8=False):
        m = _log_request(line)
        if m is None:
            continue
        (mo, day, hh, mi, ss, frac), toks = m
        try:
            when = datetime(2000, int(mo or 0), int(day or 0), int(hh or 0), int(mi or 0),
                            int(ss or 0), int((frac or "0").ljust(6, "0")[:6]))
        except ValueError as e:
            raise TraceError(f"{path}:{lineno}: not a log timestamp ({e})") from None
        t0 = t0 or when
        parts = toks.replace(",", " ").split()
        if not parts:
            continue
        # Ids are in [0, 2**32): ten digits at most (an int of thousands is slow, or refused).
        ids_in = [int(t) if len(t.lstrip("0")) <= 10 else -1 for t in parts]
        try:
            raw = tokens_to_bytes(ids_in)
        except ValueError:
            bad = next(t for t, v in zip(parts, ids_in) if not 0 <= v < 2**32)
            raise TraceError(f"{path}:{lineno}: prompt_token_ids: token id out of range: "
                             f"{bad if len(bad) <= 20 else bad[:17] + '...'} (ids must be "
                             "in [0, 2**32))") from None
        h = root
        hids = []
        stride = 4 * block_tokens
        for s in range(0, len(raw), stride):
            h = chain_key(h, raw[s:s + stride])
            hids.append(ids.setdefault(h, len(ids)))
        yield TraceRequest((when - t0).total_seconds() * 1000.0, len(parts), 0, hids)


def record_kv_events(endpoint: str, path: str | Path, topic: str = "",
                     limit: int | None = None) -> int:
    """Append a vLLM server's KV event batches to `path`, one JSON line each.

    Subscribes to its ZMQ PUB at `endpoint` until `limit` batches or Ctrl-C. Needs pyzmq and
    msgspec (both come with vLLM). Returns the number of batches written."""
    import msgspec
    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    dec = msgspec.msgpack.Decoder()
    n = 0

    def plain(x: object) -> object:  # bytes hashes as base64, as msgspec.json writes them
        if isinstance(x, bytes):
            return base64.b64encode(x).decode()
        if isinstance(x, list | tuple):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    with open(path, "a", encoding="utf-8") as f:
        try:
            while limit is None or n < limit:
                *_, payload = sock.recv_multipart()
                ts, events, *_ = dec.decode(payload)
                # Events are msgpack maps tagged "type", as in the JSON form.
                f.write(json.dumps([ts, plain(events)]) + "\n")
                n += 1
        except KeyboardInterrupt:
            pass
    sock.close()
    return n
