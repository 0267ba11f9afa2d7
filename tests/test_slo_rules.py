"""The SLO rules in deploy/prometheus: `promtool check rules` and `promtool test rules`
(the unit tests in deploy/prometheus/tests/) pass; every series the SLO dashboard and the
rules query is one the rules record or the server and router export; the latency
thresholds name real histogram buckets. promtool (the Debian `prometheus` package) is
needed: without it these tests skip, and fail under CI (which installs it)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import require_binary
from prometheus_client import Counter, Gauge, Histogram

from kvheat.router.metrics import RouterMetrics
from kvheat.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = [PROM / "kvheat-alerts.yml", PROM / "kvheat-slo-rules.yml",
              PROM / "kvheat-slo-alerts.yml"]
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "kvheat-slo-dashboard.json"


def _promtool() -> str:
    return require_binary("promtool", "prometheus")


def _run(*args: str) -> None:
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def test_promtool_check_rules() -> None:
    _run(_promtool(), "check", "rules", *map(str, RULE_FILES))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(test_file: Path) -> None:
    _run(_promtool(), "test", "rules", str(test_file))


def test_rule_tests_exist() -> None:
    assert {p.name for p in RULE_TESTS} >= {"kvheat-slo-tests.yml", "kvheat-slo-long-tests.yml"}


def test_prometheus_config_loads_the_rule_files() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert sorted(config["rule_files"]) == sorted(p.name for p in RULE_FILES)


# ---- series names --------------------------------------------------------------------
def _exported() -> set[str]:
    """Every series name the server's and the router's registries can expose."""
    names: set[str] = set()
    for registry in (ServerMetrics().registry, RouterMetrics().registry):
        for collector in registry._collector_to_names:  # noqa: SLF001 - no public walk
            if isinstance(collector, Counter):
                names.add(f"{collector._name}_total")  # noqa: SLF001
            elif isinstance(collector, Histogram):
                names.update(f"{collector._name}{s}"  # noqa: SLF001
                             for s in ("_bucket", "_count", "_sum"))
            elif isinstance(collector, Gauge):
                names.add(collector._name)  # noqa: SLF001
    return names


def _rules(path: Path) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def _recorded() -> set[str]:
    return {r["record"] for p in RULE_FILES for r in _rules(p) if "record" in r}


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`|\{[^}]*\}|\[[^\]]*\]')
_NAME = re.compile(r"(?<![A-Za-z0-9_:])(kvheat[_:][A-Za-z0-9_:]*)")


def _series(expr: str) -> set[str]:
    """The kvheat series names an expression selects (label matchers, strings and
    ranges removed first)."""
    return set(_NAME.findall(_STRINGS.sub(" ", expr)))


def test_series_parser() -> None:
    assert _series('sum(rate(kvheat_requests_total{finish_reason="kvheat_x"}[5m])) '
                   '/ scalar(kvheat:slo_target:ttft)') == {"kvheat_requests_total",
                                                           "kvheat:slo_target:ttft"}


def test_exporters_are_walked() -> None:
    exported = _exported()
    assert {"kvheat_requests_total", "kvheat_time_to_first_token_seconds_bucket",
            "kvheat_queue_length", "kvheat_router_requests_total"} <= exported


def test_rules_query_only_known_series() -> None:
    known = _exported() | _recorded()
    for path in RULE_FILES:
        for rule in _rules(path):
            unknown = _series(rule["expr"]) - known
            assert not unknown, f"{path.name}: {rule.get('record') or rule.get('alert')} " \
                                f"reads {sorted(unknown)}"


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_dashboard_queries_only_recorded_series() -> None:
    """The SLO dashboard reads the recording rules only (cheap over 30 days)."""
    recorded = _recorded()
    exprs = _dashboard_exprs()
    assert len(exprs) > 20
    for title, expr in exprs:
        names = _series(expr)
        assert names, f"{title}: {expr} selects no kvheat series"
        assert names <= recorded, f"{title}: {sorted(names - recorded)} are not recorded"


def test_dashboard_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for word in ("availability", "error budget", "burn rate", "p95 / p99", "kv pool", "queue",
                 "tiers"):
        assert word in titles


# ---- the targets ------------------------------------------------------------------------
def _target(name: str) -> dict:
    [rule] = [r for r in _rules(PROM / "kvheat-slo-rules.yml")
              if r.get("record") == f"kvheat:slo_target:{name}"]
    return rule


def _vector_value(expr: str) -> float:
    m = re.fullmatch(r"\s*vector\(([0-9.eE+-]+)\)\s*", expr)
    assert m, f"a target is a constant vector(<number>), not {expr!r}"
    return float(m.group(1))


@pytest.mark.parametrize("sli,histogram", [("ttft", "ttft"), ("e2e", "e2e")])
def test_latency_threshold_is_a_bucket(sli: str, histogram: str) -> None:
    """The threshold's `le` label agrees with its value and is a bucket bound of the
    exported histogram, written as Prometheus normalises it (no trailing ".0")."""
    rule = _target(f"{sli}_seconds")
    value = _vector_value(rule["expr"])
    le = rule["labels"]["le"]
    assert float(le) == value
    assert not le.endswith(".0")
    buckets = getattr(ServerMetrics(), histogram)._upper_bounds  # noqa: SLF001
    assert value in buckets


@pytest.mark.parametrize("name", ["availability", "router_availability", "ttft", "e2e"])
def test_targets_are_ratios(name: str) -> None:
    assert 0.5 <= _vector_value(_target(name)["expr"]) < 1


def test_alerts_read_targets_not_numbers() -> None:
    """Each burn-rate alert compares against the error budget recording rule, so changing
    a target in kvheat-slo-targets moves every alert."""
    for rule in _rules(PROM / "kvheat-slo-alerts.yml"):
        assert "scalar(kvheat:slo_error_budget:" in rule["expr"] or \
            "scalar(kvheat:saturation_target:" in rule["expr"], rule["alert"]
