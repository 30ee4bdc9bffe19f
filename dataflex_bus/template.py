"""``dataflex new-plugin NAME``: create a method pack from the template shipped with dataflex-bus.

The generated project (``dataflex-NAME/``, import package ``dataflex_NAME``) has its entry point wired,
one example scorer, a README and tests that pass out of the box once it is installed
(``pip install -e .``), including "the plugin is discovered and active". Template files live in
``dataflex_bus/templates/plugin`` as package data; ``*.tmpl`` files are rendered by replacing
``{{key}}`` placeholders, and a path part ``__module__`` becomes the import package name.
"""

from __future__ import annotations

import argparse
import keyword
import re
import sys
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from .errors import DataflexError

#: Lowercase words of letters and digits joined by single ``-`` or ``_``, starting with a letter.
NAME_RE = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
PREFIX = "dataflex-"
#: Names whose pack would be dataflex-bus itself: ``dataflex-bus`` / ``dataflex_bus`` and the first-party
#: ``dataflex_plugins`` package; installing such a pack would replace or shadow the bus.
RESERVED = frozenset({"bus", "plugins"})


class TemplateError(DataflexError):
    """The pack cannot be created (bad name, existing directory)."""


@dataclass(frozen=True)
class PackNames:
    """Every name derived from the NAME given on the command line."""

    name: str
    dist: str        # distribution, e.g. dataflex-my-scorer
    module: str      # import package, e.g. dataflex_my_scorer
    component: str   # registered scorer name, e.g. my_scorer
    plugin: str      # entry-point name
    cls: str         # scorer class, e.g. MyScorer

    def placeholders(self) -> dict[str, str]:
        from . import __version__

        return {"dist": self.dist, "module": self.module, "component": self.component,
                "plugin": self.plugin, "class": self.cls, "bus_version": __version__}


def pack_names(name: str) -> PackNames:
    """Derive the pack's names from NAME; raises :class:`TemplateError` for an invalid one."""
    raw = name.strip()
    if raw.lower().startswith(PREFIX):
        raw = raw[len(PREFIX):]
    if not NAME_RE.fullmatch(raw):
        raise TemplateError(
            f"invalid plugin name {name!r}: use lowercase letters and digits, words joined by '-' or '_', "
            f"starting with a letter (e.g. 'my-scorer'); the pack becomes dataflex-<name>")
    component = raw.replace("-", "_")
    if component in RESERVED:
        raise TemplateError(f"invalid plugin name {name!r}: dataflex-{component.replace('_', '-')} / "
                            f"dataflex_{component} belong to dataflex-bus itself; choose another name")
    cls = "".join(part.capitalize() for part in component.split("_"))
    if keyword.iskeyword(component) or not cls.isidentifier():
        raise TemplateError(f"invalid plugin name {name!r}: {component!r} is not usable as a Python name")
    return PackNames(name=raw, dist=PREFIX + raw.replace("_", "-"), module="dataflex_" + component,
                     component=component, plugin=component, cls=cls)


def _template_root() -> Traversable:
    return resources.files("dataflex_bus") / "templates" / "plugin"


def _render(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    left = re.findall(r"\{\{[a-z_]+\}\}", text)
    if left:  # a template bug, never the user's: fail loudly rather than write a broken project
        raise TemplateError(f"template placeholders without a value: {sorted(set(left))}")
    return text


def _walk(node: Traversable, rel: tuple[str, ...] = ()):
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name == "__pycache__":
            continue
        if child.is_dir():
            yield from _walk(child, (*rel, child.name))
        else:
            yield (*rel, child.name), child


def create_pack(name: str, parent: str | Path = ".") -> Path:
    """Create ``<parent>/dataflex-<name>/`` from the template; returns the new directory."""
    names = pack_names(name)
    parent = Path(parent)
    if not parent.is_dir():
        raise TemplateError(f"--dir {str(parent)!r} is not an existing directory")
    target = parent / names.dist
    if target.exists():
        raise TemplateError(f"{str(target)!r} already exists; choose another name or --dir "
                            "(new-plugin never overwrites files)")
    values = names.placeholders()
    files = []
    for rel, node in _walk(_template_root()):
        parts = [p.replace("__module__", names.module) for p in rel]
        if parts[-1].endswith(".tmpl"):
            parts[-1] = parts[-1][: -len(".tmpl")]
            content = _render(node.read_text(encoding="utf-8"), values)
        else:
            content = node.read_text(encoding="utf-8")
        files.append((Path(*parts), content))
    if not files:
        raise TemplateError("the plugin template is missing from this dataflex-bus installation")
    target.mkdir()
    for path, content in files:
        out = target / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(content, encoding="utf-8")
    return target


def bus_source() -> str:
    """Where the running dataflex-bus was installed from, so the next steps say what pip will use for the
    pack's ``dataflex-bus`` requirement (until it is published, a clone)."""
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        raw = metadata.distribution("dataflex-bus").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return "not installed as a distribution: first `pip install -e /path/to/dataflex-bus` (a clone)"
    url = json.loads(raw).get("url", "") if raw else ""
    if url.startswith("file://"):
        return f"already installed here from {unquote(urlparse(url).path)} (nothing to download)"
    return "already installed here (nothing to download)"


def cmd_new_plugin(args: argparse.Namespace) -> int:
    """``dataflex new-plugin NAME [--dir DIR]``."""
    target = create_pack(args.name, args.dir)
    names = pack_names(args.name)
    print(f"created {target}/ (distribution {names.dist}, package {names.module}, scorer {names.component})")
    print("next steps:")
    print(f"  cd {target}")
    print(f"  pip install -e '.[test]'   # dataflex-bus itself: {bus_source()}")
    print("  pytest                    # includes: the plugin is discovered and active")
    print("  dataflex plugins          # shows it with its version and components")
    sys.stdout.flush()
    return 0
