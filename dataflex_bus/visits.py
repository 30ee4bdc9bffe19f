"""What a prompt visit is to a component: its class (easy / hard / other) and the history fields the
``on_prompts`` batch carries.

This is part of the plugin contract: a component declaring ``uses_history`` reads the ``history_*``
fields named here and may say how visits are classified (:meth:`Component.visit_classes` returns a
:class:`VisitClasses`). The history itself, kept by the host kit, is :mod:`dataflex_bus.history`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    import torch
    from torch import Tensor

#: Visit classes. A visit is *easy* (all right) or *hard* (all wrong) under :class:`VisitClasses`;
#: anything else, a singleton group included, is *other* and never starts a streak.
OTHER, EASY, HARD = 0, 1, 2
CLASS_NAMES = ("other", "easy", "hard")
#: Recent visits the history keeps per prompt (ring buffer): the width of the ``[N, WINDOW]`` fields.
WINDOW = 4
#: Recent rollout rewards the history keeps per prompt, over its visits (Knapsack RL's reward buffer: 16).
REWARD_WINDOW = 16
#: A rollout is a success when its reward exceeds this: binary 0/1, Knapsack RL's -1/0/1 and GRESO's
#: 0/0.1/1 rewards alike count only the right answers (the per-visit ``history_successes``).
SUCCESS_THRESHOLD = 0.5

#: Per-candidate fields of the ``on_prompts`` batch (``[N]`` unless noted).
CANDIDATE_FIELDS = (
    "prompt_index",          # dense index into the prompt table
    "history_visits",        # rolled-out visits so far
    "history_last_step",     # step of the last visit, -1 if never
    "history_class",         # class of the last visit (OTHER if never)
    "history_streak",        # length of the current run of visits of that class (0 for OTHER / never)
    "history_steps",         # [N, WINDOW] steps of the last visits, most recent first, -1 where none
    "history_means",         # [N, WINDOW] mean reward of those visits, NaN where none
    "history_classes",       # [N, WINDOW] class of those visits, -1 where none
    "history_sizes",         # [N, WINDOW] rollouts of those visits (ragged groups differ), 0 where none
    "history_successes",     # [N, WINDOW] of which successes (reward > SUCCESS_THRESHOLD), 0 where none
    "history_rewards",       # [N, REWARD_WINDOW] the last rollout rewards over the visits, most recent first
                             # (each visit's rows in reverse row order), NaN where none
    "history_reward_count",  # rollout rewards recorded so far (every visit, every row)
)
#: Batch-level (0-dimensional) fields of the ``on_prompts`` batch.
STEP_FIELDS = (
    "history_epoch",         # passes over the prompt table so far (candidates considered // prompts)
    "history_counts_step",   # the completed step the three counts describe, -1 before the first
    "history_counts_epoch",  # the pass its last candidate belonged to ((considered - 1) // prompts), 0 before
    "history_step_groups",   # groups rolled out in that step (every generation round)
    "history_step_easy",     # of which easy (by VisitClasses.count_class)
    "history_step_hard",     # of which hard
)
FIELDS = frozenset(CANDIDATE_FIELDS + STEP_FIELDS)
MODES = ("zero_variance", "greso")


@dataclass(frozen=True)
class PromptState:
    """Per-prompt state a component owns and the history keeps for it (MoPPS's Beta posterior): ``width``
    float64 values per prompt, ``init`` per column for a prompt never visited. The history reads it out at
    ``on_prompts`` as the ``[N, width]`` field :attr:`field` (``history_<name>``), updates it at every visit
    through the component's :meth:`~dataflex_bus.components.Component.update_prompt_state`, and saves it
    with the rest of the history (so a resume on another dataset is refused and a resumed run continues
    exactly). ``success_min`` is the component's own success rule for the :class:`Visits` its update sees: a
    rollout is a success when its reward is at least this (MoPPS's trainer: ``reward >= 1``); ``None``, the
    history's rule (reward above :data:`SUCCESS_THRESHOLD`)."""

    name: str
    init: tuple[float, ...]
    success_min: float | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or f"history_{self.name}" in FIELDS:
            raise ConfigError(ConfigIssue("prompt_state", f"{self.name!r} must be an identifier naming no "
                                          "built-in history field"))
        if not self.init:
            raise ConfigError(ConfigIssue("prompt_state", f"{self.name!r}: give at least one initial value"))
        if self.success_min is not None and not math.isfinite(self.success_min):
            raise ConfigError(ConfigIssue("prompt_state", f"{self.name!r}: success_min must be finite, got "
                                          f"{self.success_min!r}"))

    @property
    def field(self) -> str:
        return f"history_{self.name}"

    @property
    def width(self) -> int:
        return len(self.init)


@dataclass(frozen=True)
class Visits:
    """Visits handed to :meth:`~dataflex_bus.components.Component.update_prompt_state`: one per rolled-out
    group of distinct prompts (``prompt``, long ``[V]``, dense indices), its rollouts (``size``) and successes
    (``successes``: by the state's :attr:`PromptState.success_min` if it sets one, else reward >
    :data:`SUCCESS_THRESHOLD`), both long ``[V]``, and the step."""

    prompt: Tensor
    size: Tensor
    successes: Tensor
    step: int


@dataclass(frozen=True)
class VisitClasses:
    """How a rolled-out group is classified from its rewards (mean, min, max, size).

    ``zero_variance`` (default): a visit is zero-variance iff all rewards are equal (and the group has
    at least two rows); easy iff also ``reward >= easy_min``, hard iff ``reward <= hard_max``; any other
    zero-variance value (all 0.5) is *other*. ``greso`` (exact reproduction of the GRESO code): easy iff the
    group mean ``>= tau_easy``, hard iff ``<= tau_hard`` (a mix of format errors and wrong answers counts
    as hard although it is not zero-variance).

    :meth:`count_class` is what the per-step counts use (GRESO's exploration-probability adaptation): the
    same as :meth:`classify` in ``zero_variance`` mode; in ``greso`` mode, as GRESO's code counts, a group
    whose rewards all equal ``count_easy`` (resp. ``count_hard``).
    """

    mode: str = "zero_variance"
    easy_min: float = 1.0
    hard_max: float = 0.0
    tau_easy: float = 0.98
    tau_hard: float = 0.11
    count_easy: float = 1.0
    count_hard: float = 0.1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(ConfigIssue("mode", f"{self.mode!r} is not a visit-class mode", MODES))

    def classify(self, mean: Tensor, low: Tensor, high: Tensor, size: Tensor,
                 dtype: torch.dtype | None = None) -> Tensor:
        """Long ``[G]``: the class of each visit (streak rule). ``dtype``: the rewards' own dtype (see
        :meth:`count_class`); the reward values ``easy_min``/``hard_max`` are rounded to it."""
        groups = size > 1  # a singleton is trivially "all equal": never a streak (P1.8)
        if self.mode == "greso":  # GRESO compares the group mean with its thresholds as Python floats
            easy = groups & (mean >= self.tau_easy)
            hard = groups & (mean <= self.tau_hard) & ~easy
        else:
            zv = groups & (low == high)
            easy = zv & (low >= _as(self.easy_min, dtype))
            hard = zv & (high <= _as(self.hard_max, dtype)) & ~easy
        return _classes(easy, hard)

    def count_class(self, mean: Tensor, low: Tensor, high: Tensor, size: Tensor,
                    dtype: torch.dtype | None = None) -> Tensor:
        """Long ``[G]``: the class each visit counts as in the per-step counts. ``dtype``: the dtype the rewards
        came in (``low``/``high`` may be wider): ``count_easy``/``count_hard`` are rounded to it first, as
        GRESO's float32 ``reward == 0.1`` does (a float32 0.1 is not the float64 0.1)."""
        if self.mode != "greso":
            return self.classify(mean, low, high, size, dtype)
        same = (size > 1) & (low == high)
        return _classes(same & (low == _as(self.count_easy, dtype)), same & (low == _as(self.count_hard, dtype)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as(value: float, dtype: torch.dtype | None) -> float:
    """``value`` rounded to ``dtype`` (as a tensor of that dtype compared with a Python float holds it)."""
    import torch

    return value if dtype is None else float(torch.tensor(value, dtype=dtype))


def _classes(easy: Tensor, hard: Tensor) -> Tensor:
    import torch

    return torch.where(easy, EASY, torch.where(hard, HARD, OTHER)).to(torch.long)
