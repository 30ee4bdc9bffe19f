"""What the methods decided at one event, and how every host carries it out on a :class:`Batch`.

The CPU shim and the verl trainer both call :func:`carry_out_rollout` after ``on_rollout`` and
:func:`carry_out_advantage` after ``on_advantage``, and draw prompts with :func:`sampling_probabilities`;
they only move tensors in and out (the shim keeps them in memory, verl in TransferQueue). So a decision
means the same thing in both places:

* at ``on_rollout`` a decision keeps or drops whole groups: the host removes the dropped rows before any
  further compute. An empty selection, or a method asking to skip the step, never reaches the trainer as
  an empty batch: the first real group is kept for the (cheap) forward passes and the update is skipped.
* at ``on_advantage`` weights are *multiplied* into ``rollout_is_weights`` (never overwrite verl's own),
  recomputed advantages replace the old ones on real rows, and a dropped row gets ``response_mask``,
  ``loss_mask`` and ``advantages`` zeroed (so token-mean renormalises over the kept tokens and KL/entropy
  skip the row; a weight of 0 would only dilute the loss). A host may also remove those rows physically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import BatchFieldError

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch


class Decision:
    """What the participants decided at one event; the host loop carries it out.

    ``keep``: bool ``[B]`` rows to keep (``None``: all). ``advantages``: recomputed ``[B, T]`` (subset
    selectors). ``weights``: ``[B, T]`` multiplied into ``rollout_is_weights`` (1 on tokens that do not
    count). ``domain_probs``: sampling probabilities for the next prompts (mix). ``skip_update``: an
    empty-selection policy asked to skip this step's policy update. ``metrics``: ``dataflex/...``.
    """

    __slots__ = ("advantages", "domain_probs", "keep", "metrics", "skip_update", "weights")

    def __init__(self) -> None:
        self.keep: Tensor | None = None
        self.advantages: Tensor | None = None
        self.weights: Tensor | None = None
        self.domain_probs: dict[str, float] | None = None
        self.skip_update = False
        self.metrics: dict[str, float] = {}

    def drop(self, rows: Tensor) -> None:
        """Drop ``rows`` (bool ``[B]``): keep masks of several methods AND."""
        keep = ~rows
        self.keep = keep if self.keep is None else self.keep & keep

    def restrict(self, keep: Tensor) -> None:
        """Keep only ``keep`` (bool ``[B]``) of what is kept so far."""
        self.keep = keep if self.keep is None else self.keep & keep

    def scale(self, weights: Tensor) -> None:
        """Multiply ``[B, T]`` weights in: the weights of several methods multiply."""
        self.weights = weights if self.weights is None else self.weights * weights

    def __repr__(self) -> str:
        keep = None if self.keep is None else f"{int(self.keep.sum())}/{self.keep.numel()}"
        return (f"Decision(keep={keep}, advantages={self.advantages is not None}, "
                f"weights={self.weights is not None}, domain_probs={self.domain_probs}, "
                f"skip_update={self.skip_update})")


# ---------------------------------------------------------------------------- on_rollout
@dataclass
class RolloutAction:
    """What a host does after ``on_rollout``: carry on with ``keep`` (``None``: every row) and skip the
    update when ``skip_update``. ``removed``: real rows removed."""

    keep: Tensor | None
    skip_update: bool
    removed: int


def first_group(batch: Batch) -> Tensor:
    """Bool ``[B]``: the rows of the first real group (what an empty or skipped step carries on with)."""
    valid = torch.nonzero(batch.valid_rows).flatten()
    if valid.numel() == 0:
        return torch.ones(len(batch), dtype=torch.bool)
    return batch.group_index == batch.group_index[valid[0]]


def carry_out_rollout(batch: Batch, decision: Decision) -> RolloutAction:
    """The rows to carry on with after ``on_rollout``. Raises if a method asked for something that can
    only be done once advantages exist (the validation places such methods at ``on_advantage``)."""
    if decision.weights is not None or decision.advantages is not None:
        raise BatchFieldError("dataflex", "weights" if decision.weights is not None else "advantages",
                              "decided at on_rollout, before advantages exist; a method writing them must act "
                              "at on_advantage")
    keep = decision.keep
    skip = decision.skip_update
    real = batch.valid_rows
    if keep is not None:
        keep = keep & real
    if skip or (keep is not None and bool(real.any()) and not bool(keep.any())):
        keep, skip = first_group(batch), True
    if keep is None or bool(keep[real].all()):
        return RolloutAction(None, skip, 0)
    # Padding rows travel with the batch (the host re-pads anyway); only real rows are removed.
    keep = keep | ~real
    return RolloutAction(keep, skip, int((real & ~keep).sum()))


# ---------------------------------------------------------------------------- on_advantage
@dataclass
class AdvantageAction:
    """What a host does after ``on_advantage``: write ``fields`` (dense ``[B, T]``, every row, padding
    included), optionally remove the rows not in ``keep`` (already fully masked), skip the update when
    ``skip_update`` (then nothing is written)."""

    fields: dict[str, Tensor] = field(default_factory=dict)
    keep: Tensor | None = None
    skip_update: bool = False


def carry_out_advantage(batch: Batch, decision: Decision) -> AdvantageAction:
    """The fields to write after ``on_advantage``. ``batch`` must hold ``response_mask`` and, when the
    decision drops rows or replaces advantages, ``advantages`` and ``loss_mask``; its
    ``rollout_is_weights`` (if any) are multiplied, never replaced."""
    if decision.skip_update:
        return AdvantageAction(skip_update=True)
    out: dict[str, Tensor] = {}
    if decision.weights is not None:
        w = decision.weights.to(torch.float32)
        if "rollout_is_weights" in batch.fields:
            w = batch["rollout_is_weights"].to(torch.float32) * w
        out["rollout_is_weights"] = w
    advantages = None
    if decision.advantages is not None:
        current = batch["advantages"]
        advantages = torch.where(batch.valid_rows[:, None], decision.advantages.to(current.dtype), current)
    keep = None
    if decision.keep is not None:
        drop = batch.valid_rows & ~decision.keep
        if bool(drop.any()):
            rows = drop[:, None]
            out["response_mask"] = batch["response_mask"].masked_fill(rows, 0)
            loss_mask = batch.get("loss_mask")
            out["loss_mask"] = (batch["response_mask"] if loss_mask is None else loss_mask).masked_fill(rows, 0)
            advantages = (batch["advantages"] if advantages is None else advantages).masked_fill(rows, 0)
            keep = ~drop
    if advantages is not None:
        out["advantages"] = advantages
    return AdvantageAction(out, keep)


# ---------------------------------------------------------------------------- mix
def check_probabilities(values: Tensor, domains: Sequence[str], who: str) -> None:
    """Raise unless ``values`` are ``len(domains)`` finite, non-negative probabilities with a positive sum
    (checked where a mixer publishes them, so a bad mixer is named at once)."""
    if tuple(values.shape) != (len(domains),):
        raise BatchFieldError(who, "probabilities", f"expected shape ({len(domains)},) for domains {list(domains)}, "
                              f"got {tuple(values.shape)}")
    v = values.double()
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()) or float(v.sum()) <= 0:
        shown = {d: float(x) for d, x in zip(domains, v.tolist())}
        raise BatchFieldError(who, "probabilities",
                              f"must be finite, non-negative and sum to more than 0, got {shown}")


def sampling_probabilities(probs: Mapping[str, float] | None, domains: Sequence[str]) -> Tensor:
    """Float64 ``[D]`` probabilities over ``domains`` (in the sampler's order) for the next prompts:
    uniform without a mixer, else the published ``probs`` renormalised (a domain absent gets 0)."""
    if probs is None:
        return torch.full((len(domains),), 1.0 / len(domains), dtype=torch.float64)
    p = torch.tensor([float(probs.get(d, 0.0)) for d in domains], dtype=torch.float64)
    check_probabilities(p, domains, "dataflex mix")
    return p / p.sum()
