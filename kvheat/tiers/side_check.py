"""Checksums taken on a thread beside the copy they check.

A host-tier read is a copy out of a slot and an xxh3 pass over it. From about 1 MiB a copy
no longer leaves the slot in cache, so the check reads it again: about 20% of the copy.
xxhash releases the GIL, so on a second core the check runs while the caller copies
(`bench/tiers/bandwidth.py`, host rows of 16 a call). Waking the thread costs 50-200 us
here, as much as copying 1-2 MiB, so only reads of several MiB are sent (`worth_it`).
Results are used only after both are done: the caller holds its store's lock throughout,
so the slots cannot change under the check.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

import xxhash

_hash = xxhash.xxh3_64_intdigest
# Below this many bytes the thread's wake-up costs more than the check it takes over (a
# copy of 4 MiB takes about 400 us here, its check 70 us, a wake-up 50-200 us).
MIN_BYTES = 4 << 20
# A check not answered by then (a thread stopped at interpreter exit) is done inline.
_WAIT_S = 5.0


def bad_indices(raws: Sequence[memoryview], sums: Sequence[int]) -> list[int]:
    """Positions whose bytes no longer hash to their checksum."""
    if [_hash(r) for r in raws] == list(sums):
        return []
    return [i for i, (r, s) in enumerate(zip(raws, sums, strict=True)) if _hash(r) != s]


class SideCheck:
    """One check in flight on the thread; `result()` waits for it."""

    __slots__ = ("raws", "sums", "bad", "done")

    def __init__(self, raws: Sequence[memoryview], sums: Sequence[int]) -> None:
        self.raws, self.sums = raws, sums
        self.bad: list[int] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        """Take the check (on the thread); if it raises, `result` takes it inline."""
        try:
            self.bad = bad_indices(self.raws, self.sums)
        except Exception:  # answered inline by `result`: the thread never dies of one
            self.bad = None
        finally:
            self.done.set()

    def result(self) -> list[int]:
        """Positions that failed their check; taken inline if the thread gave no result in time."""
        if not self.done.wait(_WAIT_S) or self.bad is None:
            return bad_indices(self.raws, self.sums)
        return self.bad


class SideChecker:
    """A daemon thread that takes checksum checks beside the callers' copies.

    Shared by every host store of the process, started on first use (and again in a
    forked child, which has none)."""

    def __init__(self, cpus: Callable[[], int] | None = None) -> None:
        self._cpus = cpus or (lambda: len(os.sched_getaffinity(0)))
        self._jobs: queue.SimpleQueue[SideCheck] = queue.SimpleQueue()
        self._pid = 0
        self._lock = threading.Lock()

    def worth_it(self, nbytes: int) -> bool:
        """Sending a check of `nbytes` pays: large enough, and a second core to run on."""
        return nbytes >= MIN_BYTES and self._cpus() > 1

    def submit(self, raws: Sequence[memoryview], sums: Sequence[int]) -> SideCheck:
        """Queue a check of `raws` against `sums` on the thread (started here if needed)."""
        with self._lock:
            if self._pid != os.getpid():
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._jobs,),
                                 name="kvheat-side-check", daemon=True).start()
                self._pid = os.getpid()
            job = SideCheck(raws, sums)
            self._jobs.put(job)
        return job

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[SideCheck]) -> None:
        while True:
            jobs.get().run()


CHECKER = SideChecker()
