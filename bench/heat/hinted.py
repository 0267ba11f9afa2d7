"""Replays that carry the request hints a server would pass (kvheat/cache/hints.py).

A trace's request names its session (`session_id`, or, where the trace has none, the
earlier request whose whole prompt it extends: `derive_sessions`) and, for the agentic
traces, the model's finish reason (`stop`). `replay_hinted` drives the real block cache as
`kvheat.replay.replay` does (one request at a time, match, allocate, free), passing the
session on allocate and the finish reason on free; with `hints=False` it is that replay
exactly (tests/test_heat_sessions.py checks it).

Agentic held-out draws (`agentic_draw`): sessions of `../shared/traces/agentic/raw/` (sub-
agents as sessions of their own), each started at a seeded offset within two hours,
requests beyond four hours dropped, 64-token ids grouped by 8 into 512-token blocks (full
groups only), ids made distinct per copy: the recipe of `agentic_dev.jsonl` on other
sessions and seeds.

    python bench/heat/hinted.py --trace agentic,conv --policies lru,lruk,kvheat,belady
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

if not __package__:  # run as `python bench/heat/hinted.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import TRACES
from kvheat.cache import CacheConfig, KVCacheManager, Outcome, Request
from kvheat.replay import PreparedTrace, load_trace, parse_tokens
from kvheat.replay.replayer import PolicySpec, _policy, pool_blocks
from kvheat.replay.traces import TraceRequest

BLOCK = 512
RAW = TRACES / "agentic" / "raw"


@dataclass
class HintedTrace:
    """A prepared trace and, per request, its session and finish reason (None: unknown)."""

    name: str
    prepared: PreparedTrace
    sessions: list[str | None]
    reasons: list[str | None]


def derive_sessions(trace: list[TraceRequest], block_tokens: int) -> list[str]:
    """A session per request where the trace names none: the session of the longest earlier
    request whose full blocks are a prefix of this one (its whole prompt, less a partial
    last block), else a new one. A prefix extended by a second, different next block (a
    shared system prompt, a branch) starts a new session for the newcomer."""
    full: dict[int, tuple[int, str]] = {}  # last full block id -> (full blocks, session)
    children: dict[int, dict[int, str]] = {}  # that id -> next block id -> session
    out: list[str] = []
    for i, r in enumerate(trace):
        h = r.hash_ids
        sess = None
        for j in range(len(h) - 1, -1, -1):
            hit = full.get(h[j])
            if hit is not None and hit[0] == j + 1:
                nxt = h[j + 1] if j + 1 < len(h) else -1
                kids = children.setdefault(h[j], {})
                sess = kids.get(nxt)
                if sess is None:
                    sess = hit[1] if not kids else f"d{i}"
                    kids[nxt] = sess
                break
        if sess is None:
            sess = f"d{i}"
        if r.session is not None:
            sess = r.session
        out.append(sess)
        n_full = len(h) if r.input_length == len(h) * block_tokens else len(h) - 1
        if n_full:
            full[h[n_full - 1]] = (n_full, sess)
    return out


def _reasons(path: Path) -> list[str | None]:
    out: list[str | None] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                s = json.loads(line).get("stop")
                out.append(s if isinstance(s, str) and s else None)
    return out


def agentic_draw(seed: int, n_sessions: int = 120, subagents: bool = True,
                 files: list[Path] | None = None) -> tuple[list[TraceRequest], list[str | None]]:
    """A draw of agentic sessions from the raw files (see the module doc): requests and
    their finish reasons. Sessions are drawn with replacement, each copy its own ids."""
    rng = random.Random(seed)
    files = files if files is not None else sorted(RAW.glob("trace_*.json"))
    if not files:
        raise FileNotFoundError(f"no raw agentic sessions under {RAW}")
    sessions = []  # list of lists of (t, in, out, ids64, stop)
    for f in files:
        d = json.loads(f.read_text())
        main: list[tuple] = []
        for r in d["requests"]:
            if r.get("type") == "subagent":
                if subagents:
                    t0 = r["t"]
                    sub = [(t0 + s2["t"], s2["in"], s2["out"], s2["hash_ids"], s2.get("stop"))
                           for s2 in r.get("requests", []) if s2.get("type") != "subagent"]
                    if sub:
                        sessions.append(sub)
            else:
                main.append((r["t"], r["in"], r["out"], r["hash_ids"], r.get("stop")))
        if main:
            sessions.append(main)
    events: list[tuple[float, int, TraceRequest, str | None]] = []
    next_id = 0
    for copy in range(n_sessions):
        reqs = sessions[rng.randrange(len(sessions))]
        start = rng.uniform(0, 7200)
        remap: dict[int, int] = {}
        t_first = reqs[0][0]
        for t, _n_in, n_out, ids, stop in reqs:
            ts = start + (t - t_first)
            if t - t_first > 4 * 3600:
                break
            n_groups = len(ids) // 8
            if n_groups == 0:
                continue
            block_ids = []
            for g in range(n_groups):
                key = ids[8 * g + 7]  # a 64-token id names its whole prefix
                if key not in remap:
                    remap[key] = next_id
                    next_id += 1
                block_ids.append(remap[key])
            tr = TraceRequest(ts * 1000.0, n_groups * BLOCK, n_out, block_ids, f"c{copy}")
            events.append((ts, len(events), tr, stop if stop else None))
    events.sort(key=lambda e: (e[0], e[1]))
    return [e[2] for e in events], [e[3] for e in events]


@cache
def hinted(name: str) -> HintedTrace:
    """`conv`, `synth` (sessions derived), `conv_a`/`conv_b` (its first and second half
    by request count), `agentic` (the dev draw), `draw<seed>` (a held-out draw)."""
    if name.startswith("draw"):
        trace, reasons = agentic_draw(int(name[4:]))
        return HintedTrace(name, PreparedTrace(trace, BLOCK), derive_sessions(trace, BLOCK), reasons)
    files = {"conv": "mooncake_conversation_part1.jsonl", "synth": "mooncake_synthetic_trace.jsonl",
             "agentic": "agentic/agentic_dev.jsonl"}
    base = name.split("_")[0]
    path = TRACES / files[base]
    trace = load_trace(path, BLOCK)
    reasons = _reasons(path) if base == "agentic" else [None] * len(trace)
    sessions = derive_sessions(trace, BLOCK)
    if name.endswith(("_a", "_b")):
        half = len(trace) // 2
        sl = slice(0, half) if name.endswith("_a") else slice(half, None)
        trace, reasons, sessions = trace[sl], reasons[sl], sessions[sl]
    return HintedTrace(name, PreparedTrace(trace, BLOCK), sessions, reasons)


def replay_hinted(ht: HintedTrace, policy: PolicySpec, capacity_tokens: int,
                  sessions: bool = True, reasons: bool = True, time_scale: float = 1.0,
                  queue_depth: int = 0, progress: Callable[[int], None] | None = None) -> dict:
    """`kvheat.replay.replay` (one request at a time), passing the trace's sessions on
    allocate and finish reasons on free where asked. `queue_depth` d: the next d requests
    wait in the cache's queue (`KVCacheManager.queue`) while one is served, as in a
    server with d requests waiting. Returns hit rate and counts."""
    pt = ht.prepared
    bt = pt.block_tokens
    num_blocks = capacity_tokens // bt
    pol = _policy(policy)
    now = [0.0]
    allocated = pool_blocks(pt, capacity_tokens)
    mgr = KVCacheManager(CacheConfig(num_blocks=allocated, block_size=bt), policy=pol,
                         clock=lambda: now[0])
    if allocated < num_blocks:
        pol.bind(num_blocks)
    next_use = getattr(pol, "next_use", None) if pol.needs_future else None
    belady = pt.next_use if next_use is not None else None
    t0 = time.perf_counter()
    trace = pt.trace
    waiting: dict[int, Request] = {}

    def make(i: int) -> Request:
        r = trace[i]
        return mgr.make_hashed_request(str(i), r.hash_ids, r.input_length, r.tenant,
                                       ht.sessions[i] if sessions else None)

    for i, r in enumerate(trace):
        now[0] = r.timestamp_ms * time_scale / 1000.0
        for j in range(i + 1, min(i + 1 + queue_depth, len(trace))):
            if j not in waiting:
                waiting[j] = make(j)
                mgr.queue(waiting[j])
        req = waiting.pop(i, None) or make(i)
        if belady is not None and next_use is not None:
            for k, nu in zip(req.keys, belady[i]):
                next_use[k] = nu
        if len(req.block_tokens) > num_blocks:
            mgr.dequeue(req.request_id)
            mgr.record_prompt(r.input_length, 0, 0)
        else:
            mgr.allocate(req)
            mgr.free(req, Outcome.FINISHED, ht.reasons[i] if reasons else None)
        if progress is not None:
            progress(i)
    st = mgr.stats
    return {"trace": ht.name, "policy": pol.name, "capacity_tokens": capacity_tokens,
            "hit_rate": st.hit_rate, "hit_tokens": st.hit_tokens,
            "total_tokens": st.query_tokens, "evictions": st.evicted_blocks,
            "sessions": sessions, "reasons": reasons, "time_scale": time_scale,
            "queue_depth": queue_depth,
            "seconds": round(time.perf_counter() - t0, 2), "policy_stats": pol.stats()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="agentic,conv")
    ap.add_argument("--policies", default="lru,lruk,kvheat,belady")
    ap.add_argument("--capacity", default="1M,3M,10M")
    ap.add_argument("--no-hints", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    for t in a.trace.split(","):
        ht = hinted(t)
        for p in a.policies.split(","):
            line = []
            for c in a.capacity.split(","):
                r = replay_hinted(ht, p, parse_tokens(c), not a.no_hints, not a.no_hints)
                rows.append(r)
                line.append(f"{100 * r['hit_rate']:6.2f}%")
            print(f"{t:10s} {p:10s} " + " ".join(line), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
