"""GFPO selector (contrib/dataflex-gfpo): hand-computed selections and advantages, vectorised == loop."""

import math

import pytest
import torch
from dataflex_gfpo.selector import GFPO, keep_counts, rank_in_group

from dataflex_bus import Batch, Score
from dataflex_bus.errors import ConfigError
from dataflex_bus.host import ANY_HOST
from dataflex_bus.testing import apply_method, check_selector, make_batch

EPS = 1e-6


def _batch(groups, lengths, rewards, padding=0):
    """Rows listed group by group; ``padding`` empty rows at the end."""
    uid = [f"g{g}" for g, size in enumerate(groups) for _ in range(size)] + [f"pad{i}" for i in range(padding)]
    lens = torch.tensor(list(lengths) + [0] * padding)
    T = int(lens.max())
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    rm = torch.zeros(len(uid), T)
    r = torch.tensor([float(v) for v in rewards] + [0.0] * padding)
    rm[torch.arange(len(uid)), (lens - 1).clamp_min(0)] = r
    rm[lens == 0] = 0
    return Batch.from_tensors(uid=uid, is_padding=[False] * sum(groups) + [True] * padding,
                              response_mask=mask, rm_scores=rm)


def _select(batch, **params):
    return GFPO(**params).select(batch, Score(batch.rewards, "response"), 0)


def test_length_keeps_the_k_shortest_and_recomputes_advantages_on_them():
    b = _batch([4], lengths=[5, 3, 8, 2], rewards=[1, 0, 1, 1])
    sel = _select(b, metric="length", k=2)
    assert sel.keep.tolist() == [False, True, False, True]
    # kept rewards [0, 1]: mean 0.5, unbiased std sqrt(0.5)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    row_adv = sel.advantages.sum(-1) / b.lengths.clamp_min(1)
    assert torch.allclose(row_adv, torch.tensor([0.0, -a, 0.0, a]), atol=1e-6)
    # broadcast over the row's real tokens only, 0 elsewhere
    assert torch.equal(sel.advantages != 0, b.token_mask & sel.keep[:, None])


def test_reward_per_token_keeps_the_most_efficient():
    b = _batch([4], lengths=[5, 3, 8, 2], rewards=[1, 0, 1, 1])
    sel = _select(b, metric="reward_per_token", k=2)
    # r/L = 0.2, 0, 0.125, 0.5 -> rows 3 and 0; both rewarded -> std 0 -> advantage 0
    assert sel.keep.tolist() == [True, False, False, True]
    assert torch.count_nonzero(sel.advantages) == 0


def test_ties_resolve_by_row_and_singletons_get_zero_advantage():
    b = _batch([3, 1, 2], lengths=[4, 4, 4, 7, 6, 2], rewards=[0, 1, 0, 1, 1, 0], padding=2)
    sel = _select(b, metric="length", k=2)
    assert sel.keep.tolist() == [True, True, False, True, True, True, False, False]
    row_adv = sel.advantages.sum(-1) / b.lengths.clamp_min(1)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    # group 0 keeps rows 0, 1 (tie on length: lower row first); the singleton's kept set is itself -> 0
    assert torch.allclose(row_adv, torch.tensor([-a, a, 0.0, 0.0, a, -a, 0.0, 0.0]), atol=1e-6)


def test_keep_fraction_rounds_half_up_with_at_least_one():
    sizes = torch.tensor([4, 3, 1, 5, 2])
    assert keep_counts(sizes, None, 0.5).tolist() == [2, 2, 1, 3, 1]  # 1.5 -> 2, 2.5 -> 3, 1.0 -> 1
    assert keep_counts(sizes, None, 0.1).tolist() == [1, 1, 1, 1, 1]
    assert keep_counts(sizes, None, 1.0).tolist() == [4, 3, 1, 5, 2]
    assert keep_counts(sizes, 3, None).tolist() == [3, 3, 1, 3, 2]


def test_rank_in_group_is_lexicographic_and_ignores_padding():
    key = torch.tensor([3.0, 1.0, 1.0, 0.0, 9.0, 2.0])
    gi = torch.tensor([1, 0, 1, 0, -1, 1])
    assert rank_in_group(key, gi, 2).tolist() == [2, 1, 0, 0, -1, 1]


def _reference(batch, metric, k=None, fraction=None, eps=EPS):
    """Per-group Python loop of the paper's definition."""
    keep = torch.zeros(len(batch), dtype=torch.bool)
    adv = torch.zeros(len(batch), dtype=torch.float64)
    r, L, gi = batch.rewards.double(), batch.lengths, batch.group_index
    for g in range(batch.num_groups):
        rows = [i for i in range(len(batch)) if gi[i] == g]
        if metric == "length":
            rows.sort(key=lambda i: (int(L[i]), i))
        else:
            rows.sort(key=lambda i: (-float(r[i]) / max(int(L[i]), 1), i))
        m = min(k, len(rows)) if k is not None else min(max(math.floor(fraction * len(rows) + 0.5), 1), len(rows))
        kept = rows[:m]
        vals = r[kept]
        mean = vals.mean()
        std = vals.std() if m > 1 else torch.tensor(1.0, dtype=torch.float64)
        for i in kept:
            keep[i] = True
            adv[i] = (r[i] - mean) / (std + eps)
    return keep, adv


@pytest.mark.parametrize("metric", ["length", "reward_per_token"])
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_equals_per_group_loop(metric, seed):
    b = make_batch(groups=7, group_size=6, mixed_group_sizes=True, padding_rows=3, max_len=6, seed=seed)
    params = {"k": 3} if seed % 2 else {"keep_fraction": 0.4}
    sel = _select(b, metric=metric, **params)
    keep, adv = _reference(b, metric, params.get("k"), params.get("keep_fraction"))
    assert torch.equal(sel.keep, keep)
    row_adv = sel.advantages.double().sum(-1) / b.lengths.clamp_min(1)
    assert torch.allclose(row_adv, adv, atol=1e-5)


def test_contract_and_padding():
    check_selector(GFPO(k=2))
    check_selector(GFPO(metric="reward_per_token", keep_fraction=0.5))


def test_parameters_are_checked():
    with pytest.raises(ConfigError, match="set either k"):
        GFPO()
    with pytest.raises(ConfigError, match="only one of k and keep_fraction"):
        GFPO(k=2, keep_fraction=0.5)
    with pytest.raises(ConfigError, match="metric"):
        GFPO(k=2, metric="shortest")
    with pytest.raises(ConfigError, match="keep_fraction"):
        GFPO(keep_fraction=0.0)


def test_through_the_pipeline_by_name(contrib_components):
    b = make_batch(groups=4, group_size=4, padding_rows=2, seed=3)
    block = {"mechanism": "select", "scorer": {"name": "outcome_reward"},
             "actuator": {"name": "gfpo", "params": {"metric": "length", "k": 2}}}
    decision = apply_method(block, b)
    assert int(decision.keep.sum()) == 8
    assert decision.advantages is not None
    assert decision.metrics["dataflex/kept_rows"] == 8.0
    assert "dataflex/gfpo/kept_mean_length" in decision.metrics
    assert decision.metrics["dataflex/gfpo/kept_mean_length"] <= decision.metrics["dataflex/gfpo/all_mean_length"]


def test_a_k_that_keeps_every_row_is_warned_before_training(contrib_components):
    from dataflex_bus import validate

    def block(k):
        return {"mechanism": "select", "scorer": {"name": "outcome_reward"},
                "actuator": {"name": "gfpo", "params": {"k": k}}}

    warned = validate(block(8), host=ANY_HOST.replace(**{"group_size": 8})).warnings
    assert any("keeps every row" in str(w) for w in warned)
    assert not validate(block(4), host=ANY_HOST.replace(**{"group_size": 8})).warnings
