"""Safe, memoised plugin discovery over the ``dataflex`` entry-point group.

Unlike pluggy's ``load_setuptools_entrypoints`` (which stops at the first plugin that fails to import),
each plugin is loaded in its own try/except; allow/deny lists are applied *before* import; every
failure is recorded with plugin, distribution, version and error, and reported once on stderr.
``DATAFLEX_STRICT_PLUGINS=1`` turns the first failure into an exception (our own tests run strict).

Environment:

* ``DATAFLEX_LOAD_PLUGINS``: comma-separated allowlist of entry-point or distribution names. Unset:
  load all; set but empty: load none.
* ``DATAFLEX_DISABLE_PLUGINS``: comma-separated denylist, same names. A disabled plugin is never
  imported.
* ``DATAFLEX_STRICT_PLUGINS``: ``1`` re-raises the first load failure.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field
from importlib import metadata  # group selection and EntryPoint.dist: stdlib since 3.10
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginLoadError
from .registry import ComponentSpec, Register, Registry, local_specs, normalize_name

ENTRY_POINT_GROUP = "dataflex"
ENV_LOAD = "DATAFLEX_LOAD_PLUGINS"
ENV_DISABLE = "DATAFLEX_DISABLE_PLUGINS"
ENV_STRICT = "DATAFLEX_STRICT_PLUGINS"

ACTIVE, DISABLED, FAILED = "active", "disabled", "failed"


@dataclass
class PluginRecord:
    """What discovery knows about one plugin, whatever became of it."""

    name: str
    distribution: str | None
    version: str | None
    status: str
    error: str | None = None
    components: list[ComponentSpec] = field(default_factory=list)
    module: Any = field(default=None, repr=False)

    @property
    def pin(self) -> str:
        """``name==version`` of the providing distribution, as recorded with every run."""
        return f"{self.distribution or self.name}=={self.version or 'unknown'}"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "components": [{"name": c.name, "kind": c.kind}
                           for c in sorted(self.components, key=lambda c: (c.kind, c.name))],
        }


def _names_from_env(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {normalize_name(n.strip()) for n in raw.split(",") if n.strip()}


def strict_mode() -> bool:
    return os.environ.get(ENV_STRICT, "").strip().lower() in {"1", "true", "yes", "on"}


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


class PluginSet:
    """The result of one discovery pass: records (active, disabled, failed) and the loaded modules."""

    def __init__(self, records: list[PluginRecord], pm: pluggy.PluginManager) -> None:
        self.records = records
        self.pm = pm

    @property
    def active(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == ACTIVE]

    @property
    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == FAILED]

    def registry(self) -> Registry:
        """Components of active plugins plus in-process registrations (read fresh on every call)."""
        specs = [c for r in self.active for c in r.components]
        return Registry([*specs, *local_specs()])

    def pins(self) -> list[str]:
        return sorted({r.pin for r in self.active})

    def observers(self) -> list[tuple[str, Any]]:
        """Active plugin modules that implement at least one training-event hook."""
        out = []
        for r in self.active:
            hooks = {h.name for h in self.pm.get_hookcallers(r.module) or []}
            if hooks & set(hookspecs.EVENTS):
                out.append((r.name, r.module))
        return out


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """Hook implementations of ``plugin`` that match no hookspec (a misspelt hook)."""
    return sorted(h.name for h in pm.get_hookcallers(plugin) or [] if h.spec is None)


def _load_one(ep: Any, pm: pluggy.PluginManager, strict: bool) -> PluginRecord:
    dist = getattr(ep, "dist", None)
    dist_name = dist.metadata["Name"] if dist is not None else None
    version = dist.version if dist is not None else None
    record = PluginRecord(ep.name, dist_name, version, ACTIVE)
    key = f"{normalize_name(dist_name or '')}:{ep.name}"
    try:
        module = ep.load()
        if pm.is_registered(module):
            raise PluginLoadError(f"module {getattr(module, '__name__', module)!r} is already registered "
                                  f"under another entry point")
        pm.register(module, name=key)
        unknown = _unknown_hooks(pm, module)
        if unknown:
            pm.unregister(module)
            known = ", ".join(sorted(hookspecs.documented_hooks()))
            raise PluginLoadError(f"implements unknown hook(s) {', '.join(unknown)} (known hooks: {known})")
        register = Register(ep.name, dist_name, version)
        impls = [i for i in pm.hook.dataflex_register.get_hookimpls() if i.plugin is module]
        try:
            for impl in impls:
                impl.function(register=register)
        except Exception:
            pm.unregister(module)
            raise
        record.components = register.specs
        record.module = module
    except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not end the host
        record.status = FAILED
        record.error = f"{type(exc).__name__}: {exc}"
        record.components = []
        if strict:
            raise PluginLoadError(
                f"plugin {ep.name!r} from {dist_name or '?'} {version or ''} failed to load: {record.error}"
            ) from exc
        sys.stderr.write(
            f"dataflex: plugin {ep.name!r} ({dist_name or '?'} {version or ''}) failed to load and is skipped: "
            f"{record.error}\n"
        )
        if os.environ.get("DATAFLEX_DEBUG"):
            traceback.print_exception(exc)
    return record


def discover(*, strict: bool | None = None) -> PluginSet:
    """Scan the entry-point group and load every allowed plugin. Prefer :func:`get_plugins` (memoised)."""
    strict = strict_mode() if strict is None else strict
    allow = _names_from_env(ENV_LOAD)
    deny = _names_from_env(ENV_DISABLE) or set()
    pm = new_plugin_manager()
    records: list[PluginRecord] = []
    eps = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        # A distribution on sys.path twice shows its entry points twice on Python < 3.12: keep one.
        dist_key = normalize_name(ep.dist.metadata["Name"]) if ep.dist else ""
        eps.setdefault((dist_key, ep.name), ep)
    for _, ep in sorted(eps.items()):
        dist = getattr(ep, "dist", None)
        names = {normalize_name(ep.name)}
        if dist is not None:
            names.add(normalize_name(dist.metadata["Name"]))
        if (allow is not None and not names & allow) or names & deny:
            records.append(PluginRecord(ep.name, dist.metadata["Name"] if dist else None,
                                        dist.version if dist else None, DISABLED))
            continue
        records.append(_load_one(ep, pm, strict))
    return PluginSet(records, pm)


_CACHE: PluginSet | None = None


def get_plugins(*, refresh: bool = False) -> PluginSet:
    """The process-wide plugin set, discovered once (``importlib.metadata`` caches nothing)."""
    global _CACHE
    if _CACHE is None or refresh:
        _CACHE = discover()
    return _CACHE


def reset_plugins() -> None:
    """Forget the memoised plugin set (tests, or after installing a package at run time)."""
    global _CACHE
    _CACHE = None
