"""A host adapter imports the core only through its front door, ``dataflex_bus.kit``, and the package's public
face (``dataflex_bus``); the front door exports exactly what the adapters import of it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dataflex_bus
from dataflex_bus import kit

ROOT = Path(__file__).resolve().parents[2]
#: Each adapter: its folder and its dotted package (imports inside it are its own).
ADAPTERS = {ROOT / "dataflex_bus" / "verl": "dataflex_bus.verl", ROOT / "dataflex_bus" / "trl": "dataflex_bus.trl",
            ROOT / "dataflex_bus" / "shim": "dataflex_bus.shim", ROOT / "tests" / "hosts" / "lean_host": "lean_host"}


def imports(source: str, package: str) -> list[tuple[int, str, list[str]]]:
    """``(line, absolute module, names)`` of every import in ``source`` (a module of ``package``), inside
    functions and ``TYPE_CHECKING`` blocks too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


def strays(source: str, package: str) -> list[str]:
    """The imports of the core that go around the front door: not ``dataflex_bus.kit``, not a name of the
    public face, not the adapter's own package."""
    face = set(dataflex_bus.__all__)
    found = []
    for line, module, names in imports(source, package):
        if not (module == "dataflex_bus" or module.startswith("dataflex_bus.")):
            continue
        if module == "dataflex_bus.kit" or module == package or module.startswith(package + "."):
            continue
        if module == "dataflex_bus" and names and set(names) <= face:
            continue
        found.append(f"line {line}: {module} {names}")
    return found


def adapter_modules() -> list[tuple[Path, str]]:
    out = []
    for folder, package in ADAPTERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            out.append((path, ".".join([package, *rel[:-1]])))  # the package its relative imports start from
    return out


def test_every_adapter_imports_the_core_only_through_the_front_door():
    found = {str(path.relative_to(ROOT)): bad for path, package in adapter_modules()
             if (bad := strays(path.read_text(), package))}
    assert found == {}, found


def test_the_check_catches_an_import_around_the_front_door():
    """The check above can fail: a relative, absolute or lazy import of a core module is caught."""
    assert strays("from ..errors import ConfigError\n", "dataflex_bus.trl")
    assert strays("def f():\n    from dataflex_bus.steps import Step\n", "lean_host")
    assert strays("import dataflex_bus.runtime\n", "dataflex_bus.verl")
    assert not strays("from ..kit import ConfigError\nfrom .rows import Layout\nfrom .. import __version__\n",
                      "dataflex_bus.trl")


def test_the_front_door_exports_exactly_what_the_adapters_use():
    used: set[str] = set()
    for path, package in adapter_modules():
        for _, module, names in imports(path.read_text(), package):
            if module == "dataflex_bus.kit":
                used |= set(names)
    assert used == set(kit.__all__), {"exported, never used": sorted(set(kit.__all__) - used),
                                      "used, not exported": sorted(used - set(kit.__all__))}


@pytest.mark.parametrize("name", kit.__all__)
def test_every_name_of_the_front_door_resolves(name):
    assert getattr(kit, name) is not None


def test_an_unknown_name_says_where_to_add_it():
    with pytest.raises(AttributeError, match="add it there"):
        kit.no_such_name  # noqa: B018


def test_importing_the_front_door_imports_no_torch():
    code = "import sys, dataflex_bus.kit; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
