"""The host kit's part of an allocation (mechanism ``allocate``, :mod:`dataflex_bus.mechanisms.allocate`): how
a decision's per-prompt counts are carried out, before generation (:func:`carry_out_counts`) and in
continuation rounds (:func:`continuation_counts`), and the step's ``dataflex/alloc/*`` metrics
(:class:`AllocationStats`). Kept here, beside the kit's replay (:mod:`dataflex_bus.replay`), so the general
carry-out (:mod:`dataflex_bus.carry`) and the metrics every host publishes (:mod:`dataflex_bus.step_metrics`)
name no mechanism of the data flow."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .carry import carry_out_prompts
from .errors import BatchFieldError

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .decision import Decision


def carry_out_counts(batch: Batch, decision: Decision, group_size: int) -> Tensor:
    """Long ``[N]``: the rollouts to generate for each ``on_prompts`` candidate: the allocator's counts of
    the candidates kept (a selection after it zeroes the ones it skips), ``group_size`` for every kept
    candidate when no allocator counted (warmup), 0 otherwise."""
    keep = carry_out_prompts(batch, decision)
    if decision.counts is None:
        return torch.where(keep, group_size, 0).to(torch.long)
    return torch.where(keep, decision.counts.to(torch.long), 0)


def continuation_counts(batch: Batch, decision: Decision) -> Tensor | None:
    """Long ``[num_groups]``: how many more rollouts each group of an ``on_rollout`` batch gets (0 for a
    group the decision drops), or ``None`` when none does. Raises if a group's rows disagree."""
    from .ops import segment_max, segment_min

    if decision.counts is None:
        return None
    counts = decision.counts.to(torch.float64)  # exact for counts (the segment reductions fill with inf)
    gi, n = batch.group_index, batch.num_groups
    hi, lo = segment_max(counts, gi, n), segment_min(counts, gi, n)
    if bool((hi != lo).any()):
        raise BatchFieldError("dataflex allocate", "counts", "a continuation count must be the same on every row "
                              "of a group (it is the group's)")
    keep = batch.valid_rows if decision.keep is None else decision.keep & batch.valid_rows
    kept = segment_max(keep.to(torch.float64), gi, n) > 0
    per_group = torch.where(kept, hi, 0.0).clamp_min(0).to(torch.long)
    return per_group if bool((per_group > 0).any()) else None


class AllocationStats:
    """``dataflex/alloc/*`` of one step, when a method allocates rollouts per prompt: over every prompt
    generated in the step (every round, after its continuation rounds) the fewest, most and mean rollouts
    (``min``, ``max``, ``mean``), how many prompts were generated (``covered``) and how many candidates were
    given no rollout (``skipped``); ``continued``: groups a continuation round extended, ``rollouts``: every
    rollout of those prompts."""

    def __init__(self) -> None:
        self.sizes: list[Tensor] = []
        self.skipped = 0
        self.continued = 0

    def candidates(self, counts: Tensor) -> None:
        """One draw's counts (long ``[N]``, 0 = skipped)."""
        self.skipped += int((counts == 0).sum())

    def groups(self, sizes: Tensor) -> None:
        """The final sizes of one round's groups."""
        self.sizes.append(sizes.to(torch.long))

    def metrics(self) -> dict[str, float]:
        p = "dataflex/alloc/"
        sizes = torch.cat(self.sizes) if self.sizes else torch.zeros(0, dtype=torch.long)
        out = {f"{p}covered": float(sizes.numel()), f"{p}skipped": float(self.skipped),
               f"{p}continued": float(self.continued), f"{p}rollouts": float(sizes.sum())}
        if sizes.numel():
            out.update({f"{p}min": float(sizes.min()), f"{p}max": float(sizes.max()),
                        f"{p}mean": float(sizes.double().mean())})
        return out


__all__ = ["AllocationStats", "carry_out_counts", "continuation_counts"]
