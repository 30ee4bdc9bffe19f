"""Pre-rollout prompt selection: GRESO (arXiv 2506.02177), "GRPO with Efficient Selective Rollout".

A prompt whose last visits were zero-variance (every rollout right, or every rollout wrong) is very likely
zero-variance again, and its rollouts would carry no GRPO signal. GRESO skips such prompts *before*
generating for them, probabilistically: the longer the current run of easy (or hard) visits, the more
likely the skip, with a floor that keeps some exploration, since about a fifth of such prompts become
informative again. Two exploration probabilities (one for easy, one for hard prompts) adapt once per step
toward a target share of zero-variance groups among the rollouts.

As a dataflex method this is the scorer ``zero_variance_streak`` (the signed length of a prompt's current
run of easy/hard visits, read from the per-prompt history the bus keeps) times the selector ``greso``
(the skip rule, its random draws and the adaptation). Both act at ``on_prompts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Score, Scorer, Selection, Selector
from dataflex_bus.visits import EASY, HARD, MODES, VisitClasses

_CLASS_PARAMS = ("mode", "easy_min", "hard_max", "tau_easy", "tau_hard", "count_easy", "count_hard")


class ZeroVarianceStreak(Scorer):
    """Signed length of the prompt's current run of zero-variance visits: ``+z`` for ``z`` easy (all right)
    visits in a row, ``-z`` for hard (all wrong), ``0`` otherwise and for a prompt never rolled out.

    The parameters say how the history classifies a visit (:class:`dataflex_bus.visits.VisitClasses`):
    ``mode=zero_variance`` (default) calls a visit easy iff its rewards are all equal and ``>= easy_min``,
    hard iff all equal and ``<= hard_max``; ``mode=greso`` reproduces the GRESO code (group mean
    ``>= tau_easy`` easy, ``<= tau_hard`` hard; the per-step counts use rewards all equal to
    ``count_easy``/``count_hard``). A singleton group is never easy or hard.
    """

    requires: ClassVar = ("history_streak", "history_class")
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"
    uses_history: ClassVar = True
    params: ClassVar = {
        "mode": Param(str, "zero_variance", choices=MODES, doc="how a visit is classified"),
        "easy_min": Param(float, 1.0, doc="zero_variance: an all-equal reward at least this is easy"),
        "hard_max": Param(float, 0.0, doc="zero_variance: an all-equal reward at most this is hard"),
        "tau_easy": Param(float, 0.98, doc="greso: a group mean at least this is easy"),
        "tau_hard": Param(float, 0.11, doc="greso: a group mean at most this is hard"),
        "count_easy": Param(float, 1.0, doc="greso: per-step counts take groups all equal to this as easy"),
        "count_hard": Param(float, 0.1, doc="greso: per-step counts take groups all equal to this as hard"),
    }
    mode: str
    easy_min: float
    hard_max: float
    tau_easy: float
    tau_hard: float
    count_easy: float
    count_hard: float

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        if values["easy_min"] <= values["hard_max"]:
            return [("easy_min", f"easy_min={values['easy_min']!r} must exceed hard_max={values['hard_max']!r}")]
        if values["tau_easy"] <= values["tau_hard"]:
            return [("tau_easy", f"tau_easy={values['tau_easy']!r} must exceed tau_hard={values['tau_hard']!r}")]
        return []

    def visit_classes(self) -> VisitClasses:
        return VisitClasses(**{k: self.config[k] for k in _CLASS_PARAMS})

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        streak = batch["history_streak"].to(torch.long)
        cls = batch["history_class"].to(torch.long)
        signed = torch.where(cls == EASY, streak, torch.where(cls == HARD, -streak, 0))
        signed = torch.where(batch.valid_rows, signed, 0)
        real = max(int(batch.valid_rows.sum()), 1)
        metrics = {"streak/easy": float((signed > 0).sum()) / real, "streak/hard": float((signed < 0).sum()) / real}
        return Score(values=signed.to(torch.float32), granularity="prompt", metrics=metrics)


class Greso(Selector):
    """GRESO's probabilistic skip rule with adaptive exploration probabilities.

    For a candidate with signed streak ``s`` (from ``zero_variance_streak``) the keep probability is
    ``max(p_easy**s, explore_floor)`` if ``s > 0``, ``max(p_hard**-s, explore_floor)`` if ``s < 0`` and 1
    if ``s == 0`` (never seen, or last visit informative); one uniform per candidate per draw from the
    selector's own generator (saved with its state). Once per step, from the first draw of the next step,
    each probability moves by ``step`` toward more skipping when the share of that class among the previous
    step's rolled-out groups reached its target (``target_zero_variance/3`` for easy, ``2/3`` of it for
    hard), toward less otherwise, within ``[p_min, p_max]``; not before ``adapt_from_epoch`` passes over
    the prompts.
    """

    requires: ClassVar = ("history_counts_epoch", "history_counts_step", "history_step_groups",
                          "history_step_easy", "history_step_hard")
    accepts: ClassVar = ("prompt",)
    uses_history: ClassVar = True
    #: The signed streak its keep probabilities are powers of; another scorer's value would be read as one.
    intended_scorers: ClassVar = ("zero_variance_streak",)
    params: ClassVar = {
        "p_easy_init": Param(float, 0.5, low=0.0, high=1.0, doc="initial exploration probability, easy prompts"),
        "p_hard_init": Param(float, 0.5, low=0.0, high=1.0, doc="initial exploration probability, hard prompts"),
        "target_zero_variance": Param(float, 0.25, low=0.0, high=1.0,
                                      doc="target share of zero-variance groups (a third easy, two thirds hard)"),
        "step": Param(float, 0.01, low=0.0, high=1.0, doc="adaptation step of the probabilities"),
        "p_min": Param(float, 0.05, low=0.0, high=1.0, doc="lowest exploration probability"),
        "p_max": Param(float, 0.95, low=0.0, high=1.0, doc="highest exploration probability"),
        "explore_floor": Param(float, 0.01, low=0.0, high=1.0, doc="lowest keep probability of any prompt"),
        "adapt_from_epoch": Param(int, 1, low=0, doc="adapt once this many passes over the prompts are done"),
        "seed": Param(int, 0, low=0, doc="seed of the skip draws"),
    }
    # The parameters, set as attributes by Component.__init__.
    p_easy_init: float
    p_hard_init: float
    target_zero_variance: float
    step: float
    p_min: float
    p_max: float
    explore_floor: float
    adapt_from_epoch: int
    seed: int

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        if values["p_min"] > values["p_max"]:
            return [("p_min", f"p_min={values['p_min']!r} must be <= p_max={values['p_max']!r}")]
        for name in ("p_easy_init", "p_hard_init"):
            if not values["p_min"] <= values[name] <= values["p_max"]:
                return [(name, f"{name}={values[name]!r} must lie in [p_min, p_max] = "
                         f"[{values['p_min']!r}, {values['p_max']!r}]")]
        return []

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.p_easy = float(self.p_easy_init)
        self.p_hard = float(self.p_hard_init)
        self.adapted_through = -1
        self.generator = torch.Generator().manual_seed(int(self.seed))

    def _adapt(self, batch: Batch) -> None:
        counts_step = int(batch["history_counts_step"])
        if counts_step < 0 or counts_step <= self.adapted_through:
            return
        self.adapted_through = counts_step
        groups = int(batch["history_step_groups"])
        # the epoch the counted step ended in, as GRESO's `if epoch > 0` at the end of a step reads it
        if int(batch["history_counts_epoch"]) < self.adapt_from_epoch or groups == 0:
            return
        # R >= target on integer counts against the target as written (0.3, not 0.29999...): exact at the edge.
        alpha, delta = Fraction(repr(float(self.target_zero_variance))), self.step
        easy, hard = int(batch["history_step_easy"]), int(batch["history_step_hard"])
        # Too many zero-variance rollouts of a class: explore it less (a lower p skips more).
        if 3 * easy >= alpha * groups:
            self.p_easy = max(self.p_easy - delta, self.p_min)
        else:
            self.p_easy = min(self.p_easy + delta, self.p_max)
        if 3 * hard >= 2 * alpha * groups:
            self.p_hard = max(self.p_hard - delta, self.p_min)
        else:
            self.p_hard = min(self.p_hard + delta, self.p_max)

    def keep_probability(self, signed: Tensor) -> Tensor:
        """Float64 ``[N]``: each candidate's keep probability from its signed streak at the current ``p_easy``
        and ``p_hard`` (GRESO's ``1 - skip_probability``)."""
        s = signed.to(torch.float64)
        # float64 operands: torch.where on two Python floats would round p to float32 first
        p = torch.tensor([self.p_hard, self.p_easy], dtype=torch.float64)
        base = p[(s > 0).to(torch.long)]
        return torch.where(s != 0, torch.clamp_min(base ** s.abs(), self.explore_floor), 1.0)

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        self._adapt(batch)
        keep_prob = self.keep_probability(score.values)
        u = torch.rand(len(batch), generator=self.generator, dtype=torch.float64)
        valid = batch.valid_rows
        keep = (u < keep_prob) & valid
        real = max(int(valid.sum()), 1)
        return Selection(keep=keep, metrics={"greso/p_easy": self.p_easy, "greso/p_hard": self.p_hard,
                                             "greso/skipped": float((~keep & valid).sum()),
                                             "greso/keep_prob_mean": float(keep_prob[valid].sum()) / real})

    def state_dict(self) -> dict[str, Any]:
        return {"p_easy": self.p_easy, "p_hard": self.p_hard, "adapted_through": self.adapted_through,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.p_easy = float(state["p_easy"])
        self.p_hard = float(state["p_hard"])
        self.adapted_through = int(state["adapted_through"])
        self.generator.set_state(state["generator"])
