"""A/B arms: `hash(user) % 100` picks the arm, each arm its own cache policy (docs/server.md,
"A/B arms").

The hash is xxh64 of the user string: stable across processes and restarts (Python's
`hash` of a str is salted per process), so a user stays in one arm. `ArmStats` keeps what
the per-arm report needs: a bounded window of TTFTs for P50/P99 and token-weighted hit
counts.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np
import xxhash

from ..cache import hit_rate
from .config import ArmConfig


def user_bucket(user: str) -> int:
    """The user's bucket in [0, 100)."""
    return xxhash.xxh64_intdigest(user.encode("utf-8", "surrogatepass")) % 100


def arm_user(user: str | None, tenant: str | None) -> str:
    """Whom a request's arm is chosen by: its `user` field, else its tenant, else one bucket.

    The server and the router both pick arms by this."""
    return user or tenant or "anonymous"


class ArmRouter:
    """Buckets to arms: arm i takes the next `share` buckets, in config order."""

    def __init__(self, arms: Sequence[ArmConfig]) -> None:
        if sum(a.share for a in arms) != 100:
            raise ValueError("arm shares must add up to 100")
        self.names = [a.name for a in arms]
        self._by_bucket: list[str] = []
        for a in arms:
            self._by_bucket += [a.name] * a.share

    def arm_for(self, user: str) -> str:
        """The arm that `user` reaches."""
        return self._by_bucket[user_bucket(user)]


class ArmStats:
    """Per-arm TTFT window and hit counts; written by the engine thread, read by handlers.

    The hit counts are the cache's (each request the cache counted, with the tokens it
    counted), summed once requests finish: the arm's hit rate is its cache's."""

    def __init__(self, names: Sequence[str], window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self.ttft: dict[str, deque[float]] = {n: deque(maxlen=window) for n in names}
        self.requests = dict.fromkeys(names, 0)  # clients' requests
        self.prewarms = dict.fromkeys(names, 0)  # a router's prewarms (PREWARM_HEADER)
        self.prompt_tokens = dict.fromkeys(names, 0)
        self.cached_tokens = dict.fromkeys(names, 0)

    def record(self, arm: str, ttft: float | None, prompt_tokens: int, cached_tokens: int,
               prewarm: bool = False) -> None:
        """Count a finished request the cache counted.

        A prewarm's tokens are the cache's like any other's; it is counted apart from the
        clients' requests and their TTFTs."""
        with self._lock:
            self.prompt_tokens[arm] += prompt_tokens
            self.cached_tokens[arm] += cached_tokens
            if prewarm:
                self.prewarms[arm] += 1
                return
            self.requests[arm] += 1
            if ttft is not None:
                self.ttft[arm].append(ttft)

    def summary(self) -> list[dict[str, float | int | str | None]]:
        """One row per arm: requests, hit rate (token-weighted), TTFT P50/P99 in seconds."""
        rows: list[dict[str, float | int | str | None]] = []
        with self._lock:
            for name, window in self.ttft.items():
                t = np.fromiter(window, dtype=np.float64)
                p = self.prompt_tokens[name]
                rows.append({
                    "arm": name,
                    "requests": self.requests[name],
                    "prewarm_requests": self.prewarms[name],
                    "prompt_tokens": p,
                    "cached_tokens": self.cached_tokens[name],
                    "hit_rate": hit_rate(self.cached_tokens[name], p),
                    "ttft_p50_s": float(np.percentile(t, 50)) if t.size else None,
                    "ttft_p99_s": float(np.percentile(t, 99)) if t.size else None,
                })
        return rows
