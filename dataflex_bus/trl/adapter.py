"""The TRL adapter's state, in two objects the trainer holds: :class:`RunSettings`, what is fixed for the run
(read once at construction from the ``GRPOConfig``, the plan and the training dataset), and
:class:`BatchState`, where the current generation batch stands (its pass through TRL's method, its kit step,
whether its update is skipped) and how many generation batches were generated. Every module of the host reads
them (``trainer.dataflex_settings``, ``trainer.dataflex_batch``) instead of attributes of its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..batch import Batch
    from ..generation import Generation
    from ..steps import Step
    from .batches import BatchMaker
    from .processes import Processes
    from .prompts import PromptStream
    from .records import Pass


@dataclass(frozen=True, eq=False)
class RunSettings:
    """What the TRL host fixes for a run."""

    processes: Processes
    #: ``num_generations``: rollouts per prompt of TRL's own groups.
    group_size: int
    steps_per_generation: int
    #: Optimizer steps per generation batch (the host check refused a span that is not a whole number of them).
    span: int
    #: Micro-steps per generation batch.
    micro: int
    #: Prompts (groups) of one generation batch.
    target: int
    #: Prompts a round is rounded up to, so that every process gets whole rows.
    unit: int
    #: Groups of any size (an allocation): TRL's advantages are replaced by the host's over the groups.
    ragged: bool
    #: Rounds stop after their rewards and TRL's method runs again on the kept rows (passes.py; stored rows
    #: join that pass: replays.py): the plan the host's refusals read (environments).
    collects: bool
    #: TRL's old-policy pass runs (so it may compute the entropy a method reads).
    old_needed: bool
    #: The training dataset's domain label per row (``None``: no domain column).
    labels: list[str] | None
    #: The domains a mixer samples from, in the sampler's order (or the configured / found ones).
    domains: list[str] | None
    #: Builds the bus's batches from TRL's rows.
    batches: BatchMaker
    #: The host's own prompt stream when the block draws prompts by row (``None``: TRL's own prompts).
    stream: PromptStream | None
    #: The training dataset (its identity is computed once, when first needed: state.py).
    dataset: Any = field(repr=False, default=None)

    @cached_property
    def dataset_id(self) -> dict[str, Any]:
        """The training dataset's identity (:func:`~dataflex_bus.trl.dataset_id.identify`), computed once."""
        from . import dataset_id

        return dataset_id.identify(self.dataset)


@dataclass
class BatchState:
    """Where the current generation batch stands, and how many were generated."""

    #: Generation batches generated so far (the kit's step index of the next one).
    generations: int = 0
    #: The pass through TRL's own method now running (``None`` outside one: TRL's methods run as TRL's).
    current_pass: Pass | None = None
    #: The generation rounds of the batch, while they run.
    gen: Generation | None = None
    #: The kit's step of the batch, until its end (after its last optimizer step).
    step: Step | None = None
    #: The batch ``on_step_end`` gets.
    end_batch: Batch | None = None
    #: The batch's update is skipped (nothing left to train).
    skip: bool = False
    #: Filler rollouts of the batch (passes.sharded).
    fillers: int = 0


__all__ = ["BatchState", "RunSettings"]
