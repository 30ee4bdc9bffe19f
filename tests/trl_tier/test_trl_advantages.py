"""The TRL host's advantages over groups of any size (``trl_advantages``) against TRL 1.16's own formula on
equal contiguous groups (bit for bit), and per group on ragged, scattered groups."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch
from trl.trainer.utils import nanstd

from dataflex_bus.trl.advantages import trl_advantages

pytestmark = pytest.mark.trl

MODES = [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"),
         ("group", "normalize_then_sum")]


def trl_view(rpf: torch.Tensor, w: torch.Tensor, G: int, scale: str, aggregation: str) -> torch.Tensor:
    """TRL 1.16's ``_generate_and_score_completions`` advantages (groups of ``G`` contiguous rows)."""
    unscorable = torch.isnan(rpf).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rpf * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        if scale in ("group", "none"):
            std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        else:
            std = nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = rpf.view(-1, G, rpf.size(1))
        reward_k = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True))
                    / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)).view(-1, rpf.size(1))
        rewards = (reward_k * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        adv = (rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def rewards(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.rand(rows, 2, generator=g)
    out[3] = float("nan")  # unscorable: every function returned None
    out[6, 1] = float("nan")  # one function did not apply
    return out


@pytest.mark.parametrize(("scale", "aggregation"), MODES)
def test_equal_contiguous_groups_are_trls_advantages_bit_for_bit(scale, aggregation):
    rpf, w = rewards(24), torch.tensor([1.0, 0.5])
    got, _ = trl_advantages(rpf, torch.arange(24) // 4, 6, w, scale_rewards=scale, aggregation=aggregation)
    assert torch.equal(got, trl_view(rpf, w, 4, scale, aggregation))


@pytest.mark.parametrize(("scale", "aggregation"), MODES)
def test_scattered_ragged_groups_are_each_groups_own(scale, aggregation):
    """Groups of 5, 2 and 3 rows, interleaved: each row's advantage is what the same rows give laid out
    contiguously (padded with unscorable rows to one size, which no statistic counts)."""
    groups = torch.tensor([0, 1, 0, 2, 0, 1, 2, 0, 2, 0])
    rpf, w = rewards(10), torch.tensor([1.0, 2.0])
    rpf[3] = torch.tensor([0.3, 0.1])
    got, _ = trl_advantages(rpf, groups, 3, w, scale_rewards=scale, aggregation=aggregation)
    order = torch.sort(groups, stable=True).indices
    padded = torch.full((15, 2), float("nan"))
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 10, 11, 12])
    padded[slots] = rpf[order]
    want = trl_view(padded, w, 5, scale, aggregation)[slots]
    assert torch.allclose(got[order], want, atol=1e-6, rtol=0)


def test_a_group_of_one_and_an_unscorable_row_get_zero():
    rpf = torch.tensor([[1.0], [0.0], [1.0], [float("nan")], [0.5]])
    adv, std_zero = trl_advantages(rpf, torch.tensor([0, 0, 1, 2, 2]), 3, torch.ones(1))
    assert adv[2] == 0 and adv[3] == 0 and adv[4] == 0  # group of one; group of one scorable row
    assert adv[0] > 0 > adv[1]
    assert not bool(torch.isnan(adv).any())
    assert std_zero.tolist() == [False, False, False, False, False]
    flat, std_zero = trl_advantages(torch.ones(4, 1), torch.tensor([0, 0, 1, 1]), 2, torch.ones(1))
    assert bool((flat == 0).all()) and bool(std_zero.all())


def test_an_unknown_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match="scale_rewards='mean'"):
        trl_advantages(torch.ones(2, 1), torch.tensor([0, 0]), 1, torch.ones(1), scale_rewards="mean")
    with pytest.raises(ValueError, match="multi_objective_aggregation='avg'"):
        trl_advantages(torch.ones(2, 1), torch.tensor([0, 0]), 1, torch.ones(1), aggregation="avg")
