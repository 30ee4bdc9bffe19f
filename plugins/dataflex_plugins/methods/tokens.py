"""Token selection (mechanism ``select``, token granularity): train the policy gradient on the highest-scoring
response tokens only, "Beyond the 80/20 Rule" (arXiv 2506.01939) with ``token_entropy``.

Every decision is made on whole tensors: one ``kthvalue`` finds a batch's threshold (a selection over 16,384 x
2,048 tokens costs about one ``torch.topk`` over the valid tokens, ``benchmarks/bench_tokens.py``), one row-wise
``topk`` finds every sequence's; ties are resolved exactly and deterministically, and nothing loops over rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Score, Selection, Selector
from dataflex_bus.errors import BatchFieldError
from dataflex_bus.host import MINIBATCH_INDEX
from dataflex_bus.jagged import ROW_CHUNK

from ._checks import check_token_shape

#: The authors' ceil, ``int(N * rho + 0.9999)``: exact for every ``rho * N`` that float error puts a hair
#: above an integer (``0.3 * 10`` is 3.0000000000000004, whose ceil would be 4).
_CEIL_SLACK = 0.9999
#: torch.quantile's own limit; beyond it ranks need more than float32's 24 bits.
_FLOAT32_RANKS = 2 ** 24


def topk_count(n: Tensor, rho: float) -> Tensor:
    """Long, like ``n``: tokens the top-k form keeps of ``n`` valid ones, ``max(1, ceil(rho * n))`` (0 for
    ``n = 0``)."""
    k = torch.floor(n.to(torch.float64) * rho + _CEIL_SLACK).to(torch.long).clamp_min(1)
    return torch.minimum(k, n)


def _ranks(n: Tensor, q: float) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.quantile``'s linear interpolation ranks for ``n`` values: ``(below, above, weight)`` with
    ``q * (n - 1)`` computed as torch computes it (in float32, so a threshold equals TRL's to the bit), in
    float64 where float32 could not count the values."""
    dtype = torch.float32 if int(n.max()) <= _FLOAT32_RANKS else torch.float64
    rank = torch.tensor(q, dtype=dtype) * (n - 1).clamp_min(0).to(dtype)
    below = rank.to(torch.long)
    return below, torch.ceil(rank).to(torch.long), (rank - below.to(dtype)).to(torch.float32)


def _count(mask: Tensor) -> int:
    """True entries of a bool tensor: ``count_nonzero`` is many times faster than a bool ``sum`` at [B, T]."""
    return int(torch.count_nonzero(mask))


def _fill(values: Tensor, valid: Tensor) -> Tensor:
    """Float32 ``values`` with ``-inf`` off ``valid``: the order statistics of the valid values are the
    largest ones, so no variable-size gather is needed (the score of a valid token is finite)."""
    return torch.where(valid, values.to(torch.float32), float("-inf"))


def _valid_values(values: Tensor, valid: Tensor) -> Tensor:
    """The ``valid`` entries of ``values`` in row-major order, gathered :data:`ROW_CHUNK` rows at a time
    (indexing the whole ``[B, T]`` at once first builds an int64 index of every valid entry, several times
    the values' own size)."""
    rows = values.shape[0]
    if rows <= ROW_CHUNK:
        return values[valid]
    return torch.cat([values[i:i + ROW_CHUNK][valid[i:i + ROW_CHUNK]] for i in range(0, rows, ROW_CHUNK)])


def _largest(values: Tensor, valid: Tensor, k: int, threshold: Tensor) -> Tensor:
    """Bool like ``values``: exactly the ``k`` largest of its ``valid`` entries, ``threshold`` being the ``k``-th;
    ties at the threshold go to the earliest entries in row-major order (``torch.topk`` breaks them arbitrarily,
    which would make two hosts keep different tokens of the same batch)."""
    above = values > threshold
    above &= valid
    ties = values == threshold
    ties &= valid
    need = k - _count(above)
    if _count(ties) != need:
        order = ties.view(-1).cumsum(0, dtype=torch.int32).view_as(ties)
        ties &= order <= need
    above |= ties
    return above


def select_flat(values: Tensor, valid: Tensor, rho: float, form: str) -> tuple[Tensor, float]:
    """Bool like ``values``: the tokens kept among ``valid`` ones, all in one scope, and the threshold.

    ``topk``: exactly ``k = max(1, ceil(rho * N))`` tokens, the largest (the authors' rule). ``quantile``:
    every token at or above ``torch.quantile(valid values, 1 - rho)`` (linear interpolation; TRL's rule), so
    ties at the threshold are all kept. ``N = 0`` keeps nothing.
    """
    n = _count(valid)
    if n == 0:
        return torch.zeros_like(valid), 0.0
    values = values.to(torch.float32)  # no copy for a float32 score
    # The order statistics of the valid values alone: a sixth of [B, T] at log-uniform response lengths, and
    # no filled copy of the scores.
    picked = _valid_values(values, valid)
    if form == "topk":
        k = int(topk_count(torch.tensor(n), rho))
        threshold = torch.kthvalue(picked, n - k + 1).values
        return _largest(values, valid, k, threshold), float(threshold)
    below_rank, above_rank, weight = _ranks(torch.tensor(n), 1.0 - rho)
    below, above = int(below_rank), int(above_rank)
    low = torch.kthvalue(picked, below + 1).values
    high = low
    # The next order statistic: the low value again if it is repeated, else the smallest value above it (two
    # cheap passes instead of a second kthvalue).
    if above != below and _count(picked <= low) < above + 1:
        high = picked.masked_fill(picked <= low, float("inf")).min()
    threshold = torch.lerp(low, high, weight.to(low.dtype))
    keep = values >= threshold
    keep &= valid
    return keep, float(threshold)


def select_rows(values: Tensor, valid: Tensor, rho: float, form: str) -> tuple[Tensor, Tensor]:
    """:func:`select_flat` in every row at once (``scope: sequence``): bool ``[B, T]`` and each row's
    threshold (``[B]``, ``-inf`` for a row without valid token, which keeps nothing)."""
    filled = _fill(values, valid)
    n = torch.count_nonzero(valid, dim=1)
    has = n > 0
    if form == "topk":
        k = topk_count(n, rho)
        top = torch.topk(filled, int(k.max()), dim=1).values if bool(has.any()) else filled[:, :1]
        threshold = top.gather(1, (k - 1).clamp_min(0)[:, None])
        above = filled > threshold
        ties = filled == threshold
        need = k - torch.count_nonzero(above, dim=1)
        keep = above | ties
        if bool((torch.count_nonzero(ties, dim=1) != need)[has].any()):
            keep = above | (ties & (ties.cumsum(dim=1, dtype=torch.int32) <= need[:, None]))
        return keep & has[:, None], threshold.squeeze(1)
    below, above_rank, weight = _ranks(n, 1.0 - rho)
    # Descending positions of the two order statistics around each row's rank.
    width = int((n - below).max()) if bool(has.any()) else 1
    top = torch.topk(filled, max(width, 1), dim=1).values
    low = top.gather(1, (n - 1 - below).clamp_min(0)[:, None])
    high = top.gather(1, (n - 1 - above_rank).clamp_min(0)[:, None])
    threshold = torch.lerp(low, high, weight[:, None])
    return valid & (filled >= threshold) & has[:, None], threshold.squeeze(1)


class TopEntropy(Selector):
    """Keep the top-``rho`` tokens by score (``token_entropy``: the high-entropy "forking" tokens) for the
    policy-gradient term; see docs/methods.md for the forms, scopes and normalisations."""

    selects_tokens: ClassVar = True
    accepts: ClassVar = ("token",)
    min_timing: ClassVar = "post_advantage"
    requires: ClassVar = ("response_mask",)
    intended_scorers: ClassVar = ("token_entropy",)
    params: ClassVar = {
        "rho": Param(float, 0.2, low=0.0, high=1.0, low_open=True,
                     doc="share of the scope's valid tokens kept (the paper: 0.2; 1 keeps every token)"),
        "form": Param(str, "topk", choices=("topk", "quantile"),
                      doc="topk: exactly max(1, ceil(rho N)) tokens (the authors' code); quantile: every token at "
                          "or above the (1 - rho) quantile (TRL), ties included"),
        "scope": Param(str, "batch", choices=("batch", "minibatch", "sequence"),
                       doc="what the threshold is taken over: the step's valid tokens, each mini-batch's (the "
                           "host's minibatch_index), or each response's"),
        "normalize": Param(str, "all_tokens", choices=("all_tokens", "selected_tokens"),
                           doc="all_tokens: the loss keeps its denominator over every valid token (the paper, "
                               "TRL); selected_tokens: over the kept tokens, as weights N/K per scope (the "
                               "authors' verl code)"),
        "mask_kl": Param(bool, False, doc="the tokens left out leave the KL and entropy terms too (loss masks)"),
    }
    rho: float
    form: str
    scope: str
    normalize: str
    mask_kl: bool

    @classmethod
    def requires_for(cls, values: Mapping[str, Any]) -> Sequence[str]:
        if values.get("scope") == "minibatch":
            return (*cls.requires, MINIBATCH_INDEX)
        return cls.requires

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        values = score.values
        check_token_shape(self.who, "score", values, batch)
        bad = batch.nonfinite_rows(values)
        if bad is not None:
            rows = torch.nonzero(bad).flatten()[:5].tolist()
            raise BatchFieldError(self.who, "score", f"non-finite token scores (NaN/inf) on rows {rows}")
        valid = batch.token_mask
        if self.scope == "sequence":
            keep, thresholds = select_rows(values, valid, self.rho, self.form)
            has = batch.lengths > 0
            threshold = float(thresholds[has].mean()) if bool(has.any()) else 0.0
            n, k = batch.lengths, torch.count_nonzero(keep, dim=1)
        elif self.scope == "minibatch":
            keep, threshold, n, k = self._per_minibatch(batch, values, valid)
        else:
            keep, threshold = select_flat(values, valid, self.rho, self.form)
            n, k = torch.count_nonzero(valid).reshape(1), torch.count_nonzero(keep).reshape(1)
        metrics = {"top_entropy/threshold": threshold}
        return Selection(keep=keep.any(dim=1), tokens=keep, token_weights=self._weights(batch, keep, n, k),
                         mask_kl=self.mask_kl, metrics=metrics)

    def _per_minibatch(self, batch: Batch, values: Tensor, valid: Tensor) -> tuple[Tensor, float, Tensor, Tensor]:
        """``scope: minibatch``: one threshold per mini-batch; per row, its mini-batch's valid and kept counts."""
        batch.require(self.who, [MINIBATCH_INDEX])
        index = batch[MINIBATCH_INDEX].to(torch.long)
        if tuple(index.shape) != (len(batch),):
            raise BatchFieldError(self.who, MINIBATCH_INDEX, f"expected one mini-batch per row, shape "
                                  f"({len(batch)},), got {tuple(index.shape)}")
        keep = torch.zeros_like(valid)
        real = batch.valid_rows
        ids = torch.unique(index[real])
        thresholds = []
        n_rows = torch.zeros(len(batch), dtype=torch.long)
        k_rows = torch.zeros(len(batch), dtype=torch.long)
        # One pass per mini-batch (the optimizer steps of one update: a handful), each on whole tensors.
        for j in ids.tolist():
            rows = torch.nonzero((index == j) & real).flatten()
            part, t = select_flat(values.index_select(0, rows), valid.index_select(0, rows), self.rho, self.form)
            keep.index_copy_(0, rows, part)
            thresholds.append(t)
            n_rows[rows] = _count(valid.index_select(0, rows))
            k_rows[rows] = _count(part)
        threshold = sum(thresholds) / len(thresholds) if thresholds else 0.0
        return keep, threshold, n_rows, k_rows

    def _weights(self, batch: Batch, keep: Tensor, n: Tensor, k: Tensor) -> Tensor | None:
        """The kept tokens' loss weights that give the chosen normaliser (``n``, ``k``: the valid and kept
        tokens of each row's scope, one value for a batch scope), 1 elsewhere; ``None`` when that is all 1.

        The weights route (default) keeps token-mean's denominator at every valid token: ``all_tokens`` as it
        is, ``selected_tokens`` times ``N / K``. The mask route (``mask_kl``) divides by the kept tokens:
        ``selected_tokens`` as it is, ``all_tokens`` times ``K / N``.
        """
        over_kept = self.normalize == "selected_tokens"
        if over_kept == self.mask_kl:
            return None
        factor = n.to(torch.float64) / k.clamp_min(1) if over_kept else k.to(torch.float64) / n.clamp_min(1)
        # One factor per row ([B, 1]), or one for the batch ([1, 1]): broadcast over the tokens.
        return torch.where(keep, factor.to(torch.float32).reshape(-1, 1), torch.ones((), dtype=torch.float32))
