"""GFPO, Group Filtered Policy Optimization (Shrivastava et al., arXiv 2508.09726).

GRPO trained on long chains of thought inflates response length. GFPO samples a larger group per
prompt and trains only on a filtered subset ``S`` of each group: the ``k`` responses that rank best on
a desirability metric, either the shortest (``metric: length``) or the most token-efficient (highest
reward per token, ``metric: reward_per_token``). Advantages are recomputed over the kept subset::

    A_i = (r_i - mean_S(r)) / (std_S(r) + eps)   for i in S,     A_i = 0 otherwise

with the unbiased std as verl's GRPO uses and ``eps`` = verl's 1e-6. A kept subset of one response
has ``r_i - mean_S = 0`` and gets advantage 0 (its std is taken as 1, not NaN). The filtered rows are
dropped from the update (``Selection.keep``), which is what removing them from the paper's loss means.

Everything is vectorised across groups: one lexicographic stable sort by ``(group, key, row)`` gives each
row its rank in its group; ties resolve by row index, so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus import Param, Score, Selection, Selector
from dataflex_bus.ops import gather_segments, segment_count, segment_mean_std

METRICS = ("length", "reward_per_token")


def rank_in_group(key: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """0-based rank of each row within its group by ascending ``key`` (ties: lower row first).

    Rows with ``group_index < 0`` (padding) are ranked after every group and get rank ``-1``.
    """
    n = key.numel()
    gkey = torch.where(group_index >= 0, group_index, torch.full_like(group_index, num_groups))
    # Two stable sorts give the lexicographic order (group, key, row): first by key, then by group.
    by_key = torch.sort(key, stable=True).indices
    order = by_key[torch.sort(gkey[by_key], stable=True).indices]
    counts = torch.bincount(gkey, minlength=num_groups + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(n, device=key.device) - starts[gkey[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return torch.where(group_index >= 0, rank, torch.full_like(rank, -1))


def keep_counts(group_sizes: Tensor, k: int | None, keep_fraction: float | None) -> Tensor:
    """Rows kept per group: ``min(k, G)`` or ``clamp(floor(f*G + 0.5), 1, G)`` (no banker's rounding)."""
    if k is not None:
        return group_sizes.clamp(max=k)
    assert keep_fraction is not None
    m = torch.floor(keep_fraction * group_sizes.double() + 0.5).long()
    return torch.minimum(m.clamp_min(1), group_sizes)


class GFPO(Selector):
    """Keep the ``k`` (or ``keep_fraction`` of the) best responses per group by length or reward/token;
    recompute GRPO advantages over the kept subset, 0 for the rest. The scorer's values are not used
    (pair it with any post_reward scorer, e.g. ``reward_difficulty``)."""

    params: ClassVar[Mapping[str, Param]] = {
        "metric": Param(str, default="length", choices=METRICS,
                        doc="length: keep the shortest; reward_per_token: keep the highest r_i / L_i"),
        "k": Param((int, type(None)), default=None, low=1, doc="responses kept per group (min(k, G))"),
        "keep_fraction": Param((float, type(None)), default=None, low=0.0, high=1.0, low_open=True,
                               doc="fraction of each group kept, rounded half up, at least 1"),
        "eps": Param(float, default=1e-6, low=0.0, doc="added to the kept subset's std"),
    }
    requires: ClassVar[tuple[str, ...]] = ("rm_scores", "response_mask")
    # It rewrites advantages, so it must act after they exist.
    min_timing: ClassVar[str] = "post_advantage"
    rewrites_advantages: ClassVar[bool] = True
    needs_groups: ClassVar[bool] = True

    metric: str
    k: int | None
    keep_fraction: float | None
    eps: float

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        if values.get("k") is None and values.get("keep_fraction") is None:
            return [("k", "set either k (responses kept per group) or keep_fraction")]
        if values.get("k") is not None and values.get("keep_fraction") is not None:
            return [("keep_fraction", "set only one of k and keep_fraction")]
        return []

    def sort_key(self, rewards: Tensor, lengths: Tensor) -> Tensor:
        """Ascending key: smaller is better."""
        if self.metric == "length":
            return lengths.double()
        return -(rewards.double() / lengths.clamp_min(1).double())

    def select(self, batch: Any, score: Score, step_id: int) -> Selection:
        gi, ng = batch.group_index, batch.num_groups
        rewards, lengths = batch.rewards, batch.lengths
        batch.check_finite(f"selector {self.name!r}", "rm_scores", rewards)
        rank = rank_in_group(self.sort_key(rewards, lengths), gi, ng)
        per_group = keep_counts(batch.group_sizes, self.k, self.keep_fraction)
        keep = (gi >= 0) & (rank < gather_segments(per_group, gi, fill=0))

        kept_index = torch.where(keep, gi, torch.full_like(gi, -1))
        mean, std, count = segment_mean_std(rewards, kept_index, ng, unbiased=True)
        std = torch.where(count >= 2, std, torch.ones_like(std))
        mean = torch.where(count >= 1, mean, torch.zeros_like(mean))
        r = rewards.double()
        adv = (r - gather_segments(mean, kept_index)) / (gather_segments(std, kept_index, fill=1.0) + self.eps)
        adv = torch.where(keep, adv, torch.zeros_like(adv))
        dtype = batch["advantages"].dtype if batch.has("advantages") else torch.float32
        advantages = (adv[:, None] * batch.token_mask.double()).to(dtype)

        real = batch.valid_rows
        dropped = real & ~keep
        metrics = {
            "gfpo/kept_mean_length": _mean(lengths, keep),
            "gfpo/kept_mean_reward": _mean(rewards, keep),
            "gfpo/all_mean_length": _mean(lengths, real),
            "gfpo/all_mean_reward": _mean(rewards, real),
        }
        if bool(dropped.any()):
            metrics["gfpo/dropped_mean_length"] = _mean(lengths, dropped)
        metrics["gfpo/groups_with_one_kept"] = float((segment_count(kept_index, ng) == 1).sum())
        return Selection(keep=keep, advantages=advantages, metrics=metrics)


def _mean(values: Tensor, mask: Tensor) -> float:
    n = int(mask.sum())
    return float(values[mask].double().sum() / n) if n else 0.0
