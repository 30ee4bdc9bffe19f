"""The shim as a host of replay: stored rows join a step before its old log-probs, the compute counters add
up (replayed rows are trained, never generated), DOTS generates its fresh share, and a resumed run replays
exactly what the uninterrupted one does."""

from __future__ import annotations

import pytest

from dataflex_bus.shim import run_training

from .conftest import tiny, without_times

SMALL = {"trainer": {"prompts_per_step": 8, "group_size": 4, "save_every": 2},
         "data": {"domains": ["copy", "random"]}}
#: Prompts come back within a few steps here (copy's 3-digit level keeps 500 training prompts and gets a quarter
#: of the draws), so per-prompt replay has work to do.
REVISITS = {"trainer": {"prompts_per_step": 32, "group_size": 4, "save_every": 4},
            "data": {"domains": ["copy", "random"], "heldout": 1000}}
DOTS = {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
        "actuator": {"name": "rollout_replay", "params": {"fresh_fraction": 0.5, "capacity": 32, "dedup": True,
                                                          "max_age_steps": 2}}}
REPO = {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
        "actuator": {"name": "rollout_replay", "params": {"unit": "prompt", "priority": "highest",
                                                          "advantage": "split", "correction": "behaviour",
                                                          "per_prompt": 8, "min_to_replay": 4, "replays": 4,
                                                          "capacity": 4096}}}


def run(block, steps, sections=SMALL, **kw):
    return run_training(tiny(block, **sections), steps=steps, **kw)


def test_dots_on_the_shim_generates_half_and_trains_a_full_batch():
    m = run(DOTS, 4).metrics
    assert [x["dataflex/replay/fresh_prompts"] for x in m] == [8, 4, 4, 4]
    assert [x["dataflex/replay/rows"] for x in m] == [0, 16, 16, 16]
    assert all(x["dataflex/trained/rows"] == 32 for x in m)
    last = m[-1]
    assert last["compute/generated_rollouts"] == 32 + 3 * 16 and last["compute/replayed_rows"] == 3 * 16
    for x in m:
        assert x["compute/generated_rollouts"] == (x["compute/trained_rows"] - x["compute/replayed_rows"]
                                                   + x["compute/dropped_rows"])


@pytest.mark.integration
def test_repo_on_the_shim_adds_stored_rows_to_revisited_prompts():
    m = run(REPO, 10, REVISITS).metrics
    replayed = [x["dataflex/replay/rows"] for x in m]
    assert replayed[0] == 0 and sum(replayed) > 0
    assert all(x["dataflex/replay/fresh_prompts"] == 32 for x in m)
    assert all(x["dataflex/trained/rows"] == 128 + r for x, r in zip(m, replayed))
    assert m[-1]["compute/generated_rollouts"] == 10 * 128 and m[-1]["compute/replayed_rows"] == sum(replayed)


@pytest.mark.integration
@pytest.mark.parametrize("block", [DOTS, REPO], ids=["dots", "repo"])
def test_a_resumed_replay_run_equals_the_uninterrupted_one(tmp_path, block):
    full = without_times(run(block, 8, REVISITS, out=tmp_path / "full").metrics)
    assert sum(x["dataflex/replay/rows"] for x in full[4:]) > 0  # the resumed half replays
    run(block, 4, REVISITS, out=tmp_path / "half")
    resumed = run(block, 8, REVISITS, out=tmp_path / "half", resume=True)
    assert without_times(resumed.metrics) == full
