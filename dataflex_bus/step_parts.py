"""The step hooks a data-flow mechanism plugs into the host kit, so the kit's step (:mod:`dataflex_bus.steps`),
its generation rounds (:mod:`dataflex_bus.generation`) and the runtime (:mod:`dataflex_bus.runtime`) name no
mechanism.

A mechanism that changes which rows a step generates or trains (allocate, replay) names its parts on its
:class:`~dataflex_bus.mechanisms.base.Mechanism` as ``"module:Class"`` strings (``step_part``, ``run_part``;
``mechanisms/`` imports no kit). The runtime builds one :class:`RunPart` per such method (state kept across
steps, checkpointed under the part's ``key``), each :class:`~dataflex_bus.steps.Step` one :class:`StepPart`;
the kit calls the fixed hooks below (each a no-op by default), part by part in the registry's order of
mechanisms. A host reaches a part's own calls through the part (``ReplayPart.of(step)``, ``ReplayRun.of(runtime)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .carry import AdvantageAction
    from .decision import Decision
    from .history import PromptTable
    from .method import Method
    from .pipeline import Pipeline
    from .runtime import Runtime
    from .steps import Candidates, Chosen, Step

S = TypeVar("S", bound="StepPart")
R = TypeVar("R", bound="RunPart")


class StepPart:
    """One data-flow mechanism's part of one step. The hooks, in step order (each a no-op by default):
    :meth:`prompts`, :meth:`continues`, :meth:`per_group_cap`, :meth:`more`, :meth:`extended`, :meth:`round_done`,
    :meth:`advantage_batch`, :meth:`after_advantage`, :meth:`end`."""

    def __init__(self, step: Step) -> None:
        self.step = step

    @classmethod
    def of(cls: type[S], step: Step) -> S | None:
        """This mechanism's part of ``step`` (``None``: the block has no such method)."""
        part = step.parts.get(cls)
        return part if isinstance(part, cls) else None

    def prompts(self, target: int, draw: Callable[[int], Candidates[Any]], chunk: int) -> Chosen[Any] | None:
        """The step's prompts, when this part draws them (``None``: the kit's own prompt phase)."""
        return None

    def continues(self) -> bool:
        """Whether a round's groups may get more rollouts after ``on_rollout`` (continuation rounds)."""
        return False

    def per_group_cap(self) -> str | None:
        """``None``: :meth:`more` reads the whole round. Else it decides each group on its own rows, so a group
        may be decided as it arrives, under a cap taken in this order (:data:`~dataflex_bus.screening.CAP_ORDERS`)."""
        return None

    def more(self, batch: Batch, decision: Decision) -> Tensor | None:
        """Long ``[G]``: more rollouts for each group of the open round (``None``: none)."""
        return None

    def extended(self, batch: Batch) -> None:
        """A continuation's rollouts (``batch``) joined their groups."""

    def round_done(self, batch: Batch) -> None:
        """A generation round is complete (its groups whole)."""

    def advantage_batch(self, batch: Batch) -> Batch:
        """The ``on_advantage`` batch with this part's fields."""
        return batch

    def after_advantage(self, batch: Batch, decision: Decision, action: AdvantageAction) -> None:
        """``on_advantage`` was carried out into ``action``."""

    def end(self, out: dict[str, float]) -> None:
        """The step ends: the part's checks, and its metrics added to ``out``."""


class RunPart:
    """One data-flow mechanism's state for the run, built from its ``method``; checkpointed under :attr:`key`
    (:meth:`state_dict` ``None``: nothing to save yet)."""

    #: The runtime state's key (the checkpoint's layout).
    key: ClassVar[str] = ""
    #: What the state is, in a refusal: ``checkpoint and config disagree on whether <kept> is kept``.
    kept: ClassVar[str] = ""

    def __init__(self, runtime: Runtime, method: Method) -> None:
        self.runtime = runtime
        self.method = method

    @classmethod
    def of(cls: type[R], runtime: Runtime) -> R | None:
        """This mechanism's part of the run (``None``: the block has no such method)."""
        part = runtime.parts.get(cls.key)
        return part if isinstance(part, cls) else None

    def set_prompts(self, table: PromptTable) -> None:
        """The host gave the dataset's prompts (:meth:`Runtime.set_prompts`)."""

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore ``state`` (``None``: the checkpoint holds none)."""


def load_part(ref: str) -> type:
    """The class a ``"module:Class"`` string names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def parts_of(pipeline: Pipeline | None) -> tuple[tuple[type[StepPart], ...], list[tuple[type[RunPart], Method]]]:
    """The step parts and the run parts (with their method) of the pipeline's methods, in the registry's
    order of mechanisms (the same whatever order the block lists its methods in)."""
    from .mechanisms import mechanisms

    steps: list[type[StepPart]] = []
    runs: list[tuple[type[RunPart], Method]] = []
    methods = pipeline.methods if pipeline is not None else []
    for mech in mechanisms():
        mine = [method for method in methods if method.config.mechanism == mech.name]
        if mine and mech.step_part:
            steps.append(load_part(mech.step_part))
        if mech.run_part:
            runs.extend((load_part(mech.run_part), method) for method in mine)
    return tuple(steps), runs


def run_part_classes() -> list[type[RunPart]]:
    """The run part of every registered mechanism that has one (a checkpoint may hold any of their keys)."""
    from .mechanisms import mechanisms

    return [load_part(m.run_part) for m in mechanisms() if m.run_part]


__all__ = ["RunPart", "StepPart", "load_part", "parts_of", "run_part_classes"]
