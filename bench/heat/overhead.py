"""Policy decision overhead per block access, measured inside the real cache.

Every policy hook (insert, hit, acquire, release, leaf, victim, evict, and the batched
acquire/release the cache calls where a policy overrides them) is wrapped with a
nanosecond timer; per request the time spent in hooks is divided by the request's block
accesses (the replay is the project's `kvheat.replay.replay`). The timer's own cost (an
empty wrapped call, calibrated here) is subtracted. The policies run interleaved, round
after round, so load from other processes falls on all of them alike; each keeps its
best round (lowest median).

    .venv/bin/python bench/heat/overhead.py --trace conv --json docs/results/heat/overhead.json

Each row also keeps every hook's share: its time (less the timer's) per block access over
the whole replay, the calls' fixed cost included (`hooks_ns_per_access`; printed with
`--by-hook`). A hook called once per request (`on_session`, `on_finish`) weighs most on
short requests, which the per-request median is made of.

A policy named `NAME+hints` (e.g. `kvheat+hints`) replays with the request hints (the
replayer's `hints=True`: sessions, finish reasons) and its hint hooks timed too; the others
replay without. Traces: those of bench/heat/sessions.py (`conv`, `synth`, `agentic_dev`,
`agentic_raw`, ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as `python bench/heat/overhead.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.heat.sessions import policy_spec, trace
from kvheat.cache import make_policy
from kvheat.replay import replay

HOOKS = ("on_insert", "on_hit", "on_acquire", "on_release", "on_leaf", "victim", "on_evict",
         "on_acquire_all", "on_release_all", "on_session", "on_finish", "on_queue", "on_dequeue")


# The timer: wall time, or with `--cpu-time` this thread's CPU time (what other processes
# on a loaded machine do not add to).
TIMER = [time.perf_counter_ns]


def _calibrate(n: int = 200_000) -> float:
    acc = [0]
    now = TIMER[0]

    def empty() -> None:
        return None

    def timed() -> None:
        t = now()
        empty()
        acc[0] += now() - t

    for _ in range(n):
        timed()
    return acc[0] / n


def measure(trace_name: str, policy: str, capacity_tokens: int) -> dict[str, float]:
    """Replay through the project's replayer with timed hooks; per request, hook time
    divided by the request's block accesses (its `progress` callback closes each one)."""
    hints = policy.endswith("+hints")
    pt = trace(trace_name)
    # The policy replayed before this one is garbage in reference cycles (a heap's key is
    # its policy's bound method): collected now, not by a full collection inside this
    # one's timed hooks (which charged it to the policy that ran next).
    gc.collect()
    spec = policy_spec(policy.removesuffix("+hints"))
    pol = make_policy(spec) if isinstance(spec, str) else spec()
    acc = [0]
    calls = [0]
    by_hook = dict.fromkeys(HOOKS, 0)  # over the whole replay: time, calls
    calls_by_hook = dict.fromkeys(HOOKS, 0)
    now = TIMER[0]
    for name in HOOKS:
        fn = getattr(pol, name)

        def wrapped(*a, _fn=fn, _name=name):  # type: ignore[no-untyped-def]
            t = now()
            r = _fn(*a)
            dt = now() - t
            acc[0] += dt
            calls[0] += 1
            by_hook[_name] += dt
            calls_by_hook[_name] += 1
            return r

        setattr(pol, name, wrapped)
    per_access: list[float] = []
    timer_ns = _calibrate()
    num_blocks = capacity_tokens // pt.block_tokens
    accesses = [0]

    def close_request(i: int) -> None:
        n = len(pt.keys[i])
        if n <= num_blocks:  # longer requests skip the cache (no hooks run)
            per_access.append(max(0.0, acc[0] - calls[0] * timer_ns) / n / 1000.0)
            accesses[0] += n
        acc[0] = calls[0] = 0

    # without hints as every bench replays (the trace's own session ids only)
    replay(pt, lambda: pol, capacity_tokens, progress=close_request, hints=True if hints else None)
    per_access.sort()
    hooks = {h: round((by_hook[h] - calls_by_hook[h] * timer_ns) / max(accesses[0], 1), 1)
             for h in HOOKS if calls_by_hook[h]}
    return {"median_us": statistics.median(per_access),
            "p99_us": per_access[int(0.99 * (len(per_access) - 1))],
            "mean_us": statistics.fmean(per_access), "timer_ns": timer_ns,
            "hooks_ns_per_access": hooks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="conv")
    ap.add_argument("--policies", default="lru,arc,s3fifo,twoq,lruk,kvheat")
    ap.add_argument("--capacity", default="1M")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time hooks by this thread's CPU time (a loaded machine)")
    ap.add_argument("--by-hook", action="store_true",
                    help="print each hook's ns per block access (kept in the JSON either way)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.cpu_time:
        TIMER[0] = time.thread_time_ns
    cap = int(float(a.capacity.rstrip("M")) * 1_000_000)
    rows = []
    print(f"{'policy':10s} {'median µs':>10s} {'p99 µs':>8s} {'mean µs':>8s}  (per block access, {a.trace} @ {a.capacity})")
    pols = a.policies.split(",")
    best: dict[str, dict[str, float]] = {}
    for _ in range(a.repeat):
        for p in pols:
            m = measure(a.trace, p, cap)
            if p not in best or m["median_us"] < best[p]["median_us"]:
                best[p] = m
    for p in pols:
        m = best[p]
        rows.append({"trace": a.trace, "policy": p, "capacity": cap, **m})
        print(f"{p:10s} {m['median_us']:10.2f} {m['p99_us']:8.2f} {m['mean_us']:8.2f}", flush=True)
        if a.by_hook:
            hooks = sorted(m["hooks_ns_per_access"].items(), key=lambda kv: -kv[1])
            print("    " + ", ".join(f"{h} {ns:.0f}" for h, ns in hooks) + "  (ns per access)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
