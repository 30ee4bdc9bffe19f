"""The host kit's part of an allocation (mechanism ``allocate``, :mod:`dataflex_bus.mechanisms.allocate`): how
a decision's per-prompt counts are carried out, before generation (:func:`carry_out_counts`) and in
continuation rounds (:func:`continuation_counts`), and the step's ``dataflex/alloc/*`` metrics
(:class:`AllocationStats`). Kept here, beside the kit's replay (:mod:`dataflex_bus.replay`), so the general
carry-out (:mod:`dataflex_bus.carry`) and the metrics every host publishes (:mod:`dataflex_bus.step_metrics`)
name no mechanism of the data flow. :class:`AllocationPart` is allocation's hooks into the kit's step
(:mod:`dataflex_bus.step_parts`): the one-draw prompt phase, continuation rounds, the step's metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .carry import carry_out_prompts
from .errors import BatchFieldError
from .step_parts import StepPart

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .decision import Decision
    from .method import Method
    from .runtime import Runtime
    from .steps import Candidates, Chosen, Step


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


def allocator(runtime: Runtime, event: str) -> Method | None:
    """The method allocating rollouts (mechanism ``allocate``) at ``event``, if one acts there."""
    from .mechanisms.allocate import Allocator

    if runtime.pipeline is None:
        return None
    return next((m for m in runtime.pipeline.at(event) if isinstance(m.actuator, Allocator)), None)


class AllocationPart(StepPart):
    """Allocation's part of one step: an allocator at ``on_prompts`` draws the step's candidates at once and
    gives each its count of rollouts; one at ``on_rollout`` extends a round's groups (continuation rounds);
    :attr:`stats`, the step's ``dataflex/alloc/*``."""

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.stats = AllocationStats()

    def prompts(self, target: int, draw: Callable[[int], Candidates[Any]], chunk: int) -> Chosen[Any] | None:
        """One draw of ``target`` candidates through ``on_prompts``; each gets its count of rollouts (0: not
        generated), the budget spent on the candidates of this draw."""
        from .fill import PromptCounts, add_class_counts
        from .steps import Chosen

        step = self.step
        runtime = step.runtime
        if allocator(runtime, "on_prompts") is None:
            return None
        if target % chunk:
            raise ValueError(f"an allocation draws the step's {target} candidates at once, in whole draws of {chunk}")
        got = draw(target)
        batch = step.candidate_batch(got, target)
        decision = runtime.emit("on_prompts", batch, step.index)
        step.metrics.update(decision.metrics)
        counts = carry_out_counts(batch, decision, int(runtime.host.group_size or 0))
        if decision.skip_update:
            step.skip_at_prompts = True
        index = torch.nonzero(counts > 0).flatten()
        c = PromptCounts(considered=target, skipped=target - int(index.numel()), generated=int(index.numel()),
                         draws=1)
        add_class_counts(c, batch, counts > 0)
        step.prompt_counts += c
        step.kit.counters.add(considered_prompts=target)
        self.stats.candidates(counts)
        return Chosen([got.items], index, counts[index], drawn=target)

    def continues(self) -> bool:
        return allocator(self.step.runtime, "on_rollout") is not None

    def per_group_cap(self) -> str | None:
        """Every method at ``on_rollout`` decides each group on its own rows (:attr:`Plan.screens_on_arrival
        <dataflex_bus.plan.Plan.screens_on_arrival>`; any other, a selection with a pool baseline or a budget over
        the round, could change a group's count by what else is in the round): the strictest of their caps."""
        from .mechanisms.allocate import Allocator
        from .screening import strictest

        runtime = self.step.runtime
        if not runtime.plan.screens_on_arrival or runtime.pipeline is None:
            return None
        return strictest([m.actuator.continuation_cap() for m in runtime.pipeline.at("on_rollout")
                          if isinstance(m.actuator, Allocator)])

    def more(self, batch: Batch, decision: Decision) -> Tensor | None:
        return continuation_counts(batch, decision)

    def extended(self, batch: Batch) -> None:
        self.stats.continued += int(torch.unique(batch.group_index[batch.valid_rows]).numel())

    def round_done(self, batch: Batch) -> None:
        self.stats.groups(batch.group_sizes)

    def end(self, out: dict[str, float]) -> None:
        out.update(self.stats.metrics())


__all__ = ["AllocationPart", "AllocationStats", "allocator", "carry_out_counts", "continuation_counts"]
