"""The queued-blocks hint in kvheat (kvheat/heat/heat_policy.py `victim`, `on_dequeue`), through
the cache's public API: a block a queued request needs is kept back from eviction, and
once the request leaves the queue it is evictable again, in its place by heat."""

from __future__ import annotations

from kvheat.cache import CacheConfig, KVCacheManager
from kvheat.heat import KVHeat

BS = 4


def _cache(num_blocks: int) -> tuple[KVCacheManager, KVHeat, list[float]]:
    now = [0.0]
    pol = KVHeat()
    return KVCacheManager(CacheConfig(num_blocks, BS), pol, clock=lambda: now[0]), pol, now


def _fill(m: KVCacheManager, now: list[float], n: int) -> list[list[int]]:
    """`n` one-block prompts, cached and released oldest first."""
    prompts = []
    for i in range(n):
        now[0] += 1
        tokens = [10 * i + j for j in range(BS)]
        r = m.make_request(f"r{i}", tokens)
        m.allocate(r)
        m.free(r)
        prompts.append(tokens)
    return prompts


def _admit(m: KVCacheManager, now: list[float], rid: str, tokens: list[int]) -> None:
    now[0] += 1
    r = m.make_request(rid, tokens)
    m.allocate(r)
    m.free(r)


def test_blocks_kept_back_for_a_queued_request_are_evictable_once_it_leaves() -> None:
    m, pol, now = _cache(4)
    p = _fill(m, now, 4)
    m.queue(m.make_request("w", p[0] + [99]))  # waits for r0's block, the coldest
    _admit(m, now, "n0", [500 + j for j in range(BS)])
    assert m.match_tokens(p[0]) == BS  # kept back: the next coldest went instead
    assert m.match_tokens(p[1]) == 0
    m.dequeue("w")  # cancelled: r0's block is the coldest again, and goes next
    assert not pol.held
    _admit(m, now, "n1", [600 + j for j in range(BS)])
    assert m.match_tokens(p[0]) == 0
    assert m.match_tokens(p[2]) == BS
    m.check_invariants()


def test_a_dequeued_request_leaves_every_block_evictable() -> None:
    m, pol, now = _cache(4)
    p = _fill(m, now, 4)
    m.queue(m.make_request("w", p[0] + p[1][:1]))
    m.queue(m.make_request("v", p[2]))
    _admit(m, now, "n0", [500 + j for j in range(2 * BS)])  # r1, r3 go; r0, r2 kept back
    assert [m.match_tokens(t) for t in p] == [BS, 0, BS, 0]
    m.dequeue("w")
    m.dequeue("v")
    # a prompt that needs the whole cache: every cached block must be found by `victim`
    now[0] += 1
    big = m.make_request("big", list(range(1000, 1000 + 4 * BS)))
    m.allocate(big)
    assert [m.match_tokens(t) for t in p] == [0, 0, 0, 0]
    m.free(big)
    m.check_invariants()
