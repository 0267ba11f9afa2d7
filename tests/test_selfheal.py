"""`kvheat serve --self-heal`: each action fires on its injected cause and ends once the
cause is gone, a dry run changes nothing, the rate limit holds, and greedy outputs under
self-healing equal a plain server's. Real servers (the tiny model) on loopback, real
tiers (a real Redis for the fault, a disk folder), as in test_server_faults.py; the
overload decisions are driven with /metrics text, as test_doctor.py scores it."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RedisServer, wait_for
from test_server import MODEL, Served, start, stop

from kvheat.doctor import Finding, Snapshot, parse_metrics
from kvheat.server.cli import serve_command
from kvheat.server.config import ConfigError, ServerConfig, TenantConfig
from kvheat.server.selfheal import SelfHealer
from kvheat.tiers import TierManager, TierSpec
from kvheat.tiers.redis_store import RedisStore


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(s: Served, prompt: list[int] | str, key: str | None = None,
              **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}
    return httpx.post(s.base + "/v1/completions", headers=headers, timeout=60, json=body)


def _heal_config(**kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"threads": 1, "self_heal": "on", "self_heal_interval_s": 0.2,
                           "self_heal_hold_s": 0.5, "self_heal_min_gap_s": 1.0,
                           "self_heal_probe_ok": 2}
    out.update(kw)
    return out


# ---- config and flag --------------------------------------------------------------------
def test_config_keys_are_typed_and_the_flag_takes_an_optional_mode() -> None:
    assert ServerConfig().self_heal == "off"
    for bad in ({"self_heal": "yes"}, {"self_heal": True}, {"self_heal_interval_s": 0},
                {"self_heal_interval_s": "2"}, {"self_heal_probe_ok": 0},
                {"self_heal_hold_s": -1.0}):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)
    with pytest.raises(ConfigError, match="priority"):
        TenantConfig(**{"name": "acme", "api_keys": ["sk-acme-key"], "priority": "high"})

    def parsed(*args: str) -> Any:
        return serve_command.make_context("serve", list(args)).params["self_heal"]

    assert parsed() is None  # the config's (off)
    assert parsed("--self-heal") == "on"
    assert parsed("--self-heal=dry-run") == "dry-run"
    assert parsed("--self-heal", "off") == "off"


# ---- tier fault: bypass, probe back, restore -------------------------------------------
def _evicting_traffic(s: Served, seed: int, n: int) -> None:
    """Distinct prompts through a small pool: every eviction demotes to the tier."""
    for i in range(n):
        r = _complete(s, _ids(seed + i, 64))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("mode", ["on", "dry-run"])
def test_tier_fault_bypass_probe_and_restore(redis_server: RedisServer, mode: str) -> None:
    s = start(ServerConfig(**_heal_config(
        num_blocks=24, self_heal=mode,
        # a gap longer than the checks below take, however loaded the machine: the Redis
        # comes back empty, and its indexed blocks' failed loads are fault evidence again
        self_heal_min_gap_s=5.0,
        tiers=TierSpec(redis_url=redis_server.url, redis_bytes=64 << 20, redis_shared=False))))
    heal = s.server.healer
    assert heal is not None
    tc = s.server.worker.engines["default"].tiers
    assert tc is not None
    redis = tc.stores[0]
    assert isinstance(redis, RedisStore)
    redis.backoff_max_s = 0.2  # the store retries soon
    labels = {"action": "bypass", "cause": "tier_fault", "tier": "redis",
              "dry_run": "true" if mode == "dry-run" else "false"}
    try:
        _evicting_traffic(s, 0, 6)
        assert s.metric("kvheat_self_heal_actions_total") == 0  # healthy: nothing done
        redis_server.stop()  # the cause
        seen_bypassed = False
        deadline = time.monotonic() + 20
        while s.metric("kvheat_self_heal_actions_total", **labels) < 1:
            assert time.monotonic() < deadline, "no bypass on a dead tier"
            _evicting_traffic(s, 100 + int(time.monotonic() * 1000) % 10000, 2)
            seen_bypassed |= tc.health()[0].bypassed
        seen_bypassed |= tc.health()[0].bypassed
        if mode == "dry-run":  # reported, not done
            assert not seen_bypassed and not tc.health()[0].bypassed
        else:
            assert tc.health()[0].bypassed and not tc.health()[0].up
            assert s.metric("kvheat_self_heal_active", **labels) == 1
            # Served while bypassed: blocks are recomputed, requests answer.
            _evicting_traffic(s, 5000, 3)
            spans = [sp for sp in s.exporter.get_finished_spans()
                     if sp.name == "kvheat.self_heal"]
            assert any(e.name == "self_heal.bypass" and e.attributes is not None
                       and e.attributes["kvheat.self_heal.tier"] == "redis"
                       for sp in spans for e in sp.events)
        # The rate limit: one bypass per tier however long the fault lasts.
        time.sleep(1.5)
        assert s.metric("kvheat_self_heal_actions_total", **labels) == 1
        redis_server.start()  # the cause goes
        restore = dict(labels, action="restore")
        deadline = time.monotonic() + 20
        while s.metric("kvheat_self_heal_actions_total", **restore) < 1:
            assert time.monotonic() < deadline, "the tier was never restored"
            _evicting_traffic(s, 9000 + int(time.monotonic() * 1000) % 10000, 1)
            time.sleep(0.1)
        assert not tc.health()[0].bypassed and tc.health()[0].up
        assert s.metric("kvheat_self_heal_active", **labels) == 0
        assert s.metric("kvheat_self_heal_actions_total", action="recalibrate",
                        tier="redis") >= 1
        assert s.metric("kvheat_internal_errors_total") == 0
    finally:
        stop(s)


# ---- overload: shed by priority, raise the autoscaler's signal, rate limit, revert ------
def _overload_text(finished: int, refused: int) -> bytes:
    return (f'kvheat_requests_total{{arm="default",tenant="t",endpoint="completions",'
            f'finish_reason="length"}} {finished}\n'
            f'kvheat_rejected_requests_total{{status="503"}} {refused}\n'
            f'kvheat_queue_length{{arm="default",queue="waiting"}} 0\n'
            f'kvheat_queue_length{{arm="default",queue="running"}} 1\n').encode()


def _window(a: tuple[int, int], b: tuple[int, int]) -> Snapshot:
    return Snapshot(parse_metrics(_overload_text(*a)), parse_metrics(_overload_text(*b)), 2.0)


def test_overload_sheds_lowest_priority_first_rate_limited_and_reverts() -> None:
    tenants = [TenantConfig("batch", ["sk-batch-key"], priority=0),
               TenantConfig("bulk", ["sk-bulk-key"], priority=1),
               TenantConfig("live", ["sk-live-key"], priority=2)]
    # A long interval: the test drives the steps itself, at the times it names.
    s = start(ServerConfig(**_heal_config(num_blocks=64, tenants=tenants,
                                          self_heal_interval_s=3600.0,
                                          self_heal_hold_s=10.0, self_heal_min_gap_s=10.0)))
    heal = s.server.healer
    assert heal is not None
    over = _window((100, 0), (120, 30))  # 30 of 50 offered refused with 503
    calm = _window((120, 30), (160, 30))

    def actions(action: str) -> float:
        return s.metric("kvheat_self_heal_actions_total", action=action, dry_run="false")

    try:
        assert [_complete(s, "hi", k).status_code for k in
                ("sk-batch-key", "sk-bulk-key", "sk-live-key")] == [200, 200, 200]
        heal.step(over, 0.0)
        assert heal.shed_level == 1 and actions("shed") == 1
        r = _complete(s, "hi", "sk-batch-key")
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "load_shed"
        assert _complete(s, "hi", "sk-bulk-key").status_code == 200
        assert _complete(s, "hi", "sk-live-key").status_code == 200
        # The autoscaler's signal: the window's 30 refused, on the HPA's series.
        assert actions("scale_signal") == 1 and heal.boost == 30
        s.server.worker.refresh_gauges()
        assert s.metric("kvheat_queue_length", queue="waiting") == 30
        assert heal.read()[("kvheat_queue_length",
                            (("arm", "default"), ("queue", "waiting")))] == 0  # not to itself
        # Rate limit: still overloaded a second later, no second step yet.
        heal.step(over, 1.0)
        assert heal.shed_level == 1 and actions("shed") == 1
        assert heal.boost == 31 and actions("scale_signal") == 1  # + the one shed since
        heal.step(over, 10.0)
        assert heal.shed_level == 2 and actions("shed") == 2
        assert _complete(s, "hi", "sk-bulk-key").status_code == 429
        heal.step(over, 30.0)
        assert heal.shed_level == 2  # the highest priority is never shed
        assert _complete(s, "hi", "sk-live-key").status_code == 200
        # The cause goes: one class back per hold (10 s), the signal back to the queue.
        heal.step(calm, 31.0)
        heal.step(calm, 35.0)
        assert heal.shed_level == 2 and heal.boost > 0  # within the hold
        heal.step(calm, 41.0)
        assert heal.shed_level == 1 and heal.boost == 0
        assert actions("unshed") == 1 and actions("scale_signal_end") == 1
        heal.step(calm, 45.0)
        assert heal.shed_level == 1
        heal.step(calm, 51.0)
        assert heal.shed_level == 0 and actions("unshed") == 2
        assert _complete(s, "hi", "sk-batch-key").status_code == 200
        s.server.worker.refresh_gauges()
        assert s.metric("kvheat_queue_length", queue="waiting") == 0
        assert s.metric("kvheat_self_heal_shed_requests_total") == 2
        assert s.metric("kvheat_rejected_requests_total", status="429") == 2
    finally:
        stop(s)


def test_dry_run_sheds_nothing() -> None:
    tenants = [TenantConfig("batch", ["sk-batch-key"], priority=0),
               TenantConfig("live", ["sk-live-key"], priority=1)]
    s = start(ServerConfig(**_heal_config(num_blocks=64, tenants=tenants, self_heal="dry-run",
                                          self_heal_interval_s=3600.0)))
    heal = s.server.healer
    assert heal is not None
    try:
        heal.step(_window((100, 0), (120, 30)), 0.0)
        assert s.metric("kvheat_self_heal_actions_total", action="shed", dry_run="true") == 1
        assert _complete(s, "hi", "sk-batch-key").status_code == 200  # counted, not refused
        assert s.metric("kvheat_self_heal_shed_requests_total", dry_run="true") == 1
        s.server.worker.refresh_gauges()
        assert s.metric("kvheat_queue_length", queue="waiting") == 0  # HPA's series untouched
        assert s.server.metrics.queue_boost == {}
    finally:
        stop(s)


# ---- tier_slow on a tier that is fast again: recalibrate -------------------------------
def _slow_text(recomputed: int) -> bytes:
    return (f'kvheat_requests_total{{arm="default",tenant="none",endpoint="completions",'
            f'finish_reason="length"}} {10 + recomputed}\n'
            f'kvheat_load_decisions_total{{arm="default",decision="recompute"}} {recomputed}\n'
            f'kvheat_load_decisions_total{{arm="default",decision="load"}} 0\n'
            f'kvheat_tier_bandwidth_bytes_per_second{{arm="default",tier="disk",'
            f'direction="read"}} 1000\n').encode()


def _disk_healer(tmp_path: Path, num_blocks: int) -> tuple[Served, SelfHealer, TierManager]:
    """A server with a disk tier and a healer stepped by the test (its own interval is an
    hour); the healer and the arm's tiers."""
    s = start(ServerConfig(**_heal_config(
        num_blocks=num_blocks, self_heal_interval_s=3600.0,
        tiers=TierSpec(disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20))))
    heal = s.server.healer
    assert heal is not None
    tc = s.server.worker.engines["default"].tiers
    assert tc is not None
    return s, heal, tc


def test_stale_slow_timings_are_recalibrated(tmp_path: Path) -> None:
    s, heal, tc = _disk_healer(tmp_path, num_blocks=24)
    disk = tc.stores[0]
    try:
        # Timings left from a slow spell: 5 s a block, so every disk block is recomputed.
        for _ in range(50):
            disk.read_model.record(tc.block_bytes, 5.0)
        assert (tc.estimate_load_s(0, 1) or 0) > 1
        slow = Snapshot(parse_metrics(_slow_text(0)), parse_metrics(_slow_text(20)), 2.0)
        heal.step(slow, 0.0)
        # Its probe read is fast: not bypassed, measured again instead.
        assert not tc.health()[0].bypassed
        assert s.metric("kvheat_self_heal_actions_total", action="recalibrate",
                        cause="tier_slow", tier="disk") == 1
        assert (tc.estimate_load_s(0, 1) or 9) < 0.5
        heal.step(slow, 0.5)  # within the gap (1 s): not again
        assert s.metric("kvheat_self_heal_actions_total", action="recalibrate") == 1
        # A full disk (refusing writes, the doctor's tier_fault at 0.8) still serves its
        # reads: it is not bypassed.
        full = parse_metrics(_slow_text(20) + b'kvheat_tier_writable{arm="default",tier="disk"} 0\n')
        heal.step(Snapshot(parse_metrics(_slow_text(20)), full, 2.0), 5.0)
        assert not tc.health()[0].bypassed and not heal.bypassed
    finally:
        stop(s)


# ---- greedy outputs, and a failing step contained ---------------------------------------
def test_greedy_outputs_under_self_heal_equal_a_plain_servers(tmp_path: Path) -> None:
    """Prompts repeated through a small pool (their blocks go to disk and come back),
    served with the disk tier in use, bypassed by the healer, and restored: every answer
    is the plain server's."""
    prompts = [_ids(i, 48) for i in range(6)]
    plain = start(ServerConfig(num_blocks=64, threads=1))
    try:
        want = [_complete(plain, p, max_tokens=8).json()["choices"][0]["text"] for p in prompts]
    finally:
        stop(plain)
    s, heal, tc = _disk_healer(tmp_path, num_blocks=16)
    try:
        def answers() -> list[str]:
            return [_complete(s, p, max_tokens=8).json()["choices"][0]["text"] for p in prompts]

        assert answers() == want
        assert answers() == want  # again: some blocks come back from disk
        heal._bypass("disk", "tier_fault", 1.0, 0.0)
        heal._apply()
        assert tc.health()[0].bypassed
        assert answers() == want
        for t in (1.0, 2.0, 3.0):  # its probes pass: restored
            heal._tiers(_no_finding(), _no_finding(), t)
        assert not tc.health()[0].bypassed
        assert answers() == want
        assert s.metric("kvheat_tier_hit_tokens_total", tier="disk") > 0
    finally:
        stop(s)


def _no_finding() -> Finding:
    return Finding("none", 0.0)


def test_a_failing_step_is_contained() -> None:
    s = start(ServerConfig(**_heal_config(num_blocks=32)))
    heal = s.server.healer
    assert heal is not None

    def broken() -> Any:
        raise RuntimeError("injected scrape failure")

    try:
        heal.read = broken  # type: ignore[method-assign]
        assert wait_for(lambda: s.metric("kvheat_internal_errors_total", where="self_heal") >= 2)
        assert _complete(s, "still serving").status_code == 200
        assert heal._thread is not None and heal._thread.is_alive()
    finally:
        stop(s)


def test_a_tier_that_turned_slow_is_seen_before_its_model_follows(tmp_path: Path) -> None:
    """The latest reads far slower than the transfer model predicts (its trimmed mean
    still the old speed, loads still chosen, so no doctor finding yet): the healer probes
    the tier at once; fast by the probe, its timings are measured again."""
    s, heal, tc = _disk_healer(tmp_path, num_blocks=24)
    model = tc.stores[0].read_model
    try:
        for _ in range(200):
            model.record(tc.block_bytes, 1e-4)
        assert model.drift() == pytest.approx(1.0, rel=0.2)
        heal.step(_window((1, 0), (2, 0)), 0.0)
        assert s.metric("kvheat_self_heal_actions_total", action="recalibrate") == 0
        for _ in range(8):
            model.record(tc.block_bytes, 0.05)  # 500x slower
        assert (tc.estimate_load_s(0, 1) or 1) < 1e-3  # the window's fit has not moved
        assert (model.drift() or 0) > 100
        heal.step(_window((2, 0), (3, 0)), 0.0)
        assert s.metric("kvheat_self_heal_actions_total", action="recalibrate",
                        cause="tier_slow", tier="disk") == 1
        assert (model.drift() or 9) < 2  # measured again: consistent
    finally:
        stop(s)
