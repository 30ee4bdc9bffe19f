"""Model-predictive prompt selection: MoPPS (arXiv 2507.04632, code ``thu-rllab/MoPPS``).

Each prompt keeps a Beta posterior over its success rate, updated after every rollout of it and decayed
toward the prior; before generation the host draws a pool of ``pool x B`` candidates, every candidate gets
one Thompson draw ``g ~ Beta(alpha, beta)``, and the ``B`` candidates whose draw is closest to the target rate
(0.5: the most informative) are generated, with the host's usual group size. So it is a pre-rollout
*selector* (mechanism ``select``), and works on every host that selects prompts, TRL's included.

As a dataflex method: the scorer ``mopps`` (the posterior, kept as per-prompt state in the history, and
the draws) times the selector ``top_b`` (the ``B`` best of the pool). Spec: ``allocation.md`` section 4.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Score, Scorer, Selection, Selector
from dataflex_bus.visits import PromptState, Visits

STRATEGIES = ("topk", "threshold")


class Mopps(Scorer):
    """MoPPS's posterior and Thompson draw (``recipe/ours/mopps.py``). Per prompt ``(alpha, beta)`` start at the
    prior and after every visit of ``k`` rollouts with ``s`` successes (reward ``>= success_min``, 1.0 as the
    authors' trainer counts them, ``our_ray_trainer.py:451``) become
    ``alpha <- decay * alpha + (1 - decay) * prior_alpha + s`` and ``beta <- decay * beta + (1 - decay) * prior_beta
    + (k - s)`` (the README's formula with the group's own size, so ragged groups count right; the official code
    multiplies the success rate by ``rollout.n``, the same for uniform groups, and its precedence quirk sets
    ``(8, 8)`` at ``rollout.n = 1``). A prompt not rolled out is neither updated nor decayed. Score: one draw
    ``g`` per candidate per draw, ``-(g - target_mean)^2`` (``topk``, the paper's) or ``-`` the distance of ``g``
    outside ``[lower, upper]`` (``threshold``: inside the band every candidate ties at 0, and ``top_b`` keeps the
    first in draw order, a uniformly random subset of them as the official shuffle is). Draws from the
    scorer's own NumPy generator (seeded by ``seed``, saved in its state)."""

    requires: ClassVar = ("prompt_index",)
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"
    uses_history: ClassVar = True
    params: ClassVar = {
        "prior_alpha": Param(float, 1.0, low=0.0, low_open=True, doc="Beta prior alpha (a never-seen prompt)"),
        "prior_beta": Param(float, 1.0, low=0.0, low_open=True, doc="Beta prior beta"),
        "decay": Param(float, 1.0, low=0.0, high=1.0, doc="lambda: weight of the old posterior at each visit (1: "
                       "no forgetting, MoPPS's MATH default; 0.5 for Countdown and Geometry3k)"),
        "strategy": Param(str, "topk", choices=STRATEGIES, doc="closest to target_mean, or inside [lower, upper]"),
        "target_mean": Param(float, 0.5, low=0.0, high=1.0, doc="the success rate to select for"),
        "lower": Param(float, 0.3, low=0.0, high=1.0, doc="threshold: lower edge of the band"),
        "upper": Param(float, 0.7, low=0.0, high=1.0, doc="threshold: upper edge of the band"),
        "seed": Param(int, 0, low=0, doc="seed of the Thompson draws"),
        # Rewards lie in [0, 1] (the authors' acc): at or below 0 every rollout would be a success, above 1 none,
        # and every posterior would drift to one end.
        "success_min": Param(float, 1.0, low=0.0, high=1.0, low_open=True,
                             doc="a rollout is a success when its reward is at least this (1.0: the authors' "
                             "trainer, acc >= 1; the bus's history counts rewards above 0.5)"),
    }
    prior_alpha: float
    prior_beta: float
    decay: float
    strategy: str
    target_mean: float
    lower: float
    upper: float
    seed: int
    success_min: float

    STATE = "beta_posterior"

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        if values["lower"] > values["upper"]:
            return [("lower", f"lower={values['lower']!r} must be <= upper={values['upper']!r}")]
        return []

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.rng = np.random.Generator(np.random.PCG64(int(self.seed)))

    def prompt_state(self) -> PromptState:
        return PromptState(self.STATE, (float(self.prior_alpha), float(self.prior_beta)),
                           success_min=float(self.success_min))

    def update_prompt_state(self, state: Tensor, visits: Visits) -> Tensor:
        lam = float(self.decay)
        prior = torch.tensor([self.prior_alpha, self.prior_beta], dtype=torch.float64)
        s = visits.successes.to(torch.float64)
        observed = torch.stack([s, visits.size.to(torch.float64) - s], dim=1)
        return lam * state + (1 - lam) * prior + observed

    def draw(self, alpha: Tensor, beta: Tensor) -> Tensor:
        """One Thompson draw per candidate (float64)."""
        return torch.from_numpy(self.rng.beta(alpha.numpy(), beta.numpy()))

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        posterior = batch[f"history_{self.STATE}"].to(torch.float64)
        alpha, beta = posterior[:, 0], posterior[:, 1]
        g = self.draw(alpha, beta)
        if self.strategy == "topk":
            values = -(g - self.target_mean) ** 2
        else:
            values = -(torch.clamp(self.lower - g, min=0) + torch.clamp(g - self.upper, min=0))
        valid = batch.valid_rows
        real = max(int(valid.sum()), 1)
        mean = alpha / (alpha + beta)
        metrics = {"mopps/posterior_mean": float(mean[valid].sum()) / real,
                   "mopps/draw_mean": float(g[valid].sum()) / real}
        return Score(values=torch.where(valid, values, 0.0), granularity="prompt", metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = dict(state["rng"])


class TopB(Selector):
    """Keep the ``B`` highest-scoring candidates of a draw, ``B`` the prompts the step still needs
    (``budget_prompts``); the host draws a pool of ``pool x B`` candidates at once (at most
    ``dataflex.max_oversample x B``). Ties go to the earlier candidate (MoPPS's ``np.argsort`` is not stable,
    so the official order among ties is unspecified). A pool smaller than ``B`` keeps all of it, and the host
    draws more."""

    requires: ClassVar = ("budget_prompts",)
    accepts: ClassVar = ("prompt",)
    intended_scorers: ClassVar = ("mopps", "predicted")
    params: ClassVar = {
        "pool": Param(float, 8.0, low=1.0, doc="candidates drawn per prompt generated (MoPPS's ts_ratio: 8 for "
                      "Countdown, 16 for MATH)"),
    }
    pool: float

    def candidates_per_prompt(self) -> float:
        return float(self.pool)

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        valid = batch.valid_rows
        b = min(int(batch["budget_prompts"]), int(valid.sum()))
        values = torch.where(valid, score.values.to(torch.float64), float("-inf"))
        order = torch.sort(values, descending=True, stable=True).indices[:b]
        keep = torch.zeros(len(batch), dtype=torch.bool)
        keep[order] = True
        return Selection(keep=keep & valid, metrics={"top_b/kept": float(b), "top_b/pool": float(valid.sum())})
