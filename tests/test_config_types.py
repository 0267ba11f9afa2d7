"""Every config key is checked for its type, by one checker driven by the dataclasses'
type hints (`kvheat.tiers.spec.check_fields`): wrong-typed values in a config file or
built in code are refused with one line naming the key (and the tenant or arm), and
`kvheat serve --config F` / `kvheat route --config F` exit non-zero without a traceback.
Also: reserved tenant names, the KV events secret, and /metrics without tenant names."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from kvheat.checks import check_fields, describe_type, type_ok
from kvheat.engine import EngineConfig, SchedulerConfig
from kvheat.router.cli import route_command
from kvheat.router.config import ReplicaSpec, RouterConfig, RouterConfigError
from kvheat.server.cli import serve_command
from kvheat.server.config import (
    ArmConfig,
    ConfigError,
    ServerConfig,
    TenantConfig,
    load_config,
)
from kvheat.server.metrics import ServerMetrics
from kvheat.tiers.spec import TierSpec

SECRET = "0123456789abcdef"  # 16 bytes


# ---- the checker -----------------------------------------------------------------------------
@pytest.mark.parametrize("tp, good, bad", [
    (int, [0, -3, 2**70], [True, False, 1.0, 64.5, "1", None, [1]]),
    (float, [0, 1, 0.5, -2.5], [True, math.nan, math.inf, -math.inf, "0.5", None]),
    (bool, [True, False], ["false", "true", 0, 1, None, "no"]),
    (str, ["", "x"], [5, None, b"x", ["x"], True]),
    (list[str], [[], ["a", "b"]], ["abc", ("a",), ["a", 1], [None], {"a": 1}]),
    (list[int], [[], [0, 3]], [[True], [1.0], "0,1", [[1]]]),
    (dict[int, float], [{}, {1: 2.0, 3: 4}], [{"1": 2.0}, {1: "2"}, {1: True}, {True: 1.0},
                                              [(1, 2.0)], {1: math.nan}]),
    (int | None, [None, 3], [3.5, "3", True]),
    (str | None, [None, "x"], [5, False]),
    (int | str, [3, "8MiB"], [3.5, None, True]),
])
def test_type_ok(tp: Any, good: list[Any], bad: list[Any]) -> None:
    for v in good:
        assert type_ok(v, tp), (v, tp)
    for v in bad:
        assert not type_ok(v, tp), (v, tp)


def test_messages_name_the_key_and_type_never_the_value() -> None:
    with pytest.raises(ConfigError) as e:
        ServerConfig(admin_token=123456789)  # type: ignore[arg-type]
    msg = str(e.value)
    assert msg == "admin_token must be a string (or unset), not an integer"
    assert "123456789" not in msg  # a secret that happens to be a number stays secret
    assert describe_type(list[str]) == "a list of strings"
    assert describe_type(dict[int, float]) == "a table of integers to finite numbers"


def _wrong_values(tp: Any) -> list[Any]:
    """Values of the wrong type for hint `tp`."""
    candidates = [True, 5, 64.5, math.nan, "false", ["x"], [1.5], {"k": object()}, object()]
    return [v for v in candidates if not type_ok(v, tp)]


# A valid instance of each config dataclass, and the fields whose values are converted
# before the check (so they take more than their hint says).
VALID: dict[type, dict[str, Any]] = {
    TenantConfig: {"name": "acme", "api_keys": ["sk-acme"]},
    ArmConfig: {"name": "a", "share": 100},
    ServerConfig: {},
    TierSpec: {},
    ReplicaSpec: {"url": "http://127.0.0.1:8000"},
    RouterConfig: {"replicas": [ReplicaSpec("http://127.0.0.1:8000")]},
    SchedulerConfig: {},
    EngineConfig: {},
}
CONVERTED = {(ServerConfig, "engine_cores"), (ServerConfig, "tenants"), (ServerConfig, "arms")}


@pytest.mark.parametrize("cls", list(VALID), ids=lambda c: c.__name__)
def test_every_field_refuses_wrong_types(cls: type) -> None:
    """Each field of each config dataclass, given each value of a wrong type, is refused
    (ValueError: ConfigError, RouterConfigError) with a message naming it."""
    cls(**VALID[cls])  # the base is valid
    hints = typing.get_type_hints(cls)
    checked = 0
    for f in fields(cls):
        for v in _wrong_values(hints[f.name]):
            if (cls, f.name) in CONVERTED and isinstance(v, (str, list)):
                continue  # read by its converter (engine_cores "0-3", tenants as tables)
            with pytest.raises(ValueError) as e:
                cls(**{**VALID[cls], f.name: v})
            assert f.name in str(e.value), (cls.__name__, f.name, v, str(e.value))
            checked += 1
    assert checked >= len(fields(cls))


def test_check_fields_is_generic() -> None:
    from dataclasses import dataclass

    @dataclass
    class C:
        a: int
        b: list[str] | None = None

    check_fields(C(1, ["x"]))
    with pytest.raises(ValueError, match=r"^thing: b must be a list of strings \(or unset\), "
                                         r"not a list holding an integer$"):
        check_fields(C(1, ["x", 2]), "thing")  # type: ignore[list-item]


# ---- the probe's cases, through config files --------------------------------------------------
def _write(tmp_path: Path, data: dict[str, Any], fmt: str) -> Path:
    p = tmp_path / f"config.{fmt}"
    if fmt == "toml":
        p.write_text(_toml(data))
    elif fmt == "yaml":
        p.write_text(yaml.safe_dump(data))
    else:
        p.write_text(json.dumps(data))
    return p


def _toml(data: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, float) and math.isnan(v):
            return "nan"
        return json.dumps(v)

    def tables(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, dict) for t in v)

    lines = [f"{k} = {val(v)}" for k, v in data.items() if not tables(v)]
    for key, v in data.items():
        if tables(v):
            for t in v:
                lines += [f"[[{key}]]"] + [f"{k} = {val(x)}" for k, x in t.items()]
    return "\n".join(lines) + "\n"


BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"tenants": [{"name": "acme", "api_keys": "sk-7Qz"}]},
     "tenant 'acme': api_keys must be a list of strings, not a string"),
    ({"kv_events_token_ids": "false"}, "kv_events_token_ids must be true or false"),
    ({"redis_cluster": "false"}, "redis_cluster must be true or false"),
    ({"redis_tier_shared": "false"}, "redis_tier_shared must be true or false"),
    ({"admin_token": 123456789}, "admin_token must be a string"),
    ({"served_model_name": 5}, "served_model_name must be a string"),
    ({"num_blocks": 64.5}, "num_blocks must be an integer"),
    ({"num_blocks": True}, "num_blocks must be an integer, not a boolean"),
    ({"seed": "x"}, "seed must be an integer, not a string"),
    ({"kv_events_topic": 5}, "kv_events_topic must be a string"),
    ({"host_tier_blocks": 1.5}, "host_tier_blocks must be an integer"),
    ({"disk_tier_dir": 5, "disk_tier_bytes": "1GiB"}, "disk_tier_dir must be a string"),
    ({"disk_tier_dir": "/tmp/x", "disk_tier_bytes": 1.5e9}, "disk_tier_bytes must be a size"),
    ({"tier_mode": 1}, "tier_mode must be a string"),
    ({"engine_cores": [0.5]}, "engine_cores must be a list of integers"),
    ({"drain_timeout_s": "25"}, "drain_timeout_s must be a finite number"),
    ({"tenants": {"name": "acme"}}, "tenants must be a list"),
    ({"tenants": [{"name": "acme", "api_keys": ["k"], "temperature": "0.5"}]},
     "tenant 'acme': temperature must be a finite number"),
    ({"tenants": [{"name": "acme", "api_keys": ["k"], "quota_blocks": 8.5}]},
     "tenant 'acme': quota_blocks must be an integer"),
    ({"tenants": [{"name": "acme", "api_keys": ["k"], "logit_bias": {"13": "x"}}]},
     "tenant 'acme': logit_bias must be a table of integers to finite numbers"),
    ({"tenants": [{"name": "acme"}]}, "tenant 'acme' needs the key(s): api_keys"),
    ({"tenants": [{"name": "none", "api_keys": ["k"]}]}, "tenant name 'none' is reserved"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "metrics_label": 7}]},
     "tenant 'a': metrics_label must be a string"),
    ({"arms": [{"name": "a", "share": "100"}]}, "arm 'a': share must be an integer"),
    ({"arms": [{"name": "a", "share": 100, "num_blocks": 1.5}]},
     "arm 'a': num_blocks must be an integer"),
    ({"kv_events_secret": "short"}, "kv_events_secret must have at least 16 bytes"),
    ({"kv_events_secret": 12345678901234567890}, "kv_events_secret must be a string"),
    ({"metrics_token": 5}, "metrics_token must be a string"),
]


@pytest.mark.parametrize("fmt", ["toml", "yaml", "json"])
@pytest.mark.parametrize("data, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_serve_refuses_bad_config_file(tmp_path: Path, fmt: str, data: dict[str, Any],
                                       message: str) -> None:
    p = _write(tmp_path, data, fmt)
    with pytest.raises(ConfigError, match="^" + _re(message)):
        load_config(p)
    res = CliRunner().invoke(serve_command, ["--config", str(p)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: " + message), res.output


def _re(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("fmt", ["toml", "yaml"])
def test_real_cli_one_line_and_nonzero_exit(tmp_path: Path, fmt: str) -> None:
    """The installed commands, in a subprocess: one line naming the key, exit 1, no
    traceback; the router refuses the same file (it reads the tenants' api keys)."""
    p = _write(tmp_path, {"num_blocks": 64.5,
                          "tenants": [{"name": "acme", "api_keys": ["k"]}]}, fmt)
    env = {**os.environ, "KVHEAT_EVENTS_SECRET": ""}
    kvheat = [sys.executable, "-m", "kvheat.cli"]
    for args in (["serve", "--config", str(p)],
                 ["route", "--replica", "http://127.0.0.1:1", "--config", str(p)]):
        r = subprocess.run(kvheat + args, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        assert r.stderr.strip() == "Error: num_blocks must be an integer, not a decimal number"


# ---- 1. api_keys as a bare string: refused by the server and the router --------------------
def test_api_keys_string_refused_by_router_too(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _write(tmp_path, {"tenants": [{"name": "acme", "api_keys": "sk-7Qz"}]}, "toml")
    res = CliRunner().invoke(route_command, ["--replica", "http://127.0.0.1:1",
                                             "--config", str(bad)])
    assert res.exit_code == 1
    assert "tenant 'acme': api_keys must be a list of strings" in res.output
    # The right form maps the whole key to the tenant.
    got = _route(tmp_path, monkeypatch, {"tenants": [{"name": "acme", "api_keys": ["sk-7Qz"]}]})
    assert got.tenants == {"sk-7Qz": "acme"}
    with pytest.raises(RouterConfigError, match="tenants must be a table of strings to strings"):
        RouterConfig(replicas=[ReplicaSpec("http://a")], tenants=list("sk-7Qz"))  # type: ignore[arg-type]


def _route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: dict[str, Any] | None,
           *args: str, env_secret: str = "") -> RouterConfig:
    """Run `kvheat route` up to the point it would serve; its RouterConfig."""
    import uvicorn

    import kvheat.router.app as router_app

    seen: list[RouterConfig] = []

    class FakeRouter:
        def __init__(self, cfg: RouterConfig) -> None:
            seen.append(cfg)
            self.keys = type("K", (), {"tokenizer": None})()
            self.app = None

    monkeypatch.setattr(router_app, "KVHeatRouter", FakeRouter)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr("gc.freeze", lambda: None)
    monkeypatch.setenv("KVHEAT_EVENTS_SECRET", env_secret)
    # port 0: the route command checks that it can listen, and 9000 may be taken here
    argv = ["--replica", "http://127.0.0.1:1", "--port", "0", *args]
    if data is not None:
        argv += ["--config", str(_write(tmp_path, data, "json"))]
    res = CliRunner().invoke(route_command, argv)
    assert res.exit_code == 0, res.output
    return seen[0]


# ---- 2. strings are not booleans -------------------------------------------------------------
@pytest.mark.parametrize("key", ["kv_events_token_ids", "redis_cluster", "redis_tier_shared"])
def test_string_false_is_not_a_bool(key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key} must be true or false, not a string$"):
        load_config(None, **{key: "false"})
    assert load_config(None, **{key: False}) is not None


def test_router_bools_and_numbers() -> None:
    r = [ReplicaSpec("http://a")]
    for kw, key in [({"prewarm": "false"}, "prewarm"), ({"overload_guard": 1}, "overload_guard"),
                    ({"block_size": 1.5}, "block_size"), ({"max_attempts": True}, "max_attempts"),
                    ({"ghost_factor": math.nan}, "ghost_factor"),
                    ({"health_interval_s": "1"}, "health_interval_s")]:
        with pytest.raises(RouterConfigError, match=f"^{key} must be"):
            RouterConfig(replicas=r, **kw)
    for url in (5, None):
        with pytest.raises(RouterConfigError, match="^replica: url must be a string"):
            ReplicaSpec(url)  # type: ignore[arg-type]
    with pytest.raises(RouterConfigError,
                       match="^replica 'http://a': block_size must be an integer"):
        ReplicaSpec("http://a", block_size=1.5)  # type: ignore[arg-type]


# ---- 3. reserved and unsafe tenant names -----------------------------------------------------
@pytest.mark.parametrize("name", ["none", "None", "NONE", "null", "unknown", "", "a b", "a/b",
                                  "../x", "-a", "a\nb", "x" * 65, "é"])
def test_bad_tenant_names(name: str) -> None:
    with pytest.raises(ConfigError):
        TenantConfig(name, ["k"])


def test_tenant_names_and_labels() -> None:
    for ok in ("acme", "team-a", "a.b_c", "A1", "x" * 64, "tenant-3"):
        TenantConfig(ok, ["k"])
    for label in ("none", "tenant-0", "a b"):
        with pytest.raises(ConfigError, match="metrics_label"):
            TenantConfig("a", ["k"], metrics_label=label)
    with pytest.raises(ConfigError, match="same metrics_label"):
        ServerConfig(tenants=[TenantConfig("a", ["ka"], metrics_label="x"),
                              TenantConfig("b", ["kb"], metrics_label="x")])
    for keys in ([""], [" k"], ["k "], ["a\tb"], []):
        with pytest.raises(ConfigError, match="api key"):
            TenantConfig("a", keys)
    with pytest.raises(ConfigError, match="admin or metrics token"):
        ServerConfig(admin_token="adm", tenants=[TenantConfig("a", ["adm"])])


# ---- 5. secrets and tokens -------------------------------------------------------------------
def test_secret_fields() -> None:
    assert ServerConfig(kv_events_secret=SECRET).kv_events_secret == SECRET
    for bad in ("", "x" * 15, "é" * 7):  # 14 bytes
        with pytest.raises(ConfigError, match="kv_events_secret must have at least 16 bytes"):
            ServerConfig(kv_events_secret=bad)
        with pytest.raises(RouterConfigError, match="events_secret must have at least 16"):
            RouterConfig(replicas=[ReplicaSpec("http://a")], events_secret=bad)
    assert RouterConfig(replicas=[ReplicaSpec("http://a")], events_secret="é" * 8).events_secret
    with pytest.raises(ConfigError, match="metrics_token must not be empty"):
        ServerConfig(metrics_token="")
    with pytest.raises(ConfigError, match="metrics_token must be visible ASCII"):
        ServerConfig(metrics_token="a b")


def test_router_events_secret_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = "e" * 16
    assert _route(tmp_path, monkeypatch, None).events_secret is None
    assert _route(tmp_path, monkeypatch, None, env_secret=env).events_secret == env
    file = {"kv_events_secret": "f" * 16}
    assert _route(tmp_path, monkeypatch, file, env_secret=env).events_secret == "f" * 16
    assert _route(tmp_path, monkeypatch, file, "--events-secret", SECRET,
                  env_secret=env).events_secret == SECRET
    monkeypatch.setenv("KVHEAT_EVENTS_SECRET", "short")
    res = CliRunner().invoke(route_command, ["--replica", "http://127.0.0.1:1"])
    assert res.exit_code == 1 and "$KVHEAT_EVENTS_SECRET must have at least 16 bytes" in res.output
    res = CliRunner().invoke(route_command, ["--replica", "http://127.0.0.1:1",
                                             "--events-secret", "short"])
    assert res.exit_code == 1 and "events_secret must have at least 16 bytes" in res.output


def test_serve_secret_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVHEAT_EVENTS_SECRET", raising=False)
    res = CliRunner().invoke(serve_command, ["--kv-events-secret", "short"])
    assert res.exit_code == 1 and "kv_events_secret must have at least 16 bytes" in res.output
    monkeypatch.setenv("KVHEAT_EVENTS_SECRET", "short")
    res = CliRunner().invoke(serve_command, [])
    assert res.exit_code == 1 and "$KVHEAT_EVENTS_SECRET must have at least 16" in res.output
    res = CliRunner().invoke(serve_command, ["--metrics-token", "a b"])
    assert res.exit_code == 1 and "metrics_token" in res.output


def test_router_reads_replica_config_without_its_cpus(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The replicas' engine_cores are theirs: the router does not check them against its own
    CPUs (only their type)."""
    far = max(os.sched_getaffinity(0)) + 1000
    data = {"engine_cores": [far], "tenants": [{"name": "acme", "api_keys": ["k"]}]}
    assert _route(tmp_path, monkeypatch, data).tenants == {"k": "acme"}
    with pytest.raises(ConfigError, match="engine_cores"):
        load_config(_write(tmp_path, data, "json"))
    with pytest.raises(ConfigError, match="engine_cores must be a list of integers"):
        load_config(_write(tmp_path, {"engine_cores": [0.5]}, "json"), this_host=False)


# ---- 6. tenant names stay out of /metrics ----------------------------------------------------
def test_tenant_label_mapping() -> None:
    tenants = [TenantConfig("acme", ["ka"]), TenantConfig("globex", ["kg"], metrics_label="g"),
               TenantConfig("initech", ["ki"])]
    cfg = ServerConfig(tenants=tenants)
    assert cfg.tenant_labels() == {"acme": "tenant-0", "globex": "g", "initech": "tenant-2"}
    assert ServerConfig(tenants=tenants, metrics_token="tok").tenant_labels() == {
        "acme": "acme", "globex": "globex", "initech": "initech"}
    m = ServerMetrics(cfg.tenant_labels())
    assert [m.tenant_label(t) for t in ("acme", "globex", None, "none", "stranger")] == \
        ["tenant-0", "g", "none", "none", "unknown"]
    m.observe_request("a", "acme", "chat", "stop", 10, 0, 1, 0.1, [], 0.2, None)
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    assert 'tenant="tenant-0"' in text and "acme" not in text


def _server(**kw: Any) -> Any:
    import torch

    from kvheat.server.app import KVHeatServer

    torch.set_num_threads(1)
    return KVHeatServer(ServerConfig(num_blocks=32, threads=1, admin_token="adm-token",
                                     max_tokens_limit=4, **kw))


def _complete_and_scrape(client: Any, key: str, headers: dict[str, str]) -> str:
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                    json={"model": "kvheat-tiny-llama", "prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while True:
        text = client.get("/metrics", headers=headers).text
        if "kvheat_requests_total{" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_open_metrics_never_name_tenants() -> None:
    from fastapi.testclient import TestClient

    s = _server(tenants=[TenantConfig("acme-corp", ["sk-acme"]),
                         TenantConfig("globex-inc", ["sk-globex"], metrics_label="blue",
                                      quota_blocks=16)])
    with TestClient(s.app) as c:
        text = _complete_and_scrape(c, "sk-acme", {})
        _complete_and_scrape(c, "sk-globex", {})
        s.worker.call(s.worker.refresh_gauges).result(timeout=30)
        text = c.get("/metrics").text
        assert 'tenant="tenant-0"' in text and 'tenant="blue"' in text
        assert "acme" not in text and "globex" not in text
        for path in ("/health", "/v1/models"):
            r = c.get(path, headers={"Authorization": "Bearer sk-acme"})
            assert r.status_code == 200 and "acme" not in r.text and "globex" not in r.text


def test_metrics_token_guards_metrics_and_names_tenants() -> None:
    from fastapi.testclient import TestClient

    s = _server(metrics_token="m-token", tenants=[TenantConfig("acme", ["sk-acme"])])
    with TestClient(s.app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "m-token"},
                        {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer adm-token"}):
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 401, headers
            assert "kvheat_" not in r.text
        text = _complete_and_scrape(c, "sk-acme", {"Authorization": "Bearer m-token"})
        assert 'tenant="acme"' in text
