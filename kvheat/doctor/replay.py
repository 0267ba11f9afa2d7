"""What pool size would fix a capacity problem: replay the server's recent traffic.

The server keeps, per arm, a bounded record of the prompts it admitted as its cache keys
them (`RecentKeys`: the salted, chained block keys it already computed, never tokens or
text), and shows it only on the admin API (GET /admin/recent-keys). There each distinct
key becomes a small id, per answer: the ids say which prompts share which prefix blocks,
and nothing else (tenants stay apart: their keys are salted apart). `kvheat doctor` fetches
it and replays it through the real cache (`kvheat.replay`), with the arm's own eviction
policy, at the current pool size and at growing ones: one miss-ratio curve
(`kvheat.replay.curves`, LRU's exact by stack distance), its knee marked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..replay import TraceRequest
from ..replay.curves import policy_curves
from ..replay.spool import Spool
from .scrape import MAX_BYTES, TIMEOUT_S, DoctorError, fetch, loads_json

MAX_REQUESTS = 2048  # prompts kept per arm
MAX_KEYS = 65_536  # block keys kept per arm: the answer stays well under 1 MiB per arm
FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0, 8.0)
RECOVER = 0.9  # the share of the gap to an unbounded cache a recommended size must close


class RecentKeys:
    """The last admitted prompts of one arm, as block keys, bounded in prompts and keys.

    Keeping a prompt costs no hashing: the keys are the ones its request already made."""

    def __init__(self, max_requests: int = MAX_REQUESTS, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.entries: deque[tuple[float, Sequence[bytes]]] = deque(maxlen=max_requests)
        self.num_keys = 0

    def add(self, t: float, keys: Sequence[bytes]) -> None:
        """Keep one admitted prompt's keys, dropping the oldest prompts beyond the bounds."""
        ks = keys if len(keys) <= self.max_keys else keys[:self.max_keys]
        if not ks:  # shorter than a block: nothing the cache could hold
            return
        if len(self.entries) == self.entries.maxlen:
            self.num_keys -= len(self.entries[0][1])
        self.entries.append((t, ks))
        self.num_keys += len(ks)
        while self.num_keys > self.max_keys:
            self.num_keys -= len(self.entries.popleft()[1])

    def export(self) -> list[dict[str, Any]]:
        """The prompts kept, oldest first, as `{"t", "blocks"}` objects.

        `[{"t": seconds since the first, "blocks": [id, ...]}]`; an id stands for one
        distinct key within this answer only."""
        ids: dict[bytes, int] = {}
        t0 = self.entries[0][0] if self.entries else 0.0
        return [{"t": round(t - t0, 3), "blocks": [ids.setdefault(k, len(ids)) for k in ks]}
                for t, ks in self.entries]


@dataclass(frozen=True, slots=True)
class CapacityReplay:
    """One arm's prompts replayed at several pool sizes, and the size recommended."""

    arm: str
    policy: str
    block_size: int
    blocks: int  # the pool now
    requests: int
    hit_rates: dict[int, float]  # pool blocks -> replayed hit rate
    unbounded: float  # the hit rate of a cache that never evicts
    recommended: int | None  # the smallest pool that closes RECOVER of the gap
    footprint: int  # a pool this large never evicts: the replay's unbounded hit rate
    knee: int | None  # blocks where the curve reaches KNEE x unbounded (interpolated)

    @property
    def current(self) -> float:
        """The replayed hit rate at the pool's current size."""
        return self.hit_rates[self.blocks]


def recent_keys_url(admin_url: str) -> str:
    """The /admin/recent-keys URL next to the given /admin/stats (or /admin) URL."""
    base = admin_url.rstrip("/")
    for tail in ("/stats", "/arms"):
        if base.endswith(tail):
            base = base[:-len(tail)]
    return base + "/recent-keys"


def fetch_recent_keys(admin_url: str, token: str | None = None,
                      max_bytes: int = MAX_BYTES, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The server's recent-keys record (every arm's recent prompts), from its admin API."""
    url = recent_keys_url(admin_url)
    out = loads_json(fetch(url, token, max_bytes, timeout_s), url)
    if not isinstance(out, dict) or not isinstance(out.get("arms"), dict):
        raise DoctorError(f"{url}: not a recent-keys answer (no arms)")
    return out


def with_recent_keys(admin: dict[str, Any] | None, admin_url: str | None, token: str | None,
                     max_bytes: int = MAX_BYTES,
                     timeout_s: float = TIMEOUT_S) -> dict[str, Any] | None:
    """/admin/stats with the recent-keys record added as "recent_keys" (for `capacity`).

    A server without the endpoint (older) leaves it out, and the estimate is used."""
    if admin is None or not admin_url:
        return admin
    try:
        admin["recent_keys"] = fetch_recent_keys(admin_url, token, max_bytes, timeout_s)
    except DoctorError as e:
        admin["recent_keys_error"] = str(e)
    return admin


def _trace(requests: object, block_size: int) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for r in requests if isinstance(requests, list) else []:
        blocks = r.get("blocks") if isinstance(r, dict) else None
        t = r.get("t") if isinstance(r, dict) else None
        if not (isinstance(blocks, list) and blocks and isinstance(t, int | float)
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                        for b in blocks)):
            continue  # malformed: left out, never fatal
        out.append(TraceRequest(float(t) * 1000.0, len(blocks) * block_size, 0, blocks))
    return out


def replay_arm(arm: str, record: dict[str, Any],
               factors: Sequence[float] = FACTORS) -> CapacityReplay | None:
    """Replay one arm's record at its pool size and at each factor of it.

    None when the record is empty or malformed. The replay runs one prompt at a time and
    holds the prompts' full blocks only (not the decoded ones, nor the blocks of requests in
    flight), so its hit rate at the current size can be above the server's: compare sizes
    with it, not with /metrics."""
    bs, blocks, policy = record.get("block_size"), record.get("blocks"), record.get("policy")
    if not (isinstance(bs, int) and bs > 0 and isinstance(blocks, int) and blocks > 0
            and isinstance(policy, str)):
        return None
    trace = _trace(record.get("requests"), bs)
    if not trace:
        return None
    spool = Spool.build(trace, bs)
    try:
        footprint = spool.footprint_blocks()
        sizes = sorted({blocks, *(max(int(blocks * f), blocks + 1) for f in factors)})
        grid = sorted({*sizes, footprint})  # the footprint: where the curve ends
        try:
            (curve,) = policy_curves(spool, [policy], [n * bs for n in grid])
        except ValueError:  # a policy this doctor does not know
            return None
        unbounded = spool.infinite_hit_rate()
    finally:
        spool.close()
    rates = {n: p.hit_rate for n, p in zip(grid, curve.points) if n in sizes}
    gap = unbounded - rates[blocks]
    ok = [n for n in sizes if rates[n] >= rates[blocks] + RECOVER * gap]
    knee = -(-curve.knee_tokens // bs) if curve.knee_tokens is not None else None
    return CapacityReplay(arm, policy, bs, blocks, len(trace), rates, unbounded,
                          min(ok) if ok and gap > 0 else None, footprint, knee)


def replay_all(recent: dict[str, Any]) -> list[CapacityReplay]:
    """`replay_arm` of every arm of a recent-keys record that can be replayed."""
    arms = recent.get("arms")
    out = [replay_arm(str(a), r) for a, r in (arms.items() if isinstance(arms, dict) else [])
           if isinstance(r, dict)]
    return [r for r in out if r is not None]
