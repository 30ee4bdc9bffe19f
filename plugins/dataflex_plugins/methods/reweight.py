"""Built-in reweighters (mechanism ``reweight``): loss weights multiplied into ``rollout_is_weights``.

Row-level reweighters return ``[B]`` (the pipeline broadcasts over valid tokens); ``advantage_reweight``
returns ``[B, T]``. Normalisations run over real rows (and, where said, real tokens) only; padding rows
get the neutral weight 1 and are never counted.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Reweighter, Reweighting, Score
from dataflex_bus.errors import BatchFieldError

from ._checks import check_row_values, check_token_shape


def _row_softmax_times_n(logits: Tensor, valid: Tensor, who: str) -> Tensor:
    """``N * softmax(logits)`` over the real rows (max subtracted first), 1 on padding rows."""
    n = int(valid.sum())
    if n == 0:
        return torch.ones_like(logits)
    if not bool(torch.isfinite(logits[valid]).all()):
        raise BatchFieldError(who, "score", "score / temperature overflows to inf; raise the temperature")
    z = torch.where(valid, logits, torch.full_like(logits, float("-inf")))
    e = torch.exp(z - z.max())
    w = e * (n / e.sum())
    return torch.where(valid, w, torch.ones_like(w))


class AdvantageReweight(Reweighter):
    """AR (arXiv 2505.12929): per token ``w[i, t] = alpha * p[i, t] + (1 - alpha)``, no re-normalisation.

    ``p`` is the token-level score, i.e. ``token_prob`` (``exp(old_log_probs)``), so low-probability
    tokens are down-weighted relative to confident ones. ``alpha=0`` is plain GRPO; the paper uses
    0.2-0.3. The weights are used as they are (the paper does not rescale them to mean 1).
    """

    accepts: ClassVar = ("token",)
    params: ClassVar = {
        "alpha": Param(float, 0.3, low=0.0, high=1.0, doc="mixing weight of the token probability"),
    }
    alpha: float

    def reweight(self, batch: Batch, score: Score, step: int) -> Reweighting:
        p = score.values
        check_token_shape(self.who, "score", p, batch)
        # One fused pass: (1 - alpha) + alpha * p. Off-mask tokens are set to 1 by the pipeline.
        w = torch.add(torch.tensor(1.0 - self.alpha, dtype=p.dtype), p, alpha=self.alpha)
        return Reweighting(weights=w)


class Softmax(Reweighter):
    """``w_i = N * softmax(s / T)_i`` over the N real rows: mean 1 over rows (``normalize=row``).

    ``normalize=token`` rescales to mean 1 over real tokens instead: ``w <- w * sum(L) / sum(w * L)``,
    the right unit under verl's default ``token-mean`` loss aggregation. Stable for large scores (the
    maximum is subtracted before ``exp``).
    """

    params: ClassVar = {
        "temperature": Param(float, 1.0, low=0.0, low_open=True, doc="softmax temperature T"),
        "normalize": Param(str, "row", choices=("row", "token"), doc="mean 1 over rows or over tokens"),
    }
    temperature: float
    normalize: str

    def reweight(self, batch: Batch, score: Score, step: int) -> Reweighting:
        valid = batch.valid_rows
        check_row_values(self.who, "score", score.values, batch)
        s = score.values.to(torch.float64)
        w = _row_softmax_times_n(s / self.temperature, valid, self.who)
        if self.normalize == "token":
            w = _token_mean_one(w, batch)
        return Reweighting(weights=w.to(torch.float32), metrics=_row_metrics(w, valid))


class PerAdvantage(Reweighter):
    """PER-style weights (arXiv 1511.05952, adapted from sampling to loss weights).

    Priority ``p_i = |s_i| + eps`` (``s`` = ``advantage_magnitude`` gives ``|A_i|``), sampling
    probability ``P_i = p_i^alpha / sum_j p_j^alpha``, weight ``w_i = (N P_i)^(1 - beta)`` normalised to
    mean 1 over real rows. ``beta=0``: pure prioritisation; ``beta=1`` or ``alpha=0``: uniform. Computed
    as ``N * softmax(alpha * (1 - beta) * log p)``, which is the same quantity without overflow.
    """

    params: ClassVar = {
        "alpha": Param(float, 0.6, low=0.0, doc="priority exponent"),
        "beta": Param(float, 0.4, low=0.0, high=1.0, doc="importance-correction exponent"),
        "eps": Param(float, 1e-6, low=0.0, low_open=True, doc="priority floor so no row gets weight 0"),
    }
    alpha: float
    beta: float
    eps: float

    def reweight(self, batch: Batch, score: Score, step: int) -> Reweighting:
        valid = batch.valid_rows
        check_row_values(self.who, "score", score.values, batch)
        log_p = torch.log(score.values.to(torch.float64).abs() + self.eps)
        w = _row_softmax_times_n(self.alpha * (1.0 - self.beta) * log_p, valid, self.who)
        return Reweighting(weights=w.to(torch.float32), metrics=_row_metrics(w, valid))


def _token_mean_one(w: Tensor, batch: Batch) -> Tensor:
    """Rescale row weights so the mean over real tokens is 1 (rows without tokens are unaffected)."""
    lengths = batch.lengths.to(torch.float64)
    valid = batch.valid_rows
    total = float(lengths[valid].sum())
    weighted = float((w * lengths)[valid].sum())
    if total <= 0 or weighted <= 0 or not math.isfinite(weighted):
        return w
    return torch.where(valid, w * (total / weighted), w)


def _row_metrics(w: Tensor, valid: Tensor) -> dict[str, float]:
    """Effective sample size ratio of the row weights: ``(sum w)^2 / (N sum w^2)`` in (0, 1]."""
    real = w[valid]
    if real.numel() == 0:
        return {}
    ess = float(real.sum() ** 2 / (real.numel() * (real * real).sum()))
    return {"weight_ess": ess}
