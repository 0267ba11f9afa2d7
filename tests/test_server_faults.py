"""Serving under faults (issue 12): nothing on the side stops the engine loop, every
request ends with a response, tenants learn nothing of each other, big bodies do not
freeze the server, tier faults show in /metrics, shutdown is bounded. Real servers (the
tiny model, real forward passes) on loopback, as in test_server.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
from test_server import MODEL, Served, start, stop

from kvheat.server.config import ServerConfig


def _ids(seed: int, n: int) -> list[int]:
    """`n` seeded random token ids: prompts of two seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(s: Served, prompt: list[int] | str, key: str | None = None,
              **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(s.base + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **kw})


# ---- 1. a lower-tier hit must not kill the engine loop --------------------------------------
def test_disk_tier_hits_never_stop_the_engine_loop(tmp_path: Path) -> None:
    """The issue's sequence, replayed: a 160-token prompt, pushed off a 24-block device
    pool by four 200-token prompts, sent again (159 tokens come back from disk), then new
    prompts. The device series was the cache's hit count minus the tiers', counted at
    other times: it went negative and prometheus-client's error killed the loop."""
    s = start(ServerConfig(num_blocks=24, threads=1, disk_tier_dir=str(tmp_path / "kv"),
                           disk_tier_bytes="64MiB"))
    try:
        from_disk = 0
        for rnd in range(6):
            keep = _ids(1000 + rnd, 160)
            assert _complete(s, keep).status_code == 200
            for j in range(4):
                assert _complete(s, _ids(100 * rnd + j, 200)).status_code == 200
            again = _complete(s, keep)
            assert again.status_code == 200, again.text
            from_disk += again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            s.server.worker.refresh_gauges()  # as the loop does, at once
            for j in range(3):
                r = _complete(s, _ids(50 + 100 * rnd + j, 100))
                assert r.status_code == 200, r.text
            assert httpx.get(s.base + "/health").status_code == 200
        s.wait_idle()
        assert from_disk >= 6 * 144  # the disk tier did serve the repeats
        assert s.metric("kvheat_tier_hit_tokens_total", tier="disk") > 0
        # Per request, the tiers' series add up to the cached tokens exactly.
        assert s.metric("kvheat_tier_hit_tokens_total") == \
            s.metric("kvheat_cached_tokens_total") > 0
        assert s.metric("kvheat_internal_errors_total") == 0
    finally:
        stop(s)


def test_failing_metrics_and_tracing_do_not_stop_serving() -> None:
    s = start(ServerConfig(num_blocks=64, threads=1))
    try:
        def broken(*a: Any, **k: Any) -> None:
            raise ValueError("injected metrics failure")

        m = s.server.metrics
        m.refresh_arm = broken  # type: ignore[method-assign]
        m.observe_request = broken  # type: ignore[method-assign]
        s.server.tracing.child = broken  # type: ignore[method-assign]
        for i in range(3):
            r = _complete(s, f"still serving {i}", max_tokens=2)
            assert r.status_code == 200, r.text
        s.server.worker.refresh_gauges()
        s.wait_idle()
        assert httpx.get(s.base + "/health").json()["status"] == "ok"
        assert s.metric("kvheat_internal_errors_total", where="metrics") >= 3
        assert s.metric("kvheat_internal_errors_total", where="gauges") >= 1
    finally:
        stop(s)
