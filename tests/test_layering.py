"""The packages import one way (docs/architecture.md): a module may import only the
packages below its own, so nothing points back up."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvheat"
# package -> the kvheat packages it may import
# ("checks", the config type check, sits below everything: every package may use it.)
ALLOWED: dict[str, set[str]] = {
    "checks": set(),
    "cache": {"checks"},
    "heat": {"checks", "cache"},
    "tiers": {"checks", "cache"},
    "kvevents": {"checks", "cache"},
    "replay": {"checks", "cache", "heat"},
    "engine": {"checks", "cache", "heat", "tiers"},
    "integrations": {"checks", "cache", "heat", "tiers", "kvevents", "replay"},
    # kvheat doctor reads a server's metrics over HTTP: it imports no server code.
    "doctor": {"checks", "cache", "heat", "replay"},
    # server may use doctor's scoring (its self-healer): doctor imports no server code.
    "server": {"checks", "cache", "heat", "tiers", "engine", "kvevents", "doctor"},
    "router": {"checks", "cache", "heat", "tiers", "engine", "kvevents", "replay", "server"},
}


def _imported_packages(source: str, depth: int) -> set[str]:
    """The kvheat packages a module imports; `depth`: its path's parts below kvheat/ (so
    `from ..x import` names package x from a module of a subpackage)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith("kvheat."):
                out.add(node.module.split(".")[1])
            elif node.level == depth and node.module:
                out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kvheat."))
    return out


def test_packages_import_only_downwards() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:  # kvheat/cli.py and the package root sit above everything
            continue
        pkg = parts[0]
        assert pkg in ALLOWED, f"new package {pkg}: place it in ALLOWED"
        bad = _imported_packages(path.read_text(), len(parts)) - ALLOWED[pkg] - {pkg}
        if bad:
            wrong.append(f"{path.relative_to(PACKAGE)} imports {sorted(bad)}")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_the_checker_sees_upward_imports() -> None:
    src = "from ..engine import LLMEngine\nimport kvheat.server.app\nfrom .pool import BlockPool\n"
    assert _imported_packages(src, 2) == {"engine", "server"}
    lazy = "def f():\n    from kvheat.router import app\n"
    assert _imported_packages(lazy, 2) == {"router"}  # imports inside functions count too
