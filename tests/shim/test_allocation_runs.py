"""The shim as a host of rollout allocation: ragged groups by repeat_interleave, SPEED's continuation round,
MoPPS's pool, every rollout counted, and a resumed run continuing exactly (the history's reward window and
MoPPS's posterior included)."""

from __future__ import annotations

import pytest

from dataflex_bus.errors import ConfigError
from dataflex_bus.shim import run_training

from .conftest import tiny, without_times

SMALL = {"trainer": {"prompts_per_step": 8, "group_size": 4, "save_every": 4},
         "data": {"domains": ["copy", "random"]}}
KNAPSACK = {"mechanism": "allocate", "scorer": {"name": "knapsack_rate", "params": {"min_buffer_length": 4}},
            "actuator": {"name": "knapsack", "params": {"max_n": 16}}}
SPEED = {"mechanism": "allocate", "scorer": {"name": "group_solve_rate"},
         "actuator": {"name": "speed", "params": {"n_continue": 4}}}
MOPPS = {"mechanism": "select", "scorer": {"name": "mopps", "params": {"decay": 0.5}},
         "actuator": {"name": "top_b", "params": {"pool": 4}}}


def run(block, steps, **kw):
    return run_training(tiny(block, **SMALL), steps=steps, **kw)


@pytest.mark.parametrize("block", [KNAPSACK, SPEED, MOPPS], ids=["knapsack", "speed", "mopps"])
def test_a_resumed_run_continues_exactly(tmp_path, block):
    full = without_times(run(block, 8, out=tmp_path / "full").metrics)
    run(block, 4, out=tmp_path / "half")
    resumed = without_times(run(block, 8, out=tmp_path / "half", resume=True).metrics)
    assert resumed == full


def test_knapsack_spends_plain_grpos_budget_exactly_on_ragged_groups():
    m = run(KNAPSACK, 10).metrics
    assert [x["dataflex/alloc/rollouts"] for x in m] == [32.0] * 10
    assert m[-1]["compute/generated_rollouts"] == 320 == m[-1]["compute/trained_rows"]
    assert any(x["dataflex/alloc/max"] > 4 for x in m) and any(x["dataflex/knapsack/never_solved"] for x in m)


def test_speed_trains_only_continued_groups_and_counts_every_rollout():
    for x in run(SPEED, 4).metrics:
        continued = x["dataflex/alloc/continued"]
        assert x["dataflex/rollout/rows"] == 32 + 4 * continued == x["dataflex/alloc/rollouts"]
        assert x["dataflex/trained/groups"] == continued and x["dataflex/trained/rows"] == 8 * continued
        assert x["dataflex/rollout/groups"] == 8


def test_speed_with_refill_screens_until_the_step_has_its_groups():
    block = {**SPEED, "refill": {"policy": "fixed", "max_rounds": 6, "on_exhaust": "train_short"}}
    m = run(block, 3).metrics
    for x in m:
        assert x["dataflex/refill/trained_groups"] <= 8
        assert x["dataflex/alloc/continued"] <= 8 * x["dataflex/refill/rounds"]
        assert x["dataflex/trained/rows"] == 8 * x["dataflex/trained/groups"]


def test_mopps_draws_a_pool_and_keeps_the_step_prompts():
    for x in run(MOPPS, 3).metrics:
        assert x["dataflex/prompts_considered"] >= 32 and x["dataflex/prompts_generated"] == 8


def test_a_resume_with_another_dataset_is_refused(tmp_path):
    run(KNAPSACK, 4, out=tmp_path / "run")
    other = tiny(KNAPSACK, **{**SMALL, "data": {"domains": ["copy", "random"], "heldout": 40}})
    with pytest.raises(Exception, match=r"another dataset|different config"):
        run_training(other, steps=8, out=tmp_path / "run", resume=True)


def test_a_budget_below_the_floors_stops_the_run_naming_it():
    block = {**KNAPSACK, "actuator": {"name": "knapsack", "params": {"budget": 8, "max_n": 16}}}
    with pytest.raises(Exception, match=r"budget of 8 rollouts is below the floors' 32"):
        run(block, 1)
    with pytest.raises(ConfigError, match="min_n"):
        run({**KNAPSACK, "actuator": {"name": "knapsack", "params": {"min_n": 1}}}, 1)
