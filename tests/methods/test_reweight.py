"""Reweighters: AR without renormalisation, softmax (row / token mean 1), PER-style weights."""

from __future__ import annotations

import math

import pytest
import torch

from dataflex_bus.components import Score
from dataflex_bus.errors import BatchFieldError, ConfigError

from .helpers import batch_of, component, pipe, row_score


def test_advantage_reweight_is_alpha_p_plus_one_minus_alpha_without_renormalisation():
    lp = torch.log(torch.tensor([[0.5, 0.1, 0.9], [0.8, 0.2, 0.3]]))
    b = batch_of([1, 0], ["a", "a"], lengths=[3, 2], tokens=3, old_log_probs=lp)
    score = component("scorer", "token_prob").score(b, 0)
    w = component("actuator", "advantage_reweight", alpha=0.3).reweight(b, score, 0).weights
    expected = 0.3 * torch.tensor([[0.5, 0.1, 0.9], [0.8, 0.2, 0.3]]) + 0.7
    tm = b.token_mask
    assert torch.allclose(w[tm], expected[tm])
    # the pipeline multiplies these in as they are (1 on non-real tokens), no mean-1 rescaling
    d = pipe("reweight", "token_prob", "advantage_reweight", actuator_params={"alpha": 0.3}).apply(b, 0)
    assert torch.allclose(d.weights, torch.where(tm, expected, torch.ones(2, 3)))
    assert d.metrics["dataflex/weight_mean"] == pytest.approx(float(expected[tm].mean()), rel=1e-6)
    assert d.metrics["dataflex/weight_max"] == pytest.approx(0.97)
    assert d.metrics["dataflex/weight_min"] == pytest.approx(0.73)
    assert d.metrics["dataflex/weight_std"] == pytest.approx(float(expected[tm].std()), rel=1e-4)


def test_advantage_reweight_alpha_zero_is_plain_grpo_and_range_checked():
    b = batch_of([1, 0], ["a", "a"])
    d = pipe("reweight", "token_prob", "advantage_reweight", actuator_params={"alpha": 0.0}).apply(b, 0)
    assert torch.equal(d.weights, torch.ones_like(d.weights))
    with pytest.raises(ConfigError, match="alpha"):
        component("actuator", "advantage_reweight", alpha=1.5)


def test_advantage_reweight_rejects_row_scores():
    b = batch_of([1, 0], ["a", "a"])
    with pytest.raises(BatchFieldError, match=r"advantage_reweight.*score"):
        component("actuator", "advantage_reweight").reweight(b, row_score([0.5, 0.5]), 0)


def test_softmax_row_weights_are_n_times_softmax_over_real_rows():
    b = batch_of([0, 0, 0, 0], list("abcd"), padding=[False, False, True, False])
    s = row_score([0.0, 1.0, 50.0, 2.0])
    w = component("actuator", "softmax", temperature=0.5).reweight(b, s, 0).weights
    e = torch.exp(torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64))
    expected = 3 * e / e.sum()
    assert torch.allclose(w[[0, 1, 3]].double(), expected, rtol=1e-6)
    assert w[2] == 1.0  # padding: neutral
    assert float(w[[0, 1, 3]].double().mean()) == pytest.approx(1.0)


def test_softmax_is_stable_for_huge_scores():
    b = batch_of([0, 0, 0], list("abc"))
    w = component("actuator", "softmax", temperature=1.0).reweight(b, row_score([1e30, 1e30, 0.0]), 0).weights
    assert torch.allclose(w, torch.tensor([1.5, 1.5, 0.0]))


def test_softmax_token_normalisation_gives_mean_one_over_real_tokens():
    b = batch_of([0, 0, 0, 0], list("abcd"), lengths=[1, 4, 6, 3], padding=[False, False, False, True])
    s = row_score([0.3, -1.0, 2.0, 9.0])
    w = component("actuator", "softmax", normalize="token").reweight(b, s, 0).weights.double()
    lengths = torch.tensor([1.0, 4.0, 6.0], dtype=torch.float64)
    assert float((w[:3] * lengths).sum() / lengths.sum()) == pytest.approx(1.0)
    # proportional to the row softmax
    e = torch.exp(torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64))
    assert torch.allclose(w[:3] / w[0], e / e[0])
    d = pipe("reweight", "reward_difficulty", "softmax", actuator_params={"normalize": "token"}).apply(b, 0)
    assert d.metrics["dataflex/weight_mean"] == pytest.approx(1.0)


def test_softmax_nan_score_is_an_error_naming_the_reweighter():
    b = batch_of([0, 0], ["a", "b"])
    with pytest.raises(BatchFieldError, match="softmax"):
        component("actuator", "softmax").reweight(b, row_score([float("nan"), 0.0]), 0)


def _per_direct(scores, alpha, beta, eps):
    p = torch.tensor(scores, dtype=torch.float64).abs() + eps
    big_p = p**alpha / (p**alpha).sum()
    w = (len(scores) * big_p) ** (1 - beta)
    return w / w.mean()


@pytest.mark.parametrize(("alpha", "beta"), [(0.6, 0.4), (1.0, 0.0), (2.0, 0.5), (0.0, 0.3), (0.7, 1.0)])
def test_per_advantage_matches_the_direct_formula(alpha, beta):
    scores = [0.0, -1.5, 0.2, 3.0, 0.7]
    b = batch_of([0] * 6, list("abcdef"), padding=[False] * 5 + [True])
    w = component("actuator", "per_advantage", alpha=alpha, beta=beta, eps=1e-3).reweight(
        b, row_score([*scores, 100.0]), 0).weights
    assert torch.allclose(w[:5].double(), _per_direct(scores, alpha, beta, 1e-3), rtol=1e-5)
    assert w[5] == 1.0
    if beta == 1.0 or alpha == 0.0:
        assert torch.allclose(w[:5], torch.ones(5))


def test_reweighters_through_the_pipeline_multiply_into_real_tokens_only():
    b = batch_of([1, 0, 1, 0], ["a", "a", "b", "b"], lengths=[2, 6, 3, 1], padding=[False, False, False, True])
    for actuator in ("softmax", "per_advantage"):
        d = pipe("reweight", "advantage_magnitude", actuator).apply(b, 0)
        tm = b.token_mask
        assert torch.equal(d.weights[~tm], torch.ones(int((~tm).sum())))
        assert bool((d.weights[tm] > 0).all()) and bool(torch.isfinite(d.weights).all())


def test_token_score_values_are_read_by_the_reweighter():
    b = batch_of([1, 0], ["a", "a"], tokens=2)
    score = Score(values=torch.tensor([[0.0, 1.0], [0.5, 0.25]]), granularity="token")
    w = component("actuator", "advantage_reweight", alpha=0.5).reweight(b, score, 0).weights
    assert w.tolist() == [[0.5, 1.0], [0.75, 0.625]]


def test_reweight_weight_metrics_for_row_weights():
    b = batch_of([0, 0], ["a", "b"], lengths=[1, 3])
    d = pipe("reweight", "reward_difficulty", "softmax").apply(b, 0)
    w = d.weights[b.token_mask].double()
    assert d.metrics["dataflex/weight_mean"] == pytest.approx(float(w.mean()))
    assert d.metrics["dataflex/weight_std"] == pytest.approx(float(w.std()), abs=1e-9)
    assert not math.isnan(d.metrics["dataflex/weight_ess"])
