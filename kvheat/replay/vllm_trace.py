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
from .traces import TraceError, TraceRequest

FORMATS = ("mooncake", "vllm-events", "vllm-log")


def detect_format(path: str | Path) -> str:
    """'vllm-log' for a vLLM log, 'vllm-events' for a KV event file, else 'mooncake'."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            s = line.strip()
            if not s:
                continue
            if s.startswith("["):
                return "vllm-events"
            if s.startswith("{"):
                return "vllm-events" if '"events"' in s and '"hash_ids"' not in s else "mooncake"
            return "vllm-log"
    return "mooncake"


def _hash(h: object) -> object:
    # JSON turns bytes hashes into base64 strings and leaves int hashes alone: both hash.
    return tuple(h) if isinstance(h, list) else h


def _batches(path: str | Path) -> Iterator[tuple[int, float, list[dict]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ts, events = (d["ts"], d["events"]) if isinstance(d, dict) else (d[0], d[1])
                yield lineno, float(ts), list(events)
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise TraceError(f"{path}:{lineno}: not a KV event batch ({e})") from None


def load_kv_events(path: str | Path, block_tokens: int | None = None,
                   merge_s: float = 2.0) -> list[TraceRequest]:
    """Requests from a file of vLLM KV event batches (one JSON batch a line)."""
    parent: dict[object, object] = {}  # block hash -> parent hash (None: a first block)
    open_tips: dict[object, int] = {}  # chain tip -> index of its request in `reqs`
    reqs: list[tuple[float, list[object], float]] = []  # (first ts, chain, last ts)
    size = 0
    for lineno, ts, events in _batches(path):
        for ev in events:
            if not isinstance(ev, dict) or ev.get("type") != "BlockStored":
                continue
            if ev.get("medium") not in (None, "GPU") or ev.get("group_idx") not in (None, 0):
                continue
            try:
                hashes = [_hash(h) for h in ev["block_hashes"]]
                par = _hash(ev.get("parent_block_hash"))
                bs = int(ev["block_size"])
            except (KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{path}:{lineno}: not a BlockStored event ({e})") from None
            if not hashes:
                continue
            if size and bs != size:
                raise TraceError(f"{path}:{lineno}: block size {bs}, earlier {size}")
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
        raise TraceError(f"block_tokens {bt} is not a multiple of vLLM's block size {size}")
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


_LOG_LINE = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[.,](\d+))? .*?Request (\S+) details:"
                       r".*?prompt_token_ids: \[([\d,\s]*)\]")


def load_vllm_log(path: str | Path, block_tokens: int = 512) -> list[TraceRequest]:
    """Requests from a vLLM server log written with --enable-log-requests at DEBUG."""
    root = root_key(None)
    ids: dict[bytes, int] = {}
    out = []
    t0: datetime | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _LOG_LINE.search(line)
            if m is None:
                continue
            mo, day, hh, mi, ss, frac, _rid, toks = m.groups()
            when = datetime(2000, int(mo), int(day), int(hh), int(mi), int(ss),
                            int((frac or "0").ljust(6, "0")[:6]))
            t0 = t0 or when
            tokens = [int(t) for t in toks.replace(",", " ").split()]
            if not tokens:
                continue
            h = root
            hids = []
            for s in range(0, len(tokens), block_tokens):
                h = chain_key(h, tokens_to_bytes(tokens[s:s + block_tokens]))
                hids.append(ids.setdefault(h, len(ids)))
            out.append(TraceRequest((when - t0).total_seconds() * 1000.0, len(tokens), 0, hids))
    return out


def record_kv_events(endpoint: str, path: str | Path, topic: str = "",
                     limit: int | None = None) -> int:
    """Subscribe to a vLLM server's KV events (ZMQ PUB at `endpoint`) and append each
    batch to `path` as one JSON line, until `limit` batches or Ctrl-C. Needs pyzmq and
    msgspec (both come with vLLM). Returns the number of batches written."""
    import msgspec
    import zmq

    sock = zmq.Context.instance().socket(zmq.SUB)
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
