"""Component registry: who provides which scorer or actuator, and resolution by name.

The host owns the collection. Plugins only call ``register(kind, name, target)``; the registry records
the provenance (plugin, distribution, version), refuses ambiguous names with an error naming every
provider, and resolves qualified names ``distribution:name``.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .components import KINDS
from .errors import CollisionError, PluginLoadError, UnknownComponentError

if TYPE_CHECKING:
    from .components import Component

#: Config slot each kind is resolved in: scorers and actuators live in separate name spaces.
SLOT = {"scorer": "scorer", "selector": "actuator", "reweighter": "actuator", "mixer": "actuator"}
LOCAL_PLUGIN = "local"


def normalize_name(name: str) -> str:
    """PEP 503 normalisation, used for distribution and entry-point names alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class ComponentSpec:
    """One registered component and where it came from. ``target`` is imported only by :meth:`load`."""

    kind: str
    name: str
    target: str | type
    plugin: str
    distribution: str | None = None
    version: str | None = None
    summary: str = ""
    _loaded: type | None = field(default=None, repr=False, compare=False)

    @property
    def provider(self) -> str:
        """Distribution name, or the plugin name for in-process registrations."""
        return self.distribution or self.plugin

    @property
    def qualified_name(self) -> str:
        return f"{normalize_name(self.provider)}:{self.name}"

    def load(self) -> type[Component]:
        """Import the component class and check it is the declared kind."""
        if self._loaded is not None:
            return self._loaded
        from .components import Component

        target = self.target
        if isinstance(target, str):
            module_name, _, attr = target.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin {self.plugin!r} ({self.provider}): cannot import {self.kind} {self.name!r} "
                    f"from {target!r}: {type(exc).__name__}: {exc}"
                ) from exc
        else:
            obj = target
        if not (isinstance(obj, type) and issubclass(obj, Component) and obj.kind == self.kind):
            raise PluginLoadError(
                f"plugin {self.plugin!r} ({self.provider}): {self.name!r} was registered as a {self.kind} "
                f"but {target!r} is {getattr(obj, 'kind', None) or type(obj).__name__!r}"
            )
        self._loaded = obj
        return obj


class Register:
    """The callback handed to ``dataflex_register``; collects one plugin's components."""

    def __init__(self, plugin: str, distribution: str | None = None, version: str | None = None) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.specs: list[ComponentSpec] = []

    def __call__(self, kind: str, name: str, target: str | type, *, summary: str = "") -> None:
        if kind not in KINDS:
            raise ValueError(f"register(): kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
            raise ValueError(f"register(): invalid component name {name!r}")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"register(): target {target!r} must look like 'package.module:ClassName'")
        if any(s.name == name and SLOT[s.kind] == SLOT[kind] for s in self.specs):
            raise ValueError(f"register(): {SLOT[kind]} name {name!r} registered twice by this plugin")
        self.specs.append(ComponentSpec(kind, name, target, self.plugin, self.distribution, self.version,
                                        summary=summary))


# In-process registrations (decorators, test fixtures): provider "local".
_LOCAL: dict[tuple[str, str], ComponentSpec] = {}


def register_local(kind: str, name: str, target: str | type, *, summary: str = "") -> ComponentSpec:
    """Register a component in this process only (what the ``register_*`` decorators call)."""
    reg = Register(LOCAL_PLUGIN)
    reg(kind, name, target, summary=summary)
    spec = reg.specs[0]
    _LOCAL[(SLOT[kind], name)] = spec
    return spec


def unregister_local(kind: str, name: str) -> None:
    _LOCAL.pop((SLOT[kind], name), None)


def local_specs() -> list[ComponentSpec]:
    return list(_LOCAL.values())


class Registry:
    """All known components, by config slot."""

    def __init__(self, specs: Iterable[ComponentSpec]) -> None:
        self.specs = list(specs)

    def names(self, slot: str, kinds: Iterable[str] | None = None) -> list[str]:
        wanted = set(kinds) if kinds is not None else None
        return sorted({s.name for s in self.specs
                       if SLOT[s.kind] == slot and (wanted is None or s.kind in wanted)})

    def resolve(self, slot: str, name: str, *, key: str | None = None) -> ComponentSpec:
        """Find the one component named ``name`` (or ``provider:name``) in ``slot``."""
        key = key or f"dataflex.{slot}.name"
        qualifier, sep, bare = name.rpartition(":")
        candidates = [s for s in self.specs if SLOT[s.kind] == slot and s.name == bare]
        if sep:
            q = normalize_name(qualifier)
            candidates = [s for s in candidates
                          if normalize_name(s.provider) == q or normalize_name(s.plugin) == q]
        if not candidates:
            known = self.names(slot)
            close = difflib.get_close_matches(bare, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            where = f" from {qualifier!r}" if sep else ""
            raise UnknownComponentError(
                f"{key}: unknown {slot} {bare!r}{where}{hint} (installed: {', '.join(known) or 'none'})"
            )
        if len(candidates) > 1:
            providers = ", ".join(f"{s.qualified_name} (plugin {s.plugin!r})" for s in candidates)
            raise CollisionError(
                f"{key}: {slot} name {bare!r} is provided by more than one plugin: {providers}; "
                f"use a qualified name such as {candidates[0].qualified_name!r}"
            )
        return candidates[0]
