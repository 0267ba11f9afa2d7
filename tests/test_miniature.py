"""The heat policy's half-life multiple, chosen online by miniature simulation
(kvheat/heat/miniature.py): it moves the way the traffic asks, both ways, and stays
bounded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvheat.cache.eviction import make_policy
from kvheat.cli import main
from kvheat.heat import KVHeat
from kvheat.heat.miniature import MIN_CAPACITY, MIN_RATE, MINI_BLOCKS, sample_rate
from kvheat.replay import replay
from kvheat.replay.traces import TraceRequest
from kvheat.server.metrics import ServerMetrics

BLOCK = 16
CAPACITY = 256 * BLOCK  # 256 blocks: miniatures of 64


def hot_and_scans(n: int = 2400, hot: int = 40, length: int = 8, scan: int = 24,
                  seed: int = 0) -> list[TraceRequest]:
    """Half the requests reuse one of `hot` prefixes, half are one-off scans: a long
    memory keeps the hot prefixes through the scans."""
    rng = random.Random(seed)
    out, uid = [], 10**9
    for i in range(n):
        if rng.random() < 0.5:
            h = rng.randrange(hot)
            ids = [h * 100 + j for j in range(length)]
        else:
            ids = list(range(uid, uid + scan))
            uid += scan
        out.append(TraceRequest(i * 1000.0, len(ids) * BLOCK, 1, ids))
    return out


def drifting(n: int = 3000, per: int = 40, length: int = 8, phase: int = 150,
             seed: int = 0) -> list[TraceRequest]:
    """A working set that moves on every `phase` requests: a long memory keeps the old
    sets' counts, recency follows the new one."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        h = (i // phase) * per + rng.randrange(per)
        ids = [h * 100 + j for j in range(length)]
        out.append(TraceRequest(i * 1000.0, len(ids) * BLOCK, 1, ids))
    return out


def run(trace: list[TraceRequest], capacity: int = CAPACITY, block: int = BLOCK,
        **kw: object) -> tuple[float, KVHeat]:
    """kvheat made with `kw`, replayed over `trace`: its hit rate and the policy."""
    made: list[KVHeat] = []

    def make() -> KVHeat:
        p = make_policy("kvheat", **kw)
        assert isinstance(p, KVHeat)
        made.append(p)
        return p

    r = replay(trace, make, capacity, block)
    return r.hit_rate, made[0]


@pytest.mark.parametrize("trace,up", [(hot_and_scans(), True), (drifting(), False)],
                         ids=["scans-want-memory", "drift-wants-recency"])
def test_the_multiple_moves_the_way_the_traffic_asks(trace: list[TraceRequest], up: bool) -> None:
    fixed = {m: run(trace, adapt="off", reuse_mult=m)[0] for m in (0.25, 1.0, 4.0)}
    # the traces do ask: one end of the ladder beats the start by a clear margin
    better = fixed[4.0] if up else fixed[0.25]
    assert better > fixed[1.0] + 0.005
    rate, pol = run(trace)
    moved = pol.reuse_mult
    assert (moved > 1.0) if up else (moved < 1.0)
    assert rate > fixed[1.0]  # the adaptation paid for its learning
    rounds = pol.explain()
    assert rounds and any(d["moved"] for d in rounds)
    st = pol.stats()
    assert st["mini_moves"] == sum(1 for d in rounds if d["moved"]) >= 1
    assert st["mini_rate"] == 0.25  # a 256-block cache: miniatures of 64 blocks


def test_the_sample_rate_keeps_each_miniature_large_enough() -> None:
    assert sample_rate(100) == 1.0
    for cap in (512, 1953, 19531, 10**6, 10**8, 10**12):
        r = sample_rate(cap)
        assert r in [2.0**-k for k in range(17)]
        assert cap * r >= MINI_BLOCKS or r == 1.0
        assert r == MIN_RATE or cap * r / 2 < MINI_BLOCKS  # the smallest that does
    # a cache far beyond any trace (a replay's "unbounded" size) builds small miniatures
    pol = KVHeat()
    pol.bind(2 * 10**9)
    pol.penalties.block_size = BLOCK
    sel = pol._start_selector()
    assert sel.rate == MIN_RATE and sel.threshold == 1 and sel.threshold2 == 1
    assert all(len(m.manager.pool.blocks) == int(2 * 10**9 * MIN_RATE) for m in sel.minis)


def test_small_caches_and_fixed_settings_run_no_miniatures() -> None:
    trace = drifting(n=400)
    _, small = run(trace)  # replay's capacity: 256 blocks, above MIN_CAPACITY
    assert small.selector is not None
    tiny = KVHeat()
    tiny.bind(MIN_CAPACITY - 1)
    assert tiny.feedback.adapt_mult and not tiny._want_selector  # the victims' feedback
    for kw in ({"adapt": "off"}, {"half_life": 100.0}, {"adapt": "victims"}):
        _, pol = run(trace, **kw)
        assert pol.selector is None and pol.explain() == []
    with pytest.raises(ValueError, match="adapt"):
        KVHeat(adapt="sometimes")


def test_what_it_keeps_is_bounded() -> None:
    _, pol = run(drifting(n=1500))
    sel = pol.selector
    assert sel is not None
    sel.max_decisions = 8
    for _ in range(40):
        sel.decide()
    assert len(sel.decisions) <= 8
    assert sel.decisions[-1].accesses == pol.clock.accesses  # the latest kept
    # every miniature holds at most its share of the cache
    for m in sel.minis:
        assert len(m.manager.pool.blocks) == max(1, int(256 * sel.rate))


def test_a_replay_with_the_selector_is_deterministic() -> None:
    trace = hot_and_scans(n=1200)
    a, pa = run(trace)
    b, pb = run(trace)
    assert a == b and pa.explain() == pb.explain()


def test_replay_explain_prints_and_writes_what_kvheat_learned(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["replay", "builtin", "--capacity", "200K", "--limit", "1500",
                                  "--policy", "lru,kvheat", "--no-misses", "--explain",
                                  "--json", str(out)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "what the adaptive policies learned" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.count("│") > 2
            and line.split("│")[1].strip() == "kvheat" and "=" in line]
    assert len(rows) == 1  # lru learns nothing: no row
    got = {x["policy"]: x for x in json.loads(out.read_text())["results"]}
    rounds = got["kvheat"]["explain"]
    assert rounds and {"accesses", "multiple", "lead_z", "moved"} <= set(rounds[0])
    assert "explain" not in got["lru"]
    assert got["kvheat"]["policy_stats"]["reuse_mult"] == rounds[-1]["multiple"]


def test_metrics_export_the_learned_multiple() -> None:
    _, pol = run(drifting(n=1500))
    m = ServerMetrics()
    m._refresh_heat("a", pol.stats())
    m._refresh_heat("a", pol.stats())  # a second scrape adds no moves
    reg = m.registry
    assert reg.get_sample_value("kvheat_heat_multiple", {"arm": "a"}) == pol.reuse_mult
    assert reg.get_sample_value("kvheat_heat_multiple_moves_total", {"arm": "a"}) == \
        pol.stats()["mini_moves"] >= 1
    for c in ("lo", "hi"):
        v = reg.get_sample_value("kvheat_heat_candidate_hit_tokens", {"arm": "a", "candidate": c})
        assert v is not None and v > 0


def test_a_rebind_to_another_size_makes_new_miniatures() -> None:
    pol = KVHeat()
    pol.bind(4096)
    pol.penalties.block_size = BLOCK
    first = pol._start_selector()
    pol.bind(4096)  # the same size: kept
    assert pol.selector is first
    pol.bind(40)  # under MIN_CAPACITY: the victims' rule
    assert pol.selector is None and pol.feedback.adapt_mult
    pol.bind(100_000)
    assert pol._want_selector and not pol.feedback.adapt_mult
    assert pol._start_selector().rate < first.rate


def test_a_session_after_an_unfinished_request_reaches_the_next_one() -> None:
    pol = KVHeat()
    pol.bind(4096)
    pol.penalties.block_size = BLOCK
    sel = pol._start_selector()
    sel.boundary(1.0)
    sel.access_key(b"\x00\x00\x00" + b"k" * 13, 0, BLOCK)  # pending, never finished
    sel.session("s2")
    assert sel.served == 1 and not sel.pending.keys  # the pending request went first
    assert sel.pending.session == "s2"
