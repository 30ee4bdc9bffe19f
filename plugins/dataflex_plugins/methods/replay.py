"""The built-in replayer (mechanism ``replay``): RePO's and DOTS's rollout replay as options of one component.

``rollout_replay`` stores every fresh row of a step (its score as priority) and, at later steps, picks stored
rows by ``priority``: per prompt the step generates (``unit: prompt``, RePO arXiv 2506.09340) or whole stored
groups in place of fresh ones (``unit: group``, DOTS arXiv 2506.05316). The buffer, the advantage grouping and
the off-policy correction are the host kit's (:mod:`dataflex_bus.replay`), set by this component's parameters.
Everything runs on whole tensors: one stable sort (or a segment scan) per pick, no loop over prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus import Param
from dataflex_bus.components import (
    REPLAY_ADVANTAGES,
    REPLAY_CORRECTIONS,
    REPLAY_UNITS,
    Replayer,
    ReplayPick,
    ReplayPool,
    ReplaySettings,
)
from dataflex_bus.ops import segment_count, segment_max, segment_sum

from .select import max_variance_subsets

PRIORITIES = ("uniform", "highest", "recent", "max_variance", "proportional")


class RolloutReplay(Replayer):
    """Rollout replay: store fresh rows, replay stored ones by priority, corrected for being off-policy.

    ``priority`` (over the stored score, e.g. ``reward_difficulty``'s reward): ``uniform`` (random, without
    replacement), ``highest`` (largest first, older first among ties: RePO's ``highest_k``), ``recent`` (the
    newest: ``recent_k``, in the order they were stored), ``max_variance`` (the subset of largest population
    variance, larger sum among ties, the earliest rows among equal values: ``max_variance_k`` without its
    exhaustive search), ``proportional`` (probability ``(|score| + eps)^alpha``, PER's importance weights
    ``(N P)^-beta / max``). Under ``unit: group`` a stored group's priority is its mean score (``max_variance``:
    the variance of its scores, TRL's rule for which groups are worth keeping).
    """

    params: ClassVar = {
        "unit": Param(str, "group", choices=REPLAY_UNITS,
                      doc="group: whole stored groups replace fresh ones (DOTS); prompt: stored rows join the "
                          "prompts the step generates (RePO)"),
        "priority": Param(str, "uniform", choices=PRIORITIES, doc="which stored rows (or groups) are replayed"),
        "advantage": Param(str, "own_group", choices=REPLAY_ADVANTAGES,
                           doc="the group a replayed row's GRPO advantage is normalised in: the rows it was generated "
                               "with, its prompt's replayed rows, or its prompt's fresh rows too"),
        "correction": Param(str, "decoupled", choices=REPLAY_CORRECTIONS,
                            doc="decoupled: every row weighted by min(pi_old / mu, is_cap) (DOTS); behaviour: the PPO "
                                "ratio of replayed rows clipped against the stored mu (RePO)"),
        "is_cap": Param(float, 2.0, low=0.0, low_open=True,
                        doc="decoupled: truncation of pi_old / mu (verl's rollout_is_threshold; DOTS: none)"),
        "fresh_fraction": Param((float, type(None)), None, low=0.0, high=1.0, low_open=True,
                                doc="share of a step's prompts generated fresh (default: 0.5 under unit group, "
                                    "DOTS's; 1.0 under unit prompt, the only value it takes)"),
        "capacity": Param(int, 4096, low=1, doc="rows the buffer holds (the oldest groups leave first)"),
        "per_prompt": Param(int, 0, low=0, doc="rows per prompt at most, the oldest leave first (RePO: 16; 0: none)"),
        "min_to_replay": Param(int, 1, low=1, doc="unit prompt: rows of a prompt stored before any is replayed "
                                                  "(RePO: 16)"),
        "replays": Param(int, 8, low=1, doc="unit prompt: rows replayed per prompt at most (RePO: 8)"),
        "max_age_steps": Param(int, 0, low=0, doc="records older than this many steps leave (0: never; DOTS-style 2)"),
        "dedup": Param(bool, False, doc="keep only each prompt's newest stored group (DOTS)"),
        "alpha": Param(float, 0.6, low=0.0, doc="proportional: priority exponent"),
        "beta": Param(float, 0.4, low=0.0, high=1.0, doc="proportional: importance-weight exponent"),
        "eps": Param(float, 1e-6, low=0.0, low_open=True, doc="proportional: added to |score|"),
        "off_policy_coef": Param(float, 1.0, low=0.0, doc="factor on the loss of replayed rows (RePO's c_off)"),
        "seed": Param(int, 0, doc="seed of the random picks"),
    }
    unit: str
    priority: str
    advantage: str
    correction: str
    is_cap: float
    fresh_fraction: float | None
    capacity: int
    per_prompt: int
    min_to_replay: int
    replays: int
    max_age_steps: int
    dedup: bool
    alpha: float
    beta: float
    eps: float
    off_policy_coef: float
    seed: int

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.generator = torch.Generator().manual_seed(int(self.seed))

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        issues = []
        fresh = values["fresh_fraction"]
        if values["unit"] == "prompt" and fresh not in (None, 1.0):
            issues.append(("fresh_fraction", "unit prompt adds stored rows to the prompts a step generates; every "
                                             "prompt is generated (fresh_fraction 1.0)"))
        if values["per_prompt"] and values["per_prompt"] < values["min_to_replay"]:
            issues.append(("min_to_replay", f"{values['min_to_replay']} rows can never be stored for a prompt "
                                            f"(per_prompt={values['per_prompt']}): nothing would be replayed"))
        if values["unit"] == "group" and fresh == 1.0:
            issues.append(("fresh_fraction", "unit group replays stored groups in place of fresh ones; with every "
                                             "prompt fresh (1.0) nothing is replayed: set it below 1 (DOTS: 0.5)"))
        return issues

    def settings(self) -> ReplaySettings:
        return ReplaySettings(unit=self.unit, advantage=self.advantage, correction=self.correction,
                              capacity=self.capacity, per_prompt=self.per_prompt, min_to_replay=self.min_to_replay,
                              replays=self.replays, max_age_steps=self.max_age_steps,
                              fresh_fraction=self.fresh_share, dedup=self.dedup, is_cap=self.is_cap,
                              off_policy_coef=self.off_policy_coef)

    @property
    def fresh_share(self) -> float:
        """``fresh_fraction``, or its default for the unit (DOTS's 0.5; every prompt under unit prompt)."""
        if self.fresh_fraction is not None:
            return self.fresh_fraction
        return 0.5 if self.unit == "group" else 1.0

    # ------------------------------------------------------------------ picking
    def pick(self, pool: ReplayPool, step: int) -> ReplayPick:
        if self.unit == "group":
            return self._pick_groups(pool)
        return self._pick_rows(pool)

    def _pick_rows(self, pool: ReplayPool) -> ReplayPick:
        """Per segment (prompt) ``want`` rows; the pool lists each segment's rows oldest first."""
        seg, num, want = pool.segment, pool.num_segments, pool.want
        n = seg.numel()
        position = torch.arange(n, dtype=torch.float64)
        weights = None
        if self.priority == "max_variance":
            keep = max_variance_subsets(pool.priority, seg, num, want, larger_sum_first=True)
            keep = _earliest_among_equals(keep, pool.priority, seg)
            return ReplayPick(torch.nonzero(keep).flatten())
        if self.priority == "highest":
            key = -pool.priority.to(torch.float64)
        elif self.priority == "recent":
            key = -pool.seq.to(torch.float64)
        elif self.priority == "uniform":
            key = torch.rand(n, generator=self.generator, dtype=torch.float64)
        else:
            logp = self.alpha * torch.log(pool.priority.abs().to(torch.float64) + self.eps)
            key = _gumbel_keys(logp, self.generator)
        rank, order = _rank_within(seg, key, position)
        chosen = order[rank[order] < want[seg[order]]]
        if self.priority == "recent":
            # recent_k: the newest k in the order they were stored (RePO's deque order).
            chosen = chosen[torch.argsort(seg[chosen] * (n + 1) + position[chosen].to(torch.long), stable=True)]
        if self.priority == "proportional":
            weights = _per_weights(logp, seg, num, chosen, self.beta)
        return ReplayPick(chosen, weights)

    def _pick_groups(self, pool: ReplayPool) -> ReplayPick:
        """``groups`` whole stored groups (segments, oldest first)."""
        seg, num = pool.segment, pool.num_segments
        score = pool.priority.to(torch.float64)
        sizes = segment_count(seg, num).to(torch.float64)
        mean = segment_sum(score, seg, num) / sizes
        newest = segment_max(pool.seq.to(torch.float64), seg, num)
        weights_g = None
        if self.priority == "uniform":
            order = torch.randperm(num, generator=self.generator)
        elif self.priority == "recent":
            order = torch.argsort(-newest, stable=True)
        elif self.priority == "highest":
            order = torch.argsort(-mean, stable=True)
        elif self.priority == "max_variance":
            var = segment_sum(score * score, seg, num) / sizes - mean * mean
            order = torch.argsort(-var, stable=True)
        else:
            mag = segment_sum(score.abs(), seg, num) / sizes
            logp = self.alpha * torch.log(mag + self.eps)
            one = torch.zeros(num, dtype=torch.long)
            key = _gumbel_keys(logp, self.generator)
            order = torch.argsort(key, stable=True)
            weights_g = _per_weights(logp, one, 1, order[:pool.groups], self.beta)
        chosen = order[:pool.groups]
        rank = torch.full((num,), num, dtype=torch.long)
        rank[chosen] = torch.arange(chosen.numel())
        rows = torch.nonzero(rank[seg] < num).flatten()
        # Training order: the groups in pick order, rows of a group in stored order.
        rows = rows[torch.argsort(rank[seg[rows]], stable=True)]
        weights = None
        if weights_g is not None:
            per_group = torch.zeros(num, dtype=torch.float32)
            per_group[chosen] = weights_g
            weights = per_group[seg[rows]]
        return ReplayPick(rows, weights)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def _rank_within(segment: Tensor, key: Tensor, tiebreak: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's rank within its segment by ``key`` ascending (ties by ``tiebreak``), and the rows in
    (segment, rank) order."""
    order = torch.argsort(tiebreak, stable=True)
    order = order[torch.sort(key[order], stable=True).indices]
    order = order[torch.sort(segment[order], stable=True).indices]
    counts = segment_count(segment, int(segment.max()) + 1 if segment.numel() else 0)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(segment)
    rank[order] = torch.arange(segment.numel()) - starts[segment[order]]
    return rank, order


def _earliest_among_equals(keep: Tensor, values: Tensor, segment: Tensor) -> Tensor:
    """The same count of rows per (segment, value) as ``keep``, taken from the earliest rows of each: the
    lexicographically first of the subsets with the same values."""
    n = segment.numel()
    position = torch.arange(n)
    _, order = _rank_within(segment, values.to(torch.float64), position.to(torch.float64))
    seg_sorted, val_sorted = segment[order], values[order]
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = (seg_sorted[1:] != seg_sorted[:-1]) | (val_sorted[1:] != val_sorted[:-1])
    run = torch.cumsum(new_run.to(torch.long), 0) - 1
    runs = int(run.max()) + 1 if n else 0
    chosen = segment_sum(keep[order].to(torch.float64), run, runs)
    run_start = torch.nonzero(new_run).flatten()
    in_run = torch.arange(n) - run_start[run]
    out = torch.zeros(n, dtype=torch.bool)
    out[order] = in_run < chosen[run].to(torch.long)
    return out


def _gumbel_keys(logp: Tensor, generator: torch.Generator) -> Tensor:
    """Sort keys (ascending) that pick rows without replacement with probability proportional to ``exp(logp)``
    within each segment they are ranked in (the Gumbel top-k trick: one uniform per row)."""
    u = torch.rand(logp.numel(), generator=generator, dtype=torch.float64).clamp(1e-300, 1.0)
    return -(logp - torch.log(-torch.log(u)))


def _per_weights(logp: Tensor, segment: Tensor, num: int, chosen: Tensor, beta: float) -> Tensor:
    """PER's importance weights of the ``chosen`` rows: ``(N P(i))^-beta`` with ``P`` the sampling probability
    within its segment of ``N`` rows, over the largest of them."""
    top = segment_max(logp, segment, num)
    z = segment_sum(torch.exp(logp - top[segment]), segment, num)
    log_p = logp - top[segment] - torch.log(z[segment])
    count = segment_count(segment, num).to(torch.float64)
    w = torch.exp(-beta * (torch.log(count[segment]) + log_p))[chosen]
    return (w / w.max()).to(torch.float32) if w.numel() else w.to(torch.float32)
