"""The block cache's request lifecycle, tenant isolation and error handling."""

from __future__ import annotations

import pytest

from kvheat.cache import (
    CacheConfig,
    CacheError,
    KVCacheManager,
    OutOfBlocks,
    PromptTooLong,
    UnknownRequest,
)
from kvheat.cache.tenants import TenantPartitions


def mgr(num_blocks: int = 16, block_size: int = 4, **kw) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=block_size, **kw))


def test_resubmitted_prompt_reuses_every_full_block() -> None:
    m = mgr()
    toks = list(range(10))  # 2 full blocks + 2 tokens
    r1 = m.make_request("r1", toks)
    t1 = m.allocate(r1)
    assert r1.num_cached_tokens == 0
    m.free(r1)
    r2 = m.make_request("r2", toks)
    table = m.allocate(r2)
    assert r2.num_cached_tokens == 8  # the partial last block is never shared
    assert table[:2] == t1[:2]
    assert m.stats.hit_tokens == 8 and m.stats.query_tokens == 20
    m.check_invariants()


def test_next_turn_reuses_prompt_and_decoded_tokens() -> None:
    m = mgr(block_size=4)
    turn1 = [1, 2, 3, 4, 5, 6]
    r1 = m.make_request("t1", turn1, session="s")
    m.allocate(r1)
    m.append_tokens(r1, [7, 8, 9, 10])  # the model's answer fills blocks 2 and 3
    m.check_invariants()
    m.free(r1)
    turn2 = turn1 + [7, 8, 9, 10] + [11, 12, 13]
    r2 = m.make_request("t2", turn2, session="s")
    m.allocate(r2)
    assert r2.num_cached_tokens == 8  # blocks [1..4] and [5..8] (the second filled by decode)


def test_concurrent_requests_share_blocks_and_refcounts() -> None:
    m = mgr()
    a = m.make_request("a", list(range(8)) + [50])
    b = m.make_request("b", list(range(8)) + [60])
    m.allocate(a)
    m.allocate(b)
    assert a.blocks[:2] == b.blocks[:2]
    assert [x.ref_cnt for x in a.blocks[:2]] == [2, 2]
    m.free(a)
    assert [x.ref_cnt for x in b.blocks[:2]] == [1, 1]
    m.free(b)
    m.check_invariants()


def test_tenants_never_share_unless_configured() -> None:
    m = mgr(share_groups={"x": "team", "y": "team"})
    toks = list(range(8))
    for tenant in ("a", "b"):
        r = m.make_request(f"{tenant}1", toks, tenant=tenant)
        m.allocate(r)
        assert r.num_cached_tokens == 0, "a tenant hit another tenant's blocks"
        m.free(r)
    assert m.match_tokens(toks, tenant="a") == 8
    assert m.match_tokens(toks, tenant="c") == 0
    assert m.match_tokens(toks, tenant=None) == 0
    rx = m.make_request("x1", toks, tenant="x")
    m.allocate(rx)
    m.free(rx)
    assert m.match_tokens(toks, tenant="y") == 8  # x and y are configured to share
    assert m.match_tokens(toks, tenant="x", lora="adapter1") == 0  # LoRA id is a key too


def test_hash_collision_is_a_miss_not_wrong_kv() -> None:
    m = mgr()
    r = m.make_request("r", list(range(8)))
    m.allocate(r)
    m.free(r)
    # Forge a collision: another prompt whose first key equals r's but whose tokens differ.
    forged = m.make_request("f", [9, 9, 9, 9, 4, 5, 6, 7])
    forged.keys[0] = r.keys[0]
    assert m.match_prefix(forged) == []
    assert m.stats.collisions == 1


def test_errors_are_clear_and_leave_the_pool_intact() -> None:
    m = mgr(num_blocks=4)
    with pytest.raises(ValueError, match="token id"):
        m.make_request("neg", [1, -2, 3])
    with pytest.raises(ValueError, match="not an integer"):
        m.make_request("str", [1, "x", 3])  # type: ignore[list-item]
    big = m.make_request("big", list(range(17)))
    with pytest.raises(PromptTooLong, match="pool has 4 blocks"):
        m.allocate(big)
    with pytest.raises(UnknownRequest):
        m.free("nobody")
    held = m.make_request("held", list(range(12)))
    m.allocate(held)
    other = m.make_request("other", [100 + i for i in range(8)])
    before = (m.num_free, dict(m.cached), m.num_referenced)
    with pytest.raises(OutOfBlocks):
        m.allocate(other)
    assert (m.num_free, dict(m.cached), m.num_referenced) == before
    with pytest.raises(CacheError, match="already holds"):
        m.allocate(held)
    with pytest.raises(OutOfBlocks):
        m.append_tokens(held, list(range(20)))
    assert held.num_tokens == 12
    m.check_invariants()
    m.free(held)
    m.allocate(other)  # fits now
    m.check_invariants()


def test_eviction_is_leaf_first_and_skips_referenced_blocks() -> None:
    m = mgr(num_blocks=4, block_size=2)
    chain = m.make_request("chain", [1, 1, 2, 2, 3, 3])
    m.allocate(chain)
    m.free(chain)
    pinned = m.make_request("pinned", [1, 1, 2, 2])  # references the first two blocks
    m.allocate(pinned)
    assert m.evict(10) == 1  # only the leaf [3, 3] can go
    assert m.match_tokens([1, 1, 2, 2, 3, 3]) == 4
    m.free(pinned)
    assert m.evict(10) == 2
    assert m.num_cached == 0 and m.num_free == 4


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        CacheConfig(num_blocks=0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        mgr(policy="random-guess")


def fill(m: KVCacheManager, tenant: str, n_prompts: int, base: int) -> None:
    for i in range(n_prompts):
        r = m.make_request(f"{tenant}{base + i}", [base + i] * 4, tenant=tenant)
        m.allocate(r)
        m.free(r)


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc"])
def test_tenant_over_quota_evicts_its_own_blocks(policy: str) -> None:
    m = mgr(num_blocks=8, policy=policy)
    fill(m, "a", 4, 100)  # a caches 4 blocks
    m.set_tenant_quota("b", 2)
    fill(m, "b", 4, 200)  # 4 free blocks, then the pool is full
    assert m.tenant_usage("a") == 4 and m.tenant_usage("b") == 4
    fill(m, "b", 3, 300)  # b is over its quota: only b's blocks may go
    assert m.tenant_usage("a") == 4 and m.tenant_usage("b") == 4
    for i in range(4):
        assert m.match_tokens([100 + i] * 4, tenant="a") == 4
    m.check_invariants()


def test_contended_pool_takes_from_tenants_over_quota_first() -> None:
    m = mgr(num_blocks=8)
    m.set_tenant_quota("big", 2)
    fill(m, "big", 6, 100)
    fill(m, "small", 2, 200)  # the pool is full; big is over its quota of 2
    fill(m, "small", 2, 300)  # small needs blocks: they come from big
    assert m.tenant_usage("small") == 4 and m.tenant_usage("big") == 4
    assert m.match_tokens([200] * 4, tenant="small") == 4
    m.set_tenant_quota("big", None)  # lifting the quota puts big's blocks back in common
    assert not m.tenants.partitions
    m.check_invariants()


def test_the_pool_runs_tenant_partitions_only_while_a_quota_is_set() -> None:
    # Without quotas the pool runs the shared policy itself (no routing on its path);
    # with one, a single TenantPartitions policy that routes each block to its owner's.
    m = mgr(num_blocks=8)
    shared = m.policy
    assert m.pool.policy is shared
    m.set_tenant_quota("a", 2)
    assert isinstance(m.pool.policy, TenantPartitions) and m.policy is shared
    fill(m, "a", 3, 100)  # free blocks are anyone's; its cached ones sit in its partition
    assert m.tenant_usage("a") == 3 and len(m.tenants.partitions["a"].q) == 3
    assert len(shared.q) == 0
    m.set_tenant_quota("a", None)
    assert m.pool.policy is shared and len(shared.q) == 3
    m.check_invariants()


def test_quota_that_cannot_be_met_fails_cleanly() -> None:
    m = mgr(num_blocks=8)
    m.set_tenant_quota("a", 2)
    fill(m, "x", 6, 100)
    held = m.make_request("h", [1] * 8, tenant="a")
    m.allocate(held)  # a takes the 2 free blocks and now holds its whole quota
    more = m.make_request("m", [2] * 8, tenant="a")
    with pytest.raises(OutOfBlocks, match="quota"):
        m.allocate(more)
    assert "m" not in m.requests and m.tenant_usage("x") == 6
    m.check_invariants()
    with pytest.raises(ValueError):
        m.set_tenant_quota("a", 0)


def test_pin_flush_and_unpin() -> None:
    m = mgr(num_blocks=8)
    sys_prompt = list(range(8))
    r = m.make_request("r", sys_prompt + [99], tenant="t")
    m.allocate(r)
    m.free(r)
    assert m.pin_prefix(sys_prompt, tenant="t") == 8
    assert m.pin_prefix(sys_prompt, tenant="t") == 8  # idempotent
    assert m.pin_prefix(sys_prompt, tenant="other") == 0
    fill(m, "t", 10, 100)  # heavy traffic cannot push the pinned prefix out
    assert m.flush_tenant("t") > 0
    assert m.match_tokens(sys_prompt, tenant="t") == 8
    assert [p[2] for p in m.pinned()] == [8]
    assert m.unpin_prefix(sys_prompt + [5, 5, 5, 5], tenant="t") == 8
    assert m.flush_tenant("t") == 2
    assert m.match_tokens(sys_prompt, tenant="t") == 0
    m.check_invariants()


def test_blocks_after_a_recomputed_last_block_are_still_cached() -> None:
    """A fully cached prompt recomputes its last block as a private copy (for the last
    token's logits); the blocks decoded after it must still be cached for the next turn."""
    m = mgr(block_size=4)
    prompt = list(range(8))
    first = m.make_request("first", prompt)
    m.allocate(first)
    m.free(first)
    again = m.make_request("again", prompt)
    hits = m.match_prefix(again)
    assert len(hits) == 2
    m.allocate(again, hits[:-1])  # the engine reruns the last cached block
    assert again.blocks[1].key is None  # a private copy
    m.append_tokens(again, [50, 51, 52, 53])
    m.free(again)
    assert m.match_tokens(prompt + [50, 51, 52, 53]) == 12
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc", "twoq", "s3fifo", "lfu"])
def test_discard_uncaches_blocks_whose_kv_was_never_written(policy: str) -> None:
    m = mgr(num_blocks=8, policy=policy)
    evicted: list[int] = []
    m.evict_listeners.append(lambda b: evicted.append(b.block_id))
    base = list(range(8))  # two full blocks, written by a request still running
    m.allocate(m.make_request("a", base))
    toks = base + list(range(100, 110))  # + two full blocks and two tokens
    r = m.make_request("r", toks)
    table = m.allocate(r)
    assert m.num_cached == 4
    with pytest.raises(CacheError):  # the shared prefix is not this request's to drop
        m.discard(r, 1)
    assert m.num_cached == 4
    m.free("a")
    assert m.discard(r, 2) == 2  # the step that was to write blocks 2 and 3 failed
    assert m.num_cached == 2 and r.block_table == table
    m.check_invariants()
    m.free(r)
    assert evicted == []  # never-written KV is not demoted to a lower tier
    assert m.num_free == 6 and m.num_cached == 2
    again = m.make_request("again", toks)
    m.allocate(again)
    assert again.num_cached_tokens == 8  # only the written prefix is found
    m.check_invariants()
    with pytest.raises(UnknownRequest):
        m.discard(r, 0)
