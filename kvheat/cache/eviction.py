"""The eviction-policy interface the block cache runs, and the policy registry.

The cache calls these hooks and never knows which policy it runs. Candidates for eviction
are cached blocks with refcount 0; only leaves among them (no cached child) may go. A
policy keeps candidates in its own queues; when the block at the cold end of a queue is
not evictable (still referenced, or a parent of cached blocks) it is *parked*: taken out of
the queue and put back at the cold end once it becomes evictable, since it was the coldest
when met. Every hook is O(1) per block.

Policies register by name (`register_policy`). Those of other packages (kvheat's own heat
policies included: `kvheat.heat` depends on this package, not the reverse) are plugins,
imported the first time `make_policy` or `policy_names` meets a name it does not know: the
modules named in the entry-point group `kvheat.policies` (pyproject.toml), then kvheat's
own `_BUILTIN_PLUGINS` (so a source checkout that was not reinstalled finds them too).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from .hints import Outcome
from .node import Node, NodeQueue

# Where heap-ordered policies park an unevictable block they met: a marker, never filled
# (such a policy pushes the block back into its heap once it is evictable again).
PARKED = NodeQueue("parked")


class EvictionPolicy:
    """The hooks the cache calls on an eviction policy, each a no-op until overridden.

    A policy overrides the hooks it uses and `victim`, which the base does not give."""

    name = "base"
    needs_future = False  # offline policies (Belady) need the replayer's oracle

    def __init__(self) -> None:
        self.capacity = 0

    def bind(self, capacity_blocks: int) -> None:
        """Size the policy for a cache of `capacity_blocks` blocks."""
        self.capacity = capacity_blocks

    # Hooks, called by the cache. `now` is the cache clock (seconds).
    def on_insert(self, b: Node, now: float) -> None:
        """`b` was just filled and cached; it is referenced by the request that made it."""

    def on_hit(self, b: Node, now: float) -> None:
        """`b` was reused by a request's prefix match."""

    def on_acquire(self, b: Node) -> None:
        """Refcount went 0 -> 1."""

    def on_release(self, b: Node, now: float) -> None:
        """Refcount went to 0; called tail-first over a request, so parents come last."""
        self._unpark(b)

    # Batched forms, for policies that can do a request's blocks faster in one call. The
    # cache uses them only where a policy overrides them, and then calls them after the
    # refcounts of all the blocks have changed.
    def on_acquire_all(self, blocks: list[Node]) -> None:
        """`on_acquire` of each block of a cached prefix, in order."""
        for b in blocks:
            self.on_acquire(b)

    def on_release_all(self, blocks: list[Node], now: float) -> None:
        """`on_release` of each block, tail-first as given."""
        for b in blocks:
            self.on_release(b, now)

    def on_leaf(self, b: Node) -> None:
        """`b` (refcount 0) lost its last cached child and may now be evicted."""
        self._unpark(b)

    # Request hints (`kvheat.cache.hints`). The cache calls these only for a request that
    # carries a hint (a session, a cancellation, a finish reason, a queue entry), so a
    # policy that keeps the no-op defaults decides exactly as without hints.
    def on_session(self, session: str, now: float) -> None:
        """Mark the blocks hit and inserted next as a request of `session`.

        Those are the `on_hit`/`on_acquire` and `on_insert` calls until the next
        `on_session`: it is called before the request's cached prefix is acquired and
        before blocks it decodes are cached."""

    def on_finish(self, blocks: Sequence[Node], session: str | None, outcome: Outcome,
                  reason: str | None, now: float) -> None:
        """Tell the policy that a request ended, before its blocks are released.

        `outcome` is how it ended, `reason` the model's finish reason when known.
        `blocks` are those it held, in prefix order, a block with key None being private
        (it leaves uncached); their `on_release` comes after."""

    def on_queue(self, request_id: str, keys: Sequence[bytes], session: str | None) -> None:
        """Tell the policy which blocks a request waiting for admission will need.

        `keys` are its blocks' keys in prefix order, cached or not; they hold until
        `on_dequeue(request_id)`. Queuing an id again replaces its keys (the cache calls
        `on_dequeue` first)."""

    def on_dequeue(self, request_id: str) -> None:
        """The queued request was admitted, cancelled or dropped."""

    def victim(self) -> Node | None:
        """Remove and return an evictable block, or None when there is none."""
        raise NotImplementedError

    def victim_for(self, owner: str | None) -> Node | None:
        """The next victim, to make room for a block `owner` will hold.

        The base gives `victim`; a policy that keeps owners apart
        (`kvheat.cache.tenants.TenantPartitions`) chooses by `owner`."""
        return self.victim()

    def on_evict(self, b: Node) -> None:
        """`b` leaves the cache (its key is still set): ghost lists record it here."""

    def forget(self, b: Node) -> None:
        """Drop every trace of `b` from this policy, without a ghost.

        For a block that moves to another tenant's policy, is flushed, or was never
        computed."""
        if b.queue is not None:
            b.queue.remove(b)
        b.parked = None

    # Shared helpers.
    @staticmethod
    def _unpark(b: Node) -> None:
        q = b.parked
        if q is not None and b.ref_cnt == 0 and b.num_children == 0:
            b.parked = None
            q.appendleft(b)

    @staticmethod
    def _pop_evictable(q: NodeQueue) -> Node | None:
        """Pop the coldest evictable block of `q`, parking the unevictable ones met first."""
        end = q.end
        b = end.next
        while b is not end:
            nxt = b.next
            q.remove(b)
            if b.ref_cnt == 0 and b.num_children == 0:
                return b
            b.parked = q
            b = nxt
        return None

    def stats(self) -> dict[str, float]:
        """The policy's own counters, for reports and metrics (none by default)."""
        return {}


PolicyFactory = Callable[..., EvictionPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}
PLUGIN_GROUP = "kvheat.policies"
_BUILTIN_PLUGINS = ("kvheat.heat.policies",)
_plugins_loaded = False


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Decorate a policy class (or factory) to register it under `name`."""
    def deco(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_plugins() -> None:
    """Import every plugin module once; each registers its policies on import."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=PLUGIN_GROUP):
        ep.load()
    for module in _BUILTIN_PLUGINS:
        importlib.import_module(module)


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    """A new policy of the registered `name`, built with `kwargs`."""
    if name not in _REGISTRY:
        _load_plugins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)


def policy_names() -> list[str]:
    """The names of every registered policy, plugins included, sorted."""
    _load_plugins()
    return sorted(_REGISTRY)
