"""The deploy/ manifests parse, fit together, and name only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from kvheat.server.config import load_config  # noqa: E402
from kvheat.server.metrics import ServerMetrics  # noqa: E402

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} is empty"
    return docs


def _k8s() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for p in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in _docs(p):
            assert {"apiVersion", "kind", "metadata"} <= set(d), p
            out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def _exported_names() -> set[str]:
    """Every sample name the server's registry can produce."""
    names: set[str] = set()
    for fam in ServerMetrics().registry.collect():
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(fam.name)
    return names


def _metric_refs(text: str) -> set[str]:
    return set(re.findall(r"\bkvheat_[a-z_]+\b", text))


def test_kubernetes_manifests_fit_together() -> None:
    objs = _k8s()
    dep = objs["Deployment/kvheat"]
    svc = objs["Service/kvheat-replicas"]  # Service/kvheat is the router's (test_router_deploy)
    hpa = objs["HorizontalPodAutoscaler/kvheat"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in port_names
    assert container["command"][:2] == ["kvheat", "serve"]
    assert str(port_names["http"]) == container["command"][container["command"].index("--port") + 1]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == "/metrics" and int(ann["prometheus.io/port"]) == 8000
    # The config the pods mount is a valid server config.
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    cm = objs[f"ConfigMap/{vols['config']['configMap']['name']}"]
    # The HPA scales this Deployment on a per-pod custom metric the adapter serves.
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "kvheat")
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "Pods"
    adapter = yaml.safe_load(objs["ConfigMap/prometheus-adapter-kvheat"]["data"]["config.yaml"])
    served_as = {r["name"]["as"]: r for r in adapter["rules"]}
    assert m["pods"]["metric"]["name"] in served_as
    exported = _exported_names()
    for rule in adapter["rules"]:
        assert _metric_refs(rule["seriesQuery"] + rule["metricsQuery"]) <= exported, rule
    assert cm["data"]["config.toml"]


def test_configmap_server_config_loads(tmp_path: Path) -> None:
    cm = _k8s()["ConfigMap/kvheat-config"]
    p = tmp_path / "config.toml"
    p.write_text(cm["data"]["config.toml"])
    cfg = load_config(p)
    assert [a.name for a in cfg.arms] == ["lru", "kvheat"]
    assert sum(a.share for a in cfg.arms) == 100
    assert {t.name for t in cfg.tenants} == {"team-a", "team-b"}
    # The disk tier lives on a volume the deployment mounts, larger than its cap.
    dep = _k8s()["Deployment/kvheat"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in dep["containers"][0]["volumeMounts"]}
    vol = {v["name"]: v for v in dep["volumes"]}[mounts[cfg.tiers.disk_dir]]
    size = vol["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and int(size[:-2]) << 30 > cfg.tiers.disk_bytes
    # The kill comes after the server's drain deadline, with time to close up.
    assert dep["terminationGracePeriodSeconds"] >= cfg.drain_timeout_s + 3


def test_prometheus_scrape_config() -> None:
    (conf,) = _docs(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    assert jobs["kvheat-local"]["metrics_path"] == "/metrics"
    assert jobs["kvheat-local"]["static_configs"][0]["targets"]
    keep = [r for r in jobs["kvheat-pods"]["relabel_configs"] if r.get("action") == "keep"]
    assert keep, "the pod job must keep only kvheat pods"


def test_grafana_dashboard_queries_served_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvheat-dashboard.json").read_text())
    assert dash["uid"] and dash["panels"]
    exported = _exported_names()
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for needed in ("hit rate", "ttft", "tier", "evictions"):
        assert needed in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            refs = _metric_refs(t["expr"])
            assert refs and refs <= exported, (p["title"], refs - exported)
            if not refs <= _NO_ARM:
                assert 'arm=~"$arm"' in t["expr"], "every panel splits by arm"


_NO_ARM = {"kvheat_internal_errors_total", "kvheat_rejected_requests_total"}


def test_every_tier_fault_has_a_panel_and_an_alert() -> None:
    from kvheat.server.metrics import HIERARCHY_FAULTS, STORE_FAULTS

    dash = json.loads((DEPLOY / "grafana" / "kvheat-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    (conf,) = _docs(DEPLOY / "prometheus" / "prometheus.yml")
    assert "kvheat-alerts.yml" in conf["rule_files"]
    (alerts,) = _docs(DEPLOY / "prometheus" / "kvheat-alerts.yml")
    rules = [r for g in alerts["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    exported = _exported_names()
    for r in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= set(r), r
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert _metric_refs(r["expr"]) and _metric_refs(r["expr"]) <= exported, r
    for metric, kinds in (("kvheat_tier_faults_total", STORE_FAULTS),
                          ("kvheat_tier_load_faults_total", HIERARCHY_FAULTS)):
        for kind in kinds:
            sel = f'kind="{kind}"'
            assert any(metric in e and sel in e for e in exprs), (metric, kind)
            assert any(metric in r["expr"] and sel in r["expr"] for r in rules), (metric, kind)
    for metric in ("kvheat_tier_writable", "kvheat_tier_up", "kvheat_engine_failures_total",
                   "kvheat_internal_errors_total"):
        assert any(metric in e for e in exprs) and any(metric in r["expr"] for r in rules)
