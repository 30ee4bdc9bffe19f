"""Scorers: hand-computed values from the spec's formulas, padding, masks, NaN."""

from __future__ import annotations

import math

import pytest
import torch

from dataflex_bus.errors import BatchFieldError, PluginRuntimeError

from .helpers import batch_of, component, pipe


def test_reward_difficulty_is_the_outcome_reward_and_ignores_padding():
    b = batch_of([1.0, 0.25, -0.5, 7.0], ["a", "a", "b", "p"], lengths=[6, 3, 1, 6],
                 padding=[False, False, False, True])
    s = component("scorer", "reward_difficulty").score(b, 0)
    assert s.granularity == "response"
    assert s.values.tolist() == [1.0, 0.25, -0.5, 0.0]


def test_group_solve_rate_counts_are_integers_per_row():
    # group a: 3 rows, rewards 1, 0.5 (not > 0.5), 0.9 -> k=2; group b: singleton 0 -> k=0; row 4 padding.
    b = batch_of([1.0, 0.5, 0.9, 0.0, 1.0], ["a", "a", "a", "b", "a"],
                 padding=[False, False, False, False, True])
    s = component("scorer", "group_solve_rate", success_threshold=0.5).score(b, 0)
    assert s.granularity == "prompt"
    assert s.counts.dtype == torch.int64 and s.totals.dtype == torch.int64
    assert s.counts.tolist() == [2, 2, 2, 0, 0]
    assert s.totals.tolist() == [3, 3, 3, 1, 0]
    assert torch.allclose(s.values, torch.tensor([2 / 3, 2 / 3, 2 / 3, 0.0, 0.0]))
    assert s.metrics["solve_rate/none_solved"] == pytest.approx(0.5)
    assert s.metrics["solve_rate/all_solved"] == pytest.approx(0.0)
    assert s.metrics["solve_rate/mean"] == pytest.approx((2 / 3 + 0) / 2)


def test_group_solve_rate_threshold_is_strict():
    b = batch_of([0.3, 0.30001, 0.2], ["a", "a", "a"])
    s = component("scorer", "group_solve_rate", success_threshold=0.3).score(b, 0)
    assert s.counts.tolist() == [1, 1, 1]


@pytest.mark.parametrize(("agg", "expected"), [
    ("mean", [2.0, 1.5, 0.0]),
    ("sum", [6.0, 3.0, 0.0]),
    ("max", [3.0, 2.0, 0.0]),
])
def test_advantage_magnitude_aggregates_valid_tokens_only(agg, expected):
    adv = torch.tensor([[1.0, -2.0, 3.0, 99.0],
                        [-1.0, 2.0, float("nan"), float("inf")],   # non-finite only outside the mask
                        [5.0, 5.0, 5.0, 5.0]])                      # empty response: L = 0
    b = batch_of([0, 0, 0], ["a", "a", "b"], lengths=[3, 2, 0], tokens=4, advantages=adv)
    s = component("scorer", "advantage_magnitude", agg=agg).score(b, 0)
    assert s.values.tolist() == expected


def test_advantage_magnitude_mean_equals_abs_grpo_advantage():
    b = batch_of([1, 0, 0, 1, 1, 0], ["a"] * 3 + ["b"] * 3, lengths=[6, 2, 4, 1, 3, 5])
    s = component("scorer", "advantage_magnitude", agg="mean").score(b, 0)
    adv = b["advantages"][:, 0].abs()
    assert torch.allclose(s.values, adv)


def test_advantage_magnitude_padding_row_scores_zero():
    b = batch_of([1, 0, 5], ["a", "a", "z"], padding=[False, False, True],
                 advantages=torch.full((3, 6), 4.0))
    s = component("scorer", "advantage_magnitude").score(b, 0)
    assert s.values.tolist() == [4.0, 4.0, 0.0]


def test_token_prob_is_exp_on_valid_tokens_and_zero_elsewhere():
    lp = torch.tensor([[-0.5, -1.0, float("nan")], [0.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    b = batch_of([0, 0, 0], ["a", "a", "p"], lengths=[2, 3, 3], tokens=3, old_log_probs=lp,
                 padding=[False, False, True])
    s = component("scorer", "token_prob").score(b, 0)
    assert s.granularity == "token"
    expected = torch.tensor([[math.exp(-0.5), math.exp(-1.0), 0.0],
                             [1.0, math.exp(-2.0), math.exp(-3.0)],
                             [0.0, 0.0, 0.0]])
    assert torch.allclose(s.values, expected)


def test_token_prob_nan_on_a_valid_token_is_reported_by_the_pipeline():
    lp = torch.full((2, 6), -0.5)
    lp[1, 2] = float("nan")
    b = batch_of([1, 0], ["a", "a"], old_log_probs=lp)
    p = pipe("reweight", "token_prob", "advantage_reweight")
    with pytest.raises(BatchFieldError, match=r"scorer 'token_prob'.*non-finite.*rows \[1\]"):
        p.apply(b, 0)


def test_token_prob_shape_mismatch_names_the_field():
    b = batch_of([1, 0], ["a", "a"], old_log_probs=torch.zeros(2, 5))
    with pytest.raises(BatchFieldError, match="old_log_probs"):
        component("scorer", "token_prob").score(b, 0)


def test_advantage_magnitude_nan_advantage_fails_naming_the_scorer():
    adv = torch.zeros(2, 6)
    adv[0, 1] = float("nan")
    b = batch_of([1, 0], ["a", "a"], advantages=adv)
    p = pipe("select", "advantage_magnitude", "topk_fraction")
    with pytest.raises((BatchFieldError, PluginRuntimeError), match="advantage_magnitude"):
        p.apply(b, 0)


def test_scorer_declarations():
    from dataflex_plugins.methods import scorers

    assert scorers.RewardDifficulty.timing == "post_reward"
    assert scorers.GroupSolveRate.needs_groups and scorers.GroupSolveRate.granularity == "prompt"
    assert scorers.AdvantageMagnitude.timing == "post_advantage"
    assert scorers.TokenProb.timing == "post_advantage" and scorers.TokenProb.granularity == "token"
