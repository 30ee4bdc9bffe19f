"""Whole-tensor segment operations shared by the methods, the shim and the verl adapter.

Everything here works on flat tensors with a segment (group) index per row; there is no Python loop over
groups or rows. Rows whose index is negative (padding) are ignored by every reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _clean_index(index: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """Map negative (padding) indices to an extra trash segment ``num_segments``."""
    valid = index >= 0
    return torch.where(valid, index, torch.full_like(index, num_segments)), valid


def segment_sum(values: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Sum of ``values`` rows per segment; rows with ``index < 0`` are ignored."""
    idx, _ = _clean_index(index, num_segments)
    out = values.new_zeros((num_segments + 1, *values.shape[1:]))
    out.index_add_(0, idx, values)
    return out[:num_segments]


def segment_count(index: Tensor, num_segments: int) -> Tensor:
    """Number of rows per segment (int64), padding rows excluded."""
    idx, _ = _clean_index(index, num_segments)
    return torch.bincount(idx, minlength=num_segments + 1)[:num_segments]


def segment_max(values: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Per-segment maximum of a 1-D tensor; empty segments give ``-inf``."""
    idx, _ = _clean_index(index, num_segments)
    out = values.new_full((num_segments + 1,), float("-inf"))
    out.scatter_reduce_(0, idx, values, reduce="amax", include_self=True)
    return out[:num_segments]


def segment_min(values: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Per-segment minimum of a 1-D tensor; empty segments give ``+inf``."""
    idx, _ = _clean_index(index, num_segments)
    out = values.new_full((num_segments + 1,), float("inf"))
    out.scatter_reduce_(0, idx, values, reduce="amin", include_self=True)
    return out[:num_segments]


def segment_mean_std(
    values: Tensor, index: Tensor, num_segments: int, *, unbiased: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-segment ``(mean, std, count)`` of a 1-D tensor, computed in float64 for stability.

    The std of a segment with fewer than two rows (unbiased) or no rows is NaN, as ``torch.std`` gives;
    callers choose their singleton rule explicitly.
    """
    v = values.double()
    count = segment_count(index, num_segments)
    total = segment_sum(v, index, num_segments)
    cnt = count.double()
    mean = total / cnt.clamp_min(1)
    idx, valid = _clean_index(index, num_segments)
    centred = torch.where(valid, v - torch.cat([mean, mean.new_zeros(1)]).index_select(0, idx), v.new_zeros(()))
    sq = segment_sum(centred * centred, index, num_segments)
    denom = cnt - 1 if unbiased else cnt
    std = torch.where(denom > 0, (sq / denom.clamp_min(1)).sqrt(), torch.full_like(sq, float("nan")))
    mean = torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
    return mean, std, count


def gather_segments(per_segment: Tensor, index: Tensor, fill: float = 0.0) -> Tensor:
    """Broadcast per-segment values back to rows; padding rows (``index < 0``) get ``fill``."""
    valid = index >= 0
    if per_segment.shape[0] == 0:  # no segment at all (an all-padding batch): every row gets the fill
        return per_segment.new_full((index.shape[0], *per_segment.shape[1:]), fill)
    out = per_segment.index_select(0, index.clamp_min(0))  # several times faster than advanced indexing
    if valid.all():
        return out
    mask = valid.view(-1, *([1] * (out.dim() - 1)))
    return torch.where(mask, out, torch.full_like(out, fill))


def grpo_outcome_advantage(
    rewards: Tensor, group_index: Tensor, num_groups: int, *, eps: float = 1e-6, norm_by_std: bool = True
) -> Tensor:
    """Per-row GRPO advantage exactly as verl 0.9.1 computes it (``compute_grpo_outcome_advantage``).

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased std; a singleton group has mean 0 and
    std 1 (so ``A = r / (1 + eps)``); padding rows (``group_index < 0``) get 0.
    """
    mean, std, count = segment_mean_std(rewards, group_index, num_groups, unbiased=True)
    single = count <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    r = rewards.double()
    centred = r - gather_segments(mean, group_index)
    adv = centred / (gather_segments(std, group_index, fill=1.0) + eps) if norm_by_std else centred
    adv = torch.where(group_index >= 0, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


def segment_slots(index: Tensor, num_segments: int) -> Tensor:
    """Each row's position within its segment (0, 1, ... in row order), long ``[R]``: with ``index`` it places
    rows in a dense ``[num_segments, max_count]`` layout. Padding rows (``index < 0``) get -1."""
    idx, valid = _clean_index(index, num_segments)
    order = torch.sort(idx, stable=True).indices
    starts = torch.cumsum(torch.bincount(idx, minlength=num_segments + 1), 0) - torch.bincount(
        idx, minlength=num_segments + 1)
    slots = torch.empty_like(idx)
    slots[order] = torch.arange(idx.numel(), device=idx.device) - starts[idx[order]]
    return torch.where(valid, slots, torch.full_like(slots, -1))


def waves(prompt: Tensor) -> list[Tensor]:
    """Positions of ``prompt`` split into calls of distinct prompts, each repeat in a later call, in order
    (a loop as long as the most repeated prompt's visits, not over prompts)."""
    if prompt.numel() == 0:
        return []
    order = torch.sort(prompt, stable=True).indices
    p = prompt[order]
    _, counts = torch.unique_consecutive(p, return_counts=True)
    seg = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(p.numel()) - (torch.cumsum(counts, 0) - counts)[seg]
    return [torch.nonzero(rank == w).flatten() for w in range(int(counts.max()))]
