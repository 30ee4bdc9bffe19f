"""Committed-fake distributions for discovery tests: a package plus a ``.dist-info`` on a temp path.

``importlib.metadata`` finds a distribution through any ``NAME-VERSION.dist-info`` directory on
``sys.path`` holding ``METADATA`` and ``entry_points.txt``; this is exactly what pip leaves behind.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def make_dist(root: Path, dist: str, version: str, modules: dict[str, str],
              entry_points: dict[str, str]) -> Path:
    """Write package modules and a dist-info under ``root``; returns ``root``."""
    for dotted, source in modules.items():
        path = root.joinpath(*dotted.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.parents:
            if parent == root:
                break
            (parent / "__init__.py").touch(exist_ok=True)
        path.write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[dataflex]\n{lines}\n")
    return root


def forget_modules(*prefixes: str) -> None:
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            del sys.modules[name]
