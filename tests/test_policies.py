"""Each baseline policy against a hand-worked sequence of single-block requests.

Requests use distinct first tokens, so every request is one independent root block; the
pool holds 3 blocks, so the 4th distinct block forces an eviction we can predict by hand.
"""

from __future__ import annotations

import pytest

from kvheat.cache import CacheConfig, KVCacheManager, make_policy, policy_names
from kvheat.cache.classic import Belady

BS = 2


def run(policy: str, seq: str, pool: int = 3, **kw) -> tuple[KVCacheManager, list[bool]]:
    """Serve one-block requests named by letters; returns the manager and hit flags."""
    t = [0.0]

    def clock() -> float:
        t[0] += 1
        return t[0]

    m = KVCacheManager(CacheConfig(num_blocks=pool, block_size=BS), policy=make_policy(policy, **kw),
                       clock=clock)
    hits = []
    for i, ch in enumerate(seq):
        req = m.make_request(f"q{i}", [ord(ch), ord(ch)])
        m.allocate(req)
        hits.append(req.num_cached_tokens == BS)
        m.free(req)
    return m, hits


def cached(m: KVCacheManager) -> str:
    return "".join(sorted(chr(b.content[0]) for b in m.cached.values()))  # type: ignore[index]


def test_registry_lists_all_baselines() -> None:
    assert {"lru", "fifo", "lfu", "arc", "s3fifo", "twoq", "belady"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope")


def test_heat_policies_are_found_without_importing_kvheat_heat() -> None:
    """`make_policy` loads the plugin policies by name (kvheat/cache/eviction.py): a fresh
    interpreter that imports only kvheat.cache gets `kvheat`, `lruk` and `fused`."""
    import subprocess
    import sys

    code = ("import sys; from kvheat.cache import make_policy, policy_names; "
            "assert 'kvheat.heat' not in sys.modules; "
            "print(type(make_policy('kvheat')).__name__, "
            "{'kvheat', 'lruk', 'fused'} <= set(policy_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["KVHeat", "True"]


def test_lru() -> None:
    m, hits = run("lru", "ABCAD")  # D evicts B, the least recently used
    assert cached(m) == "ACD"
    assert hits == [False, False, False, True, False]


def test_fifo() -> None:
    m, hits = run("fifo", "ABCAD")  # D evicts A, the first in, despite its hit
    assert cached(m) == "BCD"
    assert hits[3]


def test_lfu() -> None:
    m, _ = run("lfu", "AABBCD")  # C has frequency 1 and is older than D's arrival
    assert cached(m) == "ABD"
    m, _ = run("lfu", "ABBCAAD")  # frequencies A3 B2 C1: C goes
    assert cached(m) == "ABD"


def test_arc_keeps_frequent_blocks_against_a_scan() -> None:
    # A and B are used twice (T2); a scan of one-off blocks must not push them out,
    # while LRU loses them.
    seq = "ABAB" + "CDEF"
    m, _ = run("arc", seq, pool=3)
    assert set("AB") <= set(cached(m))
    m, _ = run("lru", seq, pool=3)
    assert not set("AB") & set(cached(m))


def test_arc_ghost_hit_moves_to_t2_and_adapts_p() -> None:
    m, _ = run("arc", "ABCD", pool=3)  # A evicted from T1 into ghost B1
    assert cached(m) == "BCD"
    p0 = m.policy.p  # type: ignore[attr-defined]
    req = m.make_request("x", [ord("A")] * BS)
    m.allocate(req)  # a B1 ghost hit: p grows, A enters T2
    assert m.policy.p > p0  # type: ignore[attr-defined]
    assert req.blocks[0].state == 2


def test_twoq_probation_and_ghost() -> None:
    # Kin = 25% of 4 blocks = 1: once probation holds more than one block, its oldest goes.
    m, _ = run("twoq", "AB", pool=4)
    m2, hits = run("twoq", "ABCDEA", pool=4)
    # A entered probation, was pushed out to the ghost list A1out, and came back into Am.
    assert not hits[5]
    a = next(b for b in m2.cached.values() if b.content[0] == ord("A"))  # type: ignore[index]
    assert a.state == 2  # Am
    assert len(m.cached) == 2


def test_twoq_hit_on_probation_protects() -> None:
    m, hits = run("twoq", "ABAC DE".replace(" ", ""), pool=3)
    assert hits[2]
    assert "A" in cached(m)  # A was promoted to Am; the FIFO probationers went first


def test_s3fifo_one_hit_wonders_leave_through_small_queue() -> None:
    # Small queue = 10% of 10 blocks = 1 block: new blocks are evicted from it quickly
    # unless hit twice, then they move to main.
    seq = "AAA" + "BCDEFGHIJKLMN"
    m, _ = run("s3fifo", seq, pool=10)
    assert "A" in cached(m)
    m, _ = run("fifo", seq, pool=10)
    assert "A" not in cached(m)


def test_s3fifo_ghost_readmits_to_main() -> None:
    m, _ = run("s3fifo", "ABCDEFGHIJK" + "A", pool=10)
    a = next(b for b in m.cached.values() if b.content[0] == ord("A"))  # type: ignore[index]
    assert a.state == 2  # came back from the ghost straight into main


def test_belady_evicts_furthest_next_use() -> None:
    seq = "ABCDABC"
    # Precompute next uses as the replayer does.
    t = [0.0]
    pol = Belady()
    m = KVCacheManager(CacheConfig(num_blocks=3, block_size=BS), policy=pol,
                       clock=lambda: t[0])
    reqs = [m.make_request(f"q{i}", [ord(c)] * BS) for i, c in enumerate(seq)]
    hits = []
    for i, r in enumerate(reqs):
        later = [j for j in range(i + 1, len(seq)) if seq[j] == seq[i]]
        pol.next_use[r.keys[0]] = later[0] if later else float("inf")
        m.allocate(r)
        hits.append(r.num_cached_tokens > 0)
        m.free(r)
    # D arrives with A, B, C cached: C is used last, so C goes; then A, B hit, C misses.
    assert hits == [False, False, False, False, True, True, False]


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "arc", "s3fifo", "twoq"])
def test_only_leaves_are_evicted(policy: str) -> None:
    """A long shared parent chain survives while its many one-off children come and go."""
    m = KVCacheManager(CacheConfig(num_blocks=6, block_size=BS, policy=policy))
    shared = [7, 7, 8, 8]  # two blocks
    for i in range(40):
        req = m.make_request(f"q{i}", shared + [100 + i, 100 + i])
        m.allocate(req)
        m.free(req)
        m.check_invariants()
        # Every cached block's parent is cached: the cache is closed under prefixes.
        for b in m.cached.values():
            assert b.parent is None or m.cached.get(b.parent.key) is b.parent  # type: ignore[arg-type]
