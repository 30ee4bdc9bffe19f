"""Rollout allocation: Knapsack RL's value, cost, estimate and allocation, SPEED's screening and MoPPS's
posterior and selection, against the test vectors of ``allocation.md`` (sections 1.8, 3.5, 4.7) and the
official Knapsack DP ported here as the reference."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from dataflex_plugins.methods.allocate import (
    Knapsack,
    KnapsackRate,
    Speed,
    cost,
    dp_extras,
    greedy_extras,
    value,
)
from dataflex_plugins.methods.mopps import Mopps, TopB

from dataflex_bus.batch import Batch
from dataflex_bus.components import Budget, Score
from dataflex_bus.errors import BatchFieldError, ConfigError
from dataflex_bus.history import PromptHistory, PromptTable
from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.visits import Visits

NEW = -1.0  # knapsack_rate's "not valid yet"


def allocate(rates: list[float], n: int, *, budget: int | None = None, **params) -> tuple[list[int], dict]:
    batch = Batch.from_tensors(uid=torch.arange(len(rates)), prompt_index=torch.arange(len(rates)))
    knapsack = Knapsack(**{"max_n": 128, **params})
    total = budget if budget is not None else len(rates) * n
    out = knapsack.allocate(batch, Score(torch.tensor(rates, dtype=torch.float64), "prompt"), 0,
                            Budget(total, len(rates), n))
    return out.counts.tolist(), out.metrics


# ---------------------------------------------------------------------------- K1: value and cost
def test_value_and_cost_match_the_official_functions():
    for (n, p), want in {(8, 0.5): 0.1240234375, (2, 1 / 3): 0.0658436214, (8, 1 / 3): 0.1423450581,
                         (8, 0.1): 0.0461321552, (16, 0.1): 0.0659905365, (93, 0.02): 0.0162736819,
                         (8, 0.0): 0.0, (8, 1.0): 0.0}.items():
        assert float(value(n, p)) == pytest.approx(want, abs=1e-9)
    probability = cost(torch.tensor([0.5, 0.25, 0.1, 0.01], dtype=torch.float64))
    assert probability.tolist() == pytest.approx([3.321928, 8.003923, 21.854345, 229.105288], abs=1e-6)
    expectation = cost(torch.tensor([0.5, 0.1], dtype=torch.float64), "expectation")
    assert expectation.tolist() == pytest.approx([3.0, 10.111111], abs=1e-6)
    assert float(value(3, 1 / 3)) == pytest.approx(4 / 27 * (1 - (1 / 3) ** 3 - (2 / 3) ** 3))


# ---------------------------------------------------------------------------- K2-K8: the allocation
OFFICIAL = {  # allocation.md 1.8, the official sampling_budget_by_knapsack run (n, rates) -> counts, fallback ratio
    "K2": (8, [0.5, 0.25, 0.0, 1.0], [6, 9, 15, 2], 11 / 24),
    "K3": (8, [1.0] * 4, [8, 8, 8, 8], None),
    "K4": (8, [NEW, NEW, 0.5, 0.0], [11, 11, 5, 5], 3 / 12),
    "K6": (8, [0.5, 0.3, 0.1, 0.05, 0.9, 0.0, 1.0, 0.7], [7, 11, 18, 13, 3, 2, 2, 8], None),
    "K7": (8, [0.0, 0.0, 0.0, 1.0], [10, 10, 10, 2], None),
    "K8": (4, [0.5, 0.2, 0.02, 1.0], [5, 7, 2, 2], None),
}


@pytest.mark.parametrize("solver", ["greedy", "dp"])
@pytest.mark.parametrize("vector", sorted(OFFICIAL))
def test_knapsack_reproduces_the_official_allocation(vector, solver):
    n, rates, want, ratio = OFFICIAL[vector]
    counts, metrics = allocate(rates, n, solver=solver)
    assert counts == want and sum(counts) == n * len(rates)
    assert metrics["knapsack/fallback"] == float(ratio is not None)
    if ratio is not None:
        assert metrics["knapsack/fallback_ratio"] == pytest.approx(ratio)


def test_k5_cheap_effective_prompts_with_no_one_to_fall_back_on_keep_the_budget():
    # official: numpy divides by zero and its budget assert fails (got 20, expected 32); deviation
    # ks_fallback_empty: the whole remaining budget goes to the DP over the effective prompts
    counts, metrics = allocate([0.5] * 4, 8)
    assert counts == [8, 8, 8, 8] and metrics["knapsack/fallback"] == 0.0


def test_k9_the_dps_zero_extra_quirk_and_the_exact_objective():
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.9, 0.7], dtype=torch.float64)
    for solve in (lambda **kw: greedy_extras(p, 48, **kw), lambda **kw: dp_extras(p, 48, **kw)[0]):
        assert solve(min_n=2, extra=126, objective="official").tolist() == [5, 9, 16, 11, 1, 6]
        assert solve(min_n=2, extra=126, objective="exact").tolist() == [5, 9, 17, 11, 0, 6]
    official = [5, 9, 16, 11, 1, 6]
    exact = [5, 9, 17, 11, 0, 6]
    assert float(sum(value(k + 2, q) for k, q in zip(official, p) if k)) == pytest.approx(0.4197367593, abs=1e-9)
    assert float(sum(value(k + 2, q) for k, q in zip(exact, p))) == pytest.approx(0.4201425258, abs=1e-9)


def official_dp(rates: list[float], budget: int, min_n: int, k_max: int) -> list[int]:
    """``solve_by_dp``'s pure-Python path (KnapsackRL exploration_utils.py:345-414), as the reference: float32
    success rates, strict '>' (the first option found wins), the largest reachable budget backtracked."""
    e = len(rates)
    ps = np.array(rates, dtype=np.float32)
    dp = np.full((e + 1, budget + 1), -np.inf)
    dp[0][0] = 0.0
    choice = np.full((e + 1, budget + 1, 2), -1, dtype=int)
    for i in range(1, e + 1):
        r = ps[i - 1]
        for w in range(budget + 1):
            if dp[i - 1][w] > dp[i][w]:
                dp[i][w] = dp[i - 1][w]
                choice[i][w] = [0, 0]
            for k in range(1, min(k_max + 1, w + 1)):
                if dp[i - 1][w - k] == -np.inf:
                    continue
                gain = (1 - (r ** (k + min_n)) - ((1 - r) ** (k + min_n))) * r * ((1 - r) ** 2)
                if dp[i - 1][w - k] + gain > dp[i][w]:
                    dp[i][w] = dp[i - 1][w - k] + gain
                    choice[i][w] = [i - 1, k]
    w = budget
    while w > 0 and dp[e][w] == -np.inf:
        w -= 1
    out = [0] * e
    for i in range(e, 0, -1):
        item, k = choice[i][w]
        if k > 0:
            out[item] += k
            w -= k
    return out


def test_the_dp_solver_is_the_official_dp_bit_for_bit_ties_included():
    rng = random.Random(0)
    for _ in range(40):
        rates = [rng.choice([0.5, 0.25, 0.1, 0.3, 0.7, 0.9, 0.05, 0.02, round(rng.random() * 0.98 + 0.01, 2)])
                 for _ in range(rng.randint(1, 6))]
        min_n, k_max = rng.randint(2, 3), rng.randint(2, 9)
        budget = rng.randint(0, len(rates) * k_max)
        got, unplaced = dp_extras(torch.tensor(rates, dtype=torch.float64), budget, min_n=min_n, extra=k_max,
                                  objective="official")
        assert got.tolist() == official_dp(rates, budget, min_n, k_max) and unplaced == 0, (rates, budget)


def objective_value(ks: torch.Tensor, p: torch.Tensor, min_n: int, objective: str) -> float:
    v = value(ks + min_n, p)
    return float(torch.where(ks > 0, v, 0.0).sum() if objective == "official" else v.sum())


def test_greedy_reaches_the_dps_optimum():
    # the same objective value everywhere; the same counts wherever the optimum is unique (ties: the greedy
    # gives the earlier prompt the rollout, the official DP follows its float32 rounding)
    rng = random.Random(1)
    for _ in range(25):
        rates = [round(rng.random() * 0.98 + 0.01, 3) for _ in range(rng.randint(1, 6))]
        min_n, k_max = 2, rng.randint(2, 10)
        budget = rng.randint(0, len(rates) * k_max)
        for objective in ("official", "exact"):
            p = torch.tensor(rates, dtype=torch.float64)
            g = greedy_extras(p, budget, min_n=min_n, extra=k_max, objective=objective)
            d, _ = dp_extras(p, budget, min_n=min_n, extra=k_max, objective=objective)

            assert int(g.sum()) == budget
            assert objective_value(g, p, min_n, objective) == pytest.approx(objective_value(d, p, min_n, objective),
                                                                            rel=1e-6, abs=1e-9)
            if len(set(rates)) == len(rates):
                assert g.tolist() == d.tolist(), (rates, budget, objective)


# ---------------------------------------------------------------------------- edge cases (section 1.6)
def test_a_budget_below_the_floors_is_refused_naming_it():
    with pytest.raises(BatchFieldError, match=r"budget of 5 rollouts is below the floors' 8.*min_n=2"):
        allocate([0.5, 0.5, 0.25, 0.1], 8, budget=5)


def test_all_saturated_prompts_fall_back_without_dividing_by_zero():
    assert allocate([1.0] * 4, 8)[0] == [8] * 4                       # K3: every prompt n
    assert allocate([1.0] * 4, 8, budget=30)[0] == [8, 8, 7, 7]        # another budget: spent exactly
    assert allocate([0.0] * 3 + [1.0], 8)[0] == [10, 10, 10, 2]       # K7: the rest to the never-solved
    assert allocate([0.0, 0.0], 8, budget=4)[0] == [2, 2]              # nothing left: floors only


def test_budget_beyond_max_n_goes_to_the_other_prompts_never_past_max_n():
    # deviation ks_spread_cap: floors [2, 2, 2, 8]; the 2 effective prompts take 10 extras each up to max_n=12;
    # the official spreads the other 6 over them past max_n, here they go to the never-solved and the new
    # prompt (3 each, capped at max_n)
    counts, _ = allocate([0.5, 0.5, 0.0, NEW], 8, max_n=12, budget=40, allow_fallback=False)
    assert counts == [12, 12, 5, 11] and sum(counts) == 40
    with pytest.raises(BatchFieldError, match="every prompt at max_n=8"):
        allocate([0.5, 0.5], 8, max_n=8, budget=40)


def test_never_seen_prompts_get_the_group_size_and_count_as_never_solved_in_the_fallback():
    assert allocate([NEW, NEW, 0.5, 0.0], 8)[0] == [11, 11, 5, 5]            # K4, as the official code
    assert allocate([NEW, NEW, 0.5, 0.0], 8, fallback_includes_new=False)[0] == [8, 8, 5, 11]
    with pytest.raises(BatchFieldError, match="group size 200, outside"):
        allocate([NEW], 200)


def test_groups_of_one_are_refused_unless_asked_for():
    with pytest.raises(ConfigError, match="groups of one rollout"):
        Knapsack(min_n=1)
    with pytest.raises(ConfigError, match="negative_n=1"):
        Knapsack(negative_n=1)
    assert Knapsack(min_n=1, singletons=True).min_n == 1


def test_k10_a_large_ragged_group_gets_its_own_grpo_baseline():
    # 93 rollouts with one success: mean 0.0107527, std 0.1036952 -> +9.539864 / -0.103694 (verl's GRPO)
    rewards = torch.zeros(93 + 4)
    rewards[0] = 1.0
    rewards[93] = 1.0
    gi = torch.tensor([0] * 93 + [1] * 4)
    adv = grpo_outcome_advantage(rewards, gi, 2)
    assert float(adv[0]) == pytest.approx(9.539864, abs=1e-4) and float(adv[1]) == pytest.approx(-0.103694, abs=1e-5)


def test_the_singleton_trap_is_verls_rule():
    # allocation.md 6.3.2: a=[1,0,0], b=[1], c=[1,1]
    adv = grpo_outcome_advantage(torch.tensor([1.0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 0, 1, 2, 2]), 3)
    assert adv.tolist() == pytest.approx([1.154698, -0.577349, -0.577349, 0.999999, 0, 0], abs=1e-5)


# ---------------------------------------------------------------------------- E: the estimate
def history_with(visits: list[list[float]]) -> PromptHistory:
    table = PromptTable.full(["d"], [2], column="row")
    history = PromptHistory(table)
    for step, rewards in enumerate(visits):
        n = len(rewards)
        batch = Batch.from_tensors(uid=torch.zeros(n, dtype=torch.long), prompt_index=torch.zeros(n, dtype=torch.long),
                                   rm_scores=torch.tensor(rewards, dtype=torch.float32)[:, None],
                                   response_mask=torch.ones(n, 1, dtype=torch.long))
        history.record(batch, step)
    return history


def estimate(history: PromptHistory, **params) -> float:
    fields = history.fields(torch.tensor([0]))
    batch = Batch.from_tensors(uid=torch.arange(1), **fields)
    return float(KnapsackRate(**params).score(batch, 0).values[0])


def test_e_the_estimator_pools_the_last_16_rewards_most_recent_first():
    visits: list[list[float]] = []
    assert estimate(history_with(visits)) == NEW                                  # unseen: not valid
    assert estimate(history_with([[0, 0, 1, 1]])) == NEW                          # 4 < 8 rewards: not valid
    assert estimate(history_with([[1, 1, 1, 1]]), min_buffer_length=0) == 1.0      # valid from 0: its mean
    visits = [[1, 1, 0, 0, 0, 0, 0, 0]]
    assert estimate(history_with(visits)) == 0.25                                # [1, 0.25, 8]
    visits.append([1, 1])
    assert estimate(history_with(visits)) == 0.4                                 # pooled 10 -> [1, 0.4, 10]
    visits.append([0, 0] + [1] * 8 + [0] * 6)
    assert estimate(history_with(visits)) == 0.5                                 # 16: that visit only
    visits.append([1, 0, 1, -1])
    h = history_with(visits)
    assert estimate(h) == 0.5                                                    # 4 reversed + 12 of the last
    assert int(h.fields(torch.tensor([0]))["history_reward_count"][0]) == 30
    assert estimate(history_with(visits), epoch_estimation=True, robust_epoch_estimation=False) == 0.5  # 2 / 4
    assert estimate(history_with([[1] * 24])) == 1.0                             # >= 16: the whole visit


def test_the_history_keeps_per_visit_sizes_successes_and_rewards_in_order():
    h = history_with([[1, 0, 0], [0, 1], [1] * 20])
    f = h.fields(torch.tensor([0, 1]))
    assert f["history_sizes"][0].tolist() == [20, 2, 3, 0] and f["history_successes"][0].tolist() == [20, 1, 1, 0]
    assert f["history_reward_count"].tolist() == [25, 0]
    assert f["history_rewards"][0].tolist() == [1.0] * 16 and bool(torch.isnan(f["history_rewards"][1]).all())
    h2 = history_with([[1, 0, 0], [0, 1]])
    assert h2.fields(torch.tensor([0]))["history_rewards"][0, :5].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------- SPEED (section 3.5)
def speed_batch(groups: list[list[float]]) -> tuple[Batch, Score]:
    from dataflex_plugins.methods.scorers import GroupSolveRate

    rewards = [r for g in groups for r in g]
    uid = [i for i, g in enumerate(groups) for _ in g]
    n = len(rewards)
    batch = Batch.from_tensors(uid=torch.tensor(uid), rm_scores=torch.tensor(rewards)[:, None],
                               response_mask=torch.ones(n, 1, dtype=torch.long))
    return batch, GroupSolveRate().score(batch, 0)


def test_s1_speed_screens_prompts_with_some_but_not_all_right():
    batch, score = speed_batch([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1]])
    out = Speed(n_continue=12).allocate(batch, score, 0, Budget(0, 4, 4))
    assert out.keep is not None
    per_group = out.keep.view(4, 4).all(1).tolist()
    assert per_group == [False, False, True, True]
    assert out.counts.view(4, 4)[:, 0].tolist() == [0, 0, 12, 12]
    # the continuation round: the qualified groups go on, nothing more is asked for
    again = Speed(n_continue=12).allocate(batch, score, 0, Budget(0, 4, 4, round=1))
    assert again.keep is not None and again.keep.view(4, 4).all(1).tolist() == per_group
    assert int(again.counts.sum()) == 0


def test_speed_continues_at_most_the_groups_the_step_still_needs():
    batch, score = speed_batch([[1, 0], [0, 1], [1, 1], [1, 0]])
    out = Speed(n_continue=4).allocate(batch, score, 0, Budget(0, 2, 2))
    assert out.counts.view(4, 2)[:, 0].tolist() == [4, 4, 0, 0] and out.metrics["speed/unused_qualified_groups"] == 1


# ---------------------------------------------------------------------------- MoPPS (section 4.7)
def visits(successes: int, size: int) -> Visits:
    return Visits(torch.tensor([0]), torch.tensor([size]), torch.tensor([successes]), 0)


def test_m1_m2_m3_the_posterior_update():
    state = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    assert Mopps().update_prompt_state(state, visits(3, 8)).tolist() == [[4.0, 6.0]]             # M1: s=0.375
    half = Mopps(decay=0.5)
    after = half.update_prompt_state(half.update_prompt_state(state, visits(3, 8)), visits(4, 8))
    assert after.tolist() == [[6.5, 7.5]]                                                      # M2
    # M3: the README formula at n=1 (the official precedence quirk gives (8, 8))
    assert Mopps().update_prompt_state(torch.tensor([[3.0, 5.0]], dtype=torch.float64), visits(1, 1)).tolist() == \
        [[4.0, 5.0]]


def mopps_history(scorer: Mopps, prompts: int = 1) -> PromptHistory:
    history = PromptHistory(PromptTable.full(["d"], [prompts], column="row"))
    history.own(scorer.prompt_state(), scorer.update_prompt_state)
    return history


def record_group(history: PromptHistory, rewards: list[float], step: int = 0) -> None:
    n = len(rewards)
    zeros = torch.zeros(n, dtype=torch.long)
    history.record(Batch.from_tensors(uid=zeros, prompt_index=zeros, rm_scores=torch.tensor(rewards)[:, None],
                                      response_mask=torch.ones(n, 1, dtype=torch.long)), step)


def test_mopps_counts_a_success_as_the_authors_trainer_does():
    # issue #34: prior (3.33, 2.68), 12 rollouts; the trainer counts acc >= 1 (our_ray_trainer.py:451): 5 of 12
    rewards = [0, 0, 0.75, 1, 1, 0, 0.75, 1, 0, 1, 1, 0.75]
    scorer = Mopps(prior_alpha=3.33, prior_beta=2.68)
    history = mopps_history(scorer)
    record_group(history, rewards)
    assert history.fields(torch.tensor([0]))["history_beta_posterior"][0].tolist() == pytest.approx([8.33, 9.68])
    # a named threshold: at least 0.75 counts 8 of 12 (the bus's other methods count rewards above 0.5)
    lenient = Mopps(prior_alpha=3.33, prior_beta=2.68, success_min=0.75)
    history = mopps_history(lenient)
    record_group(history, rewards)
    assert history.fields(torch.tensor([0]))["history_beta_posterior"][0].tolist() == pytest.approx([11.33, 6.68])
    with pytest.raises(ConfigError, match="success_min"):
        Mopps(success_min=float("nan"))


def test_m6_posterior_moments():
    for (a, b), (mean, var) in {(1, 1): (0.5, 0.083333), (4, 6): (0.4, 0.021818), (6.5, 7.5): (0.464286, 0.016582),
                                (1, 9): (0.1, 0.008182)}.items():
        assert a / (a + b) == pytest.approx(mean, abs=1e-6)
        assert a * b / ((a + b) ** 2 * (a + b + 1)) == pytest.approx(var, abs=1e-6)


def mopps_candidates(draws: list[float], needed: int) -> tuple[Batch, Mopps]:
    n = len(draws)
    scorer = Mopps()
    scorer.draw = lambda alpha, beta: torch.tensor(draws, dtype=torch.float64)  # type: ignore[method-assign]
    batch = Batch.from_tensors(uid=torch.arange(n), prompt_index=torch.arange(n),
                               history_beta_posterior=torch.ones(n, 2, dtype=torch.float64),
                               budget_prompts=torch.tensor(needed))
    return batch, scorer


def kept(draws: list[float], needed: int, **params) -> list[int]:
    batch, scorer = mopps_candidates(draws, needed)
    for k, v in params.items():
        setattr(scorer, k, v)
    keep = TopB().select(batch, scorer.score(batch, 0), 0).keep
    return torch.nonzero(keep).flatten().tolist()


def test_m4_top_b_keeps_the_draws_closest_to_the_target_stable_ties():
    # distances [0.16, 0.0025, 0.16, 0.0625, 0, 0.0625]: official [4, 1, 5], [4, 1, 3] equally valid (tie)
    assert kept([0.1, 0.45, 0.9, 0.25, 0.5, 0.75], 3) == [1, 3, 4]


def test_m5_threshold_strategy_keeps_the_band_then_the_nearest():
    draws = [0.1, 0.45, 0.9, 0.25, 0.5, 0.75]
    assert kept(draws, 4, strategy="threshold") == [1, 3, 4, 5]
    assert kept(draws, 2, strategy="threshold") == [1, 4]


def test_mopps_draws_are_reproducible_from_its_state():
    a = Mopps(seed=3)
    alpha, beta = torch.tensor([1.0, 4.0]), torch.tensor([1.0, 6.0])
    state = a.state_dict()
    first = a.draw(alpha, beta)
    b = Mopps(seed=99)
    b.load_state_dict(state)
    assert b.draw(alpha, beta).tolist() == first.tolist()
    assert not math.isclose(float(a.draw(alpha, beta)[0]), float(first[0]))


def test_mopps_posterior_lives_in_the_history_and_round_trips():
    table = PromptTable.full(["d"], [3], column="row")
    history = PromptHistory(table)
    scorer = Mopps(decay=0.5)
    history.own(scorer.prompt_state(), scorer.update_prompt_state)
    # prompt 1 visited twice in one batch (two groups): two updates, in order
    batch = Batch.from_tensors(uid=torch.tensor([0, 0, 1, 1, 2, 2]), prompt_index=torch.tensor([1, 1, 1, 1, 2, 2]),
                               rm_scores=torch.tensor([1.0, 0, 1, 1, 0, 0])[:, None],
                               response_mask=torch.ones(6, 1, dtype=torch.long))
    history.record(batch, 0)
    state = history.fields(torch.arange(3))["history_beta_posterior"]
    # prompt 1: (1,1) -> (0.5+0.5+1, 0.5+0.5+1) = (2, 2) -> (1+0.5+2, 1+0.5+0) = (3.5, 1.5); prompt 2: (1, 3)
    assert state.tolist() == [[1.0, 1.0], [3.5, 1.5], [1.0, 3.0]]
    again = PromptHistory(table)
    again.own(scorer.prompt_state(), scorer.update_prompt_state)
    again.load_state_dict(history.state_dict())
    assert again.fields(torch.arange(3))["history_beta_posterior"].tolist() == state.tolist()
    other = PromptHistory(table)
    with pytest.raises(ConfigError, match="per-prompt state"):
        other.load_state_dict(history.state_dict())
    with pytest.raises(ConfigError, match="another dataset"):
        moved = PromptHistory(PromptTable.full(["d"], [4], column="row"))
        moved.own(scorer.prompt_state(), scorer.update_prompt_state)
        moved.load_state_dict(history.state_dict())


@pytest.mark.parametrize("success_min", ["-1", "0", "2", "1e300"])
def test_mopps_success_min_outside_the_reward_range_is_refused_naming_the_key(capsys, success_min):
    """Rewards lie in [0, 1] (the authors' acc): a success_min at or below 0 counts every rollout a success, one
    above 1 none, so every posterior would drift to one end; refused by the real CLI, naming the key."""
    from pathlib import Path

    from dataflex_bus.cli import main

    example = str(Path(__file__).parents[2] / "examples" / "mopps.yaml")
    assert main(["validate", example, f"dataflex.scorer.params.success_min={success_min}"]) == 2
    err = capsys.readouterr().err
    assert "dataflex.scorer.params.success_min" in err and "(0, 1]" in err and "Traceback" not in err
    assert main(["validate", example, "dataflex.scorer.params.success_min=0.75"]) == 0
