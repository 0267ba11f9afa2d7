"""Two defects a hostile probe found, and their siblings:

1. An `exact` arm (whole-prompt caching, each prompt keyed in a scope of its own) refused
   a request for exactly a pinned prompt with a 400 ("pinned prefixes hold 16 of 24
   blocks"): the fits-the-pool check matched the prompt without its scope, so it saw
   none of the pinned blocks the request shares. An `off` arm made the opposite mistake
   (it counted pinned blocks it never shares, and the request waited for blocks forever:
   a 503 "retry later"). One check now (`Scheduler.never_fits`), for `add` and the
   server, matching as the mode admits.
2. Two hit rates for the same requests: the cache's (admin, arms, /metrics) 159/800, the
   tiers' 160/160 (one request counted: only those with a lower-tier plan; the last
   prompt token, always recomputed, counted as loaded). One count now, of every prompt,
   by tier (`kvheat.tiers.device.record_prompt`), and one formula (`kvheat.cache.hit_rate`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import MODEL, Served, start, stop
from test_tiers_hierarchy import BS, Engine, build, prompts

from kvheat.cache.misses import MissClassifier
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.server.config import ArmConfig, ServerConfig
from kvheat.tiers import TierSpec

ADMIN = {"Authorization": "Bearer adm"}
ONE = SamplingParams(max_tokens=1, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(seed: int, n: int) -> list[int]:
    """`n` seeded random token ids: prompts of two seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(s: Served, prompt: list[int], **kw: Any) -> httpx.Response:
    return httpx.post(s.base + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **kw})


def _engine(llama: tuple, mode: str = "block", num_blocks: int = 24,
            tiers: TierSpec | None = None, **sched: Any) -> LLMEngine:
    model, tok, _ = llama
    return LLMEngine(model, tok, EngineConfig(
        num_blocks=num_blocks, block_size=16, policy="lru",
        scheduler=SchedulerConfig(prefix_caching=mode, **sched), tiers=tiers or TierSpec()))


# ---- 1. pinned prompts on exact (and off) arms ------------------------------------------
@pytest.fixture(scope="module", params=["block", "exact"])
def pinned_arm(request: pytest.FixtureRequest) -> Iterator[Served]:
    s = start(ServerConfig(num_blocks=24, threads=1, admin_token="adm", max_tokens_limit=200,
                           arms=[ArmConfig("a", 100, "lru", prefix_caching=request.param)]))
    yield s
    stop(s)


@pytest.mark.parametrize("n_prompt", [256, 250])
def test_a_pinned_prompt_is_served_from_its_pins_in_every_mode(pinned_arm: Served,
                                                                n_prompt: int) -> None:
    """The probe: a 24-block pool, a 16-block prompt pinned, then a request for exactly
    that prompt: 400 on the exact arm, 240 cached tokens on the block arm. A prompt whose
    full blocks are pinned (250 tokens: 15 pinned blocks and a partial one) is served
    from them too. Every mode serves both, from the pins, up to the pool's last block."""
    s = pinned_arm
    p = _ids(n_prompt, n_prompt)
    r = httpx.post(s.base + "/admin/pin", headers=ADMIN, json={"token_ids": p}, timeout=60)
    assert r.status_code == 200 and r.json()["pinned_tokens"] == {"a": n_prompt // 16 * 16}
    try:
        r = _complete(s, p, max_tokens=16, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 240
        # The most the pool holds beside the other pins: prompt + 128 tokens, 24 blocks.
        most = (24 * 16 - n_prompt)
        r = _complete(s, p, max_tokens=most, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == most
        r = _complete(s, p, max_tokens=most + 1)
        assert r.status_code == 400 and "KV pool has 24 blocks" in r.json()["error"]["message"]
        # Another prompt shares no pinned block: the pins hold 16 (or 15) of 24 blocks.
        r = _complete(s, _ids(7, 128), max_tokens=32)
        assert r.status_code == 400, r.text
        assert "pinned prefixes hold" in r.json()["error"]["message"]
    finally:
        r = httpx.post(s.base + "/admin/unpin", headers=ADMIN, json={"token_ids": p},
                       timeout=60)
        assert r.status_code == 200
    s.wait_idle()


def test_the_fits_check_shares_pinned_blocks_as_the_mode_admits(llama: tuple) -> None:
    """`never_fits`, the one check of the scheduler and the server: pinned blocks a
    request shares need no new block, and only the blocks its mode shares count: a
    block arm shares a pinned prefix with longer prompts, an exact arm only with the
    very prompt, an off arm never (its request needs all its blocks: it was accepted and
    then waited for them forever, answered 503 "retry later")."""
    p = _ids(1, 256)
    for mode, same, longer in (("block", True, True), ("exact", True, False),
                               ("off", False, False)):
        e = _engine(llama, mode)
        e.generate([p], ONE)
        assert e.pin_prefix(p) == 256
        sched = e.scheduler
        assert (sched.never_fits(p, 16) is None) is same, mode
        assert (sched.never_fits(p + _ids(2, 16), 16) is None) is longer, mode
        assert sched.never_fits(_ids(3, 64), 64) is None  # 8 blocks: all that is left
        assert "pinned prefixes hold 16" in (sched.never_fits(_ids(3, 64), 80) or "")
        assert "KV pool has 24" in (sched.never_fits(p, 129) or "")
        # What the check accepts, the engine runs (from the pins where it shares them).
        out = e.generate([p], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        if same:
            assert out.finish_reason == "length" and out.metrics.num_cached_tokens == 240
        e.scheduler.check_accounting()
        # `add` keeps refusing only what no pool state could ever fit.
        with pytest.raises(ValueError, match="KV pool has 24 blocks"):
            e.add_request(p, SamplingParams(max_tokens=129))
        e.close()


def test_off_arm_refuses_what_its_pins_keep_out() -> None:
    s = start(ServerConfig(num_blocks=24, threads=1, admin_token="adm",
                           arms=[ArmConfig("a", 100, "lru", prefix_caching="off")]))
    try:
        p = _ids(1, 256)
        r = httpx.post(s.base + "/admin/pin", headers=ADMIN, json={"token_ids": p}, timeout=60)
        assert r.status_code == 200
        r = _complete(s, p, max_tokens=16)
        assert r.status_code == 400, r.text  # it was a 503 "retry later", forever
        assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        stop(s)


def test_exact_arm_classifies_misses_in_the_prompt_scope() -> None:
    """The server's miss classes (and its predicted hit) keyed the prompt without the
    exact arm's scope: a repeat read as uncached, another prompt's prefix as seen."""
    s = start(ServerConfig(num_blocks=64, threads=1, admin_token="adm",
                           arms=[ArmConfig("a", 100, "lru", prefix_caching="exact")]))
    try:
        p = _ids(1, 160)
        assert _complete(s, p).status_code == 200
        # A new prompt sharing p's first 8 blocks: never seen in its own scope.
        r = _complete(s, p[:128] + _ids(2, 32))
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        s.wait_idle()
        misses = httpx.get(s.base + "/admin/stats", headers=ADMIN).json()["arms"]["a"]["misses"]
        assert misses["none"]["capacity"] == 0 and misses["none"]["compulsory"] == 320
        eng = s.server.worker.engines["a"]
        c = MissClassifier(16, bits=None)
        kinds = s.on_engine_thread(lambda: c.prepare(eng.cache, p, None,
                                                     scope=eng.scheduler.prompt_scope(p)))
        assert kinds == ["cached"] * 10
    finally:
        stop(s)


# ---- 2. one hit rate ----------------------------------------------------------------------
FIVE = [_ids(0, 160), _ids(1, 160), _ids(2, 160), _ids(3, 160), _ids(0, 160)]


def test_the_tiers_hit_rate_is_the_caches(llama: tuple) -> None:
    """The probe's five requests: a 160-token prompt, three others that push it off a
    24-block device to the host tier, then it again (159 tokens from host, the last one
    recomputed). The cache said 159/800, the tiers 160/160 (one request: the only one
    with a plan, and the recomputed token counted as loaded)."""
    e = _engine(llama, tiers=TierSpec(host_blocks=64))
    outs = []
    for p in FIVE:
        outs += e.generate([p], ONE)
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 0, 0, 159]
    assert outs[-1].metrics.cached_by_tier == {"device": 0, "host": 159}
    st, ts = e.cache.stats, e.tiers.stats()  # type: ignore[union-attr]
    assert (st.requests, st.query_tokens, st.hit_tokens) == (5, 800, 159)
    assert (ts["requests"], ts["query_tokens"]) == (5, 800)
    assert (ts["device_hit_tokens"], ts["lower_hit_tokens"]) == (0, 159)
    assert ts["total_hit_rate"] == st.hit_rate == 159 / 800
    host = ts["tiers"]["0:host"]  # type: ignore[index]
    assert host["hit_tokens"] == 159 and host["hit_blocks"] == 10
    assert host["hit_rate"] == 159 / 800
    e.close()


def test_a_request_aborted_in_prefill_is_counted_with_its_hits(llama: tuple) -> None:
    """A prompt is counted once, at its first admission: a request admitted and aborted
    before its first token is in the cache's count, with the hits it got, and its metrics
    say so (the server's arms, metrics and response count it from them: they had 0)."""
    e = _engine(llama, num_blocks=64, tiers=TierSpec(host_blocks=64),
                max_num_batched_tokens=32)
    p = _ids(5, 160)
    e.generate([p], ONE)
    rid = e.add_request(p + _ids(6, 64), ONE)
    e.step()  # admitted: 160 tokens cached (device), its first 32-token chunk scheduled
    e.abort(rid)
    out = e.release(rid)
    assert out.metrics.first_token is None and out.metrics.num_cached_tokens == 160
    assert out.metrics.cached_by_tier == {"device": 160} and out.metrics.admitted
    st, ts = e.cache.stats, e.tiers.stats()  # type: ignore[union-attr]
    assert (st.requests, st.query_tokens, st.hit_tokens) == (2, 384, 160)
    assert ts["total_hit_rate"] == st.hit_rate
    e.close()


def test_direct_tier_allocations_count_loads_in_the_caches_stats(tmp_path: Path) -> None:
    """`kvheat.tiers.device.allocate` on its own (count_stats=True, no logits rule): the cache's
    hit count left out the tokens loaded from lower tiers."""
    tc, pool = build("gqa", None, tmp_path, async_io=False)
    eng = Engine(tc, pool)
    ps = prompts(6, 4)
    for p in ps:
        eng.run(p)
    tc.tiers.flush()
    served = sum(eng.run(p) for p in reversed(ps))
    assert served == 6 * 4 * BS
    st, ts = tc.mgr.stats, tc.tiers.stats()
    assert st.hit_tokens == served and st.query_tokens == 12 * 4 * BS
    assert ts["lower_hit_tokens"] > 0 and ts["total_hit_rate"] == st.hit_rate == 0.5
    tc.close()


def test_admin_arms_metrics_and_tiers_report_one_hit_rate() -> None:
    s = start(ServerConfig(num_blocks=24, threads=1, admin_token="adm",
                           tiers=TierSpec(host_blocks=64),
                           arms=[ArmConfig("a", 100, "lru")]))
    try:
        cached = []
        for p in FIVE:
            r = _complete(s, p)
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 0, 0, 0, 159]
        s.wait_idle()
        s.on_engine_thread(s.server.worker.refresh_gauges)
        arm = httpx.get(s.base + "/admin/stats", headers=ADMIN).json()["arms"]["a"]
        row = httpx.get(s.base + "/admin/arms", headers=ADMIN).json()["arms"][0]
        want = 159 / 800
        assert arm["hit_rate"] == want
        assert arm["tiers"]["total_hit_rate"] == want and arm["tiers"]["requests"] == 5
        assert row["hit_rate"] == want and row["requests"] == 5
        assert s.metric("kvheat_prefix_hit_rate", arm="a") == pytest.approx(want)
        assert s.metric("kvheat_cached_tokens_total", arm="a") == 159
        assert s.metric("kvheat_tier_hit_tokens_total", arm="a", tier="host") == 159
    finally:
        stop(s)
