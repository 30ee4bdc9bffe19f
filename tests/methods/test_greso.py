"""GRESO: the signed-streak scorer and the skip rule with adaptive exploration probabilities (P1.3, P1.4),
checked against probabilities and adaptation steps computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from dataflex_plugins.methods.prompts import Greso, ZeroVarianceStreak

from dataflex_bus.batch import Batch
from dataflex_bus.errors import ConfigError
from dataflex_bus.visits import EASY, HARD, OTHER, VisitClasses


def candidates(streaks: list[int], classes: list[int], *, counts_step: int = -1, epoch: int = 1,
               groups: int = 0, easy: int = 0, hard: int = 0) -> Batch:
    n = len(streaks)
    scalar = {"history_epoch": epoch, "history_counts_epoch": epoch, "history_counts_step": counts_step,
              "history_step_groups": groups,
              "history_step_easy": easy, "history_step_hard": hard}
    return Batch.from_tensors(uid=torch.arange(n), prompt_index=torch.arange(n),
                              history_streak=torch.tensor(streaks), history_class=torch.tensor(classes),
                              history_visits=torch.tensor([s + 1 for s in streaks]),
                              **{k: torch.tensor(v) for k, v in scalar.items()})


def test_streak_is_signed_by_class():
    batch = candidates([3, 2, 0, 0], [EASY, HARD, OTHER, OTHER])
    score = ZeroVarianceStreak().score(batch, 0)
    assert score.values.tolist() == [3.0, -2.0, 0.0, 0.0] and score.granularity == "prompt"


def test_streak_scorer_declares_how_visits_are_classified():
    assert ZeroVarianceStreak().visit_classes() == VisitClasses()
    greso = ZeroVarianceStreak(mode="greso", count_hard=0.0).visit_classes()
    assert greso == VisitClasses(mode="greso", count_hard=0.0)
    with pytest.raises(ConfigError, match="easy_min"):
        ZeroVarianceStreak(easy_min=0.0, hard_max=0.0)
    with pytest.raises(ConfigError, match="tau_easy"):
        ZeroVarianceStreak(mode="greso", tau_easy=0.1, tau_hard=0.2)


def keep_probabilities(selector: Greso, signed: list[float], draws: int = 4000) -> torch.Tensor:
    """Empirical keep rate of each candidate over ``draws`` independent draws."""
    n = len(signed)
    big = candidates([0] * (n * draws), [OTHER] * (n * draws))
    from dataflex_bus.components import Score

    score = Score(torch.tensor(signed * draws, dtype=torch.float32), "prompt")
    keep = selector.select(big, score, 0).keep
    return keep.view(draws, n).double().mean(0)


def test_skip_rule_probabilities():
    # keep probability max(p**z, 0.01): easy z=3 at p_easy=0.5 -> 0.125; hard z=1 at p_hard=0.8 -> 0.8;
    # z=10 at 0.5 -> 0.00098 floored to 0.01; never seen or informative (0) -> always kept
    g = Greso(p_easy_init=0.5, p_hard_init=0.8)
    rate = keep_probabilities(g, [3.0, -1.0, 10.0, 0.0])
    expected = [0.125, 0.8, 0.01, 1.0]
    for got, want in zip(rate.tolist(), expected):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / 4000) + 1e-12, (got, want)
    assert rate[3] == 1.0


def test_skip_draws_are_the_selectors_own_seeded_uniforms():
    g = Greso(p_easy_init=0.5, p_hard_init=0.5, seed=3)
    batch = candidates([0] * 6, [OTHER] * 6)
    from dataflex_bus.components import Score

    signed = torch.tensor([1.0, 2.0, -1.0, -3.0, 0.0, 7.0])
    keep = g.select(batch, Score(signed, "prompt"), 0).keep
    u = torch.rand(6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    prob = torch.tensor([0.5, 0.25, 0.5, 0.125, 1.0, max(0.5**7, 0.01)], dtype=torch.float64)
    assert keep.tolist() == (u < prob).tolist()


def test_state_round_trip_continues_the_same_draws():
    from dataflex_bus.components import Score

    batch = candidates([0] * 50, [OTHER] * 50)
    score = Score(torch.full((50,), 1.0), "prompt")
    a = Greso(seed=1)
    a.select(batch, score, 0)
    b = Greso(seed=9)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.select(batch, score, 1).keep, b.select(batch, score, 1).keep)


def adapt(g: Greso, **counts) -> tuple[float, float]:
    from dataflex_bus.components import Score

    batch = candidates([0], [OTHER], **counts)
    g.select(batch, Score(torch.zeros(1), "prompt"), 0)
    return g.p_easy, g.p_hard


def test_adaptation_moves_each_probability_toward_its_target():
    # alpha = 0.25: targets 1/12 easy, 1/6 hard. 100 groups, 10 easy (>= 8.33), 10 hard (< 16.7)
    g = Greso()
    p_easy, p_hard = adapt(g, counts_step=4, groups=100, easy=10, hard=10)
    assert p_easy == pytest.approx(0.49) and p_hard == pytest.approx(0.51)
    # the same completed step seen again (another draw of the next step) adapts nothing
    assert adapt(g, counts_step=4, groups=100, easy=90, hard=90) == (p_easy, p_hard)
    # exactly at the target counts as reached (0.3 * 100 is 30.000000000000004 in floats: compared exactly)
    g2 = Greso(target_zero_variance=0.3)
    assert adapt(g2, counts_step=0, groups=100, easy=10, hard=20) == (pytest.approx(0.49), pytest.approx(0.49))
    g3 = Greso(target_zero_variance=0.3)
    assert adapt(g3, counts_step=0, groups=100, easy=9, hard=19) == (pytest.approx(0.51), pytest.approx(0.51))


def test_adaptation_respects_bounds_epochs_and_empty_steps():
    g = Greso(p_easy_init=0.06, p_hard_init=0.94, p_min=0.05, p_max=0.95, step=0.02)
    assert adapt(g, counts_step=0, groups=10, easy=10, hard=0) == (0.05, 0.95)
    frozen = Greso()
    assert adapt(frozen, counts_step=0, epoch=0, groups=10, easy=10, hard=10) == (0.5, 0.5)
    assert frozen.adapted_through == 0  # that step's chance to adapt is used up
    assert adapt(frozen, counts_step=1, epoch=1, groups=0) == (0.5, 0.5)
    assert adapt(Greso(), counts_step=-1, groups=10, easy=10) == (0.5, 0.5)
    # the epoch the counted step ended in decides (GRESO's `epoch > 0` at the end of the step), not the next draw's
    late = Greso()
    batch = candidates([0], [OTHER], counts_step=3, epoch=1, groups=10, easy=10, hard=10)
    batch = batch.with_fields(history_counts_epoch=torch.tensor(0))
    from dataflex_bus.components import Score

    late.select(batch, Score(torch.zeros(1), "prompt"), 0)
    assert (late.p_easy, late.p_hard) == (0.5, 0.5)


def test_parameter_rules():
    with pytest.raises(ConfigError, match="p_min"):
        Greso(p_min=0.6, p_max=0.5)
    with pytest.raises(ConfigError, match="p_easy_init"):
        Greso(p_easy_init=0.01)


def test_streak_scorer_meets_the_scorer_contract_on_a_prompt_batch():
    from dataflex_bus.testing import check_scorer, make_prompt_batch

    batch = make_prompt_batch(prompts=20, seed=3)
    assert {"prompt_index", "history_streak", "history_epoch"} <= set(batch.fields)
    assert bool((batch["history_visits"] == 0).any()) and bool((batch["history_visits"] > 0).any())
    score = check_scorer(ZeroVarianceStreak(), batch)
    assert score.values.abs().sum() > 0  # some candidates have a streak
    check_scorer(ZeroVarianceStreak)  # the default batch of a pre_rollout scorer is a prompt batch

