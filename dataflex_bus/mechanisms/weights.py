"""A reweighter's output, made ready for the loss: checked, expanded to ``[B, T]`` and summarised.

This runs on every step of a reweight method, on the largest tensors of the batch, so it is done in one
pass without boolean-indexed ``[B, T]`` copies (see ``benchmarks/bench_methods.py``: at 16,384 rows x 2,048
tokens the one-pass form is about 4x faster than checking and summarising ``w[token_mask]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..components import without_grad
from ..errors import BatchFieldError

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch

_BAD_WEIGHTS = "weights must be finite and non-negative on real tokens"


class WeightStats(NamedTuple):
    """Sums over the real tokens of a batch, each row's weight counted once per real token."""

    n: int
    total: float
    squares: float
    max: float
    min: float

    def metrics(self, prefix: str) -> dict[str, float]:
        """``weight_mean/std/max/min`` (std unbiased over real tokens)."""
        mean = self.total / self.n
        var = max(self.squares - self.n * mean * mean, 0.0) / (self.n - 1) if self.n > 1 else 0.0
        return {f"{prefix}weight_mean": mean, f"{prefix}weight_std": var ** 0.5,
                f"{prefix}weight_max": self.max, f"{prefix}weight_min": self.min}


def expand_weights(w: Tensor, batch: Batch, who: str) -> tuple[Tensor, WeightStats | None]:
    """Check ``[B]`` or ``[B, T]`` weights on the real tokens of ``batch`` (finite, non-negative), expand
    them to ``[B, T]`` float32 with 1 on every other token, and summarise them (``None`` without real
    tokens). Raises :class:`BatchFieldError` naming ``who``."""
    w = without_grad(w, who, "weights")
    tm = batch.token_mask
    if tuple(w.shape) not in ((len(batch),), tuple(tm.shape)):
        raise BatchFieldError(who, "weights",
                              f"expected shape {tuple(tm.shape)} or ({len(batch)},), got {tuple(w.shape)}")
    lengths = batch.lengths
    n_real = int(lengths.sum())
    if w.dim() == 1:
        # Row weights: check and summarise on [B] (each row counted once per real token), expand once.
        has_tokens = lengths > 0
        wr, lr = w[has_tokens].double(), lengths[has_tokens].double()
        if wr.numel() and (not bool(torch.isfinite(wr).all()) or bool((wr < 0).any())):
            raise BatchFieldError(who, "weights", _BAD_WEIGHTS)
        stats = None
        if n_real:
            stats = WeightStats(n_real, float((wr * lr).sum()), float((wr * wr * lr).sum()), float(wr.max()),
                                float(wr.min()))
        return torch.where(tm, w.to(torch.float32)[:, None], 1.0), stats
    w = w.to(torch.float32)
    if not n_real:
        return torch.ones_like(w), None
    # Token weights: fill non-real tokens with one real token's own weight, so whole-tensor reductions
    # give the real tokens' min/max exactly; the sums are corrected for the fill.
    row = int(torch.nonzero(lengths > 0)[0])
    fill = w[row][tm[row]][0]
    wf = torch.where(tm, w, fill)
    lo, hi = torch.aminmax(wf)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))) or float(lo) < 0:
        raise BatchFieldError(who, "weights", _BAD_WEIGHTS)
    n_fill, f = wf.numel() - n_real, float(fill)
    # Row-wise float32 reductions, combined in float64 (a float64 whole-tensor sum would copy).
    total = float(wf.sum(-1).double().sum()) - f * n_fill
    sq = float(torch.linalg.vector_norm(wf, dim=-1).double().square().sum()) - f * f * n_fill
    # In place on our own copy (no [B, T] ~mask temporary): non-real tokens -> 1.
    out = torch.where(tm, wf, torch.ones((), dtype=wf.dtype), out=wf)
    return out, WeightStats(n_real, total, sq, float(hi), float(lo))
