"""`kvheat doctor`'s capacity replay: the server's bounded record of recent prompts (as
block ids, admin token only), and a recommended pool size that, given to a fresh server
replaying the same traffic, really removes most of its capacity misses."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from test_doctor import _complete
from test_server import Served, start, stop

from kvheat.doctor import Snapshot, admin_stats, diagnose, scrape
from kvheat.doctor.replay import (
    FACTORS,
    RecentKeys,
    fetch_recent_keys,
    replay_all,
    replay_arm,
    with_recent_keys,
)
from kvheat.replay import PreparedTrace, TraceRequest, replay
from kvheat.replay.curves import KNEE
from kvheat.server.config import ServerConfig

ADMIN = "adm"
# Eight prompts with nothing in common, each several 16-token blocks, sent round-robin:
# the reuse distance (all eight) is larger than the small pool, so LRU evicts each one
# before it comes back: every miss after the first round is a capacity miss.
PROMPTS = [f"Story {i}. " + " ".join(f"item{i} part{j}" for j in range(24)) for i in range(8)]
ROUNDS = 4


def _serve(num_blocks: int) -> Served:
    return start(ServerConfig(num_blocks=num_blocks, threads=1, max_num_seqs=1,
                              max_tokens_limit=8, policy="lru", admin_token=ADMIN))


def _traffic(base: str) -> None:
    for _ in range(ROUNDS):
        for p in PROMPTS:
            assert _complete(base, p, 1) == "ok"


def test_recent_keys_is_bounded_and_says_only_which_blocks_are_shared() -> None:
    rec = RecentKeys(max_requests=3, max_keys=10)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    rec.add(1.0, [])  # shorter than a block: nothing to keep
    rec.add(1.0, [a, b])
    rec.add(2.0, [a, c])
    assert rec.export() == [{"t": 0.0, "blocks": [0, 1]}, {"t": 1.0, "blocks": [0, 2]}]
    for i in range(5):
        rec.add(3.0 + i, [bytes([i]) * 16] * 4)
    assert len(rec.entries) <= 3 and rec.num_keys <= 10
    assert rec.num_keys == sum(len(k) for _t, k in rec.entries)
    rec.add(9.0, [a] * 50)  # one huge prompt keeps its first max_keys blocks only
    assert rec.num_keys == 10 and len(rec.entries) == 1
    # At the default bounds, the worst case (every block distinct) stays under 1 MiB.
    big = RecentKeys()
    for i in range(big.entries.maxlen or 0):
        big.add(float(i), [i.to_bytes(4, "big") + j.to_bytes(4, "big") for j in range(64)])
    assert big.num_keys <= big.max_keys
    assert len(json.dumps(big.export())) < 1024 * 1024


def test_no_recommendation_when_eight_times_the_pool_is_not_enough() -> None:
    # 20 two-block prompts round-robin through 2 blocks of LRU: x8 (16 blocks) still
    # thrashes; only the footprint (40 distinct blocks, + one prompt's copy) recovers.
    reqs = [{"t": float(i), "blocks": [2 * (i % 20), 2 * (i % 20) + 1]} for i in range(80)]
    rep = replay_arm("a", {"policy": "lru", "block_size": 16, "blocks": 2, "requests": reqs})
    assert rep is not None and rep.recommended is None and rep.footprint >= 40
    assert rep.hit_rates[16] == 0.0 and rep.unbounded == 0.75
    assert replay_arm("a", {"policy": "lru", "block_size": 16, "blocks": 2,
                            "requests": [{"t": "x", "blocks": [-1]}]}) is None  # malformed
    assert replay_arm("a", {"policy": "no-such", "block_size": 16, "blocks": 2,
                            "requests": reqs}) is None


@pytest.mark.parametrize("policy", ["lru", "kvheat", "arc"])
def test_the_curve_gives_the_replayers_rates_and_a_knee(policy: str) -> None:
    # A skewed mix: a hot prompt between rounds of cold ones; the curve's points are the
    # rates a plain replay gives at those sizes (LRU's by stack distance), and the knee
    # (90% of unbounded) lies between the pool and the footprint.
    rng = random.Random(3)
    reqs = []
    for i in range(300):
        base = 0 if rng.random() < 0.5 else 4 * rng.randrange(1, 40)
        reqs.append({"t": float(i), "blocks": [base + j for j in range(4)]})
    record = {"policy": policy, "block_size": 16, "blocks": 8, "requests": reqs}
    rep = replay_arm("a", record)
    assert rep is not None
    pt = PreparedTrace([TraceRequest(r["t"] * 1000.0, 64, 0, r["blocks"]) for r in reqs], 16)
    for n, rate in rep.hit_rates.items():
        assert rate == replay(pt, policy, n * 16).hit_rate, n
    assert rep.unbounded == pt.infinite_hit_rate() and rep.footprint == pt.footprint_blocks()
    assert rep.knee is not None and rep.blocks < rep.knee <= rep.footprint
    assert rep.current < KNEE * rep.unbounded


def test_replay_recommends_a_pool_that_removes_the_capacity_misses() -> None:
    small = 24
    s = _serve(small)
    try:
        url = s.base + "/metrics"
        a = scrape(url)
        _traffic(s.base)
        s.wait_idle()
        s.wait_metric("kvheat_requests_total", ROUNDS * len(PROMPTS))
        b = scrape(url)
        cap_small = s.metric("kvheat_prefix_miss_tokens_total", kind="capacity")
        assert cap_small > 0
        # The record needs the admin token; it holds ids, never the prompts' text.
        keys_url = s.base + "/admin/recent-keys"
        assert httpx.get(keys_url).status_code == 401
        assert httpx.get(keys_url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        body = httpx.get(keys_url, headers={"Authorization": f"Bearer {ADMIN}"})
        assert body.status_code == 200 and "Story" not in body.text and "item" not in body.text
        recent = fetch_recent_keys(s.base + "/admin/stats", ADMIN)
        arm = recent["arms"]["default"] if "default" in recent["arms"] else \
            next(iter(recent["arms"].values()))
        assert arm["blocks"] == small and arm["block_size"] == 16 and arm["policy"] == "lru"
        assert len(arm["requests"]) == ROUNDS * len(PROMPTS)
        (rep,) = replay_all(recent)
        assert rep.recommended is not None and rep.recommended > small
        assert rep.hit_rates[rep.recommended] > rep.current + 0.5 * (rep.unbounded - rep.current)
        # The doctor: capacity first, its action names that pool size, the rates as evidence.
        adm = with_recent_keys(admin_stats(s.base + "/admin/stats", ADMIN),
                               s.base + "/admin/stats", ADMIN)
        top = diagnose(Snapshot(a, b, 1.0, None, adm))[0]
        assert top.cause == "capacity"
        assert f"num_blocks={rep.recommended} " in top.action and "Rule:" in top.action
        assert any(k.endswith("hit rate, unbounded") for k in top.evidence)
        assert len([k for k in top.evidence if "hit rate @" in k]) == 1 + len(FACTORS)
        # Without the admin API: the lower-bound estimate, and why there is no replay.
        plain = diagnose(Snapshot(a, b, 1.0))[0]
        assert plain.cause == "capacity" and "needs --admin-url" in plain.action
    finally:
        stop(s)
    # A fresh server of the recommended size, the same traffic: most capacity misses go.
    s = _serve(rep.recommended)
    try:
        _traffic(s.base)
        s.wait_idle()
        s.wait_metric("kvheat_requests_total", ROUNDS * len(PROMPTS))
        cap_big = s.metric("kvheat_prefix_miss_tokens_total", kind="capacity")
        assert cap_big <= 0.2 * cap_small, (cap_big, cap_small)
    finally:
        stop(s)


def test_admin_api_off_has_no_record() -> None:
    s = start(ServerConfig(num_blocks=64, threads=1, max_tokens_limit=8))
    try:
        assert httpx.get(s.base + "/admin/recent-keys").status_code == 404
    finally:
        stop(s)
