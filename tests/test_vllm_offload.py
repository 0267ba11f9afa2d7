"""kvheat's heat policy inside vLLM's real CPU offloading manager (needs the vllm extra;
CI installs it, so these run there)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
pytestmark = pytest.mark.vllm

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus  # noqa: E402

from kvheat.integrations.vllm import KVHeatCachePolicy  # noqa: E402
from kvheat.integrations.vllm_replay import replay_offload, request_keys  # noqa: E402
from kvheat.replay import WorkloadConfig, generate_workload, load_trace  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _key(i: int, group: int = 0):
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), group)


def _manager(n: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(n, cache_policy="KVHeatCachePolicy",
                                cache_policy_module_path="kvheat.integrations.vllm")


def test_vllm_factory_loads_kvheat_policy() -> None:
    mgr = _manager(8)
    assert isinstance(mgr._policy, KVHeatCachePolicy)
    assert mgr._policy.cache_capacity == 8


def _store(mgr: CPUOffloadingManager, keys, ctx: ReqContext):
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 16)
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    return out


def _lifecycle(mgr: CPUOffloadingManager) -> set:
    """lookup / prepare_load / touch / complete_load / prepare_store / complete_store /
    on_request_finished, by hand: a prefix used three times, then one-off requests that
    overflow the cache. Returns the keys evicted."""
    shared = [_key(i) for i in range(3)]
    ctx = ReqContext("r0")
    mgr.on_new_request(ctx)
    out = _store(mgr, shared, ctx)
    assert out.keys_to_store == shared and out.evicted_keys == []
    mgr.on_request_finished(ctx)
    # A second request reuses the prefix: load it, touch it, and append one chunk.
    ctx = ReqContext("r1")
    mgr.on_new_request(ctx)
    assert [mgr.lookup(k, ctx) for k in shared] == [LookupResult.HIT] * 3
    mgr.prepare_load(shared, ctx)
    mgr.touch(shared, ctx)
    mgr.complete_load(shared, ctx)
    out = _store(mgr, [*shared, _key(100)], ctx)
    assert out.keys_to_store == [_key(100)]
    mgr.on_request_finished(ctx)
    evicted: set = set()
    for r in range(18):
        ctx = ReqContext(f"x{r}")
        mgr.on_new_request(ctx)
        evicted.update(_store(mgr, [_key(1000 + 2 * r), _key(1001 + 2 * r)], ctx).evicted_keys)
        mgr.on_request_finished(ctx)
    return evicted


def test_request_lifecycle_through_the_manager() -> None:
    shared = {_key(i) for i in range(3)}
    lru = _lifecycle(CPUOffloadingManager(32, cache_policy="lru"))
    assert shared <= lru  # recency alone drops the reused prefix first
    heat = _lifecycle(_manager(32))
    assert len(heat) == len(lru) == 8 and not heat & shared  # its heat keeps it


def test_pinned_chunks_fail_a_store_atomically() -> None:
    mgr = _manager(2)
    ctx = ReqContext("a")
    mgr.on_new_request(ctx)
    ks = [_key(1), _key(2)]
    _store(mgr, ks, ctx)
    mgr.prepare_load(ks, ctx)  # both pinned by a load in flight
    before = {k: (mgr._policy.get(k).chunk_id, mgr._policy.get(k).ref_cnt) for k in ks}
    assert mgr.prepare_store([_key(3)], ReqContext("b")) is None
    assert {k: (mgr._policy.get(k).chunk_id, mgr._policy.get(k).ref_cnt) for k in ks} == before
    mgr.complete_load(ks, ctx)
    out = mgr.prepare_store([_key(3)], ReqContext("b"))
    assert out is not None and len(out.evicted_keys) == 1


def test_reset_cache_clears_chunks_and_ghosts() -> None:
    mgr = _manager(2)
    for r in range(4):
        ctx = ReqContext(str(r))
        mgr.on_new_request(ctx)
        _store(mgr, [_key(r)], ctx)
        mgr.on_request_finished(ctx)
    pol: KVHeatCachePolicy = mgr._policy  # type: ignore[assignment]
    assert pol.ghost_size() > 0
    mgr.reset_cache()
    assert pol.chunks == {} and pol.ghost_size() == 0
    assert pol.heat.evictions == 0 and pol.heat.reuse_mult == 1.0  # the multiple restarts
    assert mgr.lookup(_key(3), ReqContext("q")) is LookupResult.MISS


def _chain_request(mgr: CPUOffloadingManager, keys, name: str, ctx: ReqContext | None = None,
                   before_finish: Callable[[ReqContext], None] | None = None) -> ReqContext:
    """One request over `keys` (context `ctx`, else a fresh one named `name`): load the
    cached prefix, store the rest, `before_finish(ctx)`, finish."""
    ctx = ctx if ctx is not None else ReqContext(name)
    mgr.on_new_request(ctx)
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 16)
    hits = 0
    for k in keys:
        if mgr.lookup(k, ctx) is not LookupResult.HIT:
            break
        hits += 1
    if hits:
        mgr.prepare_load(keys[:hits], ctx)
        mgr.complete_load(keys[:hits], ctx)
    out = mgr.prepare_store(keys[hits:], ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    if before_finish is not None:
        before_finish(ctx)
    mgr.on_request_finished(ctx)
    return ctx


def test_monotone_heads_are_never_colder_than_their_tails() -> None:
    chain = [_key(i) for i in range(4)]

    def keys_after(monotone: bool) -> list[float]:
        mgr = _manager(16)
        pol = KVHeatCachePolicy(16, monotone=monotone, early_hits=False, gated=False)
        mgr._policy = pol  # the manager holds no chunks yet: swap in the configured twin
        _chain_request(mgr, chain, "a")
        pol.chunks[chain[3]].rec.count *= 8.0  # the tail hotter than its head (as a lost
        _chain_request(mgr, chain, "b")  # ghost or an admission penalty leaves it)
        heat = pol.heat
        return [heat.key(pol.chunks[k]) for k in chain]

    plain, mono = keys_after(False), keys_after(True)
    assert plain[0] < plain[3]  # without the rule the head would go before its tail
    assert all(a >= b for a, b in zip(mono, mono[1:])), mono


def test_early_hits_count_a_load_once() -> None:
    chain = [_key(i) for i in range(3)]
    counts = {}
    for early in (False, True):
        mgr = _manager(16)
        pol = KVHeatCachePolicy(16, monotone=False, early_hits=early, gated=False)
        mgr._policy = pol
        _chain_request(mgr, chain, "a")
        ctx = ReqContext("b")
        mgr.on_new_request(ctx)
        for j, k in enumerate(chain):
            ctx.set_offload_key_position(k, (j + 1) * 16)
        mgr.prepare_load(chain, ctx)
        during = pol.heat.log_count(pol.chunks[chain[0]])
        mgr.complete_load(chain, ctx)
        mgr.prepare_store(chain, ctx)
        mgr.on_request_finished(ctx)
        counts[early] = (during, pol.heat.log_count(pol.chunks[chain[0]]), pol.heat.clock.accesses,
                         pol.heat.clock.lam)
    # While the request runs, only the early policy has counted its hit ...
    assert counts[True][0] > counts[False][0]
    # ... and once it ends both have counted it exactly once, at the request's end: the
    # early one's end is later by at most the loads it counted before (virtual time).
    assert counts[True][2] == counts[False][2]
    assert 0 <= counts[True][1] - counts[False][1] <= counts[True][3] * len(chain), counts


def test_finish_inserts_move_a_stored_chunk_to_the_request_end() -> None:
    mine, other = [_key(i) for i in range(2)], [_key(100 + i) for i in range(4)]
    heat_of = {}
    for finish in (False, True):
        mgr = _manager(16)
        pol = KVHeatCachePolicy(16, finish_inserts=finish, monotone=False, early_hits=False)
        mgr._policy = pol
        ctx = ReqContext("long")
        mgr.on_new_request(ctx)
        _store(mgr, mine, ctx)  # stored at the end of prefill, then a long decode ...
        _chain_request(mgr, other, "short")  # ... while another request runs,
        _chain_request(mgr, [_key(200)], "next")  # and a third begins
        mgr.on_request_finished(ctx)
        heat_of[finish] = (pol.heat.log_count(pol.chunks[mine[0]]),
                           pol.heat.log_count(pol.chunks[other[0]]))
    # Stored once either way; with the rule its use dates from the request's end, after
    # the other request's, so it is the hotter of the two.
    assert heat_of[False][0] < heat_of[False][1]
    assert heat_of[True][0] > heat_of[True][1]


def test_gated_rules_run_only_while_evictions_are_young() -> None:
    pol = KVHeatCachePolicy(16, monotone=True, early_hits=True, gated=True)
    from kvheat.integrations.vllm import _tight

    def tight() -> bool:
        return _tight(pol.heat, pol.evicted, pol.evict_age)

    assert not tight()  # nothing evicted yet: every reuse so far was held
    pol.heat.gaps.estimate = 100.0
    pol.evicted, pol.evict_age = 5, 50.0
    assert tight()
    pol.evict_age = pol.heat.penalties.fade * 100.0
    assert not tight()
    # With the gate shut the rules do nothing: the same counts as the plain policy.
    chain = [_key(i) for i in range(3)]
    counts = []
    for p in (KVHeatCachePolicy(16, monotone=False, early_hits=False),
              KVHeatCachePolicy(16)):
        mgr = _manager(16)
        mgr._policy = p
        _chain_request(mgr, chain, "a")
        ctx = ReqContext("b")
        mgr.on_new_request(ctx)
        for j, k in enumerate(chain):
            ctx.set_offload_key_position(k, (j + 1) * 16)
        mgr.prepare_load(chain, ctx)
        counts.append([p.heat.log_count(p.chunks[k]) for k in chain])
    assert counts[0] == counts[1]


def _load(mgr: CPUOffloadingManager, keys, name: str) -> ReqContext:
    """A request that loads `keys` (all cached) and is still running (decoding)."""
    ctx = ReqContext(name)
    mgr.on_new_request(ctx)
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 16)
    mgr.prepare_load(keys, ctx)
    mgr.complete_load(keys, ctx)
    return ctx


def test_hold_gate_opens_once_evictions_are_old() -> None:
    from kvheat.integrations.vllm import _loose, _tight

    pol = KVHeatCachePolicy(16)
    assert not _loose(pol.heat, pol.evicted, pol.evict_age)  # nothing evicted yet
    pol.evicted, pol.evict_age = 5, 1e9
    pol.heat.gaps.estimate = None
    assert not _loose(pol.heat, pol.evicted, pol.evict_age)  # no reuse gap measured
    pol.heat.gaps.estimate = 100.0
    for age in (50.0, pol.heat.penalties.fade * 100.0, 1e9):
        pol.evict_age = age  # once it has evicted and measured a gap: the complement
        assert _loose(pol.heat, 5, age) != _tight(pol.heat, 5, age)


def test_hold_keeps_a_loaded_chunk_until_its_request_ends(monkeypatch) -> None:
    import kvheat.integrations.vllm as kv

    monkeypatch.setattr(kv, "_loose", lambda *a: True)  # a roomy cache: the gate open
    cold, hot, new = ([_key(b + i) for i in range(2)] for b in (0, 10, 20))
    kept = {}
    for hold in (False, True):
        mgr = _manager(4)
        pol = KVHeatCachePolicy(4, hold=hold)
        mgr._policy = pol
        _chain_request(mgr, cold, "a")  # stored once
        for i in range(3):
            _chain_request(mgr, hot, f"h{i}")  # used three times: hotter
        ctx = _load(mgr, cold, "b")  # a request loads the cold chain and decodes ...
        _chain_request(mgr, new, "c")  # ... while another one stores two chunks
        kept[hold] = {k for k in cold + hot if pol.get(k) is not None}
        mgr.on_request_finished(ctx)
        if hold:  # its end puts them back in the heap, at their heat
            assert all(pol.get(k).parked is None and not math.isnan(pol.get(k).heap_slot)
                       for k in cold)
            assert pol.fallbacks == 0
    # The reuse in flight loses its tail, the hot chain its tail too (the cold root outranks
    # it, pinned): the regime reads low on these few
    # keys and pins every root by the regime of the moment (admit_now, the default; the
    # previous default pinned only roots first seen while low, and kept set(hot) here).
    assert kept[False] == {cold[0], hot[0]}
    assert kept[True] == set(cold)


def test_held_chunks_go_when_nothing_else_is_left(monkeypatch) -> None:
    import kvheat.integrations.vllm as kv

    monkeypatch.setattr(kv, "_loose", lambda *a: True)
    chain = [_key(0), _key(1)]
    mgr = _manager(2)
    pol = KVHeatCachePolicy(2)
    mgr._policy = pol
    _chain_request(mgr, chain, "a")
    _load(mgr, chain, "b")  # both held, both evictable
    assert pol.num_evictable() == 2 and pol.heat.victim() is None
    assert pol.evict(2, {chain[0]}) is None  # one unprotected: nothing happens
    got = pol.evict(1, set())
    assert got is not None and [k for k, _ in got] == [chain[1]]  # the tail first
    assert pol.fallbacks == 1 and pol.num_evictable() == 1


def test_gate_tracks_the_mean_eviction_age() -> None:
    trace = generate_workload(WorkloadConfig(num_conversations=150, arrival_rate=3.0, seed=3))
    mgr = _manager(300)
    pol = mgr._policy  # the default: gated rules
    ages = []
    evict = pol.evict

    def watched(n, protected):
        acc = pol.heat.clock.accesses
        out = evict(n, protected)
        ages.extend(acc - c.last for _, c in out or ())  # the record is on the chunk
        return out
    pol.evict = watched
    r = replay_offload(trace, "kvheat", 300, keys=request_keys(trace, 512), manager=mgr,
                       time_scale=0.2)
    assert r.evictions == pol.evicted == len(ages) > 300
    # over about the last `capacity` evictions: inside their range, near their mean
    last = ages[-300:]
    assert min(last) <= pol.evict_age <= max(last)


def test_the_policy_chunk_is_the_managers_chunk_status() -> None:
    mgr = _manager(8)
    pol = mgr._policy
    keys = [_key(i) for i in range(3)]
    ctx = ReqContext("a")
    mgr.on_new_request(ctx)
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 16)
    out = mgr.prepare_store(keys, ctx)
    assert out is not None and list(out.store_spec.block_ids) == [0, 1, 2]
    assert [(pol.get(k).ref_cnt, pol.get(k).is_ready) for k in keys] == [(-1, False)] * 3
    assert mgr.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
    mgr.complete_store(keys, ctx)
    assert [pol.get(k).chunk_id for k in keys] == [0, 1, 2]
    assert pol.num_evictable() == mgr._num_evictable_cache_chunks == 3
    mgr.prepare_load(keys[:2], ctx)
    assert [pol.get(k).ref_cnt for k in keys] == [1, 1, 0]
    assert pol.num_evictable() == mgr._num_evictable_cache_chunks == 1
    mgr.complete_load(keys[:2], ctx)
    assert pol.num_evictable() == 3 and pol.evictable_keys() == set(keys)


def test_replayed_workload_stays_consistent_with_the_manager() -> None:
    trace = generate_workload(WorkloadConfig(num_conversations=150, arrival_rate=3.0, seed=3))
    keys = request_keys(trace, 512)
    res = {p: replay_offload(trace, p, 300, keys=keys, time_scale=0.2)
           for p in ("lru", "kvheat", "belady")}
    for r in res.values():
        assert r.requests == len(trace) and r.evictions > 0
    assert 0 < res["kvheat"].hit_rate <= res["belady"].hit_rate
    # The manager's own count of idle chunks agrees with the policy's.
    mgr = _manager(300)
    replay_offload(trace, "kvheat", 300, keys=keys, manager=mgr, time_scale=0.2)
    assert mgr._num_evictable_cache_chunks == mgr._policy.num_evictable()
    assert mgr._num_write_pending_chunks == 0


@pytest.mark.parametrize("loose", [False, True], ids=["gated", "held-loads"])
def test_protection_inside_vllm_stays_consistent_with_the_manager(monkeypatch, loose) -> None:
    """The offload tier with protection on (kvheat/heat/protect.py) all through a replay,
    with loaded chunks held while their requests run or not: the manager's count of idle
    chunks agrees with the policy's, and the chunks pass through probation."""
    import kvheat.integrations.vllm as kv

    if loose:
        monkeypatch.setattr(kv, "_loose", lambda *a: True)
    trace = generate_workload(WorkloadConfig(num_conversations=150, arrival_rate=3.0, seed=3))
    keys = request_keys(trace, 512)
    mgr = _manager(300)
    pol = mgr._policy
    pol.heat.protect = False  # no miniature to switch it back: on throughout
    pol.heat.set_protect(True)
    r = replay_offload(trace, "kvheat", 300, keys=keys, manager=mgr, time_scale=0.2)
    assert r.requests == len(trace) and r.evictions > 0 and r.hit_rate > 0
    st = pol.heat.stats()
    assert st["protect"] == 1.0 and st["protect_promotions"] > 0
    assert mgr._num_evictable_cache_chunks == pol.num_evictable()
    assert mgr._num_write_pending_chunks == 0


@pytest.mark.skipif(not (TRACES / "mooncake_conversation_part1.jsonl").exists(),
                    reason="Mooncake trace not present")
def test_kvheat_beats_lru_and_arc_inside_vllm_on_mooncake() -> None:
    trace = load_trace(TRACES / "mooncake_conversation_part1.jsonl", 512, limit=2500)
    keys = request_keys(trace, 512)
    hr = {p: replay_offload(trace, p, 1953, keys=keys).hit_rate for p in ("lru", "arc", "kvheat")}
    assert hr["kvheat"] > max(hr["lru"], hr["arc"]) + 0.01, hr


# -- the CachePolicy contract, stateful ----------------------------------------------------


class PolicyContract(RuleBasedStateMachine):
    """Drives two KVHeatCachePolicy twins (no rules) with vLLM's calls against a model of
    ref counts.
    Failing evictions go to `a` only: if they changed any state, the twins would later
    evict differently."""

    pending = Bundle("pending")
    ready = Bundle("ready")

    policy_flags: dict[str, bool] = {"monotone": False, "early_hits": False}

    def __init__(self) -> None:
        super().__init__()
        self.a = KVHeatCachePolicy(6, **self.policy_flags)
        self.b = KVHeatCachePolicy(6, **self.policy_flags)
        self.ref: dict[bytes, int] = {}  # the model: key -> ref_cnt (-1: being written)
        self.next = 0
        self.req = 0

    def _both(self, name: str, *args):
        ra = getattr(self.a, name)(*args)
        rb = getattr(self.b, name)(*args)
        return ra, rb

    @rule(target=pending, group=st.integers(0, 1))
    def insert(self, group: int):
        self.next += 1
        k = _key(self.next, group)
        ctx = ReqContext(str(self.req))
        ctx.set_offload_key_position(k, 16 * (1 + self.next % 4))
        self._both("on_store_miss", [k], ctx)
        self.a.insert(k, ChunkStatus(self.next))
        self.b.insert(k, ChunkStatus(self.next))
        self.ref[k] = -1
        return k

    @rule(target=ready, k=consumes(pending))
    def complete_store(self, k):
        if k not in self.ref:  # dropped by clear()
            return k
        self.a.get(k).ref_cnt = 0
        self.b.get(k).ref_cnt = 0
        self._both("mark_evictable", k)
        self.ref[k] = 0
        return k

    @rule(k=consumes(pending))
    def failed_store(self, k):
        if k not in self.ref:
            return
        self._both("remove", k)
        del self.ref[k]
        assert self.a.get(k) is None

    @rule(k=ready)
    def pin(self, k):
        if k not in self.ref:
            return
        if self.ref[k] == 0:
            self._both("mark_non_evictable", k)
        self.ref[k] += 1
        self.a.get(k).ref_cnt += 1
        self.b.get(k).ref_cnt += 1

    @rule(k=ready)
    def unpin(self, k):
        if self.ref.get(k, 0) <= 0:
            return
        self.ref[k] -= 1
        self.a.get(k).ref_cnt -= 1
        self.b.get(k).ref_cnt -= 1
        if self.ref[k] == 0:
            self._both("mark_evictable", k)

    @rule(ks=st.lists(ready, max_size=5, unique=True), data=st.data())
    def request_finished(self, ks, data):
        ks = [k for k in ks if k in self.ref]
        inserted = set(data.draw(st.lists(st.sampled_from(ks), unique=True))) if ks else set()
        self.req += 1
        ctx = ReqContext(str(self.req))
        self._both("on_request_finished", [ks], inserted, set(ks) - inserted, ctx)

    @rule(ks=st.lists(ready, max_size=4, unique=True))
    def touch(self, ks):
        self._both("touch", [k for k in ks if k in self.ref], ReqContext("t"))

    @rule(n=st.integers(0, 8), prot=st.lists(ready, max_size=4, unique=True))
    def evict(self, n, prot):
        protected = set(prot)
        free = [k for k, r in self.ref.items() if r == 0 and k not in protected]
        snapshot = {k: (self.a.get(k).chunk_id, self.a.get(k).ref_cnt) for k in self.ref}
        got = self.a.evict(n, protected)
        if n > len(free):
            assert got is None
            assert {k: (self.a.get(k).chunk_id, self.a.get(k).ref_cnt) for k in self.ref} == snapshot
            return  # `b` never sees it: the twins must stay in step
        got_b = self.b.evict(n, protected)
        assert got is not None and got_b is not None
        keys = [k for k, _ in got]
        assert keys == [k for k, _ in got_b]
        assert len(set(keys)) == n
        for k, chunk in got:
            assert self.ref[k] == 0 and k not in protected and chunk.ref_cnt == 0
            assert self.a.get(k) is None
            del self.ref[k]

    @precondition(lambda self: self.ref)
    @rule()
    def clear(self):
        self._both("clear")
        self.ref.clear()
        assert self.a.chunks == {} and self.a.ghost_size() == 0
        assert len(self.a.heat.heap) == 0 and self.a.evictable_keys() == set()
        assert self.a.num_evictable() == 0

    @invariant()
    def agrees_with_model(self):
        assert set(self.a.chunks) == set(self.ref)
        assert self.a.evictable_keys() == {k for k, r in self.ref.items() if r == 0}
        assert self.a.num_evictable() == len(self.a.evictable_keys())


PolicyContract.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPolicyContract = PolicyContract.TestCase


class PolicyContractAllRules(PolicyContract):
    """The same contract with every rule on, always (early hits flush and re-key inside
    mark_non_evictable); the default (gated) machine is `PolicyContractGated`."""

    policy_flags = {"finish_inserts": True, "gated": False}


class PolicyContractGated(PolicyContract):
    """The default policy: monotone and early hits behind the gate."""

    policy_flags = {}


PolicyContractGated.TestCase.settings = PolicyContract.TestCase.settings
TestPolicyContractGated = PolicyContractGated.TestCase


PolicyContractAllRules.TestCase.settings = PolicyContract.TestCase.settings
TestPolicyContractAllRules = PolicyContractAllRules.TestCase


class PolicyContractHeld(PolicyContract):
    """The default policy with the hold's gate forced open, so chunks are held and taken
    by the fallback."""

    policy_flags = {}

    def __init__(self) -> None:
        import kvheat.integrations.vllm as kv

        self._loose, kv._loose = kv._loose, lambda *a: True
        super().__init__()

    def teardown(self) -> None:
        import kvheat.integrations.vllm as kv

        kv._loose = self._loose


PolicyContractHeld.TestCase.settings = PolicyContract.TestCase.settings
TestPolicyContractHeld = PolicyContractHeld.TestCase


def test_chunks_that_leave_drop_their_self_reference() -> None:
    """`Chunk.rec` points at the chunk while it is cached; evict, remove and clear break
    that cycle, so a chunk that leaves is freed by its refcount, not the collector."""
    mgr = _manager(4)
    pol = mgr._policy
    a, b = [_key(i) for i in range(4)], [_key(10 + i) for i in range(4)]
    _chain_request(mgr, a, "a")
    kept = [pol.get(k) for k in a]
    assert all(c is not None and c.rec is c for c in kept)
    _chain_request(mgr, b, "b")  # evicts the first chain to make room
    evicted = [c for c in kept if c.key is None]  # the manager evicted them
    assert evicted and all(c.rec is None for c in evicted)
    live = [pol.get(k) for k in b]
    assert all(c is not None and c.rec is c for c in live)
    pol.clear()
    assert all(c.rec is None for c in live)


def test_side_by_side_replays_each_policy_as_alone() -> None:
    from kvheat.integrations.vllm_replay import replay_side_by_side

    trace = generate_workload(WorkloadConfig(num_conversations=120, arrival_rate=3.0, seed=5))
    keys = request_keys(trace, 512)
    both = replay_side_by_side(trace, ["arc", "kvheat", "lru"], 200, keys=keys,
                               time_scale=0.5, slice_events=7)
    for r in both:
        alone = replay_offload(trace, r.policy, 200, keys=keys, time_scale=0.5)
        assert (r.hit_tokens, r.evictions, r.stores, r.calls, r.requests) == (
            alone.hit_tokens, alone.evictions, alone.stores, alone.calls, alone.requests)
        assert r.evictions > 0 and r.manager_s > 0
