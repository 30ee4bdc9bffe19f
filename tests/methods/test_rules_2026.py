"""The cheap 2026 rules against their papers' equations, with hand-checked vectors (none of the four has
official code we could port: ScaleRL and SEC publish none, RAGEN-2's filter is a pull request to SkyRL and
LILO's sampler is a formula)."""

from __future__ import annotations

import math

import pytest
import torch
from dataflex_plugins.methods.rules2026 import (
    Learnability,
    NoPositiveResampling,
    RewardVariance,
    Sec,
    SnrFilter,
    top_mass,
)

from dataflex_bus.batch import Batch
from dataflex_bus.components import Score

from .helpers import batch_of


def candidates(n: int, budget: int | None = None) -> Batch:
    extra = {} if budget is None else {"budget_prompts": torch.tensor(budget)}
    return Batch.from_tensors(uid=torch.arange(n), is_padding=torch.zeros(n, dtype=torch.bool),
                              prompt_index=torch.arange(n), **extra)


def prompt_score(values: list[float]) -> Score:
    return Score(torch.tensor(values, dtype=torch.float64), "prompt")


def test_no_positive_resampling_drops_a_prompt_at_a_pass_rate_of_0_9():
    keep = NoPositiveResampling().select(candidates(4), prompt_score([0.95, 0.9, 0.89, 0.0]), 0)
    assert keep.keep.tolist() == [False, False, True, True]
    assert keep.metrics == {"no_positive_resampling/dropped": 2.0}


def test_reward_variance_is_each_groups_population_variance():
    b = batch_of([1, 0, 1, 0, 1, 0, 0, 0, 1, 1], uid=["a"] * 4 + ["b"] * 4 + ["c"] * 2)
    v = RewardVariance().score(b, 0).values
    assert v.tolist() == pytest.approx([0.25] * 4 + [0.1875] * 4 + [0.0] * 2)


def test_top_mass_hand_vectors():
    var = torch.tensor([0.25, 0.1875, 0.0, 0.0], dtype=torch.float64)
    # total 0.4375: 0.9 of it needs both positive groups (0.25 < 0.39375), 0.5 only the first
    assert top_mass(var, 0.9).tolist() == [True, True, False, False]
    assert top_mass(var, 0.5).tolist() == [True, False, False, False]
    assert top_mass(var, 1.0).tolist() == [True, True, False, False]
    assert top_mass(torch.zeros(3, dtype=torch.float64), 0.5).tolist() == [True] * 3  # no signal: keep all


def test_snr_filter_keeps_whole_groups_of_the_top_variance_mass():
    b = batch_of([1, 0, 1, 0, 1, 0, 0, 0, 1, 1], uid=["a"] * 4 + ["b"] * 4 + ["c"] * 2)
    sel = SnrFilter(rho=0.5).select(b, RewardVariance().score(b, 0), 0)
    assert sel.keep.tolist() == [True] * 4 + [False] * 6
    assert sel.metrics == {"snr_filter/groups_kept": 1.0, "snr_filter/groups": 3.0}


def test_learnability_before_generation_keeps_the_b_highest_p_one_minus_p():
    # p(1 - p): 0.09, 0.25, 0.21, 0, 0.1875 -> the 3 best are rows 1, 2, 4
    sel = Learnability().select(candidates(5, budget=3), prompt_score([0.1, 0.5, 0.7, 1.0, 0.25]), 0)
    assert sel.keep.tolist() == [False, True, True, False, True]


def test_learnability_after_generation_keeps_a_fraction_of_the_groups():
    b = batch_of([1, 0, 1, 1, 0, 0, 1, 1], uid=["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["d"] * 2)
    rate = Score(torch.tensor([0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]), "prompt")
    sel = Learnability(fraction=0.25).select(b, rate, 0)
    assert sel.keep.tolist() == [True, True] + [False] * 6


def test_learnability_sampling_draws_by_p_one_minus_p():
    """draw: sample, one of two: p(1 - p) 0.25 vs 0.09 -> picked 0.25 / 0.34 of the time."""
    sel = Learnability(draw="sample", seed=3)
    picks = torch.stack([sel.select(candidates(2, budget=1), prompt_score([0.5, 0.1]), 0).keep
                         for _ in range(10_000)]).to(torch.float64).mean(0)
    assert picks[0].item() == pytest.approx(0.25 / 0.34, abs=0.015)


def test_sec_td0_and_boltzmann_hand_vector():
    sec = Sec(alpha=0.5, temperature=1.0)
    sec.set_domains(["a", "b", "c"])
    assert sec.probabilities().tolist() == pytest.approx([1 / 3] * 3)
    b = batch_of([1, 0, 1, 0], uid=["x", "x", "y", "y"], domains=["a", "a", "b", "b"], domain_names=["a", "b", "c"])
    # mean |A|: a = (0.8 + 0.4) / 2 = 0.6, b = 0.2; c unseen keeps Q = 0
    sec.update(b, Score(torch.tensor([0.8, -0.4, 0.2, -0.2]), "response"), 0)
    assert sec.q.tolist() == pytest.approx([0.3, 0.1, 0.0])
    sec.update(b, Score(torch.tensor([0.0, 0.0, 1.0, 1.0]), "response"), 1)
    assert sec.q.tolist() == pytest.approx([0.15, 0.55, 0.0])
    z = [math.exp(0.15), math.exp(0.55), 1.0]
    assert sec.probabilities().tolist() == pytest.approx([x / sum(z) for x in z])
    restored = Sec(alpha=0.5, temperature=1.0)
    restored.set_domains(["a", "b", "c"])
    restored.load_state_dict(sec.state_dict())
    assert torch.equal(restored.q, sec.q)
