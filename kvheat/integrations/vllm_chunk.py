"""One vLLM offload chunk as kvheat sees it, and where it sits in its request's prefix.

`Chunk` is both a kvheat `Node` (what `KVHeat` and its heap read) and the chunk's
`ChunkStatus` (what vLLM's manager reads and writes through the policy's `get`), so each
stored chunk is one long-lived object. `Placement` gives each inserted chunk the depth and
parent kvheat's extension rule needs, from the key positions vLLM's scheduler records in
the storing request's `ReqContext`. Imports vLLM only for its types.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.request import Request, RequestStatus

from ..cache.hints import SESSION_PARAM, Outcome, check_reason
from ..cache.node import Node, PolicyRecord
from ..heat.penalties import EXTENSION, FRESH

# Where a vLLM request names its session: a key of its `kv_transfer_params` (the OpenAI
# body's field, passed through by vLLM), or an action of its `kv_hints` envelope.
SESSION_ACTION = "kvheat.session"
MAX_SESSION_CHARS = 256


class RequestHints:
    """A vLLM request's hints for the heat policy, parsed once and kept in its ReqContext."""

    __slots__ = ("session", "outcome", "reason")

    def __init__(self, session: str | None = None) -> None:
        self.session = session
        self.outcome = Outcome.FINISHED
        self.reason: str | None = None


def _session_of(ctx: ReqContext) -> str | None:
    """The session the request names (`SESSION_PARAM`, else a `SESSION_ACTION` action's
    `session_id`), or None; a value that is not a string of 1-256 characters is ignored
    (a hint, never a reason to fail the request)."""
    found: object = None
    params = ctx.kv_transfer_params
    if isinstance(params, dict):
        found = params.get(SESSION_PARAM)
    if found is None and ctx.kv_hints is not None:
        for action in ctx.kv_hints.actions:
            if action.action_type == SESSION_ACTION and isinstance(action.payload, dict):
                found = action.payload.get("session_id")
                break
    if isinstance(found, str) and 0 < len(found) <= MAX_SESSION_CHARS:
        return found
    return None


def request_hints(ctx: ReqContext) -> RequestHints:
    """The request's hints (parsed at its first call, then read from its context)."""
    h = ctx.get_state(RequestHints)
    if h is None:
        h = RequestHints(_session_of(ctx))
        ctx.set_state(h)
    return h


def record_outcome(ctx: ReqContext, outcome: Outcome | str,
                   reason: str | None = None) -> None:
    """Record how the request ended, for the policy's `on_request_finished`.

    vLLM 0.32 does not tell a cache policy: a connector's `request_finished` records it from
    vLLM's `Request` (an aborted request: CANCELLED; else FINISHED with its finish reason)."""
    h = request_hints(ctx)
    h.outcome = Outcome.parse(outcome)
    h.reason = check_reason(reason)


def request_end(request: Request) -> tuple[Outcome, str | None]:
    """How a finished vLLM `Request` ended, for `record_outcome`.

    Aborted (the client went away) is CANCELLED with reason "abort", as kvheat's server
    records a cancel; any other end is FINISHED with vLLM's finish reason ("stop", "length",
    "error", "repetition")."""
    if request.status == RequestStatus.FINISHED_ABORTED:
        return Outcome.CANCELLED, "abort"
    reason = request.get_finished_reason()
    return Outcome.FINISHED, str(reason) if reason is not None else None


class Chunk(Node, PolicyRecord):
    """A node KVHeat orders, standing for one vLLM offload chunk, and that chunk's status too.

    It has `ChunkStatus`'s `ref_cnt` (-1 while being written), `chunk_id` and `is_ready`,
    and `get` / `evict` hand it to the manager in place of the `ChunkStatus` it inserted
    (vLLM's manager reads and writes a stored chunk only through `get`). One long-lived
    object per chunk instead of two: fewer objects for the garbage collector to promote and
    scan. kvheat's heap reads the same `ref_cnt` (non-zero: skip, as vLLM's rule)."""

    # count, last, gen, flags, gap: KVHeat's per-block record, kept on the chunk itself (`rec`
    # is the chunk, a `PolicyRecord` with HeatRecord's fields): no second object per
    # stored chunk for the collector. The cycle `rec` makes lasts while the chunk is
    # cached (it is alive then anyway): evict, remove and clear break it, so a chunk that
    # leaves is freed by its refcount.
    __slots__ = ("chunk_id", "w_ins", "w_load", "pos", "stored", "count", "last", "gen",
                 "flags", "gap")
    pos: int  # its end token in the storing request (`Placement.place`)
    count: float
    last: float
    gen: int
    flags: int
    gap: float

    def __init__(self, key: OffloadKey, status: ChunkStatus) -> None:
        # on_insert fills the record: `rec` is the chunk, with HeatRecord's fields.
        super().__init__()
        self.chunk_id = status.chunk_id
        self.key = key
        self.num_tokens = 1  # vLLM offloads whole chunks only: no partial-tail demotion
        self.ref_cnt = status.ref_cnt
        self.w_ins = 0.0  # weight of the insert's access while the storing request runs
        self.w_load = 0.0  # weight of an early hit (a load began) not yet claimed
        self.stored = False  # its store completed: a later mark_evictable ends a load
        self.gap = 0.0
        self.rec = self  # a slot, not a property: KVHeat reads it at every access

    @property
    def is_ready(self) -> bool:
        """Whether the chunk is written and may be read (`ref_cnt` >= 0)."""
        return self.ref_cnt >= 0


class KnownPrefix(Node):
    """A stand-in parent for a chunk whose predecessor this request did not store.

    The cache knew that prefix before (vLLM stores a request's chunks head-to-tail)."""

    __slots__ = ()

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.inserted_at = -math.inf  # never inserted with the chunk under it


_KNOWN_ROOT, _KNOWN = KnownPrefix(0), KnownPrefix(1)


class _Stores:
    """Per request (kept in its ReqContext): the last chunk it inserted, per KV group."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        # KV group (the key's last 4 bytes, as vLLM packs it) -> the last chunk inserted
        # (a chunk's `pos` is its end token, set when it is recorded here)
        self.last: dict[bytes, Chunk] = {}


class Placement:
    """Depth and parent of each chunk the storing request inserts.

    `begin` names the request at its store misses, `place` each chunk as it is inserted."""

    __slots__ = ("ctx", "pos", "stores", "chunk_tokens")

    def __init__(self) -> None:
        self.ctx: ReqContext | None = None  # the request whose store misses come next
        self.pos: Callable[[OffloadKey], int | None] | None = None  # its key -> end token
        self.stores: _Stores | None = None
        self.chunk_tokens = 0  # tokens per chunk: gcd of the positions seen

    def begin(self, ctx: ReqContext) -> None:
        """Name the request whose chunks are inserted next."""
        self.ctx = ctx
        self.stores = None
        positions = getattr(ctx, "_offload_key_positions", None)
        self.pos = positions.get if isinstance(positions, dict) else (
            ctx.get_offload_key_position)

    def place(self, c: Chunk) -> None:
        """Set `c`'s depth from its position in the storing request, and its parent.

        The parent is a stand-in that gives KVHeat's extension rule the answer kvheat's own
        cache would: a chunk after this request's previous new chunk inherits that chunk's
        flag; one after a chunk the request did not store extends a prefix known before it."""
        key = c.key
        assert key is not None  # a chunk is placed as it is inserted, under its key
        pos = self.pos(OffloadKey(key)) if self.pos is not None else None
        if pos is None or pos <= 0:
            c.depth = -1  # unknown: neither a root nor the key naming a conversation
            return
        tpc = math.gcd(self.chunk_tokens, pos)
        self.chunk_tokens = tpc
        c.depth = depth = pos // tpc - 1
        stores = self.stores
        if stores is None:
            ctx = self.ctx
            assert ctx is not None  # `begin` named the storing request
            stores = ctx.get_state(_Stores)
            if stores is None:
                stores = _Stores()
                ctx.set_state(stores)
            self.stores = stores
        group = key[-4:]
        last = stores.last
        prev = last.get(group)
        c.pos = pos
        last[group] = c
        if depth == 0:
            return
        if prev is not None and prev.pos == pos - tpc:
            p = prev
            # New in this request: inherit its flag; back from the ghost: a known prefix.
            known = bool(p.flags & EXTENSION) or (not p.flags & FRESH and p.depth >= 1)
            c.parent = _KNOWN if known else _KNOWN_ROOT
        else:
            c.parent = _KNOWN if depth > 1 else _KNOWN_ROOT
