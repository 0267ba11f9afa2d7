"""Trace requests: Mooncake-format JSONL and the built-in multi-turn workload generator.

A trace names each request's prompt as a list of block ids; an id names a whole prefix
(block contents chained), so equal ids at equal positions mean equal prefixes.
"""

from __future__ import annotations

import json
import math
import random
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


def load_trace(path: str | Path, block_tokens: int = 512, limit: int | None = None) -> list[TraceRequest]:
    """Load a Mooncake-format JSONL trace (`timestamp`, `input_length`, `output_length`,
    `hash_ids`), checking every line; a bad line is an error naming the line."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ids = [int(x) for x in d["hash_ids"]]
                n = int(d["input_length"])
                r = TraceRequest(float(d.get("timestamp", 0)), n, int(d.get("output_length", 0)),
                                 ids, d.get("session_id"), d.get("tenant"))
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{lineno}: not a trace request ({e})") from None
            if not ids or not (len(ids) - 1) * block_tokens < n <= len(ids) * block_tokens:
                raise TraceError(f"{path}:{lineno}: {n} input tokens do not fit "
                                 f"{len(ids)} blocks of {block_tokens}")
            out.append(r)
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
