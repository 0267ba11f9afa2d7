"""Every public function, class and method in kvheat opens its docstring with a one-line
summary: a first line that is a sentence on its own (it ends with a period), followed by a
blank line or by nothing.

Public: no leading underscore, at module level, or a method of a public class. A method
that overrides a documented method of a kvheat base class shares that method's summary
(as `inspect.getdoc` would show it) and needs none of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvheat"

Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def summary_problem(doc: str | None) -> str | None:
    """Why `doc` does not open with a one-line summary (None: it does)."""
    if doc is None or not doc.strip():
        return "no docstring"
    lines = doc.strip().splitlines()
    first = lines[0].strip()
    if not first.endswith("."):
        return f"summary line does not end with a period: {first!r}"
    if len(lines) > 1 and lines[1].strip():
        return f"summary line not followed by a blank line: {first!r}"
    return None


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        out.append((rel, ast.parse(path.read_text(), filename=str(path))))
    return out


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):  # Generic[T], a parametrised base
        return _base_name(node.value)
    return None


def _documented_methods() -> dict[str, tuple[list[str], set[str]]]:
    """Every class of the whole package (excluded files too: a base is a base) by name:
    its bases' names and the methods it documents."""
    out: dict[str, tuple[list[str], set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in map(_base_name, node.bases) if b is not None]
                documented = {f.name for f in node.body
                              if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                              and summary_problem(ast.get_docstring(f)) is None}
                known = out.get(node.name)
                if known is not None:  # the same name twice: keep what either gives
                    bases += known[0]
                    documented |= known[1]
                out[node.name] = (bases, documented)
    return out


def _inherits_doc(classes: dict[str, tuple[list[str], set[str]]], cls: ast.ClassDef,
                  method: str) -> bool:
    seen: set[str] = set()
    todo = [b for b in map(_base_name, cls.bases) if b is not None]
    while todo:
        name = todo.pop()
        if name in seen or name not in classes:
            continue
        seen.add(name)
        bases, documented = classes[name]
        if method in documented:
            return True
        todo.extend(bases)
    return False


def missing_summaries() -> list[str]:
    """`file:line name: problem` for each public definition without a one-line summary."""
    classes = _documented_methods()
    wrong = []

    def check(rel: str, node: Def, name: str) -> None:
        problem = summary_problem(ast.get_docstring(node))
        if problem is not None:
            wrong.append(f"{rel}:{node.lineno} {name}: {problem}")

    for rel, module in _modules():
        for node in module.body:
            if not isinstance(node, Def) or node.name.startswith("_"):
                continue
            check(rel, node, node.name)
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if (isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                        and not item.name.startswith("_")
                        and not (ast.get_docstring(item) is None
                                 and _inherits_doc(classes, node, item.name))):
                    check(rel, item, f"{node.name}.{item.name}")
    return wrong


def test_public_definitions_open_with_a_one_line_summary() -> None:
    wrong = missing_summaries()
    assert not wrong, (f"{len(wrong)} public definitions without a one-line summary:\n"
                       + "\n".join(wrong))


def test_the_checker_reads_a_summary_line() -> None:
    assert summary_problem("Do this.") is None
    assert summary_problem("Do this.\n\n    More about it.\n    ") is None
    assert summary_problem(None) == "no docstring"
    assert summary_problem("  ") == "no docstring"
    assert summary_problem("Do this and\n    that.").startswith("summary line does not end")
    assert summary_problem("Do this.\n    More.").startswith("summary line not followed")
