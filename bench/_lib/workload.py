"""Token-level workloads for the engine benches (bench/engine/table.py) and their tests:
the replayer's traces, made into real prompts.

A trace names each prompt as a list of block ids, an id standing for a whole prefix. Here
each id becomes a fixed run of token ids drawn from a generator seeded by the id, so equal
ids give equal tokens and prefixes shared in the trace are shared in the token prompts.
`cpu_workload` is the built-in multi-turn generator at a size two CPU cores run in
minutes; `scale_trace` shrinks a Mooncake trace (512-token blocks) to the same scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvheat.replay.traces import TraceRequest, WorkloadConfig, generate_workload


@dataclass(slots=True)
class EngineRequest:
    prompt: list[int]
    max_tokens: int
    session: str | None = None
    tenant: str | None = None


def cpu_workload_config(num_conversations: int = 32, seed: int = 0,
                        max_input_tokens: int = 1500) -> WorkloadConfig:
    """The built-in multi-turn chat workload at CPU size: a dozen shared system prompts
    of 64-384 tokens, user turns of ~40 tokens, answers of ~12 tokens."""
    return WorkloadConfig(num_conversations=num_conversations, num_system_prompts=12,
                          system_tokens=(64, 384), mean_turns=3.0, user_tokens_mean=40.0,
                          output_tokens_mean=12.0, arrival_rate=2.0, think_time_s=20.0,
                          single_turn_frac=0.3, max_input_tokens=max_input_tokens, seed=seed)


def add_resubmissions(trace: list[TraceRequest], frac: float, seed: int = 0,
                      max_gap: int = 8) -> list[TraceRequest]:
    """Resubmit a fraction of requests unchanged a few requests later (a user pressing
    "regenerate", a client retrying): the only reuse a whole-prompt cache can serve."""
    if not 0 <= frac <= 1:
        raise ValueError(f"resubmission fraction must be in [0, 1], not {frac}")
    rng = random.Random(seed)
    out = list(trace)
    inserts: list[tuple[int, TraceRequest]] = []
    for i, r in enumerate(trace):
        if rng.random() < frac:
            inserts.append((i + 1 + rng.randrange(max_gap), r))
    for pos, r in sorted(inserts, key=lambda x: -x[0]):
        out.insert(min(pos, len(out)), TraceRequest(r.timestamp_ms, r.input_length,
                                                    r.output_length, list(r.hash_ids),
                                                    r.session, r.tenant))
    return out


def scale_trace(trace: list[TraceRequest], trace_block: int, block_size: int,
                max_input: int, max_output: int) -> list[TraceRequest]:
    """Shrink each `trace_block`-token trace block to `block_size` tokens (lengths scaled
    alike), dropping requests longer than `max_input` after scaling."""
    f = block_size / trace_block
    out = []
    for r in trace:
        n = max(1, round(r.input_length * f))
        n = max(n, (len(r.hash_ids) - 1) * block_size + 1)  # keep every block non-empty
        n = min(n, len(r.hash_ids) * block_size)
        if n > max_input:
            continue
        out.append(TraceRequest(r.timestamp_ms, n, max(1, min(max_output, round(r.output_length * f))),
                                r.hash_ids, r.session, r.tenant))
    return out


def materialize(trace: list[TraceRequest], block_size: int, vocab_size: int,
                seed: int = 0, first_token: int = 2) -> list[EngineRequest]:
    """Token prompts for a trace whose blocks hold `block_size` tokens. Ids below
    `first_token` (BOS, EOS) are never drawn."""
    cache: dict[int, list[int]] = {}

    def block(hid: int) -> list[int]:
        t = cache.get(hid)
        if t is None:
            rng = random.Random(seed * 1_000_003 + hid)
            t = cache[hid] = [rng.randrange(first_token, vocab_size) for _ in range(block_size)]
        return t

    out = []
    for r in trace:
        toks: list[int] = []
        for hid in r.hash_ids:
            toks.extend(block(hid))
        if not (len(r.hash_ids) - 1) * block_size < r.input_length <= len(toks):
            raise ValueError(f"{r.input_length} tokens do not fit {len(r.hash_ids)} blocks "
                             f"of {block_size}")
        out.append(EngineRequest(toks[:r.input_length], r.output_length, r.session, r.tenant))
    return out


def cpu_workload(block_size: int, vocab_size: int, num_conversations: int = 32,
                 resubmit_frac: float = 0.15, seed: int = 0, max_input_tokens: int = 1500,
                 ) -> tuple[list[TraceRequest], list[EngineRequest]]:
    """The built-in workload: (trace in block ids, the same as token prompts)."""
    cfg = cpu_workload_config(num_conversations, seed, max_input_tokens)
    trace = generate_workload(cfg, block_size)
    trace = add_resubmissions(trace, resubmit_frac, seed)
    return trace, materialize(trace, block_size, vocab_size, seed)
