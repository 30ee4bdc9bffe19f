"""A mechanism is one module (#45): its actuator base and output types live beside its ``Mechanism``, and stay
importable from where packs have always imported them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dataflex_bus
from dataflex_bus import components
from dataflex_bus.mechanisms import mechanisms
from dataflex_bus.registry import local_specs, register_component, unregister_local


@pytest.mark.parametrize("mechanism", mechanisms(), ids=lambda m: m.name)
def test_an_actuator_base_lives_in_its_mechanism_module(mechanism):
    assert mechanism.base.__module__ == type(mechanism).__module__
    assert mechanism.base.kind == mechanism.kind


@pytest.mark.parametrize("name", sorted(components._MOVED))
def test_components_re_exports_what_moved(name):
    from importlib import import_module

    home = import_module(f"dataflex_bus.mechanisms.{components._MOVED[name]}")
    assert getattr(components, name) is getattr(home, name)


def test_the_package_face_and_the_old_module_give_the_same_classes():
    for name in ("Selector", "Selection", "Reweighter", "Reweighting", "Mixer"):
        assert getattr(dataflex_bus, name) is getattr(components, name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        components.Nope  # noqa: B018


def test_importing_components_loads_no_mechanism():
    code = ("import sys, dataflex_bus.components; "
            "print(any(m.startswith('dataflex_bus.mechanisms') for m in sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_register_component_reads_the_kind_from_the_class():
    from dataflex_bus.mechanisms.allocate import Allocator
    from dataflex_bus.mechanisms.replay import Replayer

    try:
        for base in (components.Scorer, Replayer, Allocator):
            cls = type(f"T{base.__name__}", (base,), {"__doc__": "a test component"})
            assert register_component(f"t_{base.kind}")(cls) is cls
            spec = next(s for s in local_specs() if s.name == f"t_{base.kind}")
            assert (spec.kind, spec.target, spec.summary) == (base.kind, cls, "a test component")
    finally:
        for kind in ("scorer", "replayer", "allocator"):
            unregister_local(kind, f"t_{kind}")


def test_register_component_refuses_a_class_of_no_kind():
    with pytest.raises(ValueError, match=r"'Actuator' has kind '', not one of scorer, predictor, selector"):
        register_component("t_nothing")(components.Actuator)
