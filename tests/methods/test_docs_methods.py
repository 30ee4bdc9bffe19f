"""docs/methods.md documents every first-party component and each of its parameters."""

from pathlib import Path

import pytest

from dataflex_bus.discovery import get_plugins

DOC = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
SCORERS = ["reward_difficulty", "group_solve_rate", "advantage_magnitude", "token_prob", "zero_variance_streak",
           "token_entropy", "knapsack_rate", "mopps", "max_solve_rate", "predicted", "reward_variance"]
PREDICTORS = ["dps", "cures", "vip"]
FIRST_PARTY = [*SCORERS, "threshold_band", "dapo", "topk_fraction", "max_variance", "greso", "top_entropy",
               "top_b", "advantage_reweight", "softmax", "per_advantage", "dump_ucb", "reward_gap", "static",
               "rollout_replay", "knapsack", "speed", "pilot_commit", "exclude_solved", "reinforce_ada",
               "ada_downsample", *PREDICTORS, "variance_split", "weighted_draw", "no_positive_resampling", "snr_filter",
               "learnability", "sec"]


@pytest.mark.parametrize("name", FIRST_PARTY)
def test_component_and_params_are_documented(name):
    text = DOC.read_text()
    registry = get_plugins().registry()
    slot = "scorer" if name in SCORERS else "predictor" if name in PREDICTORS else "actuator"
    cls = registry.resolve(slot, name).load()
    assert f"`{name}" in text, f"docs/methods.md does not document {name}"
    heading = text.find(f"### `{name}")  # a component's own section, else its first mention (the scorer table)
    section = text[heading if heading >= 0 else text.index(f"`{name}"):]
    for param in cls.params:
        assert f"`{param}" in section[:3000] or param in section[:3000], f"{name}.{param} undocumented"
