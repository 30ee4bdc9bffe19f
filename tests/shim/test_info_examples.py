"""Every built-in component's ``dataflex info`` example is a block a user can paste: it validates without a
warning (a pairing the actuator is defined on, such as greso on zero_variance_streak, not knapsack_rate) and
trains a step on the shim. The components are read from the registry, so one added later is covered too."""

from __future__ import annotations

import pytest
import yaml

from dataflex_bus import validate
from dataflex_bus.catalog import component_info
from dataflex_bus.shim import run_training
from dataflex_bus.validation import installed_registry

from .conftest import tiny

REGISTRY = installed_registry()
BUILT_IN = sorted((s for s in REGISTRY.specs if s.provider == "dataflex-bus"), key=lambda s: (s.kind, s.name))


def test_every_kind_of_component_is_covered():
    kinds = {s.kind for s in BUILT_IN}
    assert {"scorer", "selector", "reweighter", "mixer", "allocator", "replayer"} <= kinds, kinds


@pytest.mark.parametrize("spec", BUILT_IN, ids=[f"{s.kind}:{s.name}" for s in BUILT_IN])
def test_the_info_example_validates_without_warnings_and_trains_a_step(spec):
    entry = component_info(spec, REGISTRY)
    assert entry["example_validated"], entry["example"]
    block = yaml.safe_load(entry["example"])["dataflex"]
    assert spec.name in (block["scorer"]["name"], block["actuator"]["name"], block.get("predictor", {}).get("name"))
    cfg = validate(block)
    assert not cfg.warnings, [str(w) for w in cfg.warnings]
    result = run_training(tiny(block), steps=1)
    assert result.record["status"] == "complete" and len(result.metrics) == 1
    assert result.record["dataflex"]["dataflex"] == cfg.to_dict()


def test_greso_s_example_is_its_own_scorer_and_another_scorer_is_warned():
    """Before: greso's example paired it with knapsack_rate, and that block validated silently."""
    spec = next(s for s in BUILT_IN if s.name == "greso")
    block = yaml.safe_load(component_info(spec, REGISTRY)["example"])["dataflex"]
    assert block["scorer"]["name"] == "zero_variance_streak"
    wrong = validate({**block, "scorer": {"name": "knapsack_rate"}})
    assert any("zero_variance_streak" in str(w) for w in wrong.warnings)
