"""Every method block of the seed README, exactly as written there, validates and trains on the shim.

The seed README's five method blocks (its text is not in this repository; these are its blocks as its
users quote them, parameters included: AR with alpha 0.5, DUMP on reward_difficulty with window 50).
"""

from __future__ import annotations

import pytest

from dataflex_bus import validate
from dataflex_bus.host import ANY_HOST
from dataflex_bus.shim import run_training

from .conftest import tiny

SEED_BLOCKS = {
    "difficulty filtering": {
        "mechanism": "select",
        "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
        "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}},
        "warmup_step": 0,
    },
    "top-k by advantage magnitude": {
        "mechanism": "select",
        "scorer": {"name": "advantage_magnitude"},
        "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}},
    },
    "advantage reweighting": {
        "mechanism": "reweight",
        "scorer": {"name": "token_prob"},
        "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.5}},
    },
    "max-variance selection": {
        "mechanism": "select",
        "scorer": {"name": "reward_difficulty"},
        "actuator": {"name": "max_variance", "params": {"keep_fraction": 0.5}},
    },
    "DUMP UCB curriculum": {
        "mechanism": "mix",
        "scorer": {"name": "reward_difficulty"},
        "actuator": {"name": "dump_ucb", "params": {"window": 50}},
        "warmup_step": 1,
    },
}


@pytest.mark.parametrize("name", sorted(SEED_BLOCKS))
def test_seed_block_validates_and_trains(name):
    block = SEED_BLOCKS[name]
    cfg = validate(block, host=ANY_HOST.replace(**{"adv_estimator": "grpo", "group_size": 4}))
    result = run_training(tiny(block), steps=3)
    m = result.metrics[-1]
    assert result.record["status"] == "complete" and result.record["dataflex"]["dataflex"] == cfg.to_dict()
    if block["mechanism"] == "select":
        assert "dataflex/kept_fraction" in m or "dataflex/empty_selection" in m
    elif block["mechanism"] == "reweight":
        assert 0.5 <= m["dataflex/weight_min"] <= m["dataflex/weight_max"] <= 1.0  # 0.5 * p + 0.5
    else:
        assert abs(sum(m[f"dataflex/sample_prob/{d}"] for d in ("copy", "sort", "reverse", "random")) - 1) < 1e-9


def test_dump_on_rewards_is_warned_as_the_seed_writes_it():
    cfg = validate(SEED_BLOCKS["DUMP UCB curriculum"])
    assert any("advantage_magnitude" in str(w) and "reward_difficulty" in str(w) for w in cfg.warnings)
    assert not validate({**SEED_BLOCKS["DUMP UCB curriculum"], "scorer": {"name": "advantage_magnitude"}}).warnings
