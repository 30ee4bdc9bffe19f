"""The built-in replayer ``rollout_replay`` against the spec's vectors from RePO's code (methods.md P6.2: R1-R5)
and its picks' properties (DOTS's D1-D5 are the host kit's: tests/foundation/test_replay.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflex_bus.components import ReplayPool
from dataflex_bus.errors import ConfigError
from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.pipeline import build_component


def replayer(**params):
    return build_component("actuator", "rollout_replay", params)


def pool(rewards, want=None, segments=None, groups=0, seq=None):
    """One segment (or ``segments``) of stored rows, oldest first, priority = reward."""
    r = torch.tensor(rewards, dtype=torch.float32)
    seg = torch.zeros(len(rewards), dtype=torch.long) if segments is None else torch.tensor(segments)
    num = int(seg.max()) + 1
    w = torch.tensor([want] * num if isinstance(want, int) else (want or [0] * num))
    return ReplayPool(segment=seg, num_segments=num, want=w, groups=groups, reward=r, priority=r.clone(),
                      seq=torch.arange(len(rewards)) if seq is None else torch.tensor(seq),
                      age=torch.ones(len(rewards), dtype=torch.long))


R_BUFFER = [1.0, 0.0, 1.0, 0.0, 0.0]  # oldest -> newest


def test_r1_highest_k_is_a_stable_sort_by_reward_descending():
    pick = replayer(unit="prompt", priority="highest").pick(pool(R_BUFFER, want=3), 0)
    assert pick.rows.tolist() == [0, 2, 1]
    assert [R_BUFFER[i] for i in pick.rows.tolist()] == [1, 1, 0]


def test_r2_recent_k_is_the_newest_k_in_stored_order():
    assert replayer(unit="prompt", priority="recent").pick(pool(R_BUFFER, want=3), 0).rows.tolist() == [2, 3, 4]


def test_r3_max_variance_k_is_the_first_maximal_subset_in_lexicographic_order():
    rows = replayer(unit="prompt", priority="max_variance").pick(pool(R_BUFFER, want=3), 0).rows.tolist()
    assert tuple(rows) == (0, 1, 2)
    values = torch.tensor([R_BUFFER[i] for i in rows])
    assert float(values.var(unbiased=False)) == pytest.approx(0.222222, abs=1e-6) and float(values.sum()) == 2


def brute_force_max_variance(values: list[float], k: int) -> tuple[int, ...]:
    """RePO's ``max_variance_k``: exhaustive over the k-subsets, population variance, larger sum among ties,
    the first in lexicographic order among what is left."""
    best, best_key = None, None
    for combo in itertools.combinations(range(len(values)), k):
        v = [values[i] for i in combo]
        mean = sum(v) / k
        key = (round(sum((x - mean) ** 2 for x in v) / k, 9), round(sum(v), 9))
        if best_key is None or key > best_key:
            best, best_key = combo, key
    assert best is not None
    return best


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=9), st.data())
def test_max_variance_pick_equals_repos_exhaustive_search(values, data):
    k = data.draw(st.integers(1, len(values)))
    rows = replayer(unit="prompt", priority="max_variance").pick(pool([float(v) for v in values], want=k), 0).rows
    assert tuple(sorted(rows.tolist())) == brute_force_max_variance([float(v) for v in values], k)


def test_per_prompt_picks_are_made_per_segment_at_once():
    # two prompts' rows in one pool: highest per prompt, segment by segment
    p = pool([0.0, 1.0, 1.0, 0.0, 0.5], want=[1, 2], segments=[0, 0, 0, 1, 1])
    assert replayer(unit="prompt", priority="highest").pick(p, 0).rows.tolist() == [1, 4, 3]
    uniform = replayer(unit="prompt", priority="uniform", seed=3).pick(p, 0).rows
    assert sorted(torch.bincount(p.segment[uniform], minlength=2).tolist()) == [1, 2]


def test_r4_split_advantages_normalise_fresh_and_replayed_rows_apart():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    split = grpo_outcome_advantage(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1]), 2, eps=1e-4)
    assert split[:4].tolist() == pytest.approx([0.865875, -0.865875, -0.865875, 0.865875], abs=1e-6)
    assert split[4:].tolist() == pytest.approx([0.57725, 0.57725, -1.154501], abs=1e-6)


def test_r5_mixed_advantages_normalise_over_fresh_and_replayed_rows():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    mixed = grpo_outcome_advantage(rewards, torch.zeros(7, dtype=torch.long), 1, eps=1e-4)
    assert mixed.tolist() == pytest.approx([0.801634, -1.068845, -1.068845, 0.801634, 0.801634, 0.801634,
                                            -1.068845], abs=1e-6)


# ---------------------------------------------------------------------------- groups (DOTS)
def group_pool(groups: list[list[float]], planned: int, seq=None) -> ReplayPool:
    segments = [g for g, rows in enumerate(groups) for _ in rows]
    return pool([r for rows in groups for r in rows], segments=segments, groups=planned, seq=seq)


def test_uniform_group_pick_draws_whole_groups_without_replacement_from_the_seeded_generator():
    p = group_pool([[1, 0]] * 6, planned=3)
    a, b = replayer(priority="uniform", fresh_fraction=0.5), replayer(priority="uniform", fresh_fraction=0.5)
    first = a.pick(p, 0).rows
    assert first.tolist() == b.pick(p, 0).rows.tolist()  # the same seed: the same groups
    chosen = torch.unique(p.segment[first])
    assert chosen.numel() == 3 and torch.bincount(p.segment[first]).max() == 2
    state = a.state_dict()
    again = a.pick(p, 2).rows
    a.load_state_dict(state)
    assert a.pick(p, 2).rows.tolist() == again.tolist()


def test_group_priorities_rank_whole_groups():
    groups = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    rows = replayer(priority="highest", fresh_fraction=0.5).pick(group_pool(groups, 1), 0).rows
    assert rows.tolist() == [4, 5]
    rows = replayer(priority="max_variance", fresh_fraction=0.5).pick(group_pool(groups, 2), 0).rows
    assert rows.tolist() == [2, 3, 6, 7]  # the two mixed groups, older first (TRL keeps high-std groups)
    rows = replayer(priority="recent", fresh_fraction=0.5).pick(group_pool(groups, 1), 0).rows
    assert rows.tolist() == [6, 7]


def test_proportional_picks_carry_pers_importance_weights():
    p = pool([4.0, 1.0, 1.0, 1.0], want=2)
    pick = replayer(unit="prompt", priority="proportional", alpha=1.0, beta=1.0, eps=1e-12, seed=0).pick(p, 0)
    assert pick.weights is not None and pick.rows.numel() == 2
    probs = torch.tensor([4.0, 1.0, 1.0, 1.0]) / 7
    w = (4 * probs[pick.rows]) ** -1.0
    assert pick.weights.tolist() == pytest.approx((w / w.max()).tolist(), rel=1e-5)


# ---------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("params, key", [
    ({"unit": "prompt", "fresh_fraction": 0.5}, "fresh_fraction"),
    ({"unit": "group", "fresh_fraction": 1.0}, "fresh_fraction"),
    ({"unit": "prompt", "per_prompt": 4, "min_to_replay": 8}, "min_to_replay"),
    ({"priority": "oldest"}, "priority"),
    ({"is_cap": 0.0}, "is_cap"),
])
def test_parameters_that_cannot_replay_are_refused_naming_the_key(params, key):
    from dataflex_bus.validation import validate

    block = {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
             "actuator": {"name": "rollout_replay", "params": {"fresh_fraction": 0.5, **params}}}
    with pytest.raises(ConfigError) as err:
        validate(block)
    assert f"dataflex.actuator.params.{key}" in str(err.value)


def test_the_defaults_are_a_valid_configuration_of_each_unit():
    from dataflex_bus.validation import validate

    for unit, share in (("group", 0.5), ("prompt", 1.0)):
        cfg = validate({"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
                        "actuator": {"name": "rollout_replay", "params": {"unit": unit}}})
        assert cfg.methods[0].resolved is not None
        assert replayer(unit=unit).settings().fresh_fraction == share
