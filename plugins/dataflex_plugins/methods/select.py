"""Built-in selectors (mechanism ``select``): which rows enter the policy update.

All decisions are made on whole tensors: group statistics come from segment reductions, orderings
from stable sorts, so ties resolve by row index and nothing loops over groups or rows. Padding rows
are never kept and never enter a group statistic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Score, Selection, Selector
from dataflex_bus.ops import (
    gather_segments,
    grpo_outcome_advantage,
    segment_count,
    segment_max,
    segment_min,
)

from ._checks import check_row_values


class ThresholdBand(Selector):
    """Keep rows whose score lies in the band ``[low, high]`` (``inclusive``) or ``(low, high)``.

    With a group scorer that provides integer counts (``group_solve_rate``) the test is done on the
    counts: inclusive keeps ``low*G - slack <= k <= high*G + slack``, strict keeps
    ``low*G + slack < k < high*G - slack``, with ``slack = 1e-9 * G`` absorbing the float error of
    ``low*G`` itself (``0.2 * 5`` must count as exactly 1). Without counts the float scores are compared
    as they are. ``low``/``high`` may be any reals (``reward_difficulty`` scores are rewards); for rates
    the meaningful range is ``[0, 1]``.
    """

    params: ClassVar = {
        "low": Param(float, doc="lower edge of the band"),
        "high": Param(float, doc="upper edge of the band"),
        "inclusive": Param(bool, True, doc="keep scores equal to an edge"),
    }
    low: float
    high: float
    inclusive: bool

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        return granularity == "prompt"  # one score per group: the band keeps or drops the group

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        if values["low"] > values["high"]:
            return [("low", f"low={values['low']!r} must be <= high={values['high']!r}")]
        return []

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        valid = batch.valid_rows
        if score.counts is not None and score.totals is not None:
            # Integer counts against float64 edges; (low -/+ 1e-9) * G is low*G with a slack of 1e-9*G,
            # far below 1 for any realistic G, so it only absorbs the float error of low*G itself.
            k, g = score.counts, score.totals.to(torch.float64)
            if self.inclusive:
                below, above = k < (self.low - 1e-9) * g, k > (self.high + 1e-9) * g
            else:
                below, above = k <= (self.low + 1e-9) * g, k >= (self.high - 1e-9) * g
        else:
            check_row_values(self.who, "score", score.values, batch)
            s = score.values.to(torch.float64)
            if self.inclusive:
                below, above = s < self.low, s > self.high
            else:
                below, above = s <= self.low, s >= self.high
        out = below | above
        keep = valid & ~out
        n_below, n_above, n_real = torch.stack([(below & valid).sum(), (above & valid).sum(), valid.sum()]).tolist()
        real = max(n_real, 1)
        return Selection(keep=keep, metrics={"band/below_rows": n_below / real, "band/above_rows": n_above / real})


class DapoFilter(Selector):
    """DAPO dynamic sampling (arXiv 2503.14476): keep a group iff its values are not all equal.

    ``metric=reward`` (default) tests the rollouts' outcome rewards ``r_i`` whatever the scorer;
    ``metric=score`` tests the scorer's per-row values instead. A group is uninformative under GRPO
    exactly when ``min_g == max_g`` (all advantages 0). Singleton groups are kept (they are not
    "all equal" in the DAPO sense: verl gives them ``A = r``).
    """

    requires: ClassVar = ("rm_scores", "response_mask", "uid")
    needs_groups: ClassVar = True
    filters_zero_variance: ClassVar = True
    params: ClassVar = {
        "metric": Param(str, "reward", choices=("reward", "score"), doc="which per-row value must vary"),
    }
    metric: str

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        return True  # decides per group, whatever the scorer

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        if self.metric == "reward":
            v = batch.rewards
            check_row_values(self.who, "rm_scores", v, batch)
        else:
            v = score.values
            check_row_values(self.who, "score", v, batch)
        gi, ng = batch.group_index, batch.num_groups
        varied = segment_min(v, gi, ng) != segment_max(v, gi, ng)
        keep_group = varied | (batch.group_sizes == 1)
        keep = gather_segments(keep_group, gi, fill=False) & batch.valid_rows
        metrics = {"dapo/uniform_groups": float((~keep_group).sum())}
        return Selection(keep=keep, metrics=metrics)


class TopKFraction(Selector):
    """Keep the ``k = clamp(floor(fraction*N + 0.5), 1, N)`` best real rows by score.

    ``largest=true`` keeps the highest scores. Order is ``(score, row index)`` with a stable sort, so ties
    go to the earlier row; rounding is half-up, never banker's. NaN scores are rejected.
    """

    params: ClassVar = {
        "fraction": Param(float, 0.5, low=0.0, high=1.0, low_open=True, doc="share of real rows kept"),
        "largest": Param(bool, True, doc="keep the highest scores (false: the lowest)"),
    }
    fraction: float
    largest: bool

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        valid = batch.valid_rows
        values = score.values
        check_row_values(self.who, "score", values, batch)
        n = int(valid.sum())
        keep = torch.zeros(len(batch), dtype=torch.bool)
        if n == 0:
            return Selection(keep=keep, metrics={"topk/k": 0.0})
        k = min(max(math.floor(self.fraction * n + 0.5), 1), n)
        if n < len(batch):
            # Real scores are finite (checked), so an infinite fill puts padding strictly last.
            fill = float("-inf") if self.largest else float("inf")
            values = torch.where(valid, values, torch.full((), fill, dtype=values.dtype))
        # A stable sort keeps row order among equal scores in either direction: ties go to the earlier row.
        order = torch.sort(values, descending=self.largest, stable=True).indices
        keep[order[:k]] = True
        return Selection(keep=keep, metrics={"topk/k": float(k)})


class MaxVariance(Selector):
    """PODS max-variance down-sampling (arXiv 2504.13818), vectorised across groups.

    Per group keep ``m = clamp(floor(keep_fraction*G + 0.5), 1, G)`` rows maximising the variance of
    their scores: the optimum is the ``a`` lowest plus the ``m - a`` highest. Every ``a in 0..m`` of
    every group is evaluated at once from per-group prefix sums of the sorted values and squares; among
    equal variances the official scan order wins (``a = 0`` first, then ``a = m, m-1, ..., 1``, replace
    only on strict improvement), with a relative tolerance of 1e-12 absorbing float round-off.

    Advantages are then recomputed on the kept subset ``S`` of each group from the outcome rewards:
    ``A = (r - mean_S) / (std_S + eps)`` (unbiased std, a one-row subset gets mean 0 / std 1 as in verl),
    broadcast over the valid tokens; dropped rows get 0. With ``reward_difficulty`` (the PODS setting)
    the scores *are* the rewards.
    """

    rewrites_advantages: ClassVar = True
    requires: ClassVar = ("rm_scores", "response_mask", "uid")
    needs_groups: ClassVar = True
    min_timing: ClassVar = "post_advantage"
    params: ClassVar = {
        "keep_fraction": Param(float, 0.5, low=0.0, high=1.0, low_open=True, doc="share of each group kept"),
        "eps": Param(float, 1e-4, low=0.0, low_open=True, doc="added to the subset std (PODS: 1e-4)"),
    }
    keep_fraction: float
    eps: float

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        who = self.who
        check_row_values(who, "score", score.values, batch)
        keep = max_variance_keep(score.values, batch.group_index, batch.num_groups, self.keep_fraction)
        rewards = batch.rewards
        check_row_values(who, "rm_scores", rewards, batch)
        adv_rows = subset_advantages(rewards, batch.group_index, batch.num_groups, keep, self.eps)
        # Broadcast like verl (row advantage * response_mask): dropped and padding rows are 0 already.
        advantages = (batch["response_mask"] * adv_rows.to(torch.float32)[:, None]).to(torch.float32)
        return Selection(keep=keep, advantages=advantages,
                         metrics={"max_variance/kept_rows": float(keep.sum())})


def subset_advantages(rewards: Tensor, group_index: Tensor, num_groups: int, keep: Tensor,
                      eps: float) -> Tensor:
    """Per-row GRPO advantages recomputed over the kept rows of each group; 0 for the other rows.

    ``(r - mean_S) / (std_S + eps)`` with the unbiased std; a one-row subset gets mean 0 and std 1 (the
    verl convention for singleton groups), so its advantage is ``r / (1 + eps)``.
    """
    sub_index = torch.where(keep, group_index, torch.full_like(group_index, -1))
    return grpo_outcome_advantage(rewards, sub_index, num_groups, eps=eps)


def max_variance_keep(values: Tensor, group_index: Tensor, num_groups: int, keep_fraction: float) -> Tensor:
    """Bool ``[B]``: per group the ``m`` rows of maximal variance (see :class:`MaxVariance`).

    Cost: two stable sorts of ``B`` and O(B) tensor work; no per-group Python.
    """
    if num_groups == 0:
        return torch.zeros(values.shape[0], dtype=torch.bool)
    sizes = segment_count(group_index, num_groups)
    m = torch.clamp(torch.floor(keep_fraction * sizes.to(torch.float64) + 0.5).to(torch.long), min=1)
    return max_variance_subsets(values, group_index, num_groups, torch.minimum(m, sizes))


def max_variance_subsets(values: Tensor, group_index: Tensor, num_groups: int, m: Tensor, *,
                         larger_sum_first: bool = False) -> Tensor:
    """Bool ``[B]``: per group ``g`` the ``m[g]`` rows (``0 <= m[g] <=`` its size) whose values have maximal
    variance: the ``a`` lowest plus the ``m - a`` highest of the best ``a``. Among equal variances the PODS scan
    order wins (``a = 0``, then ``a = m, ..., 1``), or with ``larger_sum_first`` the subset with the larger sum
    (the smallest ``a``, RePO's ``max_variance_k``). Within equal values the lowest rows are the earliest and
    the highest the latest (stable order)."""
    b = values.shape[0]
    keep = torch.zeros(b, dtype=torch.bool)
    if num_groups == 0:
        return keep
    gi = group_index
    v = values.to(torch.float64)
    # Sort by (group, value, row): stable sort by value, then stable sort by group. Padding last.
    by_value = torch.sort(v, stable=True).indices
    g_key = _at(torch.where(gi >= 0, gi, torch.full_like(gi, num_groups)), by_value)
    order = _at(by_value, torch.sort(g_key, stable=True).indices)
    sizes = segment_count(gi, num_groups)
    n = int(sizes.sum())
    order = order[:n]
    g_sorted = _at(gi, order)
    starts = torch.cumsum(sizes, 0) - sizes
    pos = torch.arange(n) - _at(starts, g_sorted)
    # Shift each group by its minimum: exact for integer rewards, small magnitudes otherwise.
    x = _at(v, order) - _at(segment_min(v, gi, num_groups), g_sorted)
    zero = x.new_zeros(1)
    p1 = torch.cat([zero, torch.cumsum(x, 0)])
    p2 = torch.cat([zero, torch.cumsum(x * x, 0)])
    # Candidates a = 0..m_g for every group g, flattened.
    reps = m + 1
    cand_g = torch.repeat_interleave(torch.arange(num_groups), reps)
    cand_start = torch.cumsum(reps, 0) - reps
    a = torch.arange(cand_g.shape[0]) - _at(cand_start, cand_g)
    s = _at(starts, cand_g)
    e = s + _at(sizes, cand_g)
    mg = _at(m, cand_g)
    h = mg - a
    total1 = (_at(p1, s + a) - _at(p1, s)) + (_at(p1, e) - _at(p1, e - h))
    total2 = (_at(p2, s + a) - _at(p2, s)) + (_at(p2, e) - _at(p2, e - h))
    # (m - 1) * unbiased variance: same ordering as the variance within a group (m is per group).
    objective = total2 - total1 * total1 / mg.clamp_min(1).to(torch.float64)
    best = segment_max(objective, cand_g, num_groups)
    scale = (_at(p2, starts + sizes) - _at(p2, starts)) + 1.0
    tie = objective >= _at(best - 1e-12 * scale, cand_g)
    # Official scan order: a=0 first, then a=m, m-1, ..., 1; the first maximum wins. (Larger sum first: the
    # sum of the a lowest and m - a highest falls as a grows, so a=0, 1, ... in turn.)
    rank = a if larger_sum_first else torch.where(a == 0, torch.zeros_like(a), mg - a + 1)
    big = torch.full_like(rank, int(m.max()) + 2)
    # segment_min works in floats (its empty-segment fill is +inf); ranks are small exact integers.
    best_rank = segment_min(torch.where(tie, rank, big).to(torch.float64), cand_g, num_groups).to(torch.long)
    a_best = best_rank if larger_sum_first else torch.where(best_rank == 0, torch.zeros_like(m), m - best_rank + 1)
    ga, gm, gs = _at(a_best, g_sorted), _at(m, g_sorted), _at(sizes, g_sorted)
    kept_sorted = (pos < ga) | (pos >= gs - (gm - ga))
    keep.index_copy_(0, order, kept_sorted)
    return keep


def _at(t: Tensor, index: Tensor) -> Tensor:
    """``t[index]`` for 1-D gathers via ``index_select``, several times faster than advanced indexing."""
    return t.index_select(0, index)
