"""Mechanisms: how an actuator's output enters training, one registered object each.

A method is a scorer times an actuator under one mechanism. Each mechanism is a :class:`Mechanism`
object registered here by name: it says which actuator kind it takes, at which bus event a method acts,
what validation must check for it (against the host that will run it) and how its actuator's output
enters the :class:`~dataflex_bus.decision.Decision`. Validation, method application and the command line
derive their lists (mechanism names, component kinds) from this registry, so adding a mechanism is one
new module defining a :class:`Mechanism` subclass plus its registration below (see
``docs/DESIGN.md``, "How to add a mechanism").

The registry stays import-light (no torch): ``dataflex plugins`` reads it to know the component kinds.
"""

from __future__ import annotations

from .base import Mechanism, MethodRun

_REGISTRY: dict[str, Mechanism] = {}


def register_mechanism(mechanism: Mechanism) -> Mechanism:
    """Add ``mechanism`` to the registry (its name and actuator kind must be new)."""
    name, kind = mechanism.name, mechanism.kind
    if not name or not kind:
        raise ValueError(f"{type(mechanism).__name__}: a mechanism needs a name and an actuator kind")
    if name in _REGISTRY:
        raise ValueError(f"mechanism {name!r} is registered already ({type(_REGISTRY[name]).__name__})")
    taken = [m.name for m in _REGISTRY.values() if m.kind == kind]
    if taken or kind == "scorer":
        raise ValueError(f"mechanism {name!r}: actuator kind {kind!r} is taken ({taken or 'scorers'})")
    _REGISTRY[name] = mechanism
    return mechanism


def unregister_mechanism(name: str) -> None:
    """Remove a mechanism (for tests that register their own)."""
    _REGISTRY.pop(name, None)


def mechanism(name: str) -> Mechanism:
    """The mechanism called ``name``; a ``KeyError`` lists the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown mechanism {name!r} (registered: {', '.join(_REGISTRY)})") from None


def mechanisms() -> tuple[Mechanism, ...]:
    """Every registered mechanism, in registration order."""
    return tuple(_REGISTRY.values())


def mechanism_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def for_kind(kind: str) -> Mechanism:
    """The mechanism whose actuators are of ``kind`` (``selector`` -> ``select``)."""
    for m in _REGISTRY.values():
        if m.kind == kind:
            return m
    raise KeyError(f"no mechanism takes {kind!r} actuators (actuator kinds: {', '.join(actuator_kinds())})")


def actuator_kinds() -> tuple[str, ...]:
    """The actuator kinds, one per mechanism: ``selector``, ``reweighter``, ``mixer``, ..."""
    return tuple(m.kind for m in _REGISTRY.values())


def component_kinds() -> tuple[str, ...]:
    """Every component kind a plugin may register: ``scorer``, ``predictor`` (:mod:`dataflex_bus.predictor`) and
    each actuator kind."""
    return ("scorer", "predictor", *actuator_kinds())


# The built-in mechanisms, in the order the command line and the docs list them.
from .allocate import Allocate  # noqa: E402
from .mix import Mix  # noqa: E402
from .replay import Replay  # noqa: E402
from .reweight import Reweight  # noqa: E402
from .select import Select  # noqa: E402

for _builtin in (Select(), Reweight(), Mix(), Replay(), Allocate()):
    register_mechanism(_builtin)

__all__ = ["Mechanism", "MethodRun", "actuator_kinds", "component_kinds", "for_kind", "mechanism",
           "mechanism_names", "mechanisms", "register_mechanism", "unregister_mechanism"]
