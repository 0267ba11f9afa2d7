"""The traces the heat benches replay, by name: `conv` and `synth` (the shared Mooncake
traces), `gen` (the built-in generator) and `gen<seed>` (the generator with another
seed), or a path. Every heat bench replays through `kvheat.replay.replay` on a
`PreparedTrace` (keys hashed once per trace and process), as `kvheat replay` does."""

from __future__ import annotations

from functools import cache

from bench._lib import TRACES
from kvheat.replay import PreparedTrace, generate_workload, load_trace
from kvheat.replay.traces import TraceRequest, WorkloadConfig

TRACE_FILES = {
    "conv": "mooncake_conversation_part1.jsonl",
    "synth": "mooncake_synthetic_trace.jsonl",
}
BLOCK = 512
# The generator at blocks under 128 tokens: a smaller workload of the same shape (the full
# one has ~30x more block accesses at 16 tokens than at 512, minutes per replay).
GEN16 = WorkloadConfig(num_conversations=600)


def get_trace(name: str, block: int = BLOCK) -> list[TraceRequest]:
    if name == "gen":
        return generate_workload(GEN16 if block < 128 else WorkloadConfig(), block)
    if name.startswith("gen"):  # gen<seed>: the generator with another seed
        return generate_workload(WorkloadConfig(seed=int(name[3:])), block)
    return load_trace(TRACES / TRACE_FILES.get(name, name), block)


@cache
def prepared(name: str, block: int = BLOCK) -> PreparedTrace:
    """The named trace with its keys computed once per process."""
    return PreparedTrace(get_trace(name, block), block)
