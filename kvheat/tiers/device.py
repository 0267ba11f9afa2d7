"""kvheat's own device cache on top of the tiers: the tiers a spec names under it
(`tiers_for`), its evictions going down to them (`attach`), and one call allocates a request's blocks with the tiers' hits loaded into
them (`allocate`: tests, replays; the engine's scheduler calls `TierManager.lookup` and
`load` itself). `record_prompt` counts a prompt once, in the tiers' counters and the
device cache's stats (one hit rate: `kvheat.cache.hit_rate`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..cache.block import Block
from ..cache.manager import KVCacheManager, Request
from .cost import PrefillSpeed
from .loads import LoadPlan
from .manager import TierManager
from .spec import TierSpec, store_layout
from .store import DeviceBlocks, KVStore


def tiers_for(mgr: KVCacheManager, device: DeviceBlocks, spec: TierSpec, model: str = "",
              prefill_tokens_per_s: PrefillSpeed = None,
              stores: list[KVStore] | None = None) -> TierManager:
    """The tiers `spec` names under the device cache `mgr` and its pool `device`.

    `model` names the weights (KV of others is never read); `prefill_tokens_per_s`: the
    engine's prefill speed, which loads from slow tiers must beat. Entries a store kept
    from before a restart are indexed in the namespace of any tenant `mgr` knows.
    `stores`: stores made by the caller instead of the spec's (tests)."""
    return TierManager(spec, block_bytes=device.bytes_per_block, block_tokens=mgr.block_size,
                       model=model, layout=store_layout(device), policy=mgr.config.policy,
                       clock=mgr.clock, prefill_tokens_per_s=prefill_tokens_per_s,
                       device_holds=lambda key: key in mgr.cached,
                       known_namespaces=lambda: [mgr.namespace_of(t)
                                                 for t in mgr.known_tenants()],
                       stores=stores)


def attach(tiers: TierManager, mgr: KVCacheManager, device: DeviceBlocks) -> Callable[[], None]:
    """Send `mgr`'s evictions down to `tiers`, and its deletions out of them.

    A block the device evicts goes down with its KV (leaves first, so its parent is still
    cached there); one deleted on purpose (a flush, a quota cut) leaves every tier with its
    descendants. In exclusive mode a loaded block then lives on the device only. Returns
    the call that detaches them again."""
    def on_evict(b: Block) -> None:
        if tiers.stores and b.key is not None:
            parent = b.parent.key if b.parent is not None else None
            tiers.evict(b.key, mgr.namespace_of(b.tenant), b.num_tokens,
                        device.block_view(b.block_id), parent, b.tenant)

    def on_drop(b: Block) -> None:
        if tiers.stores and b.key is not None:
            tiers.drop(b.key, mgr.namespace_of(b.tenant))

    def detach() -> None:
        for listeners, fn in ((mgr.evict_listeners, on_evict), (mgr.drop_listeners, on_drop)):
            if fn in listeners:
                listeners.remove(fn)

    tiers.move_on_load = tiers.spec.mode == "exclusive"
    mgr.evict_listeners.append(on_evict)
    mgr.drop_listeners.append(on_drop)
    return detach


def prefetch(tiers: TierManager, mgr: KVCacheManager, req: Request) -> int:
    """Plan `req`'s loads when it arrives and start the slow reads; returns the tokens planned.

    The plan is kept under the request's id for `lookup` at its admission."""
    return tiers.prefetch(req.request_id, mgr.namespace_of(req.tenant), req.keys,
                          len(mgr.match_prefix(req)), req.block_tokens, owner=req.tenant)


def lookup(tiers: TierManager, mgr: KVCacheManager, req: Request, hit: int) -> LoadPlan:
    """The tiers' plan for `req` after the device's first `hit` blocks, kept under its id."""
    return tiers.lookup(mgr.namespace_of(req.tenant), req.keys, hit, req.block_tokens,
                        owner=req.tenant, request_id=req.request_id)


def allocate(tiers: TierManager, mgr: KVCacheManager, device: DeviceBlocks, req: Request,
             count_stats: bool = True) -> list[int]:
    """Allocate `req`'s device blocks with the tiers' hits loaded into them.

    Loaded tokens count as cached in `req.num_cached_tokens`. A plan that finds no free
    blocks now stays kept under the request's id (its pins and reads) for the next try.
    `count_stats`: count `req` as a whole prompt (`record_prompt`)."""
    with tiers.lower.lock:
        hit = mgr.match_prefix(req)
        plan = lookup(tiers, mgr, req, len(hit))
    table = mgr.allocate(req, matched=hit, count_stats=False)
    device_tokens = req.num_cached_tokens
    tiers.trim(plan, len(req.keys))
    n = tiers.load(plan, [b.block_id for b in req.blocks[plan.start:len(req.keys)]], device)
    loaded = plan.steps[:n]
    req.num_cached_tokens += sum(s.tokens for s in loaded)
    if count_stats:
        by_tier = {"device": device_tokens}
        for s in loaded:
            by_tier[s.name] = by_tier.get(s.name, 0) + s.tokens
        record_prompt(tiers, mgr, req.num_tokens, by_tier, len(hit) + n)
    return table


def record_prompt(tiers: TierManager, mgr: KVCacheManager, num_tokens: int,
                  cached_by_tier: Mapping[str, int], hit_blocks: int | None = None) -> None:
    """Count one prompt's hits by tier in the tiers' counters and the cache's stats.

    `cached_by_tier`: tokens served by "device" or a store's name (never a token
    recomputed); `hit_blocks`: blocks served (None: the full blocks of the tokens served)."""
    served = cached_by_tier.get("device", 0) + tiers.record_prompt(num_tokens, cached_by_tier)
    mgr.record_prompt(num_tokens, served,
                      served // mgr.block_size if hit_blocks is None else hit_blocks)


def purge(tiers: TierManager, mgr: KVCacheManager, tenant: str | None) -> dict[str, int]:
    """Delete what the tiers hold of `tenant` (a flush); returns the entries per tier.

    In a share group, only what the tenant filled."""
    shared = tenant is not None and tenant in mgr.config.share_groups
    return tiers.purge(tenant, mgr.namespace_of(tenant), shared)
