"""Safe, memoised plugin discovery over the ``dataflex`` entry-point group.

Unlike pluggy's ``load_setuptools_entrypoints`` (which stops at the first plugin that fails to import),
each plugin is loaded in its own try/except; allow/deny lists are applied *before* import; every
failure is recorded with plugin, distribution, version and error, and reported once on stderr.
``DATAFLEX_STRICT_PLUGINS=1`` turns the first failure into an exception (our own tests run strict).

Environment:

* ``DATAFLEX_LOAD_PLUGINS``: comma-separated allowlist of entry-point or distribution names. Unset:
  load all; set but empty: load none. The first-party packs are ordinary plugins of the
  ``dataflex-bus`` distribution and obey it too (list ``dataflex-bus`` to keep them).
* ``DATAFLEX_DISABLE_PLUGINS``: comma-separated denylist, same names. A disabled plugin is never
  imported.
* ``DATAFLEX_STRICT_PLUGINS``: ``1`` re-raises the first load failure.
* ``DATAFLEX_DEBUG``: ``1`` writes ``dataflex: loading plugin X (dist==version)`` to stderr before each
  import (and prints the traceback of a failure), so a plugin that kills the process is still named.

A plugin calling ``sys.exit`` or ``os._exit`` while it is imported or registers its components is a load
failure like any other (the listing goes on and names it).

A list entry naming no installed plugin or distribution is warned about with a did-you-mean.
:mod:`dataflex_bus.plugin_check` imports every plugin and component target in a child process, so a
pack that kills the interpreter (``os._exit``) or hangs at import is named instead of taking the caller
with it.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata  # group selection and EntryPoint.dist: stdlib since 3.10
from typing import Any, NoReturn

import pluggy

from . import hookspecs
from .errors import PluginLoadError, clip_text, format_traceback
from .missing import ENTRY_POINT_FIX, installed_without_entry_point, unknown_hint
from .registry import (
    ComponentSpec,
    DisabledPlugin,
    Register,
    Registry,
    debug_mode,
    local_specs,
    normalize_name,
)
from .schema import did_you_mean

ENTRY_POINT_GROUP = "dataflex"
ENV_LOAD = "DATAFLEX_LOAD_PLUGINS"
ENV_DISABLE = "DATAFLEX_DISABLE_PLUGINS"
ENV_STRICT = "DATAFLEX_STRICT_PLUGINS"
#: The distribution of the first-party packs (dataflex-bus itself).
FIRST_PARTY = "dataflex-bus"

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
    #: Problems that do not stop the plugin loading (a hook defined without ``@hookimpl``).
    warnings: list[str] = field(default_factory=list)
    #: The environment variable that disabled the plugin, and why (``None`` unless disabled).
    disabled_by: str | None = None
    disabled_reason: str | None = None
    #: What a failed plugin registered before it failed (never in the registry; named in unknown-name errors).
    declared: list[ComponentSpec] = field(default_factory=list, repr=False)

    @property
    def pin(self) -> str:
        """``name==version`` of the providing distribution, as recorded with every run."""
        return f"{self.distribution or self.name}=={self.version or 'unknown'}"

    @property
    def label(self) -> str:
        return f"plugin {self.name!r} ({self.pin})"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "warnings": list(self.warnings),
            "disabled_by": self.disabled_by,
            "components": [{"name": c.name, "kind": c.kind, "summary": c.summary, "target": c.target_text}
                           for c in sorted(self.components, key=lambda c: (c.kind, c.name))],
        }


def _raw_env(var: str) -> str | None:
    return os.environ.get(var)


def _names_from_env(var: str) -> set[str] | None:
    raw = _raw_env(var)
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

    def __init__(self, records: list[PluginRecord], pm: pluggy.PluginManager,
                 warnings: list[str] | None = None, probes: dict[str, Any] | None = None) -> None:
        self.records = records
        self.pm = pm
        #: Problems with the environment itself (an allow/deny entry naming no installed plugin).
        self.warnings = list(warnings or [])
        self._probes = dict(probes or {})

    @property
    def active(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == ACTIVE]

    @property
    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == FAILED]

    def registry(self) -> Registry:
        """Components of active plugins plus in-process registrations (read fresh on every call)."""
        specs = [c for r in self.active for c in r.components]
        disabled = [DisabledPlugin(r.name, r.distribution, r.version, r.disabled_reason or "is disabled",
                                   self._probes.get(r.name) if _is_first_party(r.distribution) else None,
                                   r.disabled_by or ENV_LOAD)
                    for r in self.records if r.status == DISABLED]
        return Registry([*specs, *local_specs()], disabled, functools.partial(unknown_hint, self.failed))

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


def _is_first_party(distribution: str | None) -> bool:
    return distribution is not None and normalize_name(distribution) == FIRST_PARTY


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """Hook implementations of ``plugin`` that match no hookspec (a misspelt hook)."""
    return sorted(h.name for h in pm.get_hookcallers(plugin) or [] if h.spec is None)


def _hook_warnings(pm: pluggy.PluginManager, module: object, components: list[ComponentSpec]) -> list[str]:
    """Hooks pluggy silently ignores: a function named like a hook but without ``@hookimpl``."""
    warnings = []
    for hook in sorted(hookspecs.documented_hooks()):
        fn = getattr(module, hook, None)
        if callable(fn) and pm.parse_hookimpl_opts(module, hook) is None:
            what = "registers no component" if hook == "dataflex_register" else "is never called"
            warnings.append(f"defines {hook}() without @hookimpl, so it {what}: decorate it with "
                            "@dataflex_bus.hookimpl")
    if not warnings and not components:
        hooks = {h.name for h in pm.get_hookcallers(module) or []}
        if not hooks & set(hookspecs.EVENTS):
            warnings.append("registers no component and implements no event hook")
    return warnings


def _dist_of(ep: Any) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)


def plugin_key(distribution: str | None, name: str) -> str:
    """``distribution:entry-point name``: one plugin, whatever its distribution's spelling."""
    return f"{normalize_name(distribution or '')}:{name}"


@contextmanager
def _exit_is_an_error(what: str) -> Iterator[None]:
    """While a plugin is imported and registered, ``os._exit`` called by it (this thread, this process)
    raises ``SystemExit`` instead, so it is recorded against the plugin as a ``sys.exit`` is, rather than
    ending the host without a word. Other threads and forked children get the real ``os._exit``; what no
    Python code can report (a crash, a signal) is named by ``plugins --check`` and debug mode."""
    real = os._exit
    pid, thread = os.getpid(), threading.get_ident()

    def refused(status: int) -> NoReturn:
        if os.getpid() != pid or threading.get_ident() != thread:
            real(status)
        raise SystemExit(f"os._exit({status}) called while {what}")

    os._exit = refused
    try:
        yield
    finally:
        os._exit = real


def _load_one(ep: Any, pm: pluggy.PluginManager, strict: bool) -> PluginRecord:
    dist_name, version = _dist_of(ep)
    record = PluginRecord(ep.name, dist_name, version, ACTIVE)
    key = plugin_key(dist_name, ep.name)
    register: Register | None = None
    if debug_mode():
        # Flushed before the import: if the plugin ends the process (os._exit), this is the last line.
        sys.stderr.write(f"dataflex: loading plugin {ep.name!r} ({record.pin})\n")
        sys.stderr.flush()
    try:
        with _exit_is_an_error("the plugin was imported"):
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
        # Through pluggy's own caller (its argument subsetting, wrappers and result handling), restricted
        # to this plugin so the components it registers are attributed to it.
        others = [p for p in pm.get_plugins() if p is not module]
        try:
            with _exit_is_an_error("the plugin registered its components"):
                pm.subset_hook_caller("dataflex_register", remove_plugins=others)(register=register)
        except (Exception, SystemExit):
            pm.unregister(module)
            raise
        record.components = register.specs
        record.module = module
        record.warnings = _hook_warnings(pm, module, record.components)
    except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not end the host
        record.status = FAILED
        record.error = f"{type(exc).__name__}: {clip_text(str(exc))}"
        record.components = []
        record.declared = list(register.specs) if register is not None else []
        if strict:
            raise PluginLoadError(
                f"plugin {ep.name!r} from {dist_name or '?'} {version or ''} failed to load: {record.error}"
            ) from exc
        sys.stderr.write(
            f"dataflex: plugin {ep.name!r} ({dist_name or '?'} {version or ''}) failed to load and is skipped: "
            f"{record.error}\n"
        )
        if debug_mode():
            sys.stderr.write(format_traceback(exc))
    for warning in record.warnings:
        sys.stderr.write(f"dataflex: warning: {record.label}: {warning}\n")
    return record


@dataclass
class _Plan:
    """What discovery will do with each entry point, decided before anything is imported."""

    entries: list[tuple[Any, str | None, str | None]]  # (entry point, disabling variable, reason)
    warnings: list[str]


def _env_entry_warnings(var: str, wanted: set[str] | None, known: set[str]) -> list[str]:
    if not wanted:
        return []
    out = []
    for name in sorted(wanted - known):
        silent = installed_without_entry_point(name)
        if silent is not None:
            out.append(f"{var} entry {name!r} names {silent}, which is installed but declares no 'dataflex' entry "
                       f"point, so it provides no plugin: {ENTRY_POINT_FIX}")
            continue
        hint = did_you_mean(name, sorted(known), n=3)
        hint = f"; {hint}" if hint else ""
        out.append(f"{var} entry {name!r} names no installed plugin or distribution{hint} "
                   f"(installed: {', '.join(sorted(known)) or 'none'})")
    return out


def _plan() -> _Plan:
    allow = _names_from_env(ENV_LOAD)
    deny = _names_from_env(ENV_DISABLE) or set()
    eps: dict[tuple[str, str], Any] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        # A distribution on sys.path twice shows its entry points twice on Python < 3.12: keep one.
        dist_key = normalize_name(ep.dist.metadata["Name"]) if ep.dist else ""
        eps.setdefault((dist_key, ep.name), ep)
    known: set[str] = set()
    entries: list[tuple[Any, str | None, str | None]] = []
    for (dist_key, _), ep in sorted(eps.items()):
        names = {normalize_name(ep.name)} | ({dist_key} if dist_key else set())
        known |= names
        if names & deny:
            entries.append((ep, ENV_DISABLE, f"{ENV_DISABLE}={_raw_env(ENV_DISABLE)!r} lists it"))
        elif allow is not None and not names & allow:
            entries.append((ep, ENV_LOAD, f"{ENV_LOAD}={_raw_env(ENV_LOAD)!r} leaves it out"))
        else:
            entries.append((ep, None, None))
    warnings = [*_env_entry_warnings(ENV_LOAD, allow, known), *_env_entry_warnings(ENV_DISABLE, deny, known)]
    return _Plan(entries, warnings)


def _probe(ep: Any) -> list[ComponentSpec]:
    """What a (disabled, first-party) plugin would register, without registering it anywhere."""
    dist_name, version = _dist_of(ep)
    register = Register(ep.name, dist_name, version)
    # A throwaway manager: the hook is called through pluggy, as for a loaded plugin, but registers nowhere.
    pm = new_plugin_manager()
    pm.register(ep.load(), name=ep.name)
    pm.hook.dataflex_register(register=register)
    return register.specs


def discover(*, strict: bool | None = None) -> PluginSet:
    """Scan the entry-point group and load every allowed plugin. Prefer :func:`get_plugins` (memoised)."""
    strict = strict_mode() if strict is None else strict
    plan = _plan()
    for warning in plan.warnings:
        sys.stderr.write(f"dataflex: warning: {warning}\n")
    pm = new_plugin_manager()
    records: list[PluginRecord] = []
    probes = {}
    for ep, variable, reason in plan.entries:
        if variable is None:
            records.append(_load_one(ep, pm, strict))
            continue
        dist_name, version = _dist_of(ep)
        records.append(PluginRecord(ep.name, dist_name, version, DISABLED, disabled_by=variable,
                                    disabled_reason=reason))
        if _is_first_party(dist_name):
            probes[ep.name] = functools.partial(_probe, ep)
    return PluginSet(records, pm, plan.warnings, probes)


# ---------------------------------------------------------------------------- the process-wide plugin set
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
