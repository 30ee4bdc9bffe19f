"""The built-in predictors (:mod:`dataflex_bus.predictor`) and the scorer that reads their prediction.

``cures``: CurES's Beta posterior on a prompt's success rate (code ``ZexuSun/CurES``, commit ``eccf298``).
``dps``: DPS's per-prompt hidden Markov model over the solve state (code ``maoyixiu/DPS``, commit ``5654d52``).
``vip``: VIP's Gaussian process over a prompt's recent outcomes (paper only: ``HieuNT91/VIP`` at ``3604dd4`` holds
a README and a licence). Every update and prediction runs on whole tensors over the prompts it touches.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Score, Scorer
from dataflex_bus.errors import BatchFieldError
from dataflex_bus.predictor import P_FIELD, Observation, Prediction, Predictor

F64 = torch.float64


class Cures(Predictor):
    """CurES (arXiv 2510.01037): per prompt the counts of accepted and all rollouts; ``p`` is the mean of
    ``Beta(accepted + prior_alpha, rejected + prior_beta)`` (``EpicSampler.update_difficulty``: the prior is
    ``Beta(1, 1)``), so a prompt never seen predicts ``prior_alpha / (prior_alpha + prior_beta)``. Column
    ``accepted``: the accepted count, the temperature of CurES's sampling (``t = (accepted + 1) / 0.01``)."""

    columns: ClassVar = ("accepted",)
    params: ClassVar = {
        "prior_alpha": Param(float, 1.0, low=0.0, low_open=True, doc="Beta prior on successes (CurES: 1)"),
        "prior_beta": Param(float, 1.0, low=0.0, low_open=True, doc="Beta prior on failures (CurES: 1)"),
    }
    prior_alpha: float
    prior_beta: float

    def bind(self, prompts: int) -> None:
        self.counts = torch.zeros(prompts, 2, dtype=F64)  # accepted, all

    def observe(self, seen: Observation) -> None:
        self.counts[seen.prompt, 0] += seen.successes.to(F64)
        self.counts[seen.prompt, 1] += seen.size.to(F64)

    def predict(self, prompt: Tensor, step: int) -> Prediction:
        c = self.counts[prompt]
        a = c[:, 0] + self.prior_alpha
        b = c[:, 1] - c[:, 0] + self.prior_beta
        return Prediction(a / (a + b), {"accepted": c[:, 0].clone()})

    def tensors(self) -> dict[str, Tensor]:
        return {"counts": self.counts}


#: DPS's transition priors (``task_sampler.py``): a number fills the 3x3 matrix.
DPS_PRIORS = {
    "progress": [[1.0, 0.5, 0.5], [1.0, 1.0, 0.5], [1.0, 1.0, 1.0]],
    "stability": [[1.0, 0.5, 0.5], [0.5, 1.0, 0.5], [0.5, 0.5, 1.0]],
    "local": [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
}
DPS_PI = {"uniform": [1 / 3, 1 / 3, 1 / 3], "1": [1.0, 0.0, 0.0], "2": [0.0, 1.0, 0.0], "3": [0.0, 0.0, 1.0]}


def dps_expected(alpha: Tensor) -> Tensor:
    """The expected transition matrices ``[V, 3, 3]`` (columns: from-state, normalised; ``P[i, j] = P(i | j)``)."""
    return alpha / alpha.sum(dim=1, keepdim=True)


def dps_step(alpha: Tensor, pi_before: Tensor, pi_new: Tensor, prior: Tensor, decay: float,
             learning_rate: float) -> tuple[Tensor, Tensor]:
    """One DPS update of ``V`` prompts (``update_transition_params`` then ``predict_next_state``): the new
    Dirichlet parameters and the predicted next-state distribution."""
    p = dps_expected(alpha)
    numerator = pi_new[:, :, None] * pi_before[:, None, :] * p
    # A transition the prior forbids (the `local` prior's 0 -> 2) has no mass: no soft count (the authors'
    # code divides 0 by 0 there and carries NaN on)
    total = numerator.sum(dim=(1, 2), keepdim=True)
    update = torch.where(total > 0, numerator / total.clamp_min(1e-300), 0.0) * learning_rate
    alpha_new = alpha * decay + prior * (1 - decay) + update
    nxt = (dps_expected(alpha_new) @ pi_new[:, :, None]).squeeze(-1)
    nxt = nxt / nxt.sum(dim=1, keepdim=True)
    return alpha_new, nxt / nxt.sum(dim=1, keepdim=True)


class Dps(Predictor):
    """DPS (ICLR 2026, ``recipe/dps/task_sampler.py``: ``BayesianHMMSampler``). Each prompt has a Dirichlet
    posterior over a 3x3 transition matrix between the solve states (0: unsolved, 1: partially solved,
    2: solved) and a predicted state distribution ``pi``. A rolled-out group is observed as the state of its
    success rate (0, in between, 1); the transitions get the soft count of (last state -> observed state),
    after decaying toward the prior, and ``pi`` becomes the expected matrix times the observed state. At the
    end of each step every known prompt not rolled out in it takes the update without an observation (decay
    only, ``pi`` propagated one step): a prompt is known once it was a candidate or rolled out, as the
    authors' dictionaries fill. Columns: ``partial`` (``pi[1]``, DPS's ``topk`` selection score) and
    ``entropy``. ``p``: ``pi[1] * m + pi[2]``, with ``m`` the mean success rate of the partially solved groups
    observed so far (0.5 before the first)."""

    columns: ClassVar = ("partial", "entropy")
    params: ClassVar = {
        "prior": Param(str, "uniform", choices=("uniform", *DPS_PRIORS),
                       doc="transition prior: uniform (every entry prior_value) or the authors' named matrices"),
        "prior_value": Param(float, 1.0, low=0.0, low_open=True, doc="the uniform prior's entry (hmm_prior_alpha)"),
        "prior_pi": Param(str, "uniform", choices=tuple(DPS_PI), doc="initial state distribution (hmm_prior_pi)"),
        "decay": Param(float, 0.7, low=0.0, high=1.0,
                       doc="hmm_transition_decay_ratio: weight of the old counts (0.7 in the authors' scripts)"),
    }
    prior: str
    prior_value: float
    prior_pi: str
    decay: float

    def bind(self, prompts: int) -> None:
        prior = (torch.tensor(DPS_PRIORS[self.prior], dtype=F64) if self.prior in DPS_PRIORS
                 else torch.full((3, 3), float(self.prior_value), dtype=F64))
        self.prior_matrix = prior
        pi0 = torch.tensor(DPS_PI[self.prior_pi], dtype=F64)
        self.alpha = prior.expand(prompts, 3, 3).clone()
        self.pi = pi0.expand(prompts, 3).clone()
        self.pi_before = pi0.expand(prompts, 3).clone()
        self.known = torch.zeros(prompts, dtype=torch.bool)
        self.visited = torch.zeros(prompts, dtype=torch.bool)
        self.times = torch.zeros(prompts, dtype=torch.long)
        self.partial = torch.tensor([0.0, 0.0], dtype=F64)  # sum and count of partially solved rates

    def observe(self, seen: Observation) -> None:
        rate = seen.rate
        state = torch.where(rate <= 0, 0, torch.where(rate >= 1, 2, 1))
        pi_new = torch.nn.functional.one_hot(state, 3).to(F64)
        at = seen.prompt
        alpha, nxt = dps_step(self.alpha[at], self.pi_before[at], pi_new, self.prior_matrix, float(self.decay), 1.0)
        self.alpha[at], self.pi[at], self.pi_before[at] = alpha, nxt, pi_new
        self.known[at] = True
        self.visited[at] = True
        self.times[at] += 1
        mid = state == 1
        self.partial += torch.stack([rate[mid].sum(), mid.sum().to(F64)])

    def end_step(self, step: int) -> None:
        idle = torch.nonzero(self.known & ~self.visited).flatten()
        if idle.numel():
            pi = self.pi[idle]
            alpha, nxt = dps_step(self.alpha[idle], self.pi_before[idle], pi, self.prior_matrix,
                                  float(self.decay), 0.0)
            self.alpha[idle], self.pi[idle], self.pi_before[idle] = alpha, nxt, pi
        self.visited.zero_()

    def predict(self, prompt: Tensor, step: int) -> Prediction:
        self.known[prompt] = True
        pi = self.pi[prompt]
        m = self.partial[0] / self.partial[1] if float(self.partial[1]) > 0 else torch.tensor(0.5, dtype=F64)
        entropy = -(pi * torch.log(pi + 1e-10)).sum(dim=1)
        p = (pi[:, 1] * m + pi[:, 2]).clamp(0.0, 1.0)
        return Prediction(p, {"partial": pi[:, 1].clone(), "entropy": entropy})

    def tensors(self) -> dict[str, Tensor]:
        return {"alpha": self.alpha, "pi": self.pi, "pi_before": self.pi_before, "known": self.known,
                "visited": self.visited, "times": self.times, "partial": self.partial}


class Vip(Predictor):
    """VIP (ICLR 2026, "Adaptive Rollout Allocation for Online RL with Verifiable Rewards"; no code published).
    A Gaussian process predicts each prompt's success rate from its recent outcomes: the data are the prompt's
    last ``window`` observed group success rates at the steps they were observed, an RBF kernel over steps
    (``amplitude``, ``lengthscale``) plus ``noise``, and the prior mean ``m`` the mean rate of the groups of the
    last step observed (0.5 before any), which is also what a prompt never seen predicts. The posterior mean at
    the step predicted for, clipped to [0, 1], is ``p``; column ``std``: the posterior standard deviation.
    Where ours may differ from the authors': the paper's GP input is a prompt representation; hosts give none,
    so each prompt's own visits in time are the GP's data (batched ``[N, window, window]`` solves)."""

    columns: ClassVar = ("std",)
    params: ClassVar = {
        "window": Param(int, 4, low=1, high=32, doc="recent visits per prompt the GP conditions on"),
        "lengthscale": Param(float, 20.0, low=0.0, low_open=True, doc="RBF lengthscale, in steps"),
        "amplitude": Param(float, 0.05, low=0.0, low_open=True, doc="RBF prior variance of the rate"),
        "noise": Param(float, 0.02, low=0.0, low_open=True, doc="observation noise variance of a group's rate"),
    }
    window: int
    lengthscale: float
    amplitude: float
    noise: float

    def bind(self, prompts: int) -> None:
        w = int(self.window)
        self.rates = torch.zeros(prompts, w, dtype=F64)
        self.steps = torch.full((prompts, w), -1.0, dtype=F64)  # -1: no visit in the slot
        self.count = torch.zeros(prompts, dtype=torch.long)
        self.mean = torch.tensor([0.5, 0.0, 0.0], dtype=F64)  # prior mean; this step's sum and count

    def observe(self, seen: Observation) -> None:
        slot = self.count[seen.prompt] % int(self.window)
        self.rates[seen.prompt, slot] = seen.rate
        self.steps[seen.prompt, slot] = float(seen.step)
        self.count[seen.prompt] += 1
        self.mean[1:] += torch.stack([seen.rate.sum(), torch.tensor(float(seen.prompt.numel()), dtype=F64)])

    def end_step(self, step: int) -> None:
        if float(self.mean[2]) > 0:
            self.mean = torch.stack([self.mean[1] / self.mean[2], torch.zeros((), dtype=F64),
                                     torch.zeros((), dtype=F64)])

    def kernel(self, a: Tensor, b: Tensor) -> Tensor:
        return self.amplitude * torch.exp(-0.5 * ((a[..., :, None] - b[..., None, :]) / self.lengthscale) ** 2)

    def posterior(self, prompt: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """GP posterior mean and variance of the rate of ``prompt`` at ``step`` (empty slots carry no weight)."""
        t, y = self.steps[prompt], self.rates[prompt]
        have = t >= 0
        m = self.mean[0]
        k = self.kernel(t, t) * (have[:, :, None] & have[:, None, :])
        eye = torch.eye(t.shape[1], dtype=F64)
        k = k + eye * torch.where(have, self.noise, 1.0)[:, :, None]
        now = torch.full((prompt.numel(), 1), float(step), dtype=F64)
        ks = self.kernel(t, now).squeeze(-1) * have  # [N, W]
        resid = torch.where(have, y - m, 0.0)
        solved = torch.linalg.solve(k, torch.stack([resid, ks], dim=2))  # [N, W, 2]
        mean = m + (ks * solved[:, :, 0]).sum(1)
        var = (self.amplitude - (ks * solved[:, :, 1]).sum(1)).clamp_min(0.0)
        return mean, var

    def predict(self, prompt: Tensor, step: int) -> Prediction:
        mean, var = self.posterior(prompt, step)
        return Prediction(mean.clamp(0.0, 1.0), {"std": var.sqrt()})

    def tensors(self) -> dict[str, Tensor]:
        return {"rates": self.rates, "steps": self.steps, "count": self.count, "mean": self.mean}


# ---------------------------------------------------------------------------- the scorer that reads it
TRANSFORMS = ("value", "closeness", "learnability", "cures")


class Predicted(Scorer):
    """Pre-rollout: the block's prediction for each candidate (``dataflex.predictor``). ``column``: ``p`` or a
    column the predictor adds (DPS: ``partial``). ``transform``: the value itself; ``closeness``
    ``-(v - target)^2`` (MoPPS-like); ``learnability`` ``v (1 - v)``; ``cures``: the log of CurES's sampling
    score, ``sqrt(p (1 - p)) / t`` with ``t = (accepted + 1) / 0.01`` (needs predictor ``cures``)."""

    requires: ClassVar = ("prompt_index",)
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"
    uses_history: ClassVar = True
    uses_predictor: ClassVar = True
    params: ClassVar = {
        "column": Param(str, "p", nonempty=True, doc="p, or a column of the predictor (predicted_<column>)"),
        "transform": Param(str, "value", choices=TRANSFORMS, doc="how the column becomes the score"),
        "target": Param(float, 0.5, low=0.0, high=1.0, doc="closeness: the rate to select for"),
    }
    column: str
    transform: str
    target: float

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        name = P_FIELD if self.column == "p" else f"predicted_{self.column}"
        if not batch.has(name):
            have = sorted(k[len("predicted_"):] for k in batch.fields if k.startswith("predicted_"))
            raise BatchFieldError(self.who, f"params.column={self.column!r}",
                                  f"the block's predictor gives no column {name!r} (it gives: p and "
                                  f"{', '.join(c for c in have if c != 'p') or 'nothing else'})")
        v = batch[name].to(F64)
        if self.transform == "closeness":
            v = -(v - self.target) ** 2
        elif self.transform == "learnability":
            v = v * (1 - v)
        elif self.transform == "cures":
            if not batch.has("predicted_accepted"):
                raise BatchFieldError(self.who, "params.transform='cures'", "needs predictor 'cures' (its column "
                                      "accepted)")
            p = batch[P_FIELD].to(F64)
            v = torch.sqrt(p * (1 - p)) * 0.01 / (batch["predicted_accepted"].to(F64) + 1)
        valid = batch.valid_rows
        real = max(int(valid.sum()), 1)
        metrics = {"predicted/mean_p": float(batch[P_FIELD].to(F64)[valid].sum()) / real}
        return Score(values=torch.where(valid, v, 0.0), granularity="prompt", metrics=metrics)

