"""Pilot-Commit and Reinforce-Ada trained on the shim for a few steps: every rollout counted, the update's
groups as the methods make them, and a resumed run continuing exactly (the eviction's per-prompt state
included)."""

from __future__ import annotations

import pytest

from dataflex_bus.config import load_config
from dataflex_bus.shim import run_training

from .conftest import tiny, without_times
from .test_cli import EXAMPLES

pytestmark = pytest.mark.integration

# A warm start long enough for some pilots to be right (the tiny policy of 5 pretraining steps solves nothing).
SMALL = {"trainer": {"prompts_per_step": 8, "group_size": 4, "save_every": 3}, "data": {"domains": ["copy", "sort"]},
         "model": {"hidden": 16, "pretrain_steps": 300}}
REINFORCE_ADA = {"methods": [
    {"name": "rounds", "mechanism": "allocate",
     "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.7}},
     "actuator": {"name": "reinforce_ada", "params": {"final_keep": 4, "max_rounds": 4}}},
    {"name": "downsample", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
     "actuator": {"name": "ada_downsample", "params": {"final_keep": 4}}}]}
PILOT_COMMIT = {"methods": [
    {"name": "evict", "mechanism": "select", "scorer": {"name": "max_solve_rate"},
     "actuator": {"name": "exclude_solved"}},
    {"name": "pc", "mechanism": "allocate", "scorer": {"name": "group_solve_rate"},
     "actuator": {"name": "pilot_commit", "params": {"n_commit": 12}}}],
    "refill": {"gen_batch_size": 24, "policy": "fixed", "max_rounds": 10, "on_exhaust": "train_short"}}


def run(block, steps, **kw):
    return run_training(tiny(block, **SMALL), steps=steps, **kw)


def test_reinforce_ada_trains_n_rows_of_each_pool_and_counts_every_rollout():
    m = run(REINFORCE_ADA, 4).metrics
    for x in m:
        pool = x["dataflex/alloc/rollouts"]
        assert x["dataflex/rollout/rows"] == pool == x["dataflex/downsample/ada_downsample/pool_rows"]
        assert 8 * 4 <= pool <= 8 * 16 and pool % 4 == 0 and x["dataflex/alloc/max"] <= 16
        assert x["dataflex/trained/rows"] == 8 * 4 and x["dataflex/trained/groups"] == 8
        assert x["dataflex/rounds/reinforce_ada/round"] == 1 + x["dataflex/alloc/max"] // 4 - 1
    assert m[-1]["compute/generated_rollouts"] == sum(x["dataflex/alloc/rollouts"] for x in m)
    assert any(x["dataflex/alloc/max"] > 4 for x in m)  # some prompt needed more rounds


def test_pilot_commit_trains_only_committed_groups_of_pilot_plus_commit():
    m = run(PILOT_COMMIT, 4).metrics
    for x in m:
        groups = x["dataflex/trained/groups"]
        assert 0 < groups <= 8 and x["dataflex/trained/rows"] == 16 * groups
        assert x["dataflex/alloc/max"] == 16 and x["dataflex/alloc/min"] == 4
        generated = 4 * x["dataflex/refill/generated_groups"] + 12 * x["dataflex/alloc/continued"]
        assert x["dataflex/rollout/rows"] == generated
    assert m[-1]["compute/generated_rollouts"] == sum(x["dataflex/rollout/rows"] for x in m)


@pytest.mark.parametrize("block", [REINFORCE_ADA, PILOT_COMMIT], ids=["reinforce_ada", "pilot_commit"])
def test_a_resumed_run_continues_exactly(tmp_path, block):
    full = without_times(run(block, 6, out=tmp_path / "full").metrics)
    run(block, 3, out=tmp_path / "half")
    resumed = without_times(run(block, 6, out=tmp_path / "half", resume=True).metrics)
    assert resumed == full


@pytest.mark.parametrize("name", ["pilot_commit", "reinforce_ada"])
def test_the_example_trains_at_its_own_sizes(name):
    """The example as written (64 prompts a step, its group sizes), two steps of a small policy."""
    config = load_config(EXAMPLES / f"{name}.yaml")
    config["model"] = {"hidden": 16, "pretrain_steps": 5}
    config["trainer"]["eval_every"] = 2
    m = run_training(config, steps=2).metrics
    for x in m:
        assert x["dataflex/trained/rows"] == 8 * x["dataflex/trained/groups"]
        assert x["dataflex/trained/groups"] == 64 or name == "pilot_commit"
