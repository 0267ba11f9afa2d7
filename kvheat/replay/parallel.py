"""Replays side by side: each (spool, policy, capacity) a task, run here or in `jobs`
forked worker processes.

Workers are forked after every spool is built (and, for an offline policy, its next-use
file written), so each reads the spool files the parent made and shares its key table
copy-on-write; a task names its spool by position, never ships it.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..cache import make_policy
from .replayer import ReplayResult, replay
from .spool import Spool


@dataclass(frozen=True, slots=True)
class ReplayTask:
    """One replay to run: a spool (by index), a policy, a capacity and `replay`'s options."""

    spool: int  # index into the spools given to `run_replays`
    policy: str
    capacity_tokens: int
    options: dict[str, Any] = field(default_factory=dict)  # `replay`'s keyword arguments


_SPOOLS: Sequence[Spool] = ()  # what forked workers inherit


def _run(task: ReplayTask) -> ReplayResult:
    sp = _SPOOLS[task.spool]
    return replay(sp, task.policy, task.capacity_tokens, sp.block_tokens, **task.options)


def run_replays(spools: Sequence[Spool], tasks: Sequence[ReplayTask], jobs: int = 1,
                on_done: Callable[[ReplayTask], None] | None = None) -> list[ReplayResult]:
    """The result of each task, in the tasks' order.

    `jobs` > 1 runs them in that many forked processes (largest spools first, so the longest
    tasks do not come last)."""
    global _SPOOLS
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    for t in tasks:  # the next-use files, once each, before any worker reads them
        if make_policy(t.policy).needs_future:
            spools[t.spool].prepare_next_use()
    _SPOOLS = spools
    try:
        if jobs == 1 or len(tasks) <= 1:
            out = []
            for t in tasks:
                out.append(_run(t))
                if on_done is not None:
                    on_done(t)
            return out
        order = sorted(range(len(tasks)), key=lambda i: -spools[tasks[i].spool].summary.refs)
        results: dict[int, ReplayResult] = {}
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx) as pool:
            pending: dict[Future[ReplayResult], int] = {pool.submit(_run, tasks[i]): i
                                                       for i in order}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    i = pending.pop(f)
                    results[i] = f.result()
                    if on_done is not None:
                        on_done(tasks[i])
        return [results[i] for i in range(len(tasks))]
    finally:
        _SPOOLS = ()
