"""Pilot-Commit (arXiv 2605.26606, code ``databricks/pilot-commit``, ``recipe/pc/``).

Each prompt first gets a few *pilot* rollouts (the host's group size); a prompt whose pilot success rate lies
in the diversity band ``[p_lower, 1 - p_upper]`` is *committed*: it gets ``n_commit`` more rollouts, appended
to its group (the pilot rows train with them, as the official code trains ``n_explore + n_commit`` rows per
prompt), and only committed groups train. A pilot below the band is too hard: dropped this time, left in
the pool for later draws (*deferred*); above it, too easy: dropped; a prompt whose pilot solved a share of
at least ``exclude_threshold`` (official 1.0) is never drawn again (*evicted*). Under ``dataflex.refill``
pilot rounds repeat until the step has its committed groups (the official ``max_num_gen_batches`` loop).

As dataflex methods: the allocator ``pilot_commit`` at ``on_rollout`` (pilot, then the commit round: the
mechanism ``allocate``'s continuation) fed ``group_solve_rate``, and the eviction as a pre-rollout selection:
the scorer ``max_solve_rate`` (the highest success rate of any visit, kept in the bus's prompt history) times
the selector ``exclude_solved``. Every difference from the official code is in docs/methods.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import (
    ALLOCATION_PARAMS,
    Allocation,
    Allocator,
    Budget,
    Param,
    Score,
    Scorer,
    Selection,
    Selector,
)
from dataflex_bus.errors import BatchFieldError
from dataflex_bus.ops import segment_min
from dataflex_bus.visits import PromptState, Visits

if TYPE_CHECKING:
    from dataflex_bus.host import HostDescription

#: How committed prompts are chosen when more pass than the step still needs.
COMMIT_ORDERS = ("arrival", "max_variance")


def pilot_classes(k: Tensor, g: Tensor, lower: float, upper: float) -> tuple[Tensor, Tensor, Tensor]:
    """Bool ``(passed, too_easy, too_hard)`` of groups with ``k`` of ``g`` pilot rollouts right: the official
    ``filter_batch`` test on the pilot mean ``k / g`` in float64 (``np.mean`` of 0/1 values is exactly that):
    passed iff ``lower <= k/g <= 1 - upper``."""
    rate = k.to(torch.float64) / g.to(torch.float64).clamp_min(1)
    too_easy = rate > (1.0 - upper)
    too_hard = ~too_easy & (rate < lower)
    return ~too_easy & ~too_hard, too_easy, too_hard


def commit_order(k: Tensor, g: Tensor, arrival: Tensor, how: str) -> Tensor:
    """Long: the groups in the order they are committed. ``arrival``: their arrival rank (the official
    buffer's ``random`` sampling on a random draw of prompts: its first ``B`` passed prompts are a uniformly
    random ``B`` of them); ``max_variance``: the official ``_sample_by_variance``, the pilot's population std
    ``sqrt(p (1 - p))`` descending (ranked by ``k (g - k) / g^2``, its square, exactly), ties in arrival order
    (one step's pilots share the official second key, the step)."""
    order = torch.argsort(arrival, stable=True)
    if how == "arrival":
        return order
    kf, gf = k.to(torch.float64), g.to(torch.float64).clamp_min(1)
    variance = kf * (gf - kf) / (gf * gf)
    return order[torch.sort(variance[order], descending=True, stable=True).indices]


class PilotCommit(Allocator):
    """Pilot-Commit's selection (``pc_ray_trainer.py:filter_batch`` and the commit of passed pilots), see the
    module doc. Fed ``group_solve_rate`` (integer counts): after the pilot round a group passes iff
    ``diversity_threshold_lower <= k/G <= 1 - diversity_threshold_upper``; the first passed groups (by
    ``commit_order``), at most the groups the step still needs, get ``n_commit`` more rollouts in the commit
    round, appended to them; only those train. The one-step variant: the official code commits a passed
    pilot in a later generation round (possibly a later step, at most ``buffer_max_off_steps`` old) from a
    buffer that survives the step; here the commit round follows its pilot in the same step and passed pilots
    beyond what the step needs are dropped."""

    accepts: ClassVar = ("prompt",)
    needs_groups: ClassVar = True
    min_timing: ClassVar = "post_reward"
    rounds: ClassVar = 2
    per_group_rule: ClassVar = True  # a group qualifies, commits or exits on its own counts
    intended_scorers: ClassVar = ("group_solve_rate",)
    params: ClassVar = {
        **ALLOCATION_PARAMS,
        "n_commit": Param(int, 48, low=1, doc="rollouts a passed prompt gets in the commit round (the official "
                          "rollout.n; 48 after a pilot of 16 in its 4B-14B scripts)"),
        "diversity_threshold_lower": Param(float, 0.125, low=0.0, high=1.0,
                                           doc="p_lower: a pilot solving a smaller share is too hard (deferred)"),
        "diversity_threshold_upper": Param(float, 0.25, low=0.0, high=1.0,
                                           doc="p_upper: a pilot solving more than 1 - p_upper is too easy"),
        "commit_order": Param(str, "arrival", choices=COMMIT_ORDERS,
                              doc="which passed prompts are committed when more pass than the step needs: arrival "
                              "(the official random buffer sampling), max_variance (its 1.5B script's)"),
    }
    n_commit: int
    diversity_threshold_lower: float
    diversity_threshold_upper: float
    commit_order: str

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        issues = super().check_params(values)
        lower, upper = values["diversity_threshold_lower"], values["diversity_threshold_upper"]
        if lower > 1.0 - upper:
            issues.append(("diversity_threshold_lower", f"diversity_threshold_lower={lower} is above 1 - "
                           f"diversity_threshold_upper = {1.0 - upper}: no pilot can pass"))
        if values["n_commit"] > values["max_n"]:
            issues.append(("n_commit", f"n_commit={values['n_commit']} exceeds max_n={values['max_n']}: a committed "
                           "prompt's pilot plus commit rollouts would be refused at step 0; raise max_n"))
        return issues

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        """The committed group (the pilot, the host's group size, plus ``n_commit``) must fit ``max_n``: known
        at validation, where the first commit round would otherwise fail mid-run."""
        issues = super().check_host(host)
        m = host.group_size
        if m is not None and self.n_commit <= self.max_n < m + self.n_commit:
            issues.append(("n_commit", f"a pilot of the group size {m} (host {host.name!r}) + n_commit="
                           f"{self.n_commit} gives a committed prompt {m + self.n_commit} rollouts, above max_n="
                           f"{self.max_n}; raise max_n or lower n_commit"))
        return issues

    def continuation_cap(self) -> str:
        # commit_order arrival takes the first passed pilots in dispatch order; max_variance ranks them all
        return "dispatch" if self.commit_order == "arrival" else "any"

    def allocate(self, batch: Batch, score: Score, step: int, budget: Budget) -> Allocation:
        if score.counts is None or score.totals is None:
            raise BatchFieldError(self.who, "score.counts", "needs the integer right/total counts of each group "
                                  "(scorer group_solve_rate)")
        real = batch.valid_rows
        gi, ng = batch.group_index, batch.num_groups
        if budget.round > 0:
            # The commit round is done: the committed groups are those it extended past their pilot.
            if budget.group_size < 1:
                raise BatchFieldError(self.who, "budget_group_size", "tells the committed groups (longer than "
                                      "their pilot of the host's group size) apart; this host gives no group size")
            committed = real & (batch.group_sizes[gi.clamp_min(0)] > budget.group_size)
            return Allocation(counts=torch.zeros(len(batch), dtype=torch.long), keep=committed)
        # One count per row, the group's: read it at each group's first row (also its arrival rank).
        first = segment_min(torch.arange(len(batch), dtype=torch.float64), gi, ng).to(torch.long)
        k = score.counts.to(torch.long)[first]
        g = score.totals.to(torch.long)[first]
        passed, too_easy, too_hard = pilot_classes(k, g, self.diversity_threshold_lower,
                                                   self.diversity_threshold_upper)
        order = commit_order(k, g, first, self.commit_order)
        take = min(budget.prompts, int(passed.sum()))
        chosen = torch.zeros(ng, dtype=torch.bool)
        chosen[order[passed[order]][:take]] = True
        go_on = real & chosen[gi.clamp_min(0)]
        metrics = {"pilot_commit/passed_groups": float(passed.sum()), "pilot_commit/too_easy_groups":
                   float(too_easy.sum()), "pilot_commit/too_hard_groups": float(too_hard.sum()),
                   "pilot_commit/committed_groups": float(take),
                   "pilot_commit/unused_passed_groups": float(int(passed.sum()) - take)}
        return Allocation(counts=torch.where(go_on, self.n_commit, 0), keep=go_on, metrics=metrics)


# ---------------------------------------------------------------------------- eviction of solved prompts
class MaxSolveRate(Scorer):
    """Pre-rollout: the highest success rate (reward > 0.5) of any visit of the prompt so far, 0 for a prompt
    never rolled out; kept as per-prompt state in the bus's history (updated at every visit, whole groups:
    a committed visit counts its pilot and commit rollouts together)."""

    requires: ClassVar = ("prompt_index",)
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"
    uses_history: ClassVar = True
    params: ClassVar = {}

    STATE = "max_solve_rate"

    def prompt_state(self) -> PromptState:
        return PromptState(self.STATE, (0.0,))

    def update_prompt_state(self, state: Tensor, visits: Visits) -> Tensor:
        size = visits.size.to(torch.float64)
        rate = torch.where(size > 0, visits.successes.to(torch.float64) / size.clamp_min(1), 0.0)
        return torch.maximum(state, rate[:, None])

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        best = batch[f"history_{self.STATE}"][:, 0].to(torch.float64)
        valid = batch.valid_rows
        real = max(int(valid.sum()), 1)
        metrics = {"max_solve_rate/solved": float((valid & (best >= 1.0)).sum()) / real}
        return Score(values=torch.where(valid, best, 0.0), granularity="prompt", metrics=metrics)


class ExcludeSolved(Selector):
    """Drop the prompts whose score is at least ``exclude_threshold`` (Pilot-Commit's ``exclude_batch``: a
    pilot mean ``>= exclude_threshold_upper`` evicts the prompt from later sampling); fed ``max_solve_rate``
    before generation, an evicted prompt is never generated again."""

    accepts: ClassVar = ("prompt",)
    intended_scorers: ClassVar = ("max_solve_rate",)
    params: ClassVar = {
        # A solve rate lies in [0, 1]: at 0 or below every prompt (a never-rolled-out one scores 0) would count
        # as evicted, above 1 none ever would.
        "exclude_threshold": Param(float, 1.0, low=0.0, high=1.0, low_open=True,
                                   doc="evict a prompt once a visit solved at least this share (the official "
                                   "exclude_threshold_upper: 1.0, every pilot rollout right)"),
    }
    exclude_threshold: float

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        return granularity == "prompt"

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        evicted = score.values.to(torch.float64) >= self.exclude_threshold
        keep = batch.valid_rows & ~evicted
        return Selection(keep=keep, metrics={"exclude_solved/excluded": float((batch.valid_rows & evicted).sum())})
