"""TRL 1.16's GRPO advantages over groups of any sizes (an allocation's ragged groups).

TRL computes its advantages in ``_generate_and_score_completions`` on ``rewards.view(-1, num_generations)``:
every group the same size, contiguous. Here the same formulas run on a dense ``[groups, largest group]``
layout padded with NaN, through TRL's own NaN-aware reductions (``torch.nanmean`` and TRL's ``nanstd``), so
that equal contiguous groups give TRL's numbers bit for bit and ragged groups the same formula per group:
``(r - mean_g) / (std_g + 1e-4)`` (``scale_rewards="group"``), the batch std (``"batch"``) or no scaling
(``"none"``), and both ``multi_objective_aggregation`` modes. A group of one has no baseline: its advantage
is 0 (TRL's NaN std there, turned to 0 as TRL turns every NaN advantage). Rows every reward function
returned ``None`` for are left out of their group's statistics and get 0, as in TRL.
"""

from __future__ import annotations

import torch
from torch import Tensor
from trl.trainer.utils import nanstd

from ..kit import segment_slots

#: TRL's constant in the advantage's denominator.
EPS = 1e-4


def dense(values: Tensor, groups: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """``values`` (``[R, ...]``) laid out as ``[num_groups, largest group, ...]`` padded with NaN, and each row's
    slot in its group."""
    slots = segment_slots(groups, num_groups)
    width = int(slots.max()) + 1 if slots.numel() else 1
    out = values.new_full((num_groups, width, *values.shape[1:]), float("nan"))
    out[groups, slots] = values
    return out, slots


def trl_advantages(rewards_per_func: Tensor, groups: Tensor, num_groups: int, reward_weights: Tensor, *,
                   scale_rewards: str = "group",
                   aggregation: str = "sum_then_normalize") -> tuple[Tensor, Tensor]:
    """``(advantages [R], std_is_zero [R])`` of rows with rewards ``rewards_per_func`` (``[R, F]``, one column per
    reward function, NaN where a function returned ``None``) in groups ``groups`` (``[R]``, ids in
    ``[0, num_groups)``), as TRL computes them (see the module doc); ``std_is_zero`` is what TRL logs as
    ``frac_reward_zero_std``."""
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        grid, slots = dense(rewards, groups, num_groups)
        mean = torch.nanmean(grid, dim=1)[groups]
        if scale_rewards in ("group", "none"):
            std = nanstd(grid, dim=1)[groups] if grid.size(1) > 1 else torch.zeros_like(rewards)
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards={scale_rewards!r}: TRL allows 'batch', 'group' or 'none'")
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + EPS)
    elif aggregation == "normalize_then_sum":
        grid, slots = dense(rewards_per_func, groups, num_groups)
        mean_k = torch.nanmean(grid, dim=1, keepdim=True)
        std_k = nanstd(grid, dim=1, keepdim=True) if grid.size(1) > 1 else torch.zeros_like(mean_k)
        reward_k = ((grid - mean_k) / (std_k + EPS))[groups, slots]
        rewards = (reward_k * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + EPS)
    else:
        raise ValueError(f"multi_objective_aggregation={aggregation!r}: TRL allows 'sum_then_normalize' or "
                         "'normalize_then_sum'")
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), std_is_zero
