"""Tenants in one share group, end to end: a real `kvheat serve` replica (in this process,
so its cache can be asked directly) behind a real `kvheat route` process, both reading one
config file. The router must salt a tenant's keys as the replica's cache does
(`kvheat.cache.hashing.tenant_salt`, share groups included): it once salted every tenant by
its own name, so a tenant whose group-mate had cached a prompt was routed as if nothing
were cached for it."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import wait_for
from test_server import MODEL, _free_port, start, stop

from kvheat.cache import hit_rate
from kvheat.server.config import ConfigError, ServerConfig, TenantConfig, load_config

SECRET = "events-secret-of-the-share-group-test"
CONFIG = f"""
num_blocks = 128
threads = 1
max_num_seqs = 4
kv_events_endpoint = "tcp://127.0.0.1:0"
kv_events_replay_endpoint = "tcp://127.0.0.1:0"
kv_events_secret = "{SECRET}"

[[tenants]]
name = "acme"
api_keys = ["sk-acme"]
share_group = "corp"

[[tenants]]
name = "initech"
api_keys = ["sk-initech"]
share_group = "corp"

[[tenants]]
name = "globex"
api_keys = ["sk-globex"]
"""


def _metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _spawn_router(replica: str, config: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvheat.cli", "route", "--replica", replica,
         "--config", str(config), "--port", str(port), "--health-interval", "0.2",
         "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def test_a_share_group_is_keyed_by_the_router_as_by_the_replica(tmp_path: Path) -> None:
    path = tmp_path / "replicas.toml"
    path.write_text(CONFIG)
    served = start(load_config(path))
    router = None
    try:
        router, base = _spawn_router(served.base, path)
        rng = random.Random(38)
        prompt = [rng.randrange(100, 1000) for _ in range(150)]  # 9 full blocks + 6 tokens
        engine = served.server.worker.engines["default"]

        def via_router(key: str) -> tuple[float, float, int]:
            """(prompt tokens, tokens the router expected cached, tokens the replica
            served from cache) of one request through the router."""
            p0 = _metric(base, "kvheat_router_prompt_tokens_total")
            e0 = _metric(base, "kvheat_router_expected_hit_tokens_total")
            r = httpx.post(base + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            return (_metric(base, "kvheat_router_prompt_tokens_total") - p0,
                    _metric(base, "kvheat_router_expected_hit_tokens_total") - e0, cached)

        def direct(tenant: str) -> int:
            """Prompt tokens the replica's cache holds for `tenant`, asked directly."""
            def probe() -> int:
                cache = engine.cache
                return len(cache.match_prefix(cache.make_request("", prompt, tenant))) * \
                    cache.block_size
            return served.on_engine_thread(probe)

        assert wait_for(lambda: _metric(base, "kvheat_router_replica_healthy") == 1, 30)
        via_router("sk-acme")  # caches the prompt under the group's salt
        assert wait_for(lambda: _metric(base, "kvheat_router_index_blocks", place="device")
                        >= 9, 30)
        held = direct("initech")
        assert held == 144 and direct("acme") == held and direct("globex") == 0
        # The group-mate: the router finds what the replica's cache holds for it, and the
        # replica serves exactly that.
        n, expected, cached = via_router("sk-initech")
        assert expected == held == cached
        assert hit_rate(int(expected), int(n)) == hit_rate(held, len(prompt))
        # Outside the group: nothing, as the replica says.
        n, expected, cached = via_router("sk-globex")
        assert expected == cached == 0 and n == len(prompt)
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        stop(served)


def test_share_groups_come_from_the_tenants_and_are_checked() -> None:
    cfg = ServerConfig(tenants=[TenantConfig("a", ["k1"], share_group="g"),
                                TenantConfig("b", ["k2"], share_group="g"),
                                TenantConfig("c", ["k3"])])
    assert cfg.share_groups == {"a": "g", "b": "g"}
    with pytest.raises(ConfigError, match="share_group"):
        TenantConfig("a", ["k1"], share_group="no spaces")
