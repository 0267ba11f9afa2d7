"""Trace replay: real traces through the real cache, policies against Belady."""

from .replayer import MissBreakdown, PreparedTrace, ReplayResult, parse_tokens, replay, replay_grid
from .traces import (
    TraceError,
    TraceRequest,
    WorkloadConfig,
    generate_workload,
    load_trace,
    save_trace,
)

__all__ = [
    "MissBreakdown", "PreparedTrace", "ReplayResult", "TraceError", "TraceRequest",
    "WorkloadConfig", "generate_workload", "load_trace", "parse_tokens", "replay",
    "replay_grid", "save_trace",
]
