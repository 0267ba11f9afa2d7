"""The cluster manifests in deploy/k8s render and fit together: the router Deployment and
its Service, the replicas (the HPA's Deployment) with their KV event ports and headless
Service, the Redis Cluster the shared tier points at, the NetworkPolicy on the event
ports, and the commands and config each pod runs parse with the real CLIs."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from kvheat.router.cli import route_command  # noqa: E402
from kvheat.server.cli import serve_command  # noqa: E402
from kvheat.server.config import load_config  # noqa: E402

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"


def objects() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(p.read_text()):
            if d is None:
                continue
            assert {"apiVersion", "kind", "metadata"} <= set(d), p
            key = f"{d['kind']}/{d['metadata']['name']}"
            assert key not in out, f"{key} is defined twice"
            out[key] = d
    return out


def pod(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    return selector.items() <= labels(obj).items()


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def parse(command, args: list[str], objs: dict[str, dict[str, Any]], tmp_path: Path):
    """The real CLI's parse of a pod's args, with the mounted paths laid out under
    tmp_path (the config file from its ConfigMap, the model folder empty)."""
    cfg = tmp_path / "etc-kvheat-config.toml"
    cfg.write_text(objs["ConfigMap/kvheat-config"]["data"]["config.toml"])
    (tmp_path / "models-current").mkdir(exist_ok=True)
    local = {"/etc/kvheat/config.toml": str(cfg), "/models/current": str(tmp_path / "models-current")}
    ctx = command.make_context(command.name, [local.get(a, a) for a in args])
    back = {v: k for k, v in local.items()}
    return {k: back.get(v, v) if isinstance(v, str) else v for k, v in ctx.params.items()}


def config(objs: dict[str, dict[str, Any]], tmp_path: Path):
    p = tmp_path / "config.toml"
    p.write_text(objs["ConfigMap/kvheat-config"]["data"]["config.toml"])
    return load_config(p), p


def test_router_and_replicas_fit_together(tmp_path: Path) -> None:
    objs = objects()
    router, replicas = objs["Deployment/kvheat-router"], objs["Deployment/kvheat"]
    for d in (router, replicas):
        assert d["spec"]["selector"]["matchLabels"].items() <= labels(d).items()
    # Clients reach the router; the router reaches every replica by the headless name.
    front, headless = objs["Service/kvheat"], objs["Service/kvheat-replicas"]
    assert selects(front["spec"]["selector"], router)
    assert not selects(front["spec"]["selector"], replicas)
    assert selects(headless["spec"]["selector"], replicas)
    assert headless["spec"]["clusterIP"] == "None"
    (rc,) = pod(router)["containers"]
    (sc,) = pod(replicas)["containers"]
    assert front["spec"]["ports"][0]["targetPort"] in ports(rc)
    args = rc["command"]
    assert args[:2] == ["kvheat", "route"]
    params = parse(route_command, list(args[2:]), objs, tmp_path)  # the real CLI parses it
    host, port = params["discover"].split(":")
    assert host == headless["metadata"]["name"]
    svc_ports = {p["name"]: p for p in headless["spec"]["ports"]}
    assert int(port) == svc_ports["http"]["port"] == ports(sc)["http"]
    assert params["port"] == ports(rc)["http"]
    # The router keys prompts with the replicas' tokenizer and tenants.
    rmounts = {m["mountPath"]: m["name"] for m in rc["volumeMounts"]}
    smounts = {m["mountPath"]: m["name"] for m in sc["volumeMounts"]}
    rvols = {v["name"]: v for v in pod(router)["volumes"]}
    svols = {v["name"]: v for v in pod(replicas)["volumes"]}
    for flag in ("config_path", "model"):
        mount = next(m for m in rmounts if params[flag].startswith(m))
        smount = next(m for m in smounts if params[flag].startswith(m))
        assert rvols[rmounts[mount]] == svols[smounts[smount]]
    sargs = sc["command"]
    sparams = parse(serve_command, list(sargs[2:]), objs, tmp_path)
    assert sparams["config_path"] == params["config_path"]
    assert sparams["model"] == params["model"]
    # The HPA scales the replicas, never the router.
    ref = objs["HorizontalPodAutoscaler/kvheat"]["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", replicas["metadata"]["name"])
    # Every Secret the pods read is in the example.
    for c in (rc, sc):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                sec = objs[f"Secret/{ref['name']}"]
                assert ref["key"] in sec["stringData"]


def test_event_ports_config_and_network_policy(tmp_path: Path) -> None:
    objs = objects()
    cfg, _ = config(objs, tmp_path)
    (sc,) = pod(objs["Deployment/kvheat"])["containers"]
    p = ports(sc)
    assert cfg.kv_events_endpoint == f"tcp://*:{p['kv-events']}"
    assert cfg.kv_events_replay_endpoint == f"tcp://*:{p['kv-replay']}"
    assert not cfg.kv_events_token_ids  # keys only to the network
    svc_ports = {x["name"]: x for x in objs["Service/kvheat-replicas"]["spec"]["ports"]}
    for name in ("kv-events", "kv-replay"):
        assert svc_ports[name]["targetPort"] == name and svc_ports[name]["port"] == p[name]
    np = objs["NetworkPolicy/kvheat-replicas"]["spec"]
    assert np["podSelector"]["matchLabels"].items() <= labels(objs["Deployment/kvheat"]).items()
    event_ports = {p["kv-events"], p["kv-replay"]}
    for rule in np["ingress"]:
        allowed = {x["port"] for x in rule["ports"]}
        if allowed & event_ports:  # only the router's pods
            (src,) = rule["from"]
            assert selects(src["podSelector"]["matchLabels"], objs["Deployment/kvheat-router"])
    assert any(event_ports <= {x["port"] for x in r["ports"]} for r in np["ingress"])


def test_the_shared_tier_points_at_the_redis_cluster(tmp_path: Path) -> None:
    objs = objects()
    cfg, _ = config(objs, tmp_path)
    assert cfg.tiers.redis_cluster and cfg.tiers.redis_shared and cfg.tiers.redis_bytes > 0
    sts = objs["StatefulSet/redis-cluster"]
    svc = objs[f"Service/{sts['spec']['serviceName']}"]
    assert svc["spec"]["clusterIP"] == "None" and selects(svc["spec"]["selector"], sts)
    m = re.fullmatch(r"redis://([^:/]+):(\d+)/0", cfg.tiers.redis_url or "")
    assert m, cfg.tiers.redis_url
    pod_host = f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"
    assert m.group(1) == pod_host
    conf = objs["ConfigMap/redis-cluster"]["data"]["redis.conf"]
    assert "cluster-enabled yes" in conf and f"port {m.group(2)}" in conf
    (rc,) = pod(sts)["containers"]
    assert ports(rc)["redis"] == int(m.group(2)) and ports(rc)["bus"] == int(m.group(2)) + 10000
    job = objs["Job/redis-cluster-create"]
    script = " ".join(pod(job)["containers"][0]["command"])
    nodes = re.findall(r"redis-cluster-(\d+)\.redis-cluster:6379", script)
    assert sorted(set(map(int, nodes))) == list(range(sts["spec"]["replicas"]))
    assert "--cluster-replicas" in shlex.split(script.replace(">-", ""))
    # The tier secret every replica needs to read the others' values.
    (sc,) = pod(objs["Deployment/kvheat"])["containers"]
    assert any(e["name"] == "KVHEAT_TIER_SECRET" for e in sc["env"])


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    """Each object against the API schemas of a Kubernetes release (kubernetes-validate ships
    them; strict: an unknown or misspelt field fails), so a typo cannot wait for a cluster."""
    import kubernetes_validate as kv  # the test extra: never skipped
    from kubernetes_validate.utils import all_versions

    # The oldest release from 1.30 on that this kubernetes-validate ships (1.30.0 while it
    # ships it: a newer one that drops old schemas moves up, not out) and its newest.
    def release(v: str) -> tuple[int, ...]:
        return tuple(map(int, v.split(".")))

    shipped = sorted({v for v in all_versions() if release(v) >= (1, 30)}, key=release)
    assert shipped, "kubernetes-validate ships no schema from 1.30 on"
    versions = [shipped[0], shipped[-1]]
    version = versions[0]
    objs = objects()
    assert {"Deployment/kvheat-router", "Deployment/kvheat", "StatefulSet/redis-cluster",
            "HorizontalPodAutoscaler/kvheat", "NetworkPolicy/kvheat-replicas"} <= set(objs)
    for v in versions:
        for key, obj in objs.items():
            try:
                kv.validate(obj, v, True)
            except kv.ValidationError as e:
                path = ".".join(str(x) for x in e.path)
                pytest.fail(f"{key} (Kubernetes {v}): {path}: {e.message}")
    # The check can fail: the same router with one misspelt field does.
    bad = copy.deepcopy(objs["Deployment/kvheat-router"])
    pod(bad)["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, True)
