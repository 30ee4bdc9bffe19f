"""The cheap 2026 rules and the actuators the predictors feed.

``no_positive_resampling`` (ScaleRL, arXiv 2510.13786; no code): drop a prompt for good once a visit's pass rate
reached ``threshold`` (0.9). ``snr_filter`` (RAGEN-2, SNR-aware filtering; a pull request to SkyRL): keep the
groups holding the top ``rho`` of the batch's reward-variance mass. ``learnability`` (LILO, arXiv 2502.12272):
select by ``p (1 - p)``, before generation (``p`` predicted) or after it (``p`` observed). ``weighted_draw``:
draw the prompts to generate without replacement with probability proportional to ``exp(score)`` (CurES's
sampler). ``variance_split``: rollouts per prompt minimising ``sum p (1 - p) / n`` under the budget (VIP's
convex allocation; CurES's eq. 127 with equal gradient moments). ``sec`` (SEC, arXiv 2505.14970): a TD(0)
bandit over domains rewarded by the mean ``|advantage|``, sampled by a Boltzmann distribution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import (
    ALLOCATION_PARAMS,
    Allocation,
    Allocator,
    Budget,
    Mixer,
    Param,
    Score,
    Scorer,
    Selection,
    Selector,
)
from dataflex_bus.ops import gather_segments, segment_min, segment_sum

from ._checks import check_row_values
from .mix import _check_domains, _domain_rows, _state_tensor
from .pilot_commit import ExcludeSolved

F64 = torch.float64


class NoPositiveResampling(ExcludeSolved):
    """ScaleRL's No-Positive-Resampling: fed ``max_solve_rate`` (the best pass rate of any visit so far), a prompt
    scored at or above ``exclude_threshold`` (0.9, the paper's) is never generated again. ScaleRL applies it at
    epoch ends to a fixed pool; here it acts at every draw, so a prompt leaves the moment its visit crosses."""

    params: ClassVar = {
        "exclude_threshold": Param(float, 0.9, low=0.0, high=1.0, low_open=True,
                                   doc="drop a prompt for good once a visit's pass rate reached this (ScaleRL: 0.9)"),
    }

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        out = super().select(batch, score, step)
        return Selection(keep=out.keep, metrics={"no_positive_resampling/dropped":
                                                 out.metrics["exclude_solved/excluded"]})


class RewardVariance(Scorer):
    """The population variance of each group's rewards, broadcast to its rows (``snr_filter``'s signal)."""

    requires: ClassVar = ("rm_scores", "response_mask", "uid")
    timing: ClassVar = "post_reward"
    granularity: ClassVar = "prompt"
    needs_groups: ClassVar = True

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        r = batch.rewards.to(F64)
        gi, g = batch.group_index, batch.num_groups
        size = batch.group_sizes.to(F64).clamp_min(1)
        mean = segment_sum(r, gi, g) / size
        var = segment_sum(r * r, gi, g) / size - mean * mean
        var = var.clamp_min(0.0)
        values = gather_segments(var, gi, fill=0.0)
        return Score(values=values, granularity="prompt",
                     metrics={"reward_variance/mean": float(var.mean()) if g else 0.0})


def group_heads(batch: Batch) -> Tensor:
    """Long ``[G]``: the first row of each real group, in group order."""
    gi, g = batch.group_index, batch.num_groups
    if g == 0:
        return torch.zeros(0, dtype=torch.long)
    return segment_min(torch.arange(len(batch), dtype=F64), gi, g).to(torch.long)


def top_mass(values: Tensor, rho: float) -> Tensor:
    """Bool mask of the fewest entries, largest first (ties to the earlier), whose sum reaches ``rho`` of the
    total (all of them when the total is 0: no signal to rank by)."""
    total = values.sum()
    if float(total) <= 0:
        return torch.ones_like(values, dtype=torch.bool)
    order = torch.sort(values, descending=True, stable=True).indices
    csum = torch.cumsum(values[order], 0)
    before = csum - values[order]
    keep_sorted = before < rho * total * (1 - 1e-12)
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


class SnrFilter(Selector):
    """RAGEN-2's SNR-aware filtering: rank the groups by reward variance and keep the fewest, largest first,
    that hold ``rho`` of the batch's total variance (a batch with no variance keeps all)."""

    accepts: ClassVar = ("prompt",)
    intended_scorers: ClassVar = ("reward_variance",)
    params: ClassVar = {
        "rho": Param(float, 0.9, low=0.0, high=1.0, low_open=True, doc="share of the variance mass kept"),
    }
    rho: float

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        return True

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        check_row_values(self.who, "score", score.values, batch)
        rows = group_heads(batch)
        keep_group = top_mass(score.values.to(F64)[rows].clamp_min(0.0), float(self.rho))
        kept = torch.zeros(batch.num_groups, dtype=torch.bool)
        kept[batch.group_index[rows][keep_group]] = True
        gi = batch.group_index
        keep = batch.valid_rows & (gi >= 0) & kept[gi.clamp_min(0)]
        return Selection(keep=keep, metrics={"snr_filter/groups_kept": float(keep_group.sum()),
                                             "snr_filter/groups": float(rows.numel())})


class _Draw(Selector):
    """Shared: keep ``B`` candidates (``budget_prompts``) before generation, or a ``fraction`` of the groups after;
    ``pool`` candidates per prompt generated; an own generator seeded by ``seed``, saved in the state."""

    accepts: ClassVar = ("prompt",)
    min_timing: ClassVar = "pre_rollout"
    pool: float
    seed: int

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.rng = np.random.Generator(np.random.PCG64(int(self.seed)))

    def candidates_per_prompt(self) -> float:
        return float(self.pool)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = dict(state["rng"])

    def keep_count(self, batch: Batch, n: int, fraction: float) -> int:
        if batch.has("budget_prompts"):
            return min(int(batch["budget_prompts"]), n)
        return min(n, max(1, math.ceil(fraction * n))) if n else 0

    def pick(self, batch: Batch, priority: Tensor, fraction: float) -> Tensor:
        """Keep the rows of the ``k`` highest-priority candidates (groups after generation; ties to the earlier)."""
        rows = group_heads(batch)
        k = self.keep_count(batch, rows.numel(), fraction)
        top = rows[torch.sort(priority[rows], descending=True, stable=True).indices[:k]]
        chosen = torch.zeros(len(batch), dtype=torch.bool)
        chosen[top] = True
        gi = batch.group_index
        if len(batch) and bool((gi >= 0).any()):
            groups = torch.zeros(batch.num_groups, dtype=torch.bool)
            groups[gi[top]] = True
            chosen = (gi >= 0) & groups[gi.clamp_min(0)]
        return chosen & batch.valid_rows


class Learnability(_Draw):
    """LILO's learnability selection: the priority of a prompt is ``p (1 - p)`` of its score (a success rate:
    ``predicted`` before generation, ``group_solve_rate`` after). Before generation it keeps the ``B`` prompts the
    step needs, after generation ``fraction`` of the groups; ``draw: top`` keeps the highest, ``draw: sample``
    draws without replacement with probability proportional to ``p (1 - p)`` (LILO's prioritised sampling;
    Gumbel keys from the selector's own generator, saved in its state)."""

    intended_scorers: ClassVar = ("predicted", "group_solve_rate")
    params: ClassVar = {
        "pool": Param(float, 4.0, low=1.0, doc="before generation: candidates drawn per prompt generated"),
        "draw": Param(str, "top", choices=("top", "sample"), doc="keep the highest p(1-p), or sample by it"),
        "fraction": Param(float, 0.5, low=0.0, high=1.0, low_open=True,
                          doc="after generation: the share of the groups kept"),
        "seed": Param(int, 0, low=0, doc="seed of draw: sample"),
    }
    draw: str
    fraction: float

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        return True

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        check_row_values(self.who, "score", score.values, batch)
        p = score.values.to(F64).clamp(0.0, 1.0)
        learn = p * (1 - p)
        priority = learn
        if self.draw == "sample":
            gumbel = torch.from_numpy(self.rng.gumbel(size=len(batch)))
            priority = torch.log(learn.clamp_min(1e-300)) + gumbel
        keep = self.pick(batch, priority, float(self.fraction))
        kept = float(learn[keep].mean()) if bool(keep.any()) else 0.0
        return Selection(keep=keep, metrics={"learnability/kept_mean": kept})


class WeightedDraw(_Draw):
    """Draw the ``B`` prompts to generate from the candidates without replacement, with probability proportional
    to ``exp(score)`` (Gumbel-top-k, the same law as ``np.random.choice(replace=False, p)``): CurES's sampler, fed
    ``predicted(transform: cures)``. Own generator, saved in its state."""

    intended_scorers: ClassVar = ("predicted",)
    params: ClassVar = {
        "pool": Param(float, 4.0, low=1.0, doc="candidates drawn per prompt generated (CurES draws from the whole "
                      "dataset; a larger pool comes closer)"),
        "seed": Param(int, 0, low=0, doc="seed of the draws"),
    }
    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        check_row_values(self.who, "score", score.values, batch)
        keys = score.values.to(F64) + torch.from_numpy(self.rng.gumbel(size=len(batch)))
        return Selection(keep=self.pick(batch, keys, 1.0))


def variance_counts(p: Tensor, total: int, min_n: int, max_n: int) -> Tensor:
    """Integer rollouts ``n`` (long, one per prompt) minimising ``sum p (1 - p) / n`` with ``sum n = total`` and
    ``min_n <= n <= max_n``: the relaxed optimum ``n = clip(sqrt(p (1 - p)) / mu, min_n, max_n)`` (``mu`` by
    bisection, 60 halvings on whole tensors), floored, the rest given one each by the largest remainder (ties
    to the earlier prompt). Prompts with ``p`` at 0 or 1 keep ``min_n``. ``total`` must lie in
    ``[len(p) min_n, len(p) max_n]``."""
    k = p.numel()
    sigma = torch.sqrt((p * (1 - p)).clamp_min(0.0)).to(F64)
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    if float(sigma.sum()) <= 0:
        base = torch.full((k,), total // k, dtype=F64)
        frac = torch.zeros(k, dtype=F64)
        frac[: total - int(base.sum())] = 1.0
        return (base + frac).to(torch.long)

    def spent(inv_mu: float) -> float:
        return float((sigma * inv_mu).clamp(min_n, max_n).sum())

    lo, hi = 0.0, 1.0
    while spent(hi) < total and hi < 1e18:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) < total else (lo, mid)
    relaxed = (sigma * hi).clamp(min_n, max_n)
    n = torch.floor(relaxed).clamp(min_n, max_n)
    left = total - int(n.sum())
    room = n < max_n
    rem = torch.where(room, relaxed - n, -1.0)
    order = torch.sort(rem, descending=True, stable=True).indices
    if left > 0:
        n[order[:left]] += 1
    elif left < 0:
        over = torch.sort(torch.where(n > min_n, relaxed - n, 2.0), stable=True).indices
        n[over[:-left]] -= 1
    return n.to(torch.long)


class VarianceSplit(Allocator):
    """Rollouts per candidate from a predicted success rate ``p`` (scorer ``predicted``): every real candidate
    is generated, with ``n`` minimising ``sum p (1 - p) / n`` under the budget and ``[min_n, max_n]``
    (:func:`variance_counts`): VIP's convex allocation of a fixed budget, and CurES's ``n ∝ sigma`` with its
    gradient moments equal (``sigma ∝ sqrt(p (1 - p))``). Needs ``budget >= B min_n``."""

    intended_scorers: ClassVar = ("predicted",)
    params: ClassVar = {**ALLOCATION_PARAMS}

    def allocate(self, batch: Batch, score: Score, step: int, budget: Budget) -> Allocation:
        check_row_values(self.who, "score", score.values, batch)
        real = torch.nonzero(batch.valid_rows).flatten()
        total = int(budget.rollouts)
        lo, hi = real.numel() * int(self.min_n), real.numel() * int(self.max_n)
        total = min(max(total, lo), hi) if not self.exact_budget else total
        if real.numel() and not lo <= total <= hi:
            from dataflex_bus.errors import BatchFieldError

            raise BatchFieldError(self.who, "budget", f"{real.numel()} candidates need between {lo} and {hi} "
                                  f"rollouts at min_n={self.min_n}, max_n={self.max_n}; the budget is {total}")
        p = score.values.to(F64)[real].clamp(0.0, 1.0)
        counts = torch.zeros(len(batch), dtype=torch.long)
        counts[real] = variance_counts(p, total, int(self.min_n), int(self.max_n))
        spread = float(counts[real].to(F64).std()) if real.numel() > 1 else 0.0
        return Allocation(counts=counts, metrics={"variance_split/std_n": spread})


class Sec(Mixer):
    """SEC (Self-Evolving Curriculum, arXiv 2505.14970): a non-stationary bandit over domains. After each step,
    every domain sampled in it gets ``Q <- alpha r + (1 - alpha) Q`` (TD(0)), its reward ``r`` the mean
    ``|advantage|`` of its rows (``advantage_magnitude(agg=mean)``); the next prompts are drawn from
    ``softmax(Q / temperature)``. Starts uniform (``Q = 0``). No official code: tested against the paper's
    equations."""

    requires: ClassVar = ("data_source",)
    accepts: ClassVar = ("prompt", "response")
    intended_scorers: ClassVar = ("advantage_magnitude",)
    params: ClassVar = {
        "alpha": Param(float, 0.5, low=0.0, high=1.0, low_open=True, doc="TD(0) learning rate (SEC: 0.5)"),
        "temperature": Param(float, 1.0, low=0.0, low_open=True, doc="Boltzmann temperature (SEC: 1.0)"),
    }
    alpha: float
    temperature: float

    def set_domains(self, domains: Sequence[str]) -> None:
        super().set_domains(domains)
        self.q = torch.zeros(len(self.domains), dtype=F64)

    def update(self, batch: Batch, score: Score, step: int) -> dict[str, float]:
        d, v = _domain_rows(self, batch, score)
        k = len(self.domains)
        count = torch.bincount(d, minlength=k).to(F64)
        reward = torch.zeros(k, dtype=F64).index_add_(0, d, v.abs()) / count.clamp_min(1)
        seen = count > 0
        self.q = torch.where(seen, self.alpha * reward + (1 - self.alpha) * self.q, self.q)
        probs = self.probabilities()
        return {f"domain/{name}/q": q for name, q in zip(self.domains, self.q.tolist())} | {
            f"domain/{name}/p": p for name, p in zip(self.domains, probs.tolist())}

    def probabilities(self) -> Tensor:
        return torch.softmax(self.q / self.temperature, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"domains": list(self.domains), "q": self.q.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_domains(state, self.domains, self.who)
        self.q = _state_tensor(state, "q", self.q, self.who)
