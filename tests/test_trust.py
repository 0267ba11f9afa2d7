"""Trust boundaries (docs/vllm.md, "Trust boundaries"): what a request carries is the
client's claim; a tenant, a salt or a shedding class comes from the operator's config or
from a trusted front that vouches for it with a MAC (kvheat/cache/tenancy.py).

- KVHeatConnector's scheduler half (real vLLM config and requests, vLLM's own block
  hasher): a tenant named in `kv_transfer_params` without the router's MAC never matches
  that tenant's blocks in the tiers, and is counted;
- `kvheat route` (a real router in front of recording replicas): a client's tenant, MAC
  and priority never reach a vLLM replica, the router's own tenant goes vouched, and the
  `cache_salt` is keyed (never `tenant:<name>`), with routing by the index still working
  under it;
- `kvheat serve --self-heal`: the shedding class is the tenant's, whatever `user` says.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_e2e import start_router, stop_router, wait_for

from kvheat.cache.hashing import block_keys, root_key
from kvheat.cache.tenancy import TENANT_PARAM, VOUCH_PARAM, TenantVouch, strip_claims
from kvheat.kvevents import BlockStored, KVEventBatch
from kvheat.router.config import ReplicaSpec, RouterConfig, RouterConfigError

SECRET = "tenant-secret-of-the-trust-tests"
BS = 16


# ---- the shared definition -------------------------------------------------------------------
def test_a_vouch_holds_for_its_tenant_salt_and_secret_only() -> None:
    v = TenantVouch(SECRET)
    salt = v.cache_salt("tenant:acme")
    assert salt != "tenant:acme" and "acme" not in salt
    assert salt == TenantVouch(SECRET).cache_salt("tenant:acme")  # one secret: one salt
    assert salt != TenantVouch("another-secret-of-16b").cache_salt("tenant:acme")
    mac = v.vouch("acme", salt)
    assert v.vouched("acme", salt, mac)
    assert not v.vouched("globex", salt, mac)  # another tenant
    assert not v.vouched("acme", "tenant:acme", mac)  # another request's salt
    assert not v.vouched("acme", salt, None) and not v.vouched("acme", salt, 5)
    assert not TenantVouch("another-secret-of-16b").vouched("acme", salt, mac)
    # A drawn key (no secret configured) salts but vouches for nobody.
    drawn = TenantVouch(b"x" * 32, configured=False)
    assert not drawn.vouched("acme", salt, drawn.vouch("acme", salt))
    assert strip_claims({TENANT_PARAM: "a", VOUCH_PARAM: "m", "x": 1}) == {"x": 1}
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TenantVouch("short")


# ---- the connector's scheduler half --------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_parts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvheat.engine.loader import save_tiny_model

    model = tmp_path_factory.mktemp("trust") / "model"
    save_tiny_model(model, seed=0)
    ktc = KVTransferConfig(kv_connector="KVHeatConnector", kv_role="kv_both",
                           kv_connector_module_path="kvheat.integrations.vllm_connector",
                           kv_connector_extra_config={})
    vc = VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32"),
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                    kv_transfer_config=ktc)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return vc, kcc


def _scheduler(vllm_parts: Any, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvheat.integrations.vllm_connector import KVHeatConnector

    monkeypatch.delenv("KVHEAT_TENANT_SECRET", raising=False)
    vc, kcc = vllm_parts
    vc.kv_transfer_config.kv_connector_extra_config = {"host_tier_size": "1MiB", **extra}
    return KVHeatConnector(vc, KVConnectorRole.SCHEDULER, kcc)


_ids = iter(range(1_000_000))


def _request(prompt: list[int], cache_salt: str | None, params: dict[str, Any] | None) -> Any:
    """A vLLM request as its engine core builds it: block hashes by vLLM's own hasher,
    chained over the cache salt, `kv_transfer_params` from the body."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}
                        if params is not None else None)
    return Request(f"r{next(_ids)}", prompt, sp, None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BS, sha256))


PROMPT = list(range(100, 100 + 6 * BS + 3))  # 6 whole blocks


def _matched(conn: Any, req: Any) -> int:
    n, _ = conn.get_num_new_matched_tokens(req, 0)
    return n or 0


def _store_for(conn: Any, req: Any) -> None:
    """What the worker reports once it saved `req`'s blocks: its keys in the host tier."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvheat.integrations.vllm_connector import KVHeatWorkerMetadata

    keys = conn.scheduler._track(req).keys_upto(len(req.block_hashes))
    report = KVHeatWorkerMetadata(changes=[("host", k, True) for k in keys])
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))


@pytest.mark.vllm
def test_a_tenant_the_client_names_never_reaches_that_tenants_tier_blocks(
        vllm_parts, monkeypatch) -> None:
    """Tenant acme's blocks are in the tiers. A request naming tenant acme itself, even
    with the very cache_salt acme's requests carry, is matched to none of them; the
    router's vouched acme gets all of them; the refusals are counted."""
    conn = _scheduler(vllm_parts, monkeypatch, tenant_secret=SECRET)
    v = TenantVouch(SECRET)
    salt = v.cache_salt("tenant:acme")  # what the router sends acme's requests
    _store_for(conn, _request(PROMPT, salt, v.params("acme", salt)))
    assert len(conn.scheduler.mirror) == 6
    want = 6 * BS  # whole blocks (never the prompt's last token: vLLM computes that)
    assert _matched(conn, _request(PROMPT, salt, v.params("acme", salt))) == want
    # The claims: the tenant alone, with a forged or another tenant's MAC, a MAC moved to
    # another salt; none loads acme's blocks.
    claims = [{"tenant": "acme"}, {"tenant": "acme", VOUCH_PARAM: "0" * 32},
              {"tenant": "acme", VOUCH_PARAM: v.vouch("globex", salt)}]
    for params in claims:
        assert _matched(conn, _request(PROMPT, salt, params)) == 0, params
    assert _matched(conn, _request(PROMPT, "tenant:acme", v.params("acme", salt))) == 0
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data.get("refused_tenant.unvouched") == 4
    # A malformed tenant is refused too, counted apart.
    assert _matched(conn, _request(PROMPT, salt, {"tenant": 7})) == 0
    assert conn.get_kv_connector_stats().data.get("refused_tenant.malformed") == 1


@pytest.mark.vllm
def test_without_a_tenant_secret_the_connector_accepts_no_tenant(vllm_parts,
                                                                 monkeypatch) -> None:
    conn = _scheduler(vllm_parts, monkeypatch)
    _store_for(conn, _request(PROMPT, "s", None))  # no tenant: the plain namespace works
    assert _matched(conn, _request(PROMPT, "s", None)) == 6 * BS
    v = TenantVouch(SECRET)
    req = _request(PROMPT, "s", v.params("acme", "s"))
    assert _matched(conn, req) == 0 and not conn.scheduler._track(req).usable
    assert conn.get_kv_connector_stats().data.get("refused_tenant.unvouched") == 1


@pytest.mark.vllm
def test_the_connectors_tenant_secret_is_type_checked() -> None:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from kvheat.integrations.vllm_connector import ConnectorConfig

    with pytest.raises(ValueError, match="tenant_secret must be"):
        ConnectorConfig.from_extra({"tenant_secret": 1234})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ConnectorConfig.from_extra({"tenant_secret": "short"})
    assert ConnectorConfig.from_extra({"tenant_secret": SECRET}).tenant_vouch() is not None


# ---- kvheat route in front of vLLM replicas ----------------------------------------------------
class _Recorder(BaseHTTPRequestHandler):
    """A vLLM replica's HTTP surface as the router uses it: /health, and completions
    answered at once, each body kept."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(200 if self.path == "/health" else 404, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        body["<prewarm>"] = bool(self.headers.get("x-kvheat-prewarm"))  # a router's own
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        self._answer(200, json.dumps({
            "id": "cmpl-1", "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode())

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def recorders() -> Iterator[list[ThreadingHTTPServer]]:
    out = []
    for _ in range(2):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        srv.bodies = []  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        out.append(srv)
    try:
        yield out
    finally:
        for srv in out:
            srv.shutdown()
            srv.server_close()


def _url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


TENANTS = {"sk-acme": "acme", "sk-globex": "globex"}


def _router(recorders: list[ThreadingHTTPServer], **kw: Any) -> Any:
    cfg = RouterConfig(replicas=[ReplicaSpec(_url(s), kind="vllm", block_size=BS)
                                 for s in recorders],
                       tenants=TENANTS, health_interval_s=0.2, prewarm=False,
                       net_signals=False, **kw)
    rt = start_router(cfg)
    assert wait_for(lambda: all(r.healthy for r in rt.router.replicas.values()))
    return rt


def _send(rt: Any, key: str, **extra: Any) -> httpx.Response:
    r = httpx.post(rt.base + "/v1/completions", timeout=30,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1} | extra)
    assert r.status_code == 200, r.text
    return r


def _bodies(recorders: list[ThreadingHTTPServer]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for s in recorders:
        out += s.bodies  # type: ignore[attr-defined]
        s.bodies.clear()  # type: ignore[attr-defined]
    return out


def test_the_router_strips_the_clients_claims_and_vouches_for_its_own_tenant(
        recorders, monkeypatch) -> None:
    monkeypatch.delenv("KVHEAT_TENANT_SECRET", raising=False)
    rt = _router(recorders, tenant_secret=SECRET)
    v = TenantVouch(SECRET)
    try:
        # globex's key, claiming acme every way a body can, and a scheduling priority.
        _send(rt, "sk-globex", cache_salt="tenant:acme", priority=-100,
              kv_transfer_params={"tenant": "acme", VOUCH_PARAM: "f" * 32, "other": 1})
        (sent,) = _bodies(recorders)
        salt = sent["cache_salt"]
        assert salt == v.cache_salt("tenant:globex") and "globex" not in salt
        assert "priority" not in sent
        params = sent["kv_transfer_params"]
        assert params["tenant"] == "globex" and params["other"] == 1
        assert v.vouched("globex", salt, params[VOUCH_PARAM])
        # The same secret at a connector accepts it; another secret does not.
        assert not TenantVouch("another-secret-of-16b").vouched("globex", salt,
                                                                params[VOUCH_PARAM])
    finally:
        stop_router(rt)


def test_without_a_tenant_secret_the_salt_is_still_keyed_and_no_tenant_is_sent(
        recorders, monkeypatch) -> None:
    monkeypatch.delenv("KVHEAT_TENANT_SECRET", raising=False)
    rt = _router(recorders)
    try:
        _send(rt, "sk-acme", kv_transfer_params={"tenant": "globex"})
        (sent,) = _bodies(recorders)
        assert sent["cache_salt"] not in ("tenant:acme", "tenant:globex")
        assert "tenant" not in sent.get("kv_transfer_params", {})
    finally:
        stop_router(rt)
    # A tenant secret from the environment is checked as the config's is.
    monkeypatch.setenv("KVHEAT_TENANT_SECRET", "short")
    with pytest.raises(RouterConfigError, match="KVHEAT_TENANT_SECRET"):
        RouterConfig(replicas=[ReplicaSpec("http://r:1", kind="vllm")])
    with pytest.raises(RouterConfigError, match="tenant_secret"):
        RouterConfig(replicas=[ReplicaSpec("http://r:1", kind="vllm")],
                     tenant_secret=5)  # type: ignore[arg-type]


def test_routing_follows_a_vllm_replicas_blocks_under_the_keyed_salt(recorders,
                                                                     monkeypatch) -> None:
    """A vLLM replica's KV events name the cache_salt the router gave the request; the
    index roots their keys there, and the router keys the next request of that tenant the
    same way: it goes where its prefix is, and another tenant's same prompt matches
    nothing there."""
    monkeypatch.delenv("KVHEAT_TENANT_SECRET", raising=False)
    rt = _router(recorders, tenant_secret=SECRET, policy="kvheat")
    try:
        _send(rt, "sk-acme", prompt=[7] * 40)  # another prompt: only its salt is read
        (sent,) = _bodies(recorders)
        target = rt.router.replicas[_url(recorders[1])]
        n = len(PROMPT) // BS
        rt.router.index.apply(target.name, KVEventBatch(ts=0, events=[BlockStored(
            block_hashes=[f"h{i}".encode() for i in range(n)], parent_block_hash=None,
            token_ids=PROMPT[:n * BS], block_size=BS, lora_id=None, medium="GPU",
            lora_name=None, extra_keys=[(sent["cache_salt"],)] + [None] * (n - 1))]))
        keys = rt.router.keys.route_request(PROMPT, "acme", BS, vllm=True).keys
        assert keys == block_keys(PROMPT, BS, root_key(sent["cache_salt"]))[0]
        assert rt.router.index.match(keys, [BS] * n, [target.name])[0].device_blocks == n
        for _ in range(3):
            r = _send(rt, "sk-acme")
            assert r.headers["x-kvheat-replica"] == target.name
        other = rt.router.keys.route_request(PROMPT, "globex", BS, vllm=True).keys
        assert rt.router.index.match(other, [BS] * n, [target.name])[0].blocks == 0
    finally:
        stop_router(rt)


def test_a_prewarm_reaches_a_vllm_replica_under_the_tenants_keyed_salt(recorders,
                                                                       monkeypatch) -> None:
    """The router copies a hot prompt head to the replicas that lack it: to a vLLM
    replica as the request itself (its tenant's keyed salt, vouched), never into the
    unsalted namespace that every client reaching vLLM directly shares (where
    cached_tokens would tell them the tenant's prompt)."""
    monkeypatch.delenv("KVHEAT_TENANT_SECRET", raising=False)
    cfg = RouterConfig(replicas=[ReplicaSpec(_url(s), kind="vllm", block_size=BS)
                                 for s in recorders],
                       tenants=TENANTS, health_interval_s=0.2, net_signals=False,
                       tenant_secret=SECRET, policy="kvheat")
    rt = start_router(cfg)
    v = TenantVouch(SECRET)
    try:
        assert wait_for(lambda: all(r.healthy for r in rt.router.replicas.values()))
        for _ in range(8):  # one hot prompt: its head goes to the other replica too
            _send(rt, "sk-acme")
        assert wait_for(lambda: rt.metric("kvheat_router_prewarms_total") >= 1)
        sent = _bodies(recorders)
        warm = [b for b in sent if b["<prewarm>"]]
        assert warm and len(warm) < len(sent)
        salt = v.cache_salt("tenant:acme")
        for b in sent:
            assert b.get("cache_salt") == salt, b
            assert v.vouched("acme", salt, b["kv_transfer_params"][VOUCH_PARAM])
    finally:
        stop_router(rt)


# ---- kvheat serve --self-heal: the shedding class ------------------------------------------------
def test_shedding_follows_the_tenant_whatever_user_the_client_sends() -> None:
    from test_selfheal import _complete, _heal_config, _window
    from test_server import start, stop

    from kvheat.server.arms import user_bucket
    from kvheat.server.config import ArmConfig, ServerConfig, TenantConfig

    tenants = [TenantConfig("batch", ["sk-batch-key"], priority=0),
               TenantConfig("live", ["sk-live-key"], priority=1)]
    arms = [ArmConfig("low", 50, "lru", priority=0), ArmConfig("high", 50, "lru", priority=1)]
    s = start(ServerConfig(**_heal_config(num_blocks=64, tenants=tenants, arms=arms,
                                          self_heal_interval_s=3600.0)))
    heal = s.server.healer
    assert heal is not None
    # Users the arms' buckets send to each arm (buckets 0-49: low, 50-99: high).
    low = next(f"u{i}" for i in range(1000) if user_bucket(f"u{i}") < 50)
    high = next(f"u{i}" for i in range(1000) if user_bucket(f"u{i}") >= 50)
    try:
        heal.step(_window((100, 0), (120, 30)), 0.0)  # overloaded: the lowest class goes
        assert heal.shed_level == 1
        for user in (low, high, None):
            kw = {"user": user} if user else {}
            assert _complete(s, "hi", "sk-batch-key", **kw).status_code == 429, user
            assert _complete(s, "hi", "sk-live-key", **kw).status_code == 200, user
    finally:
        stop(s)


def test_the_docs_state_the_trust_boundaries() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    section = doc.split("## Trust boundaries", 1)[1].split("\n## ", 1)[0]
    for needed in ("tenant_secret", "KVHEAT_TENANT_SECRET", "cache_salt", "cached_tokens",
                   "kvheat_connector_refused_tenants_total"):
        assert needed in section, needed


def test_a_client_cannot_pass_its_requests_off_as_a_routers_prewarms() -> None:
    """`x-kvheat-prewarm` is the client's claim unless it carries the events secret's MAC
    of the prompt (what `kvheat route` sends): a client's `1`, or a mark for another
    prompt, counts as a client request; only the router's mark counts as a prewarm."""
    from test_server import ADMIN, start, stop

    from kvheat.kvevents.secret import EventSecret
    from kvheat.server.config import ServerConfig

    events_secret = "prewarm-events-secret-0123456789"
    served = start(ServerConfig(num_blocks=64, threads=1, max_num_seqs=4, admin_token=ADMIN,
                                max_tokens_limit=8, kv_events_secret=events_secret))
    try:
        prompt = list(range(5, 40))
        mark = EventSecret(events_secret).prewarm_mark(prompt)

        def send(header: str | None, tokens: list[int]) -> None:
            r = httpx.post(served.base + "/v1/completions", timeout=60,
                           headers={"x-kvheat-prewarm": header} if header else {},
                           json={"model": "kvheat-tiny-llama", "prompt": tokens, "max_tokens": 1})
            assert r.status_code == 200, r.text

        def counts() -> tuple[int, int]:
            served.wait_idle()
            rows = httpx.get(served.base + "/admin/arms",
                             headers={"Authorization": f"Bearer {ADMIN}"}).json()["arms"]
            return (sum(r["requests"] for r in rows), sum(r["prewarm_requests"] for r in rows))

        send("1", prompt)
        send(mark, prompt[:-1])  # the router's mark of another prompt
        send("0" * 32, prompt)
        assert counts() == (3, 0)
        send(mark, prompt)
        assert counts() == (3, 1)
    finally:
        stop(served)
