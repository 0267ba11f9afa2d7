"""Trace requests: Mooncake-format JSONL and the built-in multi-turn workload generator.

A trace names each request's prompt as a list of block ids; an id names a whole prefix
(block contents chained), so equal ids at equal positions mean equal prefixes.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str | None = None
    tenant: str | None = None


class TraceError(ValueError):
    pass


# Bounds on what a trace line may hold. A line of 32 Mi characters is far beyond any real
# request (a Mooncake line of 1M block ids, a vLLM log line of a 4M-token prompt); a longer
# one is refused rather than read whole. Block ids are the 8-byte unsigned contents the
# cache hashes; counts are 64-bit.
MAX_LINE_CHARS = 1 << 25
BLOCK_ID_LIMIT = 1 << 64
MAX_COUNT = (1 << 63) - 1
_BAD_BYTES = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of non-UTF-8 bytes


def read_lines(path: str | Path, strict_utf8: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) for each non-blank line of a text file, each line bounded by
    `MAX_LINE_CHARS`; with `strict_utf8` a line that is not UTF-8 is an error naming it
    (otherwise bad bytes read as U+FFFD)."""
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
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, not {v!r}")
    return v


def _check_str(where: str, name: str, v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise TraceError(f"{where}: {name} must be a non-empty string or null, not {_show(v)}")
    return v


def parse_request(where: str, d: object, block_tokens: int) -> TraceRequest:
    """One Mooncake request (a decoded JSON line), every field type- and range-checked:
    `hash_ids` a non-empty list of block ids in [0, 2**64), `input_length` an integer
    that fits them, `output_length` an integer >= 0, `timestamp` (ms) a finite number
    >= 0, `session_id` and `tenant` strings. Other fields are ignored."""
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
                        _check_str(where, "tenant", d.get("tenant")))


def load_trace(path: str | Path, block_tokens: int = 512, limit: int | None = None) -> list[TraceRequest]:
    """Load a Mooncake-format JSONL trace (`timestamp`, `input_length`, `output_length`,
    `hash_ids`, optionally `session_id` and `tenant`), checking every line
    (`parse_request`); a bad line is a `TraceError` naming the file, line and field."""
    block_tokens = positive_int(block_tokens, "block_tokens")
    if limit is not None:
        limit = positive_int(limit, "limit")
    out: list[TraceRequest] = []
    for lineno, line in read_lines(path):
        where = f"{path}:{lineno}"
        out.append(parse_request(where, parse_json_line(path, lineno, line), block_tokens))
        if limit is not None and len(out) >= limit:
            break
    return out


def save_trace(trace: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            d = {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                 "output_length": r.output_length, "hash_ids": r.hash_ids}
            if r.session is not None:
                d["session_id"] = r.session
            if r.tenant is not None:
                d["tenant"] = r.tenant
            f.write(json.dumps(d) + "\n")


@dataclass(slots=True)
class WorkloadConfig:
    """A multi-turn chat workload: conversations open on one of a few shared system
    prompts (Zipf popularity), come back after a think time, and grow turn by turn."""

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
