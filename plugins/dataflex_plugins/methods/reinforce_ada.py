"""Reinforce-Ada (arXiv 2510.04996, code ``RLHFlow/Reinforce-Ada``; spec ``allocation.md`` section 2).

Online successive elimination: every prompt gets rounds of ``M`` rollouts (the host's group size) until it
*exits* (``balanced``: at least ``n // 2`` positives and ``n - n // 2`` negatives; ``positive_focused``: one
positive), at most ``max_rounds`` rounds; then each prompt's pool is downsampled to ``n = final_keep`` rows
(the first positives and negatives in arrival order, balanced where the pool allows) and every kept row gets
the *pool* baseline ``A = r - pos / (pos + neg)`` over every rollout generated for the prompt.

As dataflex methods, two in one block: the allocator ``reinforce_ada`` at ``on_rollout`` (the rounds, as
continuations of the same groups; fed ``group_solve_rate`` with ``success_threshold`` the positive
threshold, 0.7) and the subset selector ``ada_downsample`` at ``on_advantage``, where every generated row is
still in the batch (the downsampling and the pool baseline). The two share ``final_keep`` and the positive
threshold; validation refuses a block where they differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Budget, Param, Score, Selection, Selector
from dataflex_bus.errors import BatchFieldError, ConfigIssue
from dataflex_bus.ops import gather_segments, grpo_outcome_advantage, segment_sum

from ._checks import check_row_values

if TYPE_CHECKING:
    from dataflex_bus.block import MethodConfig
    from dataflex_bus.host import HostDescription

CHOICES = ("balanced", "positive_focused")
BASELINES = ("pool", "kept")
#: The most generation rounds one step may give a prompt (the bound of ``max_rounds``).
MAX_ROUNDS = 16


def exits(pos: Tensor, neg: Tensor, n: int, choice: str) -> Tensor:
    """Bool: the prompts with ``pos`` positives and ``neg`` negatives so far that stop sampling (the official exit
    test, ``ray_trainer.py:1086-1108``)."""
    if choice == "balanced":
        return (pos >= n // 2) & (neg >= n - n // 2)
    return pos >= 1


def kept_counts(pos: Tensor, neg: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Long ``(a, b)``: the positives and negatives a pool of ``pos`` / ``neg`` keeps (``downsample_cache``):
    ``a = min(n // 2, pos)``, ``b = min(n - a, neg)``, topped up from the positives left when ``a + b < n``. The
    official fallback for a prompt that never exits (``:1144-1199``) keeps the same under both choices (under
    ``positive_focused`` such a pool holds no positive, and its ``t_pos = 1`` finds none), so one rule serves
    every prompt; a pool smaller than ``n`` keeps all of it."""
    a = torch.clamp(pos, max=n // 2)
    b = torch.minimum(n - a, neg)
    a = a + torch.minimum(pos - a, n - a - b)
    return a, b


def class_rank(cls: Tensor, gi: Tensor, num_groups: int) -> Tensor:
    """Long ``[B]``: each real row's rank among the rows of its group and class (bool ``cls``) in row order
    (0 for the first); padding rows get ``-1``."""
    b = gi.numel()
    real = gi >= 0
    key = torch.where(real, gi * 2 + cls.to(torch.long), 2 * num_groups)
    order = torch.sort(key, stable=True).indices  # (group, class), then row order
    sorted_key = key[order]
    pos = torch.arange(b)
    start = torch.ones(b, dtype=torch.bool)
    if b > 1:
        start[1:] = sorted_key[1:] != sorted_key[:-1]
    begin = torch.cummax(torch.where(start, pos, 0), 0).values
    rank = torch.empty(b, dtype=torch.long)
    rank[order] = pos - begin
    return torch.where(real, rank, -1)


def pool_advantages(rewards: Tensor, positive: Tensor, gi: Tensor, num_groups: int, *, norm_by_std: bool,
                    eps: float) -> Tensor:
    """Float64 ``[B]``: ``r - mean`` (``norm_by_std``: ``/ (std + eps)``) with the mean and unbiased std of the
    group's binarised pool (1 per positive, 0 per negative; std clamped at ``eps``); a pool of at most one row
    gets mean 0 and std 1 (``core_algos.py:305-322``)."""
    pos = segment_sum(positive.to(torch.float64), gi, num_groups)
    total = segment_sum((gi >= 0).to(torch.float64), gi, num_groups)
    small = total <= 1
    mean = torch.where(small, 0.0, pos / total.clamp_min(1))
    variance = pos * (total - pos) / (total * (total - 1)).clamp_min(1)
    std = torch.where(small, 1.0, torch.sqrt(variance).clamp_min(eps))
    centred = rewards.to(torch.float64) - gather_segments(mean, gi)
    adv = centred / (gather_segments(std, gi, fill=1.0) + eps) if norm_by_std else centred
    return torch.where(gi >= 0, adv, 0.0)


class ReinforceAda(Allocator):
    """Reinforce-Ada's rounds (``_generate_multi_round_adaptive_downsampling``), see the module doc: after each
    round a prompt exits by ``choice`` on its pool's integer counts (``group_solve_rate``: positive iff
    ``reward > success_threshold``); an active prompt gets the host's group size ``M`` more rollouts in the next
    round, appended to its group, until ``max_rounds``. No group is dropped (the downsampling is
    ``ada_downsample``'s, at on_advantage). The official defaults: ``M = 8`` rounds of ``round_repeat``,
    ``max_rounds = 4`` (at most 32 rollouts a prompt), ``final_keep`` its ``rollout.n``."""

    accepts: ClassVar = ("prompt",)
    needs_groups: ClassVar = True
    min_timing: ClassVar = "post_reward"
    rounds: ClassVar = MAX_ROUNDS
    per_group_rule: ClassVar = True  # a group qualifies, commits or exits on its own counts
    intended_scorers: ClassVar = ("group_solve_rate",)
    params: ClassVar = {
        **ALLOCATION_PARAMS,
        "final_keep": Param(int, low=1, doc="n: rows each prompt keeps for the update (the official "
                            "final_keep_per_prompt = rollout.n); the exit counts target n // 2 positives"),
        "choice": Param(str, "balanced", choices=CHOICES, doc="exit rule: balanced (n // 2 positives and n - n // 2 "
                        "negatives) or positive_focused (one positive)"),
        "max_rounds": Param(int, 4, low=1, high=MAX_ROUNDS, doc="N: generation rounds at most"),
    }
    final_keep: int
    choice: str
    max_rounds: int

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        issues = super().check_host(host)
        m = host.group_size
        if m is not None and m * self.max_rounds > self.max_n:
            issues.append(("max_n", f"max_rounds={self.max_rounds} rounds of the group size {m} (host "
                           f"{host.name!r}) give a prompt up to {m * self.max_rounds} rollouts, above max_n="
                           f"{self.max_n}; raise max_n or lower max_rounds"))
        return issues

    def host_warnings(self, host: HostDescription) -> list[tuple[str, str]]:
        m = host.group_size
        if m is not None and m < self.final_keep:
            return [("final_keep", f"final_keep={self.final_keep} is above the round size {m} (the group size of "
                     f"host {host.name!r}): a prompt exiting after one round keeps only {m} rows (the paper's "
                     "Algorithm 1 takes M >= n)")]
        return []

    def continuation_cap(self) -> str:
        return "none"  # every unexited group goes on, however many

    def allocate(self, batch: Batch, score: Score, step: int, budget: Budget) -> Allocation:
        if score.counts is None or score.totals is None:
            raise BatchFieldError(self.who, "score.counts", "needs the integer positive/total counts of each group "
                                  "(scorer group_solve_rate, success_threshold the positive threshold)")
        real = batch.valid_rows
        pos = score.counts.to(torch.long)
        neg = score.totals.to(torch.long) - pos
        done = exits(pos, neg, self.final_keep, self.choice)
        more = real & ~done
        if budget.round + 1 >= self.max_rounds:  # the last round: the unexited prompts fall back
            more = torch.zeros_like(more)
        if bool(more.any()) and budget.group_size < 1:
            raise BatchFieldError(self.who, "budget_group_size", "a round generates the host's group size M, which "
                                  "this host does not give")
        gi = batch.group_index
        group_done = torch.zeros(batch.num_groups, dtype=torch.bool)
        group_done[gi[real]] = done[real]  # (one flag per group: its rows agree)
        metrics = {"reinforce_ada/round": float(budget.round + 1),
                   "reinforce_ada/exited_groups": float(group_done.sum()),
                   "reinforce_ada/unexited_groups": float((~group_done).sum())}
        return Allocation(counts=torch.where(more, budget.group_size, 0).to(torch.long), metrics=metrics)


class AdaDownsample(Selector):
    """Reinforce-Ada's downsampling and pool baseline (``downsample_cache``, the fallback, and
    ``compute_grpo_outcome_advantage`` with ``global_stat_est``): per group keep the first ``a`` positives and
    the first ``b`` negatives in row order (the arrival order; a row is positive iff its score, the reward with
    ``reward_difficulty``, exceeds ``positive_threshold``), ``a, b`` as :func:`kept_counts`; the kept rows'
    advantages become ``r - pos/(pos + neg)`` over the whole group (``baseline: pool``; ``kept``: verl's GRPO
    over the kept rows), divided by the pool's std (+ eps) under ``norm_by_std``. Dropped rows get 0."""

    rewrites_advantages: ClassVar = True
    requires: ClassVar = ("rm_scores", "response_mask", "uid")
    needs_groups: ClassVar = True
    min_timing: ClassVar = "post_advantage"
    accepts: ClassVar = ("response",)
    intended_scorers: ClassVar = ("reward_difficulty",)
    params: ClassVar = {
        "final_keep": Param(int, low=1, doc="n: rows each group keeps (reinforce_ada's final_keep)"),
        # Rewards lie in [0, 1]: below 0 every row would be positive, at 1 or above none, and no prompt could
        # exit balanced.
        "positive_threshold": Param(float, 0.7, low=0.0, high=1.0, high_open=True,
                                    doc="a row is positive when its score exceeds this (the official "
                                    "positive_threshold; reinforce_ada's scorer's success_threshold)"),
        "baseline": Param(str, "pool", choices=BASELINES, doc="pool: the mean over every generated row of the "
                          "group (global_stat_est, the official script); kept: GRPO over the kept rows"),
        "norm_by_std": Param(bool, False, doc="divide by the std (+ eps): the official script sets "
                             "norm_adv_by_std_in_grpo=false"),
        "eps": Param(float, 1e-6, low=0.0, low_open=True, doc="the std's floor and epsilon (verl's 1e-6)"),
    }
    final_keep: int
    positive_threshold: float
    baseline: str
    norm_by_std: bool
    eps: float

    @classmethod
    def check_block(cls, key: str, method: MethodConfig,
                    block: Sequence[tuple[str, MethodConfig]]) -> list[ConfigIssue]:
        """The ``reinforce_ada`` allocator of the block (if any) exits on the same ``final_keep`` and positive
        threshold (its scorer's ``success_threshold``)."""
        mine = method.resolved
        if mine is None:
            return []
        issues = []
        for other_key, other in block:
            theirs = other.resolved
            if theirs is None or theirs.actuator.name != "reinforce_ada":
                continue
            pairs = [("final_keep", mine.actuator_params["final_keep"], theirs.actuator_params.get("final_keep"),
                      f"{other_key}.actuator.params.final_keep")]
            if "success_threshold" in theirs.scorer_params:
                pairs.append(("positive_threshold", mine.actuator_params["positive_threshold"],
                              theirs.scorer_params["success_threshold"],
                              f"{other_key}.scorer.params.success_threshold"))
            for name, value, want, where in pairs:
                if value != want:
                    issues.append(ConfigIssue(f"{key}.actuator.params.{name}", f"{name}={value!r} differs from "
                                              f"{where}={want!r}: the downsampling and the rounds apply one rule"))
        return issues

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        check_row_values(self.who, "score", score.values, batch)
        rewards = batch.rewards
        check_row_values(self.who, "rm_scores", rewards, batch)
        gi, ng = batch.group_index, batch.num_groups
        real = batch.valid_rows
        positive = real & (score.values.to(torch.float64) > self.positive_threshold)
        negative = real & ~positive
        pos = segment_sum(positive.to(torch.long), gi, ng)
        neg = segment_sum(negative.to(torch.long), gi, ng)
        a, b = kept_counts(pos, neg, self.final_keep)
        rank = class_rank(positive, gi, ng)
        quota = torch.where(positive, gather_segments(a, gi), gather_segments(b, gi))
        keep = real & (rank < quota)
        if self.baseline == "pool":
            adv = pool_advantages(rewards, positive, gi, ng, norm_by_std=self.norm_by_std, eps=self.eps)
        else:
            sub = torch.where(keep, gi, torch.full_like(gi, -1))
            adv = grpo_outcome_advantage(rewards.to(torch.float64), sub, ng, eps=self.eps,
                                         norm_by_std=self.norm_by_std)
        adv = torch.where(keep, adv, 0.0).to(torch.float32)
        advantages = (batch["response_mask"] * adv[:, None]).to(torch.float32)
        kept = segment_sum(keep.to(torch.long), gi, ng)
        metrics = {"ada_downsample/kept_rows": float(keep.sum()),
                   "ada_downsample/short_groups": float((kept < self.final_keep).sum()),
                   "ada_downsample/zero_signal_groups": float(((a == 0) | (b == 0)).sum()),
                   "ada_downsample/pool_rows": float(real.sum())}
        return Selection(keep=keep, advantages=advantages, metrics=metrics)

