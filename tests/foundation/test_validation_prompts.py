"""Validation of pre-rollout selection and of dynamic sampling with refill: where methods act, what a
pre_rollout scorer may feed, one prompt history per block, and the refill keys."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus import Score, Scorer
from dataflex_bus.errors import ConfigError
from dataflex_bus.host import ANY_HOST
from dataflex_bus.pipeline import build_pipeline, validate
from dataflex_bus.registry import register_local, unregister_local
from dataflex_bus.runtime import Runtime

GRESO = {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
         "actuator": {"name": "greso"}}
DAPO = {"name": "dapo", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
        "actuator": {"name": "dapo"}}


class RolloutHungry(Scorer):
    """Claims to run before generation but reads rewards."""

    requires = ("rm_scores", "response_mask")
    timing = "pre_rollout"
    granularity = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch.rewards, "prompt")


class GroupyPrompt(Scorer):
    requires = ("prompt_index",)
    timing = "pre_rollout"
    granularity = "prompt"
    needs_groups = True

    def score(self, batch, step, **ctx):
        return Score(torch.zeros(len(batch)), "prompt")


class PlainPrompt(Scorer):
    """A pre-rollout scorer that needs no history: the prompt's index."""

    requires: ClassVar = ("prompt_index",)
    timing = "pre_rollout"
    granularity = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch["prompt_index"].float(), "prompt")


@pytest.fixture
def prompt_toys():
    for name, cls in (("t_hungry", RolloutHungry), ("t_groupy", GroupyPrompt), ("t_plain", PlainPrompt)):
        register_local("scorer", name, cls)
    yield
    for name in ("t_hungry", "t_groupy", "t_plain"):
        unregister_local("scorer", name)


def issues(cfg, **context):
    """The issues of ``cfg`` on a host with ``context`` (``adv_estimator``, ``group_size``, ...)."""
    with pytest.raises(ConfigError) as err:
        validate(cfg, host=ANY_HOST.replace(**context))
    return {i.key: str(i) for i in err.value.issues}


def test_greso_stack_acts_before_and_after_generation():
    pipe = build_pipeline({"methods": [GRESO, DAPO], "refill": {"policy": "greso"}})
    assert [m.event for m in pipe.methods] == ["on_prompts", "on_rollout"]
    assert pipe.config.refill is not None and pipe.config.refill.policy == "greso"
    runtime = Runtime({"methods": [GRESO, DAPO]})
    assert runtime.plan.before_generation and runtime.plan.reads_history and runtime.plan.needs_prompt_ids


def test_a_generic_selector_acts_before_generation_on_a_pre_rollout_score(prompt_toys):
    pipe = build_pipeline({"mechanism": "select", "scorer": {"name": "t_plain"},
                           "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}}})
    assert pipe.event == "on_prompts"
    runtime = Runtime({"mechanism": "select", "scorer": {"name": "t_plain"}, "actuator": {"name": "topk_fraction"}})
    assert runtime.plan.before_generation and not runtime.plan.reads_history


def test_pre_rollout_scorer_only_feeds_a_selection():
    found = issues({"mechanism": "reweight", "scorer": {"name": "zero_variance_streak"},
                    "actuator": {"name": "softmax"}})
    assert "runs pre_rollout" in found["dataflex.scorer.name"] and "'reweight'" in found["dataflex.scorer.name"]


def test_pre_rollout_scorer_needs_a_selector_that_can_act_before_generation():
    found = issues({"mechanism": "select", "scorer": {"name": "zero_variance_streak"},
                    "actuator": {"name": "max_variance"}})
    assert "no earlier than post_advantage" in found["dataflex.actuator.name"]


def test_scorer_that_needs_rollouts_cannot_run_pre_rollout(prompt_toys):
    found = issues({"mechanism": "select", "scorer": {"name": "t_hungry"}, "actuator": {"name": "topk_fraction"}})
    assert "requires ['rm_scores', 'response_mask'], not available at on_prompts" in found["dataflex.scorer.name"]
    assert 'set timing = "post_reward"' in found["dataflex.scorer.name"]
    found = issues({"mechanism": "select", "scorer": {"name": "t_groupy"}, "actuator": {"name": "topk_fraction"}})
    assert "needs groups of rollouts" in found["dataflex.scorer.name"]


def test_history_selector_after_generation_is_refused():
    found = issues({"mechanism": "select", "scorer": {"name": "group_solve_rate"}, "actuator": {"name": "greso"}})
    assert "pair it with a pre_rollout scorer" in found["dataflex.scorer.name"]


def test_methods_must_agree_on_how_visits_are_classified():
    other = {**GRESO, "name": "greso2", "scorer": {"name": "zero_variance_streak", "params": {"mode": "greso"}}}
    found = issues({"methods": [GRESO, other]})
    assert "dataflex.methods[1].scorer.params" in found
    assert "must agree" in found["dataflex.methods[1].scorer.params"]


def test_refill_needs_a_selection_at_on_rollout():
    found = issues({"methods": [GRESO], "refill": {}})
    assert "no method of this block selects at on_rollout" in found["dataflex.refill"]
    reweight = {"mechanism": "reweight", "scorer": {"name": "token_prob"}, "actuator": {"name": "softmax"},
                "refill": {}}
    assert "dataflex.refill" in issues(reweight)


def test_refill_keys_are_checked():
    found = issues({"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"},
                    "refill": {"policy": "twice", "max_round": 3, "beta": 0.5}})
    assert "'twice' is not allowed" in found["dataflex.refill.policy"]
    assert "did you mean 'max_rounds'" in found["dataflex.refill.max_round"]
    assert "out of range" in found["dataflex.refill.beta"]
    found = issues({"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"},
                    "max_oversample": 0.5})
    assert "out of range" in found["dataflex.max_oversample"]


def test_block_keys_round_trip_through_to_dict():
    cfg = validate({"methods": [GRESO, DAPO], "refill": {"gen_batch_size": 48, "policy": "greso"},
                    "max_oversample": 20})
    again = validate(cfg.to_dict())
    assert again.refill == cfg.refill and again.max_oversample == 20.0
    plain = validate({"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}})
    assert "refill" not in plain.to_dict() and "max_oversample" not in plain.to_dict()


def test_runtime_keeps_the_history_in_its_state_and_refuses_another_dataset():
    from dataflex_bus.history import PromptTable

    runtime = Runtime({"methods": [GRESO, DAPO]})
    runtime.set_prompts(PromptTable.full(["a", "b"], [5, 5], column="extra_info.index"))
    state = runtime.state_dict()
    assert set(state) == {"pipeline", "history"} and state["history"]["table"]["prompts"] == 10
    same = Runtime({"methods": [GRESO, DAPO]})
    same.set_prompts(PromptTable.full(["a", "b"], [5, 5], column="extra_info.index"))
    same.load_state_dict(state)
    bigger = Runtime({"methods": [GRESO, DAPO]})
    bigger.set_prompts(PromptTable.full(["a", "b"], [5, 6], column="extra_info.index"))
    with pytest.raises(ConfigError, match=r"extra_info\.index: the per-prompt history in the checkpoint was "
                                          r"written for another dataset"):
        bigger.load_state_dict(state)
    early = Runtime({"methods": [GRESO, DAPO]})
    with pytest.raises(ConfigError, match="before giving the runtime its prompt table"):
        early.load_state_dict(state)
    plain = Runtime({"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}})
    with pytest.raises(ConfigError, match="disagree on whether a per-prompt history is kept"):
        plain.load_state_dict({"pipeline": plain.state_dict()["pipeline"], "history": state["history"]})
