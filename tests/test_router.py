"""The router's prefix index, its policies and the cluster simulation (`kvheat replay
--replicas`): what each place holds, vLLM's hashes indexed by content, ghosts and
expected keys, each policy's documented rules, and the simulation's hit rates, balance and
bound on the built-in workload (and on the Mooncake traces when present)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvheat.cache import CacheConfig, KVCacheManager, make_policy
from kvheat.cache.hashing import block_keys, root_key
from kvheat.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvheat.replay import PreparedTrace, generate_workload, load_trace
from kvheat.replay.traces import WorkloadConfig
from kvheat.router.index import DEVICE, LOCAL_TIER, SHARED_TIER, PrefixIndex
from kvheat.router.routing import (
    KVHeatRouting,
    KVHeatRoutingConfig,
    LeastLoad,
    PrefixHash,
    ReplicaState,
    RoundRobin,
    RouteRequest,
    SglangLike,
    rendezvous,
    rendezvous_order,
)
from kvheat.router.simulate import ClusterConfig, simulate

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def keys(n: int, tag: int = 0) -> list[bytes]:
    k, _ = block_keys(list(range(tag * 1000, tag * 1000 + 16 * n)), 16, root_key(None))
    return k


def rreq(ks: list[bytes], bs: int = 16) -> RouteRequest:
    return RouteRequest(ks, [bs] * len(ks), bs * len(ks))


def states(*names: str, **kw: float) -> list[ReplicaState]:
    return [ReplicaState(n, **kw) for n in names]  # type: ignore[arg-type]


# ---- the index -----------------------------------------------------------------------------
def test_index_places_and_prefixes() -> None:
    ix = PrefixIndex()
    for n in ("a", "b", "c"):
        ix.add_replica(n)
    ks = keys(6)
    ix.stored("a", ks[:4])
    ix.stored("b", ks[:2])
    ix.stored("b", ks[2:5], LOCAL_TIER, "host")
    ix.stored("c", ks[:1])
    ix.stored("c", ks[1:3], SHARED_TIER, "redis")
    m = {n: x for n, x in zip("abc", ix.match(ks, [16] * 6, ["a", "b", "c"]))}
    assert (m["a"].device_blocks, m["a"].local_blocks, m["a"].shared_blocks) == (4, 0, 0)
    assert (m["b"].device_blocks, m["b"].local_blocks, m["b"].shared_blocks) == (2, 3, 0)
    # The shared tier serves any replica after its own prefix.
    assert (m["c"].device_blocks, m["c"].local_blocks, m["c"].shared_blocks) == (1, 0, 2)
    assert m["a"].device_tokens == 64 and m["b"].local_tokens == 48
    ix.removed("a", ks[1:2])
    assert ix.match(ks, [16] * 6, ["a"])[0].device_blocks == 1  # a prefix ends at a gap
    # A key on two lower tiers of one replica stays until both lose it.
    ix.stored("b", ks[2:3], LOCAL_TIER, "disk")
    ix.removed("b", ks[2:3], LOCAL_TIER, "host")
    assert ix.masks[LOCAL_TIER][ks[2]] & (1 << ix.bit_of("b"))
    ix.clear_replica("b")
    assert ix.blocks_of("b") == 0 and ix.blocks_of("b", LOCAL_TIER) == 0
    ix.remove_replica("a")
    assert "a" not in ix.replicas and ix.blocks_of("a") == 0
    assert ix.add_replica("d") == 0  # the freed bit is reused


def test_index_applies_kvheat_batches_and_remembers_evictions() -> None:
    ix = PrefixIndex()
    ix.add_replica("r")
    ks = keys(3)
    ix.apply("r", KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=ks, parent_block_hash=None, token_ids=[], block_size=16,
                    lora_id=None, medium="GPU", lora_name=None)]))
    assert ix.match(ks, [16] * 3, ["r"])[0].device_blocks == 3
    ix.apply("r", KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=ks[1:], medium="GPU")]))
    m = ix.match(ks, [16] * 3, ["r"])[0]
    assert m.device_blocks == 1 and m.recent_blocks == 3  # evicted lately: still its home
    ix.apply("r", KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    assert ix.match(ks, [16] * 3, ["r"])[0].blocks == 0


def test_index_expected_keys_count_until_unexpected() -> None:
    ix = PrefixIndex()
    ix.add_replica("r")
    ks = keys(2)
    ix.expect("r", ks)
    ix.expect("r", ks)
    ix.unexpect("r", ks)
    assert ix.match(ks, [16, 16], ["r"])[0].device_blocks == 2
    ix.unexpect("r", ks)
    assert ix.match(ks, [16, 16], ["r"])[0].device_blocks == 0


def test_vllm_hashes_are_indexed_by_content_and_salt() -> None:
    """A vLLM replica's store (its own hashes, with token ids and the cache salt the router
    set) lands under the very keys kvheat computes for that tenant's prompt."""
    ix = PrefixIndex()
    ix.add_replica("v", foreign_hashes=True)
    toks = list(range(64))
    want, _ = block_keys(toks, 16, root_key("tenant:acme"))
    ix.apply("v", KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=toks[:32],
                    block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[("tenant:acme",), None]),
        BlockStored(block_hashes=[13, 14], parent_block_hash=12, token_ids=toks[32:],
                    block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
    assert ix.match(want, [16] * 4, ["v"])[0].device_blocks == 4
    other, _ = block_keys(toks, 16, root_key("tenant:globex"))
    assert ix.match(other, [16] * 4, ["v"])[0].device_blocks == 0  # another tenant: nothing
    ix.apply("v", KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[13], medium="GPU")]))
    assert ix.match(want, [16] * 4, ["v"])[0].device_blocks == 2
    # A store whose parent was never seen cannot be placed: counted, not guessed.
    ix.apply("v", KVEventBatch(ts=0, events=[
        BlockStored(block_hashes=[99], parent_block_hash=98, token_ids=toks[:16],
                    block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
    assert ix.unresolved == 1


# ---- policies ------------------------------------------------------------------------------
def test_round_robin_least_load_and_health() -> None:
    rr = RoundRobin()
    reps = states("a", "b", "c")
    assert [rr.choose(rreq([]), reps).replica for _ in range(4)] == [0, 1, 2, 0]
    reps[1].healthy = False
    assert {rr.choose(rreq([]), reps).replica for _ in range(4)} == {0, 2}
    ll = LeastLoad()
    reps = states("a", "b", "c")
    reps[0].in_flight, reps[1].in_flight, reps[2].in_flight = 3, 1, 2
    assert ll.choose(rreq([]), reps).replica == 1
    for r in reps:
        r.healthy = False
    with pytest.raises(RuntimeError):
        ll.choose(rreq([]), reps)


def test_prefix_hash_is_stable_and_moves_only_the_leavers_keys() -> None:
    ph = PrefixHash()
    names = ["a", "b", "c", "d"]
    reqs = [rreq(keys(2, tag)) for tag in range(200)]
    before = [names[ph.choose(r, states(*names)).replica] for r in reqs]
    assert len(set(before)) == 4
    after = [["a", "b", "d"][ph.choose(r, states("a", "b", "d")).replica] for r in reqs]
    assert all(x == y for x, y in zip(before, after) if x != "c")
    assert rendezvous(b"k", names) == rendezvous(b"k", names)


def test_sglang_like_follows_its_thresholds() -> None:
    sg = SglangLike()
    reps = states("a", "b")
    long = keys(10)
    sg.routed(rreq(long[:4]), "b")  # b's tree holds 4 of the 10 blocks: 40% > 30%
    assert sg.choose(rreq(long), reps).replica == 1
    sg2 = SglangLike()
    sg2.routed(rreq(long[:2]), "b")  # 20%: not enough, least loaded (the first)
    assert sg2.choose(rreq(long), reps).replica == 0
    # Imbalanced (diff > 64 and max > 1.5 x min): least loaded whatever the cache.
    reps[1].in_flight, reps[0].in_flight = 100, 30
    assert sg.choose(rreq(long), reps).replica == 0
    reps[1].in_flight, reps[0].in_flight = 100, 70  # 100 < 1.5 x 70: balanced enough
    assert sg.choose(rreq(long), reps).replica == 1


def test_sglang_like_names_the_first_holder_on_a_tie() -> None:
    # SGLang's tree names one tenant per node, the first that held it; which replica comes
    # first in the list (the least-loaded order) does not matter.
    long = keys(10)
    for first, second in (("b", "a"), ("a", "b")):
        sg = SglangLike()
        sg.routed(rreq(long[:6]), first)
        sg.routed(rreq(long[:6]), second)
        d = sg.choose(rreq(long), states("a", "b"))
        assert d.mode == "cache" and "ab"[d.replica] == first


def test_kvheat_affinity_hot_heads_and_the_overload_guard() -> None:
    ix = PrefixIndex()
    for n in ("a", "b"):
        ix.add_replica(n)
    pol = KVHeatRouting(ix)
    conv = keys(8, 1)
    ix.stored("b", conv[:6])
    d = pol.choose(rreq(conv), states("a", "b"))
    assert d.replica == 1 and d.mode == "affinity" and d.expected_hit_tokens == 96
    # Without the guard the hit is worth any queue; with it, a wait there far beyond the
    # time to first token elsewhere moves the request.
    reps = states("a", "b")
    reps[1].pending_prefill = 10_000
    assert pol.choose(rreq(conv), reps).replica == 1
    guarded = KVHeatRouting(ix, KVHeatRoutingConfig(overload_guard=True))
    d = guarded.choose(rreq(conv), reps)
    assert d.replica == 0 and d.mode == "overload"
    reps[1].pending_prefill = 50  # a short queue: the hit wins
    assert guarded.choose(rreq(conv), reps).replica == 1
    # A prefix in every request (hot) pulls nothing: new prompts after it spread.
    pol2 = KVHeatRouting(PrefixIndex())
    for n in ("a", "b"):
        pol2.index.add_replica(n)
    sysk = keys(3, 2)
    pol2.index.stored("a", sysk)
    chosen = []
    for tag in range(40):
        r = rreq(sysk + keys(2, 100 + tag))  # the same 3-block head, then a new prompt
        d = pol2.choose(r, states("a", "b"))
        pol2.routed(r, ["a", "b"][d.replica], d.expected_hit_tokens)
        chosen.append(d.replica)
    assert pol2.hot_head(rreq(sysk + keys(1, 999)), 2) == 3
    assert 10 <= chosen.count(1) <= 30, chosen  # not all on the replica holding the head


def test_kvheat_new_prefixes_shard_by_hash_and_go_home_after_eviction() -> None:
    ix = PrefixIndex()
    for n in ("a", "b", "c"):
        ix.add_replica(n)
    pol = KVHeatRouting(ix)
    p = keys(4, 7)
    first = pol.choose(rreq(p), states("a", "b", "c"))
    assert first.mode in ("shard", "balance")
    name = "abc"[first.replica]
    ix.stored(name, p)
    ix.removed(name, p)  # evicted, but its policy remembers: back home
    d = pol.choose(rreq(p), states("a", "b", "c"))
    assert d.replica == first.replica and d.mode == "home"



def test_router_remembers_an_eviction_as_long_as_the_replica_does() -> None:
    """A prefix evicted 9x the replica's capacity ago is still in its ghost history (it
    keeps up to 10.7x); the router still sends it there, where it comes back as a ghost
    hit. An index remembering 8x the keys held would have forgotten it."""
    from kvheat.router.simulate import _feed

    ix, short = PrefixIndex(), PrefixIndex(ghost_factor=8.0)  # the default, 12x; 8x
    caches = {}
    for n in ("a", "b"):
        caches[n] = KVCacheManager(CacheConfig(num_blocks=1100, block_size=16),
                                   policy=make_policy("kvheat"))
        for index in (ix, short):
            index.add_replica(n)
            caches[n].index_listeners.append(_feed(index, n))

    def run(name: str, ids: list[int]) -> None:
        mgr = caches[name]
        req = mgr.make_hashed_request(str(ids[0]), ids, 16 * len(ids))
        mgr.allocate(req, mgr.match_prefix(req))
        mgr.free(req)

    prefix = [1, 2, 3, 4]
    run("a", prefix)
    for i in range(1100):  # 11,000 blocks through "a": 9x its capacity evicted since
        run("a", [100_000 + 10 * i + j for j in range(10)])
    probe = caches["a"].make_hashed_request("p", prefix, 64)
    assert not caches["a"].match_prefix(probe)
    d = KVHeatRouting(ix).choose(RouteRequest(probe.keys, probe.block_tokens, 64),
                                 states("a", "b"))
    assert (d.replica, d.mode) == (0, "home")
    forgot = KVHeatRouting(short).choose(RouteRequest(probe.keys, probe.block_tokens, 64),
                                         states("a", "b"))
    assert forgot.mode != "home"
    before = caches["a"].policy.ghost_hits  # type: ignore[attr-defined]
    run("a", prefix)
    assert caches["a"].policy.ghost_hits == before + len(prefix)  # type: ignore[attr-defined]


def test_kvheat_new_prefix_goes_to_the_less_queued_of_its_two_hashed_replicas() -> None:
    names = ["a", "b", "c", "d"]
    ix = PrefixIndex()
    for n in names:
        ix.add_replica(n)
    p = keys(4, 11)
    order = rendezvous_order(p[0], names, 4)
    assert order[0] == rendezvous(p[0], names) and sorted(order) == [0, 1, 2, 3]
    two = KVHeatRouting(ix)
    one = KVHeatRouting(ix, KVHeatRoutingConfig(shard_choices=1))
    reps = states(*names)
    assert two.choose(rreq(p), reps).replica == order[0]  # idle: the hash alone
    reps[order[0]].pending_prefill = 5_000
    d = two.choose(rreq(p), reps)
    assert d.replica == order[1] and d.mode == "shard"
    assert one.choose(rreq(p), reps).replica == order[0]
    # Never beyond its two: the other two replicas idle, the less queued of the two.
    reps[order[1]].pending_prefill = 9_000
    assert two.choose(rreq(p), reps).replica == order[0]
    with pytest.raises(ValueError, match="shard_choices"):
        KVHeatRoutingConfig(shard_choices=0)

# ---- the simulation ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin() -> PreparedTrace:
    cfg = WorkloadConfig(num_conversations=400, seed=3)
    return PreparedTrace(generate_workload(cfg, 512), 512)


def test_simulation_kvheat_against_the_baselines(builtin: PreparedTrace) -> None:
    cap = 600_000
    res = {r: simulate(builtin, r, ClusterConfig(replicas=3, capacity_tokens=cap))
           for r in ("rr", "least-load", "prefix-hash", "sglang-like", "kvheat")}
    k = res["kvheat"]
    assert k.bound_hit_rate and k.of_bound >= 0.9
    assert k.hit_rate > res["rr"].hit_rate and k.hit_rate > res["least-load"].hit_rate
    assert k.imbalance_prefill <= 1.25 and k.imbalance_requests <= 1.25
    assert sum(r.requests for r in k.per_replica) == len(builtin.trace)
    assert k.requests == len(builtin.trace) and k.total_tokens == sum(
        r.input_length for r in builtin.trace)
    # The bound is one cache of N x C with the same policy.
    from kvheat.replay import replay
    assert k.bound_hit_rate == pytest.approx(replay(builtin, "kvheat", 3 * cap, 512).hit_rate)


def test_simulation_with_a_shared_tier(builtin: PreparedTrace) -> None:
    base = simulate(builtin, "rr", ClusterConfig(replicas=3, capacity_tokens=300_000))
    shared = simulate(builtin, "rr", ClusterConfig(replicas=3, capacity_tokens=300_000,
                                                   shared_tokens=3_000_000))
    assert shared.shared_hit_tokens > 0 and base.shared_hit_tokens == 0
    assert shared.hit_rate > base.hit_rate


def test_simulation_under_other_replica_names(builtin: PreparedTrace) -> None:
    # Hashing routers place by name: other names, other placements of the same trace.
    # A router blind to names (round robin) gives the same run whatever they are.
    cfg = ClusterConfig(replicas=3, capacity_tokens=300_000)
    named = ClusterConfig(replicas=3, capacity_tokens=300_000, names=("pod-x", "pod-y", "pod-z"))
    a, b = simulate(builtin, "prefix-hash", cfg), simulate(builtin, "prefix-hash", named)
    assert [r.requests for r in a.per_replica] != [r.requests for r in b.per_replica]
    assert sum(r.requests for r in b.per_replica) == len(builtin.trace)
    rr = simulate(builtin, "rr", named, bound=False)
    assert rr.hit_tokens == simulate(builtin, "rr", cfg, bound=False).hit_tokens
    for bad in (("a", "b"), ("a", "a", "b")):
        with pytest.raises(ValueError, match="one distinct name per replica"):
            ClusterConfig(replicas=3, names=bad)


def test_replay_cli_replicas(tmp_path: Path) -> None:
    from kvheat.cli import main

    out = tmp_path / "c.json"
    res = CliRunner().invoke(main, ["replay", "builtin", "--replicas", "2", "--capacity",
                                    "300K", "--router", "rr,kvheat", "--json", str(out),
                                    "--plot", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [r["router"] for r in data["results"]] == ["rr", "kvheat"]
    assert all(0 < r["hit_rate"] <= r["bound_hit_rate"] * 1.1 for r in data["results"])
    assert (tmp_path / "c.png").stat().st_size > 1000
    bad = CliRunner().invoke(main, ["replay", "builtin", "--replicas", "2", "--router", "x"])
    assert bad.exit_code != 0 and "unknown router" in bad.output


@pytest.mark.skipif(not (TRACES / "mooncake_conversation_part1.jsonl").exists(),
                    reason="the Mooncake traces are not at ../shared/traces")
def test_simulation_on_the_conversation_trace_at_1m() -> None:
    pt = PreparedTrace(load_trace(TRACES / "mooncake_conversation_part1.jsonl"), 512)
    cfg = ClusterConfig(replicas=4, capacity_tokens=1_000_000)
    k = simulate(pt, "kvheat", cfg)
    s = simulate(pt, "sglang-like", cfg)
    assert k.of_bound >= 0.9 and k.imbalance_prefill <= 1.25
    assert k.hit_rate > s.hit_rate and k.imbalance_prefill <= s.imbalance_prefill


def test_replicas_of_sharded_traffic_take_the_cluster_regime() -> None:
    # 600 documents, each kept on one of 4 replicas: each replica sees a quarter of the
    # keys and reads about 2 bits less entropy than one cache of all the traffic, below the
    # high tier. ClusterEntropy, fed what the router routes, reads what that one cache reads.
    from kvheat.router.regime import ClusterEntropy

    rng = random.Random(0)
    caches = [KVCacheManager(CacheConfig(num_blocks=512, block_size=4), policy=make_policy(
        "kvheat")) for _ in range(4)]
    one = KVCacheManager(CacheConfig(num_blocks=2048, block_size=4), policy=make_policy("kvheat"))
    ce = ClusterEntropy()
    assert ce.bits() is None
    for i in range(6000):
        d = rng.randrange(600)
        tokens = [1, 2, 3, 4, 10 + d, 11, 12, 13, 14 + i % 7]
        for mgr in (caches[d % 4], one):
            req = mgr.make_request(str(i), tokens)
            mgr.allocate(req, mgr.match_prefix(req))
            mgr.free(req)
        ce.observe(req.keys)
    own = [c.policy.tracker.bits() for c in caches]
    assert all(6.5 < b < 7.6 for b in own) and {c.policy.mode for c in caches} == {"mid"}
    assert one.policy.mode == "high"
    assert ce.bits() == pytest.approx(one.policy.tracker.bits(), abs=1e-6)
    for c in caches:
        c.set_cluster_entropy(ce.bits())
        req = c.make_request("next", [1, 2, 3, 4, 10, 11, 12, 13])
        c.allocate(req, c.match_prefix(req))
        c.free(req)
        assert c.policy.mode == "high"


def test_cluster_entropy_rolls_over_without_a_cold_reading() -> None:
    # Past max_keys a fresh tracker starts; the old one answers until the fresh one has
    # seen two windows, so the replicas are never told the entropy of a handful of keys.
    from kvheat.router.regime import ClusterEntropy

    ce = ClusterEntropy(window=16.0, max_keys=64)
    for i in range(64):
        ce.observe([b"root", b"k%d" % i])
    old = ce.live
    ce.observe([b"root"])  # no depth-1 key: not counted
    assert old.updates == 64 and ce.answering is old
    ce.observe([b"root", b"k64"])  # the 65th key: a fresh tracker, the old one answers
    assert ce.live is not old and ce.answering is old and ce.live.updates == 1
    assert ce.bits() == old.bits() > 4.0
    for i in range(30):
        ce.observe([b"root", b"k%d" % (65 + i)])
    assert ce.answering is old  # 31 updates: not yet two windows
    ce.observe([b"root", b"k95"])
    assert ce.answering is ce.live and ce.bits() == ce.live.bits() > 4.0


def test_index_tracks_a_real_cache() -> None:
    """Fed by a real manager's listeners, the index holds exactly its keys."""
    ix = PrefixIndex()
    ix.add_replica("r")
    mgr = KVCacheManager(CacheConfig(num_blocks=16, block_size=4))
    mgr.index_listeners.append(lambda b, s: (ix.stored if s else ix.removed)("r", [b.key]))
    for i in range(30):
        r = mgr.make_request(str(i), [i % 5] * (4 * (1 + i % 4)), tenant=str(i % 2))
        mgr.allocate(r)
        mgr.free(r)
    assert set(ix.masks[DEVICE]) == set(mgr.cached)


def test_router_config_passes_shard_choices_to_the_policy() -> None:
    from kvheat.router.app import KVHeatRouter
    from kvheat.router.config import ReplicaSpec, RouterConfig, RouterConfigError

    spec = [ReplicaSpec("http://127.0.0.1:1")]
    for n in (1, 3):
        pol = KVHeatRouter(RouterConfig(replicas=spec, shard_choices=n)).policy
        assert isinstance(pol, KVHeatRouting) and pol.config.shard_choices == n
    with pytest.raises(RouterConfigError, match="shard_choices"):
        RouterConfig(replicas=spec, shard_choices=0)


def test_router_ghosts_option_bounds_the_index_memory() -> None:
    from kvheat.router.app import KVHeatRouter
    from kvheat.router.cli import route_command
    from kvheat.router.config import ReplicaSpec, RouterConfig, RouterConfigError

    spec = [ReplicaSpec("http://127.0.0.1:1")]
    assert KVHeatRouter(RouterConfig(replicas=spec)).index.ghost_factor == 12.0
    assert KVHeatRouter(RouterConfig(replicas=spec, ghost_factor=0.5)).index.ghost_factor == 0.5
    for bad in (-1.0, 65.0, float("nan")):
        with pytest.raises(RouterConfigError, match="ghost_factor"):
            RouterConfig(replicas=spec, ghost_factor=bad)
    res = CliRunner().invoke(route_command, ["--replica", "http://127.0.0.1:1", "--ghosts", "-2"])
    assert res.exit_code != 0 and "--ghosts" in res.output
    # The multiple bounds what the index keeps: 1,024 held keys' floor x the factor.
    for factor in (0.0, 1.0):
        ix = PrefixIndex(ghost_factor=factor)
        ix.add_replica("a")
        ks = keys(3000, 5)
        ix.stored("a", ks)
        ix.removed("a", ks)
        assert len(ix.ghosts) == int(factor * 1024)
