"""Every validation rule of the foundation, each naming the config key and the allowed values."""

from __future__ import annotations

import pytest

from dataflex_bus.errors import ConfigError
from dataflex_bus.host import ANY_HOST
from dataflex_bus.pipeline import build_pipeline, validate


def block(scorer="toy_reward", actuator="toy_band", mechanism="select", sparams=None, aparams=None, **extra):
    return {"mechanism": mechanism, "scorer": {"name": scorer, "params": sparams or {}},
            "actuator": {"name": actuator, "params": aparams or {}}, **extra}


def issues(cfg, **context):
    """The issues of ``cfg`` on a host with ``context`` (``adv_estimator``, ``group_size``, ...)."""
    with pytest.raises(ConfigError) as err:
        validate(cfg, host=ANY_HOST.replace(**context))
    return {i.key: str(i) for i in err.value.issues}


def test_valid_block_passes(toys):
    cfg = validate(block(aparams={"low": 0.2, "high": 0.8}))
    assert cfg.actuator.params == {"low": 0.2, "high": 0.8}


def test_unknown_names_list_and_suggest(toys):
    found = issues(block(scorer="toy_rewad", actuator="nope"))
    assert "did you mean 'toy_reward'" in found["dataflex.scorer.name"]
    assert "toy_reward" in found["dataflex.scorer.name"]  # lists what exists
    assert "unknown actuator 'nope'" in found["dataflex.actuator.name"]


def test_actuator_kind_must_match_mechanism(toys):
    found = issues(block(actuator="toy_mixer", mechanism="select"))
    msg = found["dataflex.actuator.name"]
    assert "is a mixer" in msg and "needs a selector" in msg and "toy_band" in msg


def test_unknown_param_wrong_type_out_of_range(toys):
    found = issues(block(aparams={"lo": 0.1, "high": "0.8", "fraction": 0.0, "mode": "fuzzy"}))
    assert "unknown parameter" in found["dataflex.actuator.params.lo"]
    assert "allowed: fraction, high, low, mode" in found["dataflex.actuator.params.lo"]
    assert "expected float" in found["dataflex.actuator.params.high"]
    assert "out of range" in found["dataflex.actuator.params.fraction"]
    assert "(0, 1]" in found["dataflex.actuator.params.fraction"]
    assert "allowed: inclusive, strict" in found["dataflex.actuator.params.mode"]


def test_cross_parameter_rule(toys):
    found = issues(block(aparams={"low": 0.9, "high": 0.1}))
    assert "must be <= high" in found["dataflex.actuator.params.low"]


def test_bool_is_not_a_number_and_nan_is_refused(toys):
    found = issues(block(aparams={"low": True, "high": float("nan")}))
    assert "got bool" in found["dataflex.actuator.params.low"]
    assert "finite" in found["dataflex.actuator.params.high"]


def test_requires_must_be_available_at_the_scorers_event(toys):
    found = issues(block(scorer="toy_needs_adv"))
    assert "requires ['advantages'], not available at on_rollout" in found["dataflex.scorer.name"]
    # ... and says how to fix it: the earliest timing whose event has the field
    assert found["dataflex.scorer.name"].endswith('; set timing = "post_advantage" in ToyNeedsAdvantage (the earliest '
                                                  'timing that has them)')


def test_a_misspelt_choice_gets_a_did_you_mean(toys):
    found = issues(block(mechanism="reweigh"))
    assert found["dataflex.mechanism"] == ("dataflex.mechanism: 'reweigh' is not allowed (allowed: select, reweight, "
                                           "mix, replay, allocate); did you mean 'reweight'?")


def test_resolve_names_the_slots_when_given_a_kind(toys):
    from dataflex_bus.discovery import get_plugins

    with pytest.raises(ValueError, match="'reweighter' is not a slot; the slots are 'scorer', 'actuator' and "
                                         "'predictor': a reweighter resolves under 'actuator'"):
        get_plugins().registry().resolve("reweighter", "softmax")


def test_token_scorer_cannot_feed_a_row_selector(toys):
    found = issues(block(scorer="toy_token_prob"))
    assert "token-level scores" in found["dataflex.scorer.name"]
    assert "prompt or response" in found["dataflex.scorer.name"]


def test_group_scorer_under_non_group_estimator(toys):
    found = issues(block(scorer="toy_group_rate"), adv_estimator="gae")
    assert "not group-based" in found["dataflex.scorer.name"] and "grpo" in found["dataflex.scorer.name"]
    found = issues(block(scorer="toy_group_rate"), group_size=1)
    assert "rollout n=1" in found["dataflex.scorer.name"]
    validate(block(scorer="toy_group_rate"), host=ANY_HOST.replace(**{"adv_estimator": "grpo", "group_size": 8}))


def test_pipeline_event_follows_declared_timing(toys):
    assert build_pipeline(block(scorer="toy_group_rate")).event == "on_rollout"
    assert build_pipeline(block()).event == "on_advantage"  # per-row scores would split groups
    assert build_pipeline(block(mechanism="reweight", actuator="toy_scale")).event == "on_advantage"
    assert build_pipeline(block(mechanism="reweight", actuator="toy_scale", scorer="toy_token_prob")).event \
        == "on_advantage"
    assert build_pipeline(block(mechanism="mix", actuator="toy_mixer")).event == "on_step_end"


def test_block_and_component_problems_are_reported_together(toys):
    found = issues(block(aparams={"low": 2.0}, typo=1))
    assert set(found) == {"dataflex.typo", "dataflex.actuator.params.low"}


# ---------------------------------------------------------------------------- the selection probe
def test_the_selection_probe_is_bounded_whatever_the_group_size(register):
    """The probe once held (n+1) x n rows: n=3000 cost `validate` 14 s and 4.5 GB, n=10^11 all memory."""
    from dataflex_bus import Selection, Selector

    seen = []

    class Sizes(Selector):
        def select(self, batch, score, step):
            seen.append(len(batch))
            return Selection(batch.valid_rows.clone())

    register("selector", "t_probe_sizes", Sizes)
    block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "t_probe_sizes"}}
    for n in (8, 300, 10**11):
        seen.clear()
        validate(block, host=ANY_HOST.replace(group_size=n))
        g = min(n, 64)
        assert seen == [(g + 1) * g], n


def test_probe_warnings_say_what_the_probe_held():
    def band(low, high, n):
        block = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                 "actuator": {"name": "threshold_band", "params": {"low": low, "high": high}}}
        return [str(w) for w in validate(block, host=ANY_HOST.replace(group_size=n)).warnings]

    (none,) = band(0.9, 0.95, 8)            # 7/8 and 8/8 lie outside
    assert "keeps no row" in none and "0..8 of 8 rollouts right" in none
    assert band(0.9, 0.95, 3000) == []       # 58/64 .. 60/64 lie inside, as 2700/3000 .. 2850/3000 do
    (every,) = band(0.0, 1.0, 3000)
    assert "keeps every row" in every and "0..64 of 64 rollouts right" in every and "n=3000" in every
