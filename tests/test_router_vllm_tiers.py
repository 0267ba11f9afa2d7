"""`kvheat route` in front of vLLM replicas that run KVHeatConnector: the connector's tier
events reach the router through vLLM's own publisher (vLLM publishes what its connector's
`take_events` returns in the same batches as its pool's), shaped as the connector emits
them (vLLM's block hashes, the parent's hash, token ids, the first block's extra keys with
the cache salt, medium / locality / ownership from `kvevents.schema.tier_place`); the index
places them on the replica's lower tier or the shared tier, and the kvheat policy counts
them as held at that tier's efficiency, after the device prefix."""

from __future__ import annotations

import time

import pytest
from conftest import vllm_events_index, wait_for

from kvheat.cache.hashing import block_keys, root_key
from kvheat.kvevents import BlockRemoved, BlockStored, KVEventBatch
from kvheat.kvevents.schema import tier_place
from kvheat.router.index import PrefixIndex
from kvheat.router.routing import KVHeatRouting, KVHeatRoutingConfig, ReplicaState, RouteRequest

BS = 32
SALT = "tenant:acme"
TOKENS = list(range(500, 500 + 4 * BS))


def gpu_store(hashes: list[int], parent: int | None, toks: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[(SALT,)] + [None] * (len(hashes) - 1)
                       if parent is None else None)


def tier_store(tier: str, h: int, parent: int | None, i: int) -> BlockStored:
    """One block entering a tier, as the connector reports it (one event per block)."""
    medium, locality, ownership = tier_place(tier)
    return BlockStored(block_hashes=[h], parent_block_hash=parent,
                       token_ids=TOKENS[i * BS:(i + 1) * BS], block_size=BS, lora_id=None,
                       medium=medium, lora_name=None,
                       extra_keys=[(SALT,)] if parent is None else [None],
                       locality=locality, ownership=ownership)


def tier_removed(tier: str, h: int) -> BlockRemoved:
    medium, locality, ownership = tier_place(tier)
    return BlockRemoved(block_hashes=[h], medium=medium, locality=locality,
                        ownership=ownership)


def want() -> list[bytes]:
    return block_keys(TOKENS, BS, root_key(SALT))[0]


def test_blocks_in_a_vllm_replicas_tiers_are_indexed_by_place() -> None:
    ix = PrefixIndex()
    ix.add_replica("v", foreign_hashes=True)
    ix.add_replica("w", foreign_hashes=True)
    # vLLM computed 4 blocks; its connector saved them to the host tier, the last two to
    # Redis as well; then vLLM's pool evicted blocks 2 and 3.
    ix.apply("v", KVEventBatch(ts=0, events=[
        gpu_store([11, 12, 13, 14], None, TOKENS),
        *[tier_store("host", h, h - 1 if i else None, i) for i, h in enumerate([11, 12, 13, 14])],
        tier_store("redis", 13, 12, 2), tier_store("redis", 14, 13, 3),
        BlockRemoved(block_hashes=[13, 14], medium="GPU")]))
    m = ix.match(want(), [BS] * 4, ["v", "w"])
    assert (m[0].device_blocks, m[0].local_blocks, m[0].shared_blocks) == (2, 2, 0)
    # The shared tier serves every replica: w holds nothing itself, but Redis has 2 and 3
    # only after a prefix w lacks, so w's match is empty; a replica is charged its own
    # misses first.
    assert m[1].blocks == 0
    # The host tier loses block 3: the replica's local run stops at block 2, Redis follows.
    ix.apply("v", KVEventBatch(ts=0, events=[tier_removed("host", 14)]))
    m = ix.match(want(), [BS] * 4, ["v"])[0]
    assert (m.device_blocks, m.local_blocks, m.shared_blocks) == (2, 1, 1)
    # A tier store of another tenant's salt never matches acme's prompt.
    other = block_keys(TOKENS, BS, root_key("tenant:globex"))[0]
    assert ix.match(other, [BS] * 4, ["v"])[0].blocks == 0


def test_the_kvheat_policy_prefers_a_tier_hit_and_charges_it_the_tiers_cost() -> None:
    ix = PrefixIndex()
    for name in ("gpu", "host", "redis-only", "none"):
        ix.add_replica(name, foreign_hashes=True)
    hashes = [21, 22, 23, 24]
    ix.apply("gpu", KVEventBatch(ts=0, events=[gpu_store(hashes, None, TOKENS)]))
    ix.apply("host", KVEventBatch(ts=0, events=[
        tier_store("host", h, h - 1 if i else None, i) for i, h in enumerate(hashes)]))
    cfg = KVHeatRoutingConfig()
    pol = KVHeatRouting(ix, cfg)
    req = RouteRequest(want(), [BS] * 4, 4 * BS + 10)
    reps = [ReplicaState(n) for n in ("none", "host", "gpu")]
    d = pol.choose(req, reps)
    assert reps[d.replica].name == "gpu"
    assert d.scores == [0.0, cfg.local_tier_efficiency * 4 * BS, 4.0 * BS]
    # Without the device copy, the host tier's copy wins over a replica with nothing.
    d = pol.choose(req, [ReplicaState(n) for n in ("none", "host")])
    assert d.replica == 1 and d.expected_hit_tokens == 4 * BS
    # A block only in the shared tier counts for every replica, at the shared tier's cost.
    ix.apply("redis-only", KVEventBatch(ts=0, events=[
        tier_store("redis", h, h - 1 if i else None, i) for i, h in enumerate(hashes)]))
    d = pol.choose(req, [ReplicaState(n) for n in ("none", "host")])
    assert d.scores == [cfg.shared_tier_efficiency * 4 * BS, cfg.local_tier_efficiency * 4 * BS]


@pytest.mark.vllm
def test_connector_events_reach_the_index_through_vllms_own_publisher() -> None:
    """vLLM's ZmqEventPublisher (what `--kv-events-config` starts) carrying one step's
    batch: its pool's stores, then the connector's tier events, as the scheduler joins
    them (`kv_cache_manager.take_events()` + `connector.take_events()`)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    with vllm_events_index(kv) as (pub, ix):
        medium, locality, ownership = tier_place("host")
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None,
                           token_ids=TOKENS[:2 * BS], block_size=BS, lora_id=None,
                           medium="GPU", lora_name=None, extra_keys=[(SALT,), None]),
            *[kv.BlockStored(block_hashes=[h], parent_block_hash=p,
                             token_ids=TOKENS[i * BS:(i + 1) * BS], block_size=BS,
                             lora_id=None, medium=medium, lora_name=None,
                             extra_keys=[(SALT,)] if p is None else [None],
                             locality=locality, ownership=ownership)
              for i, (h, p) in enumerate([(b"h1", None), (b"h2", b"h1")])],
            kv.BlockRemoved(block_hashes=[b"h2"], medium="GPU")]))
        ks = want()[:2]
        assert wait_for(lambda: ix.match(ks, [BS] * 2, ["v"])[0].local_blocks == 1)
        m = ix.match(ks, [BS] * 2, ["v"])[0]
        assert (m.device_blocks, m.local_blocks) == (1, 1)
