"""No module of the package imports itself back at run time, through imports made inside functions too (only
``if TYPE_CHECKING:`` imports are left out): a loop works only while every lazy import in it stays lazy."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dataflex_bus"


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (a package's own ``__init__`` is not counted
    for its submodules: it is loaded before them)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def add(source: str, target: str) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and name != source and not source.startswith(name + "."):
                graph[source].add(name)

    for source, (path, is_package) in modules.items():
        here = source.split(".") if is_package else source.split(".")[:-1]
        stack: list[ast.AST] = [ast.parse(path.read_text())]
        while stack:
            for node in ast.iter_child_nodes(stack.pop()):
                if isinstance(node, ast.If) and _type_checking(node):
                    stack.extend(node.orelse)
                    continue
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        add(source, alias.name)
                elif isinstance(node, ast.ImportFrom):
                    base = here[: len(here) - node.level + 1] if node.level else []
                    target = ".".join(base + ([node.module] if node.module else []))
                    add(source, target)
                    for alias in node.names:
                        add(source, f"{target}.{alias.name}")
                stack.append(node)
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_finder_sees_a_loop_through_a_lazy_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "kit.py").write_text("from .sub.leaf import f\n")
    (package / "sub" / "__init__.py").write_text("from .other import g\n")
    (package / "sub" / "other.py").write_text("def g():\n    from ..kit import f\n")
    (package / "sub" / "leaf.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from ..kit import f\n")
    assert loops(import_graph(package)) == [["pkg.kit", "pkg.sub", "pkg.sub.other"]]


def test_no_module_imports_itself_back():
    assert loops(import_graph(PACKAGE)) == []
