"""Every built-in method through real entry-point discovery: the five seed configs, wiring, validation,
empty selections and non-finite policies."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus.block import DataflexConfig
from dataflex_bus.errors import BatchFieldError, ConfigError, DataflexError
from dataflex_bus.host import ANY_HOST
from dataflex_bus.pipeline import build_pipeline, validate

from .helpers import batch_of, pipe

SEEDS = {
    "difficulty_filter": {"mechanism": "select",
                          "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
                          "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}},
                          "warmup_step": 0},
    "topk_advantage": {"mechanism": "select",
                       "scorer": {"name": "advantage_magnitude", "params": {"agg": "mean"}},
                       "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}}},
    "advantage_reweight": {"mechanism": "reweight", "scorer": {"name": "token_prob"},
                           "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.3}}},
    "max_variance": {"mechanism": "select", "scorer": {"name": "reward_difficulty"},
                     "actuator": {"name": "max_variance", "params": {"keep_fraction": 0.5}}},
    "dump": {"mechanism": "mix", "scorer": {"name": "advantage_magnitude", "params": {"agg": "mean"}},
             "actuator": {"name": "dump_ucb", "params": {"c": 1.0, "window": 300, "temperature": 0.1}}},
}

EVENTS = {"difficulty_filter": "on_rollout", "topk_advantage": "on_advantage",
          "advantage_reweight": "on_advantage", "max_variance": "on_advantage", "dump": "on_step_end"}


def _grpo_batch(groups=6, size=5, padding=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [0, 1, 2, 3, 4, 5][:groups]
    rewards, uid, doms = [], [], []
    for i, k in enumerate(ks):
        rewards += [1.0] * k + [0.0] * (size - k)
        uid += [f"p{i}"] * size
        doms += [["math", "code", "logic"][i % 3]] * size
    rewards += [1.0] * padding
    uid += ["pad"] * padding
    doms += ["math"] * padding
    lengths = torch.randint(1, 9, (len(rewards),), generator=g).tolist()
    return batch_of(rewards, uid, lengths=lengths, tokens=8, domains=doms,
                    padding=[False] * (groups * size) + [True] * padding)


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_configs_validate_build_and_run(name):
    block = SEEDS[name]
    cfg = validate(block, host=ANY_HOST.replace(**{"adv_estimator": "grpo", "group_size": 5}))
    assert isinstance(cfg, DataflexConfig)
    p = build_pipeline(block)
    assert p.event == EVENTS[name]
    assert p.provenance["scorer"].startswith("dataflex-bus") or ":" in p.provenance["scorer"]
    b = _grpo_batch()
    d = p.apply(b, 0)
    if name == "difficulty_filter":
        # G=5, k = 0..5: inclusive [0.2, 0.8] keeps k = 1..4 -> 4 groups, 20 rows; padding never kept
        assert int(d.keep.sum()) == 20 and d.keep.view(-1)[:5].sum() == 0 and not bool(d.keep[-2:].any())
        assert d.metrics["dataflex/kept_groups"] == 4.0
    elif name == "topk_advantage":
        assert int(d.keep.sum()) == 15 and not bool(d.keep[-2:].any())
    elif name == "advantage_reweight":
        tm = b.token_mask
        expected = 0.3 * torch.exp(b["old_log_probs"]) + 0.7
        assert torch.allclose(d.weights[tm], expected[tm]) and bool((d.weights[~tm] == 1).all())
    elif name == "max_variance":
        assert int(d.keep.sum()) == 6 * 3 and d.advantages is not None
        kept_adv = d.advantages[:, 0].view(-1)[:30].view(6, 5)
        assert torch.allclose(kept_adv.sum(1), torch.zeros(6), atol=1e-5)
    else:
        assert set(d.domain_probs) == {"math", "code", "logic"}
        assert sum(d.domain_probs.values()) == pytest.approx(1.0)


ALL_METHODS = [
    ("select", "group_solve_rate", "threshold_band", {"low": 0.2, "high": 0.8}),
    ("select", "reward_difficulty", "threshold_band", {"low": 0.5, "high": 2.0}),
    ("select", "reward_difficulty", "dapo", {}),
    ("select", "group_solve_rate", "dapo", {}),
    ("select", "advantage_magnitude", "topk_fraction", {"fraction": 0.3}),
    ("select", "group_solve_rate", "topk_fraction", {"fraction": 0.5, "largest": False}),
    ("select", "reward_difficulty", "max_variance", {"keep_fraction": 0.5}),
    ("select", "advantage_magnitude", "max_variance", {"keep_fraction": 0.6}),
    ("reweight", "token_prob", "advantage_reweight", {"alpha": 0.2}),
    ("reweight", "reward_difficulty", "softmax", {"temperature": 0.5}),
    ("reweight", "group_solve_rate", "softmax", {"normalize": "token"}),
    ("reweight", "advantage_magnitude", "per_advantage", {}),
    ("mix", "advantage_magnitude", "dump_ucb", {}),
    ("mix", "group_solve_rate", "dump_ucb", {"window": 2}),
    ("mix", "reward_difficulty", "reward_gap", {"floor": 0.05}),
    ("mix", "reward_difficulty", "static", {"proportions": {"math": 1, "code": 1, "logic": 2}}),
]


@pytest.mark.parametrize(("mechanism", "scorer", "actuator", "params"), ALL_METHODS)
def test_every_method_runs_through_the_pipeline(mechanism, scorer, actuator, params):
    p = pipe(mechanism, scorer, actuator, actuator_params=params)
    b = _grpo_batch()
    d = p.apply(b, 0)
    if mechanism == "select":
        assert d.keep is not None and not bool(d.keep[-2:].any())
        if (actuator in ("threshold_band", "dapo") and scorer == "group_solve_rate") or actuator == "dapo":
            # group-level decisions keep whole groups
            g = b.group_index
            for grp in range(b.num_groups):
                rows = d.keep[g == grp]
                assert bool(rows.all()) or not bool(rows.any())
    elif mechanism == "reweight":
        assert d.weights.shape == b.token_mask.shape and bool(torch.isfinite(d.weights).all())
        assert bool((d.weights >= 0).all())
    else:
        assert sum(d.domain_probs.values()) == pytest.approx(1.0)
        for dname in ("math", "code", "logic"):
            assert f"dataflex/domain_prob/{dname}" in d.metrics


@pytest.mark.parametrize(("mechanism", "scorer", "actuator", "match"), [
    ("select", "token_prob", "threshold_band", "token-level"),
    ("select", "token_prob", "topk_fraction", "token-level"),
    ("select", "token_prob", "max_variance", "token-level"),
    ("mix", "token_prob", "dump_ucb", "token-level"),
    ("reweight", "reward_difficulty", "advantage_reweight", "response-level"),
    ("reweight", "group_solve_rate", "advantage_reweight", "prompt-level"),
    ("reweight", "reward_difficulty", "max_variance", "needs a reweighter"),
    ("select", "reward_difficulty", "dump_ucb", "needs a selector"),
])
def test_impossible_combinations_are_rejected(mechanism, scorer, actuator, match):
    block = {"mechanism": mechanism, "scorer": {"name": scorer}, "actuator": {"name": actuator}}
    with pytest.raises(ConfigError, match=match):
        validate(block)


def test_group_methods_refuse_non_group_estimators():
    with pytest.raises(ConfigError, match="group"):
        validate(SEEDS["difficulty_filter"], host=ANY_HOST.replace(**{"adv_estimator": "gae"}))
    with pytest.raises(ConfigError, match="n=1"):
        validate(SEEDS["max_variance"], host=ANY_HOST.replace(**{"group_size": 1}))


def test_mixer_domain_rules_are_checked_at_validation():
    block = {"mechanism": "mix", "scorer": {"name": "reward_difficulty"},
             "actuator": {"name": "reward_gap", "params": {"floor": 0.3}}, "domains": ["a", "b", "c", "d"]}
    with pytest.raises(ConfigError, match="floor"):
        validate(block)
    block = {"mechanism": "mix", "scorer": {"name": "reward_difficulty"},
             "actuator": {"name": "static", "params": {"proportions": {"a": 1}}}, "domains": ["a", "b"]}
    with pytest.raises(ConfigError, match=r"\['b'\]"):
        validate(block)


@pytest.mark.parametrize(("policy", "expect"), [("skip", "skip"), ("keep_all", "all"), ("error", "raise")])
def test_empty_selection_follows_on_empty(policy, expect):
    block = {**SEEDS["difficulty_filter"], "on_empty": policy}
    p = build_pipeline(block)
    b = batch_of([1, 1, 0, 0], ["a", "a", "b", "b"])  # all groups uniform -> nothing in the band
    if expect == "raise":
        with pytest.raises(DataflexError, match="kept no row"):
            p.apply(b, 0)
        return
    d = p.apply(b, 0)
    assert d.metrics["dataflex/empty_selection"] == 1.0
    if expect == "skip":
        assert d.skip_update and d.keep is not None and not bool(d.keep.any())
    else:
        assert not d.skip_update and d.keep is None


def test_nan_reward_cannot_hide_in_a_solve_rate():
    b = batch_of([1.0, float("nan"), 0.0, 1.0, 0.0, 1.0], ["a"] * 3 + ["b"] * 3)
    with pytest.raises(BatchFieldError, match=r"group_solve_rate.*rows \[1\]"):
        build_pipeline(SEEDS["difficulty_filter"]).apply(b, 0)
    # on_nonfinite=drop: the row becomes padding, the group is rescored without it (k=1 of G=2)
    d = build_pipeline({**SEEDS["difficulty_filter"], "on_nonfinite": "drop"}).apply(b, 0)
    assert d.keep.tolist() == [True, False, True, True, True, True]
    assert d.metrics["dataflex/nonfinite_rows"] == 1.0


def test_nan_reward_in_dapo_is_reported():
    b = batch_of([1.0, float("nan"), 0.0, 1.0], ["a", "a", "b", "b"], advantages=torch.ones(4, 6))
    p = pipe("select", "advantage_magnitude", "dapo")
    with pytest.raises(DataflexError, match="dapo"):
        p.apply(b, 0)


def test_warmup_skips_select_and_reweight():
    p = build_pipeline({**SEEDS["max_variance"], "warmup_step": 3})
    d = p.apply(_grpo_batch(), 1)
    assert d.keep is None and d.advantages is None


def test_bool_and_float_masks_give_the_same_decisions():
    rewards = [1, 0, 0, 1, 1, 0, 1, 1]
    uid = ["a"] * 4 + ["b"] * 4
    lengths = [3, 5, 1, 6, 2, 2, 4, 6]
    ref = None
    for dt in (torch.long, torch.bool, torch.float32):
        b = batch_of(rewards, uid, lengths=lengths, mask_dtype=dt)
        d = build_pipeline(SEEDS["max_variance"]).apply(b, 0)
        assert b.lengths.tolist() == lengths
        if ref is None:
            ref = d
        assert torch.equal(d.keep, ref.keep) and torch.allclose(d.advantages, ref.advantages)
