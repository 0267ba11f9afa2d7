"""Random interleavings of allocate / match / append / free / evict / touch across tenants,
for every online policy: the pool stays consistent and every hit serves the right KV."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvheat.cache import CacheConfig, KVCacheManager, OutOfBlocks, PromptTooLong

BLOCK = 4
POOL = 24
TENANTS = ["a", "b", "c"]
# A few shared prefixes so requests really share blocks.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5], []]


def snapshot(m: KVCacheManager) -> tuple:
    return (m.num_free, sorted(m.cached), [b.ref_cnt for b in m.blocks], m.num_referenced)


class CacheMachine(RuleBasedStateMachine):
    policy = "lru"
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        # Tenants b and c are configured to share; a is isolated.
        self.m = KVCacheManager(CacheConfig(num_blocks=POOL, block_size=BLOCK, policy=self.policy,
                                            share_groups={"b": "shared", "c": "shared"}),
                                clock=self._now)
        self.kv: dict[int, tuple[int, ...]] = {}  # what the test "wrote" into each block
        self.tokens: dict[str, list[int]] = {}
        self.n = 0
        self.m.evict_listeners.append(self._on_evict)

    def _now(self) -> float:
        self.clock += 1.0
        return self.clock

    def _on_evict(self, b) -> None:
        assert b.ref_cnt == 0, "evicted a referenced block"
        assert b.num_children == 0, "evicted a block whose child is cached"

    def _check_hits(self, req, tokens: list[int], n_hit_blocks: int) -> None:
        for i, b in enumerate(req.blocks[:n_hit_blocks]):
            assert self.kv[b.block_id] == tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), "hit served wrong KV"
            assert self.m.salt_of(b.tenant) == self.m.salt_of(req.tenant), "cross-tenant hit"

    def _write(self, req, tokens: list[int], start_block: int) -> None:
        for i in range(start_block, len(req.blocks)):
            self.kv[req.blocks[i].block_id] = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])

    @rule(target=requests, tenant=st.sampled_from(TENANTS), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 6), max_size=30))
    def allocate(self, tenant, prefix, suffix):
        tokens = prefix + suffix
        if not tokens:
            tokens = [0]
        self.n += 1
        rid = f"r{self.n}"
        req = self.m.make_request(rid, tokens, tenant=tenant)
        before = snapshot(self.m)
        try:
            hits = self.m.match_prefix(req)
            self.m.allocate(req, hits)
        except (OutOfBlocks, PromptTooLong):
            if not self.m.quotas:
                assert snapshot(self.m) == before, "a failed allocate changed the pool"
            else:  # a tenant held to its quota may have evicted its own blocks first
                assert rid not in self.m.requests and self.m.num_referenced == before[3]
            return None
        assert req.num_cached_tokens == len(hits) * BLOCK
        self._check_hits(req, tokens, len(hits))
        self._write(req, tokens, len(hits))
        self.tokens[rid] = tokens
        return req

    @rule(req=requests, extra=st.lists(st.integers(0, 6), min_size=1, max_size=9))
    def append(self, req, extra):
        if req is None or req.request_id not in self.m.requests:
            return
        before = snapshot(self.m)
        n_before = len(req.blocks)
        try:
            self.m.append_tokens(req, extra)
        except OutOfBlocks:
            if not self.m.quotas:
                assert snapshot(self.m) == before
            assert len(req.blocks) == n_before and self.m.num_referenced == before[3]
            return
        toks = self.tokens[req.request_id] = self.tokens[req.request_id] + extra
        self._write(req, toks, max(n_before - 1, 0))

    @rule(req=consumes(requests))
    def free(self, req):
        if req is None or req.request_id not in self.m.requests:
            return
        self.m.free(req)

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        cached = len(self.m.cached)
        done = self.m.evict(n)
        assert done <= n and len(self.m.cached) == cached - done

    @rule(tenant=st.sampled_from(TENANTS), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 6), max_size=12))
    def match_and_touch(self, tenant, prefix, suffix):
        tokens = prefix + suffix or [0]
        req = self.m.make_request("probe", tokens, tenant=tenant)
        hits = self.m.match_prefix(req)
        for i, b in enumerate(hits):
            assert self.kv[b.block_id] == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
            assert self.m.salt_of(b.tenant) == self.m.salt_of(tenant)
        self.m.touch(hits)

    @rule(tenant=st.sampled_from(TENANTS), blocks=st.one_of(st.none(), st.integers(1, POOL)))
    def set_quota(self, tenant, blocks):
        self.m.set_tenant_quota(tenant, blocks)

    @rule(tenant=st.sampled_from(TENANTS))
    def flush(self, tenant):
        self.m.flush_tenant(tenant)
        assert not any(b.tenant == tenant and b.ref_cnt == 0 and b.num_children == 0
                       for b in self.m.cached.values())

    @rule(tenant=st.sampled_from(TENANTS), prefix=st.sampled_from(PREFIXES[:3]), unpin=st.booleans())
    def pin(self, tenant, prefix, unpin):
        if unpin:
            self.m.unpin_prefix(prefix, tenant)
            return
        n = self.m.pin_prefix(prefix, tenant)
        assert n == self.m.match_tokens(prefix, tenant)
        self.m.evict(POOL)
        assert self.m.match_tokens(prefix, tenant) == n, "a pinned prefix was evicted"

    @invariant()
    def consistent(self):
        self.m.check_invariants()
        held = sum(1 for b in self.m.blocks if b.ref_cnt > 0)
        free = self.m.num_free
        assert free + held + sum(1 for b in self.m.cached.values() if b.ref_cnt == 0) == POOL


def machine_for(policy: str) -> type:
    return type(f"Machine_{policy}", (CacheMachine,), {"policy": policy})


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "arc", "s3fifo", "twoq"])
def test_random_interleavings(policy: str) -> None:
    machine = machine_for(policy)
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    machine.TestCase().runTest()
