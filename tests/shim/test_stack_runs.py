"""Method stacks on the shim: a three-method stack trains, each method acts, resume is exact, and a
one-method `methods:` list is bit-identical to the seed-style block."""

from __future__ import annotations

import pytest

from dataflex_bus.shim import run_training

from .conftest import tiny, without_times

STACK = {"methods": [
    {"name": "filter", "mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}},
    {"name": "curriculum", "mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
     "actuator": {"name": "dump_ucb", "params": {"window": 50}}, "warmup_step": 1},
    {"name": "ar", "mechanism": "reweight", "scorer": {"name": "token_prob"},
     "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.5}}},
]}
SEED_STYLE = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
              "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}}


def test_one_method_list_is_bit_identical_to_the_seed_block():
    seed = without_times(run_training(tiny(SEED_STYLE), steps=3).metrics)
    listed = without_times(run_training(tiny({"methods": [SEED_STYLE]}), steps=3).metrics)
    assert seed == listed


def test_three_method_stack_acts_in_order_and_resumes_exactly(tmp_path, recorder):
    cfg = tiny(STACK, trainer={"save_every": 1, "prompts_per_step": 8})
    full = run_training(cfg, steps=3, out=tmp_path / "full")
    events = [e[0] for e in recorder.events]
    assert events == ["on_rollout", "on_advantage", "on_step_end"] * 3
    for m in full.metrics:
        # each method acted, its metrics under its name: DAPO kept the mixed groups, AR weighted every real
        # token by 0.5 * p + 0.5, the curriculum published domain probabilities (uniform before its warmup)
        assert m["dataflex/filter/kept_fraction"] <= 1.0 and "dataflex/filter/dapo/uniform_groups" in m
        assert 0.5 <= m["dataflex/ar/weight_min"] <= m["dataflex/ar/weight_max"] <= 1.0
        assert sum(m[f"dataflex/curriculum/domain_prob/{d}"] for d in ("copy", "sort", "reverse", "random")) == \
            pytest.approx(1.0)
    assert full.metrics[0]["dataflex/sample_prob/copy"] == 0.25
    # the probabilities the curriculum published at step 1 drive step 2's draws
    published = full.metrics[1]["dataflex/curriculum/domain_prob/copy"]
    assert full.metrics[2]["dataflex/sample_prob/copy"] == pytest.approx(published)
    record = full.record["dataflex"]
    assert [m["name"] for m in record["methods"]] == ["filter", "curriculum", "ar"]
    assert all(m["versions"]["actuator"].startswith("dataflex-bus==") for m in record["methods"])
    run_training(cfg, steps=2, out=tmp_path / "half")
    resumed = run_training(cfg, steps=3, out=tmp_path / "half", resume=True)
    assert without_times(resumed.metrics) == without_times(full.metrics)
