"""Component registry: who provides which scorer or actuator, and resolution by name.

The host owns the collection. Plugins only call ``register(kind, name, target)``; the registry records
the provenance (plugin, distribution, version), refuses ambiguous names with an error naming every
provider, and resolves qualified names ``distribution:name``.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .components import class_attribute_problems
from .errors import CollisionError, PluginLoadError, UnknownComponentError, clip_text, format_traceback
from .mechanisms import actuator_kinds, component_kinds
from .schema import did_you_mean

if TYPE_CHECKING:
    from .components import Component



def slot_of(kind: str) -> str:
    """The config slot components of ``kind`` are resolved in: scorers and actuators (every mechanism's
    actuator kind) live in separate name spaces. An unknown kind is its own slot."""
    return "scorer" if kind == "scorer" else "actuator" if kind in actuator_kinds() else kind

LOCAL_PLUGIN = "local"


def normalize_name(name: str) -> str:
    """PEP 503 normalisation, used for distribution and entry-point names alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def debug_mode() -> bool:
    """``DATAFLEX_DEBUG=1``: name each plugin and component module on stderr before importing it."""
    return os.environ.get("DATAFLEX_DEBUG", "").strip().lower() not in {"", "0", "false", "no", "off"}


def article(word: str) -> str:
    """``a`` or ``an`` before ``word`` (a component kind)."""
    return "an" if word[:1] in "aeiou" else "a"


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
            if debug_mode():
                # Flushed before the import: a component module that kills the process (os._exit) is
                # then still named on stderr.
                sys.stderr.write(f"dataflex: importing {self.kind} {self.name!r} from {target!r} "
                                 f"(plugin {self.plugin!r}, {self.pin})\n")
                sys.stderr.flush()
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:
                if debug_mode():  # the module's own file and line; validation keeps only the message
                    sys.stderr.write(format_traceback(exc))
                raise PluginLoadError(
                    f"plugin {self.plugin!r} ({self.provider}): cannot import {self.kind} {self.name!r} "
                    f"from {target!r}: {type(exc).__name__}: {clip_text(str(exc))}"
                ) from exc
        else:
            obj = target
        if not (isinstance(obj, type) and issubclass(obj, Component) and obj.kind == self.kind):
            raise PluginLoadError(
                f"plugin {self.plugin!r} ({self.provider}): {self.name!r} was registered as a {self.kind} "
                f"but {target!r} is {getattr(obj, 'kind', None) or type(obj).__name__!r}"
            )
        problems = class_attribute_problems(obj)
        if problems:
            raise PluginLoadError(
                f"plugin {self.plugin!r} ({self.provider}): {self.kind} {self.name!r} ({self.target_text}) has "
                f"invalid class attributes: {'; '.join(problems)}"
            )
        self._loaded = obj
        return obj

    @property
    def pin(self) -> str:
        """``distribution==version`` of the provider (``local`` for in-process registrations)."""
        if self.distribution is None:
            return self.plugin
        return f"{self.distribution}=={self.version or 'unknown'}"

    @property
    def target_text(self) -> str:
        """The target as ``module:Class`` text, also for a class registered directly."""
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"


class Register:
    """The callback handed to ``dataflex_register``; collects one plugin's components."""

    def __init__(self, plugin: str, distribution: str | None = None, version: str | None = None) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.specs: list[ComponentSpec] = []

    def __call__(self, kind: str, name: str, target: str | type, *, summary: str = "") -> None:
        if kind not in component_kinds():
            raise ValueError(f"register(): kind {kind!r} is not one of {', '.join(component_kinds())}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
            raise ValueError(f"register(): invalid component name {name!r}")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"register(): target {target!r} must look like 'package.module:ClassName'")
        if any(s.name == name and slot_of(s.kind) == slot_of(kind) for s in self.specs):
            raise ValueError(f"register(): {slot_of(kind)} name {name!r} registered twice by this plugin")
        self.specs.append(ComponentSpec(kind, name, target, self.plugin, self.distribution, self.version,
                                        summary=summary))


# In-process registrations (decorators, test fixtures): provider "local".
_LOCAL: dict[tuple[str, str], ComponentSpec] = {}


def register_local(kind: str, name: str, target: str | type, *, summary: str = "") -> ComponentSpec:
    """Register a component in this process only (what the ``register_*`` decorators call)."""
    reg = Register(LOCAL_PLUGIN)
    reg(kind, name, target, summary=summary)
    spec = reg.specs[0]
    _LOCAL[(slot_of(kind), name)] = spec
    return spec


def unregister_local(kind: str, name: str) -> None:
    _LOCAL.pop((slot_of(kind), name), None)


def local_specs() -> list[ComponentSpec]:
    return list(_LOCAL.values())


@dataclass(frozen=True)
class DisabledPlugin:
    """A plugin an environment variable kept from loading; its components are unknown (never imported).

    ``reason`` names the variable and its value. ``probe`` lists what it would register, for the
    first-party packs only (shipped inside dataflex-bus itself and import-light, so asking them is safe);
    a third-party pack that was disabled is never imported, not even to explain an error.
    """

    plugin: str
    distribution: str | None
    version: str | None
    reason: str
    probe: Callable[[], list[ComponentSpec]] | None = field(default=None, compare=False)
    #: The variable that disabled it: ``DATAFLEX_LOAD_PLUGINS`` or ``DATAFLEX_DISABLE_PLUGINS``.
    variable: str = "DATAFLEX_LOAD_PLUGINS"

    @property
    def label(self) -> str:
        return f"{self.plugin!r} ({self.distribution or '?'} {self.version or ''})".replace(" )", ")")


class Registry:
    """All known components, by config slot (plus the plugins an environment variable disabled)."""

    def __init__(self, specs: Iterable[ComponentSpec], disabled: Sequence[DisabledPlugin] = (),
                 explain: Callable[[str, str], str] | None = None) -> None:
        self.specs = list(specs)
        self.disabled = list(disabled)
        #: ``(slot, name) -> "; ..."``: what else may hide an unknown name (failed plugins, packs without an
        #: entry point); see :mod:`dataflex_bus.missing`.
        self.explain = explain

    def names(self, slot: str, kinds: Iterable[str] | None = None) -> list[str]:
        wanted = set(kinds) if kinds is not None else None
        return sorted({s.name for s in self.specs
                       if slot_of(s.kind) == slot and (wanted is None or s.kind in wanted)})

    def find(self, name: str, slots: Iterable[str] = ("scorer", "actuator")) -> list[ComponentSpec]:
        """Every component called ``name`` (or ``provider:name``) in ``slots``, in slot order."""
        qualifier, sep, bare = name.rpartition(":")
        wanted = list(slots)
        found = [s for s in self.specs if slot_of(s.kind) in wanted and s.name == bare]
        if sep:
            q = normalize_name(qualifier)
            found = [s for s in found if normalize_name(s.provider) == q or normalize_name(s.plugin) == q]
        return sorted(found, key=lambda s: (wanted.index(slot_of(s.kind)), s.kind, s.qualified_name))

    def resolve(self, slot: str, name: str, *, key: str | None = None) -> ComponentSpec:
        """Find the one component named ``name`` (or ``provider:name``) in ``slot``."""
        if slot not in ("scorer", "actuator", "predictor"):
            # A kind passed for a slot would otherwise find nothing and call the name unknown.
            under = f": {article(slot)} {slot} resolves under 'actuator'" if slot in actuator_kinds() else ""
            raise ValueError(f"resolve(): {slot!r} is not a slot; the slots are 'scorer', 'actuator' and "
                             f"'predictor'{under}")
        key = key or f"dataflex.{slot}.name"
        qualifier, sep, bare = name.rpartition(":")
        candidates = self.find(name, [slot])
        if not candidates:
            known = self.names(slot)
            where = f" from {qualifier!r}" if sep else ""
            swapped = self._swapped_hint(slot, name, key)
            if swapped:
                raise UnknownComponentError(f"{key}: unknown {slot} {bare!r}{where}: {swapped}")
            hint = did_you_mean(bare, known, n=3)
            hint = f"; {hint}" if hint else ""
            raise UnknownComponentError(
                f"{key}: unknown {slot} {bare!r}{where}{hint} (installed: {', '.join(known) or 'none'})"
                f"{self.unknown_hint(slot, bare)}"
            )
        if len(candidates) > 1:
            providers = ", ".join(f"{s.qualified_name} (plugin {s.plugin!r})" for s in candidates)
            raise CollisionError(
                f"{key}: {slot} name {bare!r} is provided by more than one plugin: {providers}; "
                f"use a qualified name such as {candidates[0].qualified_name!r}"
            )
        return candidates[0]

    def _swapped_hint(self, slot: str, name: str, key: str) -> str:
        """``scorer: {name: threshold_band}``: the name exists, in the other slot."""
        if slot not in ("scorer", "actuator"):
            return ""
        other = "actuator" if slot == "scorer" else "scorer"
        found = self.find(name, [other])
        if not found:
            return ""
        kinds = sorted({s.kind for s in found})
        suffix = f"{slot}.name"
        other_key = key[: -len(suffix)] + f"{other}.name" if key.endswith(suffix) else f"{other}.name"
        return (f"that is {article(kinds[0])} {' and '.join(kinds)}, which goes under {other_key}; "
                f"{slot}s installed: {', '.join(self.names(slot)) or 'none'}")

    def unknown_hint(self, slot: str, bare: str) -> str:
        """Every known reason why ``bare`` may be unknown in ``slot`` (``; ...`` sentences, or empty)."""
        hint = self.disabled_hint(slot, bare)
        if self.explain is not None:
            try:
                hint += self.explain(slot, bare)
            except Exception:  # explaining an error must never raise another one
                pass
        return hint

    def disabled_hint(self, slot: str, bare: str) -> str:
        """Why a name may be unknown: plugins that DATAFLEX_LOAD_PLUGINS / DATAFLEX_DISABLE_PLUGINS kept out."""
        if not self.disabled:
            return ""
        for d in self.disabled:
            if d.probe is None:
                continue
            try:
                provided = d.probe()
            except Exception:  # explaining an error must never raise another one
                continue
            if any(slot_of(s.kind) == slot and s.name == bare for s in provided):
                fix = (f"take it off {d.variable}" if d.variable.endswith("DISABLE_PLUGINS")
                       else f"add {d.distribution or d.plugin} to {d.variable}")
                return f"; {slot} {bare!r} is provided by plugin {d.label}, which {d.reason}: {fix}"
        unknown = [d for d in self.disabled if d.probe is None]
        if not unknown:
            return ""
        shown = ", ".join(f"{d.label} ({d.reason})" for d in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        return f"; not imported, so possibly providing it: {shown}{more}"


# ---------------------------------------------------------------------------- in-process registration
def _decorator(kind: str | None, name: str | None, summary: str) -> Callable[[type[Component]], type[Component]]:
    """Register the decorated class as a ``kind`` (``None``: the class's own ``kind``)."""

    def wrap(cls: type[Component]) -> type[Component]:
        own = kind if kind is not None else getattr(cls, "kind", "")
        if kind is None and own not in component_kinds():
            raise ValueError(f"register_component(): {getattr(cls, '__name__', cls)!r} has kind {own!r}, not one of "
                             f"{', '.join(component_kinds())}: subclass Scorer or a mechanism's actuator base")
        register_local(own, name or cls.__name__, cls, summary=summary or (cls.__doc__ or "").strip())
        return cls

    return wrap


def register_component(name: str | None = None, *,
                       summary: str = "") -> Callable[[type[Component]], type[Component]]:
    """Class decorator: make a component available by ``name`` in this process, as the kind its class declares
    (``Scorer.kind`` or its mechanism's actuator kind: ``selector``, ``reweighter``, ``mixer``, ``replayer``,
    ``allocator``). The ``register_<kind>`` decorators below name the kind again, for code written before it."""
    return _decorator(None, name, summary)


def register_scorer(name: str | None = None, *, summary: str = "") -> Callable[[type[Component]], type[Component]]:
    """Class decorator: make a scorer available by ``name`` in this process (no packaging needed)."""
    return _decorator("scorer", name, summary)


def register_selector(name: str | None = None, *, summary: str = "") -> Callable[[type[Component]], type[Component]]:
    """Class decorator: make a selector available by ``name`` in this process."""
    return _decorator("selector", name, summary)


def register_reweighter(name: str | None = None, *, summary: str = "") -> Callable[[type[Component]], type[Component]]:
    """Class decorator: make a reweighter available by ``name`` in this process."""
    return _decorator("reweighter", name, summary)


def register_mixer(name: str | None = None, *, summary: str = "") -> Callable[[type[Component]], type[Component]]:
    """Class decorator: make a mixer available by ``name`` in this process."""
    return _decorator("mixer", name, summary)


def register_predictor(name: str | None = None, *,
                       summary: str = "") -> Callable[[type[Component]], type[Component]]:
    """Class decorator: make a predictor (:class:`~dataflex_bus.predictor.Predictor`) available by ``name``."""
    return _decorator("predictor", name, summary)
