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


#: The data-flow mechanisms: they change which rows a step generates and trains (allocate: how many
#: rollouts per prompt; replay: stored rows trained again).
DATA_FLOW = ("alloc", "replay")
#: The kit modules every host runs whatever the block (#45: they name no data-flow mechanism; the mechanisms plug
#: into the step and the runtime through their parts, dataflex_bus/step_parts.py).
NEUTRAL = ("carry.py", "step_metrics.py", "steps.py", "generation.py", "runtime.py", "step_parts.py")


def named(source: str) -> list[str]:
    """The functions, classes, attributes read or set and imported modules or names of ``source`` that name a
    data-flow mechanism."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        else:
            continue
        found.extend(n for n in names if any(word in n.lower() for word in DATA_FLOW))
    return found


@pytest.mark.parametrize("module", NEUTRAL)
def test_the_general_carry_out_and_metrics_name_no_data_flow_mechanism(module):
    """Allocation's counts, metrics and step hooks live in the kit's allocation.py, replay's in replay.py."""
    from pathlib import Path

    assert named((Path(dataflex_bus.__file__).parent / module).read_text()) == []


def test_the_check_finds_a_data_flow_mechanism_named():
    assert named("from .allocation import AllocationStats\n") == ["allocation", "AllocationStats"]
    assert named("class ReplayPart:\n    pass\n") == ["ReplayPart"]
    assert named("n = step.fresh(runtime.replay, self.allocation)\n") == ["replay", "allocation"]
    assert named("from .mechanisms.allocate import Allocator\n") == ["mechanisms.allocate", "Allocator"]


def test_the_data_flow_parts_run_in_the_registry_order_whatever_the_block_order():
    """The step's hooks (and so its metrics' order) do not depend on the order a block lists its methods."""
    from types import SimpleNamespace as NS

    from dataflex_bus.allocation import AllocationPart
    from dataflex_bus.replay import ReplayPart, ReplayRun
    from dataflex_bus.step_parts import parts_of

    for order in (["allocate", "select", "replay"], ["replay", "allocate"]):
        methods = [NS(config=NS(mechanism=name)) for name in order]
        steps, runs = parts_of(NS(methods=methods))  # type: ignore[arg-type]
        assert steps == (ReplayPart, AllocationPart)
        assert [(cls, method.config.mechanism) for cls, method in runs] == [(ReplayRun, "replay")]
    assert parts_of(None) == ((), [])
