"""The :class:`Mechanism` base class and what a mechanism may ask of the method it serves."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar

from ..components import TIMINGS, Actuator, Scorer

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch
    from ..components import Score
    from ..decision import Decision
    from ..errors import ConfigIssue
    from ..host import HostDescription

T = TypeVar("T")
_TIMING_ORDER = list(TIMINGS)


def latest_event(*timings: str) -> str:
    """The bus event of the latest of ``timings`` (keys of :data:`~dataflex_bus.components.TIMINGS`)."""
    return TIMINGS[_TIMING_ORDER[max(_TIMING_ORDER.index(t) for t in timings)]]


def timing_after(timing: str, other: str) -> bool:
    """True when ``timing`` comes later in the step than ``other``."""
    return _TIMING_ORDER.index(timing) > _TIMING_ORDER.index(other)


class Need(NamedTuple):
    """What a method needs a host capability for (the value of :meth:`Mechanism.needs`): ``why``, said in the
    refusal on a host lacking it (``"selects prompts before generation (on_prompts)"``); ``at``, the part of the
    method's config the refusal names (``mechanism``, ``scorer.name``, ``actuator.name``); ``instead``, what
    to do on such a host (empty: nothing to offer)."""

    why: str
    at: str = "mechanism"
    instead: str = ""


class Needed(NamedTuple):
    """One capability a block needs of its host: the config ``key`` the refusal names, the ``capability`` and
    what for (``need``)."""

    key: str
    capability: str
    need: Need


class ComponentName(Protocol):
    @property
    def name(self) -> str: ...


class MethodSettings(Protocol):
    """What a mechanism reads of a method's config (:class:`~dataflex_bus.block.MethodConfig`, which sits above
    the mechanisms: the block's schema lists their names)."""

    @property
    def name(self) -> str: ...
    @property
    def mechanism(self) -> str: ...
    @property
    def scorer(self) -> ComponentName: ...
    @property
    def actuator(self) -> ComponentName: ...
    @property
    def warmup_step(self) -> int: ...
    @property
    def update_step(self) -> int: ...
    @property
    def on_empty(self) -> str: ...
    @property
    def on_nonfinite(self) -> str: ...


class MethodRun(Protocol):
    """What a mechanism's :meth:`Mechanism.apply` may use of the method it runs
    (:class:`dataflex_bus.method.Method` provides it)."""

    @property
    def config(self) -> MethodSettings: ...
    @property
    def event(self) -> str: ...
    @property
    def prefix(self) -> str: ...
    @property
    def refill(self) -> bool:
        """The host refills what this method drops at on_rollout (``dataflex.refill``)."""
        ...
    @property
    def scorer(self) -> Scorer: ...
    @property
    def actuator(self) -> Actuator: ...
    @property
    def counters(self) -> dict[str, int]: ...

    #: The domain probabilities this method published last (mix).
    domain_probs: dict[str, float] | None
    configured_domains: list[str] | None
    domains_checked: bool

    def score(self, batch: Batch, step: int, metrics: dict[str, float]) -> tuple[Batch, Score, Tensor | None]:
        """The scorer's checked output on ``batch``, the batch with rows of non-finite score marked as padding
        (``on_nonfinite=drop``) and those rows (``None``: none)."""
        ...

    def call(self, who: str, fn: Callable[..., T], *args: Any) -> T:
        """Call a component method (``who``: ``scorer`` or ``actuator``) under the error and write guard."""
        ...

    def empty(self, batch: Batch, keep: Tensor, step: int, decision: Decision, dropped: Tensor | None) -> bool:
        """Apply ``on_empty`` when no real row survives; True when the method's own output is then not used."""
        ...


class Mechanism:
    """One mechanism. Subclasses set the class attributes and override what differs from the defaults.

    ``kind``: the actuator kind it takes (``register(kind, ...)`` in a plugin); ``base``: the class those
    actuators subclass. ``per_block``: at most this many methods of a block may use it (``None``: any).
    ``during_warmup``: it runs before ``warmup_step`` too (a mixer gathers statistics). ``before_generation``:
    a ``pre_rollout`` scorer may feed it. ``drops_rows``: it may drop rows. ``samples_domains``: it publishes
    the domain probabilities the host draws the next prompts from. ``refill_compatible``: it may run beside
    ``dataflex.refill``.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    base: ClassVar[type[Actuator]] = Actuator
    summary: ClassVar[str] = ""
    per_block: ClassVar[int | None] = None
    #: Why, for the refusal of a block with more (``"a stack may hold " + per_block_reason``).
    per_block_reason: ClassVar[str] = ""
    during_warmup: ClassVar[bool] = False
    before_generation: ClassVar[bool] = False
    drops_rows: ClassVar[bool] = False
    samples_domains: ClassVar[bool] = False
    #: May run beside ``dataflex.refill`` (a mechanism that decides how many prompts a step generates may not).
    refill_compatible: ClassVar[bool] = True
    #: A data-flow mechanism's parts in the host kit, ``"module:Class"`` (:mod:`dataflex_bus.step_parts`; a
    #: string, so the registry imports no kit): its hooks into each step, its state for the run ("": none).
    step_part: ClassVar[str] = ""
    run_part: ClassVar[str] = ""

    def event(self, scorer: type[Scorer], actuator: type[Actuator]) -> str:
        """The bus event a method acts at: the latest of its scorer's timing and its actuator's earliest."""
        return latest_event(scorer.timing, actuator.min_timing)

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        """The host capabilities (keys of :data:`~dataflex_bus.host.CAPABILITIES`) one method needs, each with
        what for: validation refuses the method on a host lacking one, with the host's own reason, and the
        host contract suite skips the cases needing it there."""
        return {}

    def check(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator], host: HostDescription,
              key: str) -> list[ConfigIssue]:
        """Rules this mechanism adds for one method on ``host`` (``key``: the method's config key)."""
        return []

    def check_domains(self, actuator: Actuator, domains: Sequence[str]) -> list[ConfigIssue]:
        """Rules joining a built actuator's parameters and the block's ``domains`` (when it lists them)."""
        return []

    def check_stack(self, entries: Sequence[tuple[str, type[Actuator]]]) -> list[ConfigIssue]:
        """Rules between the methods of a block using this mechanism: ``(config key, actuator class)`` each,
        in list order (``per_block`` is checked by validation)."""
        return []

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        """The bus events an actuator of this mechanism can act at, each with its condition (``dataflex info``)."""
        return {latest_event(actuator.min_timing): ""}

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        """Run the method on ``batch`` and fold its actuator's output into ``decision``."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def set_domains(self, run: MethodRun, domains: Sequence[str]) -> None:
        """The host's domains, in its sampler's order (only mechanisms that sample domains care)."""

    def describe(self) -> Mapping[str, Any]:
        """What ``dataflex info`` and the docs show of this mechanism."""
        return {"name": self.name, "kind": self.kind, "summary": self.summary}

    def __repr__(self) -> str:
        return f"<mechanism {self.name!r} ({self.kind})>"
