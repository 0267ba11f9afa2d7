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


def _module_graph() -> dict[str, set[str]]:
    """kvheat's modules and the kvheat modules each imports (type-only and function-level
    imports too; a package's own ancestors are not edges: they are imported first anyway)."""
    mods: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from x import y`: module x.y when it is one, else x itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[mod].update(t for t in targets if t in mods and t != mod and t not in ancestors)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    assert _circles(_module_graph()) == []


def test_the_circle_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
