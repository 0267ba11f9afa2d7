"""The miss classifier keys a prompt exactly as the cache looks it up, in every
prefix-caching mode (`Scheduler.miss_kinds`): a prompt served again, fully cached, shows
no capacity miss. An "exact" arm once keyed the classifier's prompts without the prompt's
scope (its cached blocks read as capacity misses), and an "off" arm still counted a
cached prompt's blocks as capacity misses, though no pool size would have served them
(kvheat doctor reads capacity misses as "add KV blocks")."""

from __future__ import annotations

import random

import httpx
import pytest
from test_server import MODEL, start, stop

from kvheat.server.config import ArmConfig, ServerConfig

ADMIN = {"Authorization": "Bearer adm"}


@pytest.mark.parametrize(("mode", "compulsory"), [("block", 160), ("exact", 288),
                                                  ("off", 432)])
def test_a_fully_cached_prompt_shows_no_capacity_miss(mode: str, compulsory: int) -> None:
    s = start(ServerConfig(num_blocks=64, threads=1, admin_token="adm",
                           arms=[ArmConfig("a", 100, "lru", prefix_caching=mode)]))
    try:
        rng = random.Random(7)
        p = [rng.randrange(100, 1000) for _ in range(150)]  # 9 full blocks + 6 tokens
        q = p[:128] + [rng.randrange(100, 1000) for _ in range(22)]  # p's first 8 blocks
        served = []
        for prompt in (p, p, q):
            r = httpx.post(s.base + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            served.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        s.wait_idle()
        # Every mode caches p; "block" serves it and q's share of it, "exact" only p
        # itself, "off" nothing. What was not served is never a capacity miss here: the
        # pool never evicted (p's blocks first sights, then q's blocks outside p).
        assert served == {"block": [0, 144, 128], "exact": [0, 144, 0], "off": [0, 0, 0]}[mode]
        eng = s.server.worker.engines["a"]
        assert s.on_engine_thread(lambda: eng.cache.stats.evicted_blocks) == 0
        misses = httpx.get(s.base + "/admin/stats", headers=ADMIN).json()["arms"]["a"]["misses"]
        assert misses["none"] == {"compulsory": compulsory, "capacity": 0, "sub_block": 18,
                                  "isolation": 0}
    finally:
        stop(s)
