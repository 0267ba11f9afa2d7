"""Trace requests: Mooncake-format JSONL, kv-cache-tester's agentic session files and the
built-in multi-turn workload generator.

A trace names each request's prompt as a list of block ids; an id names a whole prefix
(block contents chained), so equal ids at equal positions mean equal prefixes.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: its time, its lengths, its blocks' ids, and its hints."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str | None = None
    tenant: str | None = None
    finish_reason: str | None = None  # the model's stop reason ("tool_use", "end_turn", ...)


class TraceError(ValueError):
    """A trace that cannot be read: its file, line and field named."""


# Bounds on what a trace line may hold. A line of 32 Mi characters is far beyond any real
# request (a Mooncake line of 1M block ids, a vLLM log line of a 4M-token prompt); a longer
# one is refused rather than read whole. Block ids are the 8-byte unsigned contents the
# cache hashes; counts are 64-bit.
MAX_LINE_CHARS = 1 << 25
BLOCK_ID_LIMIT = 1 << 64
MAX_COUNT = (1 << 63) - 1
_BAD_BYTES = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of non-UTF-8 bytes


def read_lines(path: str | Path, strict_utf8: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) for each non-blank line of a text file.

    Each line is bounded by `MAX_LINE_CHARS`; with `strict_utf8` a line that is not UTF-8 is
    an error naming it (otherwise bad bytes read as U+FFFD)."""
    errors = "surrogateescape" if strict_utf8 else "replace"
    with open(path, encoding="utf-8", errors=errors) as f:
        lineno = 0
        while True:
            line = f.readline(MAX_LINE_CHARS + 1)
            if not line:
                return
            lineno += 1
            if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
                raise TraceError(f"{path}:{lineno}: line longer than {MAX_LINE_CHARS:,} "
                                 "characters")
            if strict_utf8 and _BAD_BYTES.search(line):
                raise TraceError(f"{path}:{lineno}: not UTF-8 text")
            if line.strip():
                yield lineno, line


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_line(path: str | Path, lineno: int, line: str) -> object:
    """One line of JSON, strictly (no NaN/Infinity); any failure a `TraceError` naming the line."""
    try:
        return json.loads(line, parse_constant=_no_constant)
    except RecursionError:
        raise TraceError(f"{path}:{lineno}: JSON nested too deeply") from None
    except ValueError as e:  # bad JSON, NaN/Infinity, an integer of too many digits
        raise TraceError(f"{path}:{lineno}: not valid JSON ({e})") from None


def _show(v: object) -> str:
    s = json.dumps(v) if isinstance(v, str | int | float | bool) or v is None else type(v).__name__
    return s if len(s) <= 40 else s[:37] + "..."


def check_int(where: str, name: str, v: object, lo: int, hi: int) -> int:
    """`v` as an integer in [lo, hi]: a JSON integer, not a bool, a float or a string."""
    if type(v) is not int:
        raise TraceError(f"{where}: {name} must be an integer, not {_show(v)}")
    if not lo <= v <= hi:
        top = {BLOCK_ID_LIMIT - 1: "2**64)", MAX_COUNT: "2**63)"}.get(hi, f"{hi}]")
        raise TraceError(f"{where}: {name} {_show(v)} is out of range [{lo}, {top}")
    return v


def check_time(where: str, name: str, v: object) -> float:
    """`v` as a finite, non-negative number (not a bool or a string)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise TraceError(f"{where}: {name} must be a number, not {_show(v)}")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f < 0:
        raise TraceError(f"{where}: {name} must be a finite number >= 0, not {_show(v)}")
    return f


def positive_int(v: object, name: str) -> int:
    """`v` if it is a positive integer (not a bool), else a ValueError naming `name`."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, not {v!r}")
    return v


def _check_str(where: str, name: str, v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise TraceError(f"{where}: {name} must be a non-empty string or null, not {_show(v)}")
    return v


def _stop(where: str, v: object) -> str | None:
    """A finish reason: a string, or null or "" for none recorded."""
    return None if v == "" else _check_str(where, "stop", v)


def parse_request(where: str, d: object, block_tokens: int) -> TraceRequest:
    """One Mooncake request (a decoded JSON line), every field type- and range-checked.

    `hash_ids` a non-empty list of block ids in [0, 2**64), `input_length` an integer that
    fits them, `output_length` an integer >= 0, `timestamp` (ms) a finite number >= 0,
    `session_id`, `tenant` and `stop` (the finish reason) strings. Other fields are ignored."""
    if not isinstance(d, dict):
        raise TraceError(f"{where}: a request is a JSON object, not {_show(d)}")
    for k in ("hash_ids", "input_length"):
        if k not in d:
            raise TraceError(f"{where}: no {k}")
    raw = d["hash_ids"]
    if not isinstance(raw, list):
        raise TraceError(f"{where}: hash_ids must be a list of block ids, not {_show(raw)}")
    if not raw:
        raise TraceError(f"{where}: hash_ids is empty")
    ids = [check_int(where, f"hash_ids[{j}]", x, 0, BLOCK_ID_LIMIT - 1) for j, x in enumerate(raw)]
    n = check_int(where, "input_length", d["input_length"], 1, MAX_COUNT)
    if not (len(ids) - 1) * block_tokens < n <= len(ids) * block_tokens:
        raise TraceError(f"{where}: {n} input tokens do not fit {len(ids)} blocks of {block_tokens}")
    out = check_int(where, "output_length", d.get("output_length", 0), 0, MAX_COUNT)
    ts = check_time(where, "timestamp", d.get("timestamp", 0))
    return TraceRequest(ts, n, out, ids, _check_str(where, "session_id", d.get("session_id")),
                        _check_str(where, "tenant", d.get("tenant")),
                        _stop(where, d.get("stop")))


def iter_trace(path: str | Path, block_tokens: int = 512,
               limit: int | None = None) -> Iterator[TraceRequest]:
    """The requests of a Mooncake-format JSONL trace, one line at a time.

    The fields are `timestamp`, `input_length`, `output_length`, `hash_ids`, optionally
    `session_id` and `tenant` (memory: one line); each line is checked (`parse_request`),
    and a bad one is a `TraceError` naming the file, line and field."""
    block_tokens = positive_int(block_tokens, "block_tokens")
    if limit is not None:
        limit = positive_int(limit, "limit")
    for n, (lineno, line) in enumerate(read_lines(path), 1):
        yield parse_request(f"{path}:{lineno}", parse_json_line(path, lineno, line), block_tokens)
        if limit is not None and n >= limit:
            return


def load_trace(path: str | Path, block_tokens: int = 512, limit: int | None = None) -> list[TraceRequest]:
    """`iter_trace` as a list."""
    return list(iter_trace(path, block_tokens, limit))


def iter_copies(path: str | Path, block_tokens: int, copies: int, seed: int = 0,
                limit: int | None = None) -> Iterator[TraceRequest]:
    """`copies` plays of a Mooncake trace at once, merged in time order as a stream.

    One reader per copy, one request of each in memory: copy c starts at a seeded offset in
    [0, the trace's span), has block ids of its own (shifted past the file's largest) and
    its own sessions ("<session>#c"), as `copies` users sending the same kind of traffic.
    Copy 0 is the trace itself, unshifted. `limit` counts the file's requests, per copy."""
    copies = positive_int(copies, "copies")
    top = span = 0.0
    first: float | None = None
    for r in iter_trace(path, block_tokens, limit):  # one pass for the shifts
        top = max(top, max(r.hash_ids))
        first = r.timestamp_ms if first is None else min(first, r.timestamp_ms)
        span = max(span, r.timestamp_ms - first)
    stride = int(top) + 1
    if stride * copies > BLOCK_ID_LIMIT:
        raise TraceError(f"{path}: {copies} copies of block ids up to {int(top)} overflow 2**64")
    rng = random.Random(seed)
    offsets = [0.0] + [rng.uniform(0.0, span) for _ in range(copies - 1)]

    def play(c: int) -> Iterator[TraceRequest]:
        shift, at = c * stride, offsets[c]
        for r in iter_trace(path, block_tokens, limit):
            if c:
                r.timestamp_ms += at
                r.hash_ids = [h + shift for h in r.hash_ids]
                if r.session is not None:
                    r.session = f"{r.session}#{c}"
            yield r

    return heapq.merge(*(play(c) for c in range(copies)), key=lambda r: r.timestamp_ms)


def save_trace(trace: list[TraceRequest], path: str | Path) -> None:
    """Write `trace` as a Mooncake-format JSONL file."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            d = {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                 "output_length": r.output_length, "hash_ids": r.hash_ids}
            if r.session is not None:
                d["session_id"] = r.session
            if r.tenant is not None:
                d["tenant"] = r.tenant
            if r.finish_reason is not None:
                d["stop"] = r.finish_reason
            f.write(json.dumps(d) + "\n")


# ---- kv-cache-tester's agentic sessions ----------------------------------------------------
# One JSON file per session (`trace_NNNN.json`, github.com/callanjfox/kv-cache-tester):
# {"id", "block_size": 64, "hash_id_scope": "local", "requests": [...], ...}; each request
# has `t` (seconds since the session's start), `type` ("n" main agent, "s" a side request,
# "subagent": a nested session with its own `requests`, its `t` its start in the
# parent's clock), `in` / `out` tokens, `hash_ids` (one per full 64-token block, ids local
# to the file), `stop` (the finish reason). Bounds: a file of at most 512 MiB, sub-agents
# nested at most 4 deep, 1M requests and 4M block ids per request.
KV_TESTER_BLOCK = 64
MAX_SESSION_FILE_BYTES = 512 << 20
MAX_SUBAGENT_DEPTH = 4
MAX_SESSION_REQUESTS = 1 << 20
MAX_REQUEST_BLOCKS = 1 << 22


@dataclass(slots=True)
class SessionDraw:
    """How `load_kv_cache_tester` turns session files into one trace.

    `group`: 64-token blocks per trace block (8: 512-token blocks, as agentic_dev.jsonl);
    full groups only, a request's input being the tokens its full groups cover.
    `offset_s`: each session starts at a uniformly random offset in [0, offset_s) seconds
    (seeded by `seed`; 0: all at once). `span_s`: drop requests more than this many seconds
    after their session's start (None: keep all). `sessions`: the file stems to read (None:
    every `trace_*.json`). `max_sessions`: draw this many of them at random (seeded).
    `subagents`: replay nested sub-agent sessions, each its own session. `copies`: play
    each file this many times, each copy a session of its own (own offset, own block ids:
    as two users' sessions), to make a draw of a few files large enough to fill a cache."""

    group: int = 8
    offset_s: float = 0.0
    seed: int = 0
    span_s: float | None = None
    sessions: tuple[str, ...] | None = None
    max_sessions: int | None = None
    subagents: bool = True
    copies: int = 1

    def __post_init__(self) -> None:
        from ..checks import check_fields

        check_fields(self, "kv-cache-tester", error=TraceError)
        if self.group < 1:
            raise TraceError("kv-cache-tester: group must be >= 1")
        if self.offset_s < 0 or (self.span_s is not None and self.span_s <= 0):
            raise TraceError("kv-cache-tester: offset_s must be >= 0 and span_s > 0")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise TraceError("kv-cache-tester: max_sessions must be >= 1")
        if self.copies < 1:
            raise TraceError("kv-cache-tester: copies must be >= 1")

    @property
    def block_tokens(self) -> int:
        """Tokens per block: `group` kv-cache-tester blocks of 64 tokens."""
        return KV_TESTER_BLOCK * self.group


def session_files(path: str | Path) -> list[Path]:
    """The session files of a kv-cache-tester folder, in name order.

    Its `raw/` subfolder when it has one, or the one file given."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise TraceError(f"{p}: no such file or folder")
    if (p / "raw").is_dir() and not any(p.glob("trace_*.json")):
        p = p / "raw"
    files = sorted(p.glob("trace_*.json"))
    if not files:
        raise TraceError(f"{p}: no trace_*.json session files")
    return files


def load_kv_cache_tester(path: str | Path, draw: SessionDraw | None = None) -> list[TraceRequest]:
    """kv-cache-tester session files as one trace in time order.

    The path is a folder, its `raw/`, or one file. Each top-level session (and, with
    `draw.subagents`, each nested sub-agent, started at its `t` in its parent's clock) is a
    session of its own (`session`: "<file stem>" or "<file stem>/<agent_id>"), all started
    at `draw`'s seeded offsets. Block ids are grouped `draw.group` to a block (full groups
    only) and renumbered, one id space per file (a file's sub-agents share its ids, e.g.
    their system prompt; two files never share a block). Every field is type- and
    range-checked: a bad one is a `TraceError` naming the file and the request
    (`requests[3].requests[0]`)."""
    draw = draw or SessionDraw()
    import random

    files = session_files(path)
    if draw.sessions is not None:
        by_stem = {f.stem: f for f in files}
        missing = [s for s in draw.sessions if s not in by_stem]
        if missing:
            raise TraceError(f"{path}: no session file {', '.join(missing)} "
                             f"(have {', '.join(sorted(by_stem)[:8])}...)")
        files = [by_stem[s] for s in draw.sessions]
    rng = random.Random(draw.seed)
    if draw.max_sessions is not None and draw.max_sessions < len(files):
        files = sorted(rng.sample(files, draw.max_sessions))
    out: list[tuple[float, int, TraceRequest]] = []
    ids: dict[tuple[int, ...], int] = {}  # (file index, group of local ids) -> block id
    scope = 0  # one id space per file and copy
    for f in files:
        doc = _read_session_file(f)
        for c in range(draw.copies):
            start = rng.uniform(0.0, draw.offset_s) if draw.offset_s > 0 else 0.0
            name = f.stem if draw.copies == 1 else f"{f.stem}#{c}"
            _session_requests(str(f), doc, name, start, 0.0, scope, draw, ids, out, 0)
            scope += 1
    out.sort(key=lambda e: (e[0], e[1]))
    return [r for _, _, r in out]


def _read_session_file(f: Path) -> dict:
    try:
        size = f.stat().st_size
    except OSError as e:
        raise TraceError(f"{f}: {e.strerror or e}") from None
    if size > MAX_SESSION_FILE_BYTES:
        raise TraceError(f"{f}: {size:,} bytes, more than a session file may hold "
                         f"({MAX_SESSION_FILE_BYTES:,})")
    try:
        text = f.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{f}: not UTF-8 text") from None
    except OSError as e:
        raise TraceError(f"{f}: {e.strerror or e}") from None
    d = parse_json_line(f, 1, text)
    if not isinstance(d, dict):
        raise TraceError(f"{f}: a session file is a JSON object, not {_show(d)}")
    bs = d.get("block_size", KV_TESTER_BLOCK)
    if bs != KV_TESTER_BLOCK or type(bs) is not int:
        raise TraceError(f"{f}: block_size must be {KV_TESTER_BLOCK}, not {_show(bs)}")
    scope = d.get("hash_id_scope", "local")
    if scope != "local":
        raise TraceError(f"{f}: hash_id_scope must be \"local\", not {_show(scope)}")
    return d


def _session_requests(where: str, d: dict, session: str, start: float, base: float, fi: int,
                      draw: SessionDraw, ids: dict[tuple[int, ...], int],
                      out: list[tuple[float, int, TraceRequest]], depth: int) -> None:
    """Append the requests of one session object (a file's top level or a sub-agent)
    whose clock starts at `base` seconds into the top-level session, itself at `start`."""
    reqs = d.get("requests")
    if not isinstance(reqs, list):
        raise TraceError(f"{where}: requests must be a list, not {_show(reqs)}")
    if len(reqs) > MAX_SESSION_REQUESTS:
        raise TraceError(f"{where}: {len(reqs):,} requests, more than {MAX_SESSION_REQUESTS:,}")
    g = draw.group
    bt = draw.block_tokens
    for j, r in enumerate(reqs):
        at = f"{where}: requests[{j}]"
        if not isinstance(r, dict):
            raise TraceError(f"{at}: a request is a JSON object, not {_show(r)}")
        kind = r.get("type")
        t = check_time(at, "t", r.get("t"))
        if kind == "subagent":
            if depth + 1 > MAX_SUBAGENT_DEPTH:
                raise TraceError(f"{at}: sub-agents nested more than {MAX_SUBAGENT_DEPTH} deep")
            if not draw.subagents:
                continue
            agent = _check_str(at, "agent_id", r.get("agent_id")) or f"sub{j}"
            _session_requests(at, r, f"{session}/{agent}", start, base + t, fi, draw, ids,
                              out, depth + 1)
            continue
        if kind not in ("n", "s"):
            raise TraceError(f"{at}: type must be \"n\", \"s\" or \"subagent\", not {_show(kind)}")
        when = base + t
        if draw.span_s is not None and when > draw.span_s:
            continue
        raw = r.get("hash_ids")
        if not isinstance(raw, list):
            raise TraceError(f"{at}: hash_ids must be a list of block ids, not {_show(raw)}")
        if len(raw) > MAX_REQUEST_BLOCKS:
            raise TraceError(f"{at}: {len(raw):,} block ids, more than {MAX_REQUEST_BLOCKS:,}")
        local = [check_int(at, f"hash_ids[{k}]", x, 0, BLOCK_ID_LIMIT - 1)
                 for k, x in enumerate(raw)]
        n_in = check_int(at, "in", r.get("in"), 0, MAX_COUNT)
        if len(local) * KV_TESTER_BLOCK > n_in + KV_TESTER_BLOCK - 1 and local:
            raise TraceError(f"{at}: {len(local)} blocks of {KV_TESTER_BLOCK} tokens are more "
                             f"than its {n_in} input tokens")
        n_out = check_int(at, "out", r.get("out", 0), 0, MAX_COUNT)
        stop = _stop(at, r.get("stop"))
        n_groups = len(local) // g
        if n_groups == 0:
            continue  # no full block at this size: nothing the cache could hold
        hids = []
        for k in range(n_groups):
            key = (fi, *local[k * g:(k + 1) * g])
            hid = ids.get(key)
            if hid is None:
                hid = ids[key] = len(ids)
            hids.append(hid)
        ts_ms = (start + when) * 1000.0
        out.append((ts_ms, len(out), TraceRequest(ts_ms, n_groups * bt, n_out, hids, session,
                                                  None, stop)))


@dataclass(slots=True)
class WorkloadConfig:
    """A multi-turn chat workload for the built-in generator.

    Conversations open on one of a few shared system prompts (Zipf popularity), come back
    after a think time, and grow turn by turn."""

    num_conversations: int = 3000
    num_system_prompts: int = 12
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (1024, 4096)
    mean_turns: float = 4.0
    user_tokens_mean: float = 1500.0
    output_tokens_mean: float = 400.0
    arrival_rate: float = 1.5  # new conversations per second
    think_time_s: float = 240.0  # mean time between turns of one conversation
    single_turn_frac: float = 0.3  # one-off requests that never come back
    tenants: int = 1
    max_input_tokens: int = 64_000
    seed: int = 0


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, int(rng.lognormvariate(mu, sigma)))


def generate_workload(cfg: WorkloadConfig | None = None, block_tokens: int = 512) -> list[TraceRequest]:
    """Seeded synthetic trace in Mooncake form, so the package never needs trace files."""
    block_tokens = positive_int(block_tokens, "block_tokens")
    cfg = cfg or WorkloadConfig()
    rng = random.Random(cfg.seed)
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_system_prompts)]
    sys_len = [rng.randint(*cfg.system_tokens) for _ in range(cfg.num_system_prompts)]
    ids: dict[tuple, int] = {}

    def block_id(owner: tuple, end: int) -> int:
        return ids.setdefault((owner, end), len(ids))

    events: list[tuple[float, int, int, int]] = []  # (time, conv, turn, input_len)
    t = 0.0
    convs = []
    for c in range(cfg.num_conversations):
        t += rng.expovariate(cfg.arrival_rate)
        sp = rng.choices(range(cfg.num_system_prompts), weights)[0]
        turns = 1 if rng.random() < cfg.single_turn_frac else 1 + int(rng.expovariate(1 / max(cfg.mean_turns - 1, 1e-9)))
        tenant = f"tenant{rng.randrange(cfg.tenants)}" if cfg.tenants > 1 else None
        convs.append((sp, tenant))
        history = sys_len[sp]
        when = t
        for turn in range(turns):
            history += _lognormal(rng, cfg.user_tokens_mean)
            if history > cfg.max_input_tokens:
                break
            out_len = _lognormal(rng, cfg.output_tokens_mean)
            events.append((when, c, turn, history))
            history += out_len
            when += rng.expovariate(1 / cfg.think_time_s)
    events.sort()
    trace: list[TraceRequest] = []
    for when, c, _turn, n in events:
        sp, tenant = convs[c]
        n_blocks = -(-n // block_tokens)
        hids = []
        for j in range(n_blocks):
            end = min((j + 1) * block_tokens, n)
            # Blocks wholly inside the system prompt are shared by every conversation on it.
            owner = ("sys", sp) if end <= sys_len[sp] else ("conv", c)
            hids.append(block_id(owner, end))
        out_len = _lognormal(random.Random(hash((cfg.seed, c, n)) & 0xFFFF), cfg.output_tokens_mean)
        trace.append(TraceRequest(when * 1000.0, n, out_len, hids, f"conv{c}", tenant))
    return trace
