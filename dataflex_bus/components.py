"""The component model every plugin shares: :class:`Component`, :class:`Scorer`, :class:`Actuator`.

A method is one :class:`Scorer` (what to score) times one actuator under a mechanism; each mechanism is a
registered object in its own module of :mod:`dataflex_bus.mechanisms`, beside the actuator base its plugins
subclass and that base's output types (``mechanisms/select.py``: :class:`Selector`, :class:`Selection`;
``reweight.py``: :class:`Reweighter`; ``mix.py``: :class:`Mixer`; ``replay.py``: :class:`Replayer`;
``allocate.py``: :class:`Allocator`, :class:`Budget`). This module holds what every component shares:
parameters declared with :class:`Param` (so configs are validated before anything trains), what a component
reads (``requires``, :func:`reads`), when it can run (``timing``, :data:`TIMINGS`) and what shape its output
has (``granularity``, :class:`Score`), so the bus can wire it to the right training event and refuse
combinations that cannot work; and the checks the bus runs on what components return and declare
(:func:`as_score`, :func:`without_grad`, :func:`class_attribute_problems`).

The actuator bases and their output types stay importable from here (``from dataflex_bus.components import
Selector``), loaded from their mechanism's module on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ._lazy import lazy_exports
from .errors import BatchFieldError, ConfigIssue
from .schema import Param, check_section

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .block import MethodConfig
    from .host import HostDescription

    # Re-exported for packs written against this module (the names come from _MOVED below, at run time).
    from .mechanisms.allocate import ALLOCATION_PARAMS as ALLOCATION_PARAMS
    from .mechanisms.allocate import Allocation as Allocation
    from .mechanisms.allocate import Allocator as Allocator
    from .mechanisms.allocate import Budget as Budget
    from .mechanisms.mix import Mixer as Mixer
    from .mechanisms.replay import REPLAY_ADVANTAGES as REPLAY_ADVANTAGES
    from .mechanisms.replay import REPLAY_CORRECTIONS as REPLAY_CORRECTIONS
    from .mechanisms.replay import REPLAY_UNITS as REPLAY_UNITS
    from .mechanisms.replay import Replayer as Replayer
    from .mechanisms.replay import ReplayPick as ReplayPick
    from .mechanisms.replay import ReplayPool as ReplayPool
    from .mechanisms.replay import ReplaySettings as ReplaySettings
    from .mechanisms.reweight import Reweighter as Reweighter
    from .mechanisms.reweight import Reweighting as Reweighting
    from .mechanisms.select import Selection as Selection
    from .mechanisms.select import Selector as Selector
    from .visits import PromptState, VisitClasses, Visits

#: Each actuator base and output type, by the module of :mod:`dataflex_bus.mechanisms` that defines it: kept
#: importable from here (a module ``__getattr__``, so importing this module does not load the mechanisms, which
#: import it).
_MOVED = {
    **dict.fromkeys(("Selection", "Selector"), "select"),
    **dict.fromkeys(("Reweighting", "Reweighter"), "reweight"),
    **dict.fromkeys(("Mixer",), "mix"),
    **dict.fromkeys(("REPLAY_UNITS", "REPLAY_ADVANTAGES", "REPLAY_CORRECTIONS", "ReplaySettings", "ReplayPool",
                     "ReplayPick", "Replayer"), "replay"),
    **dict.fromkeys(("Budget", "Allocation", "ALLOCATION_PARAMS", "Allocator"), "allocate"),
}
__getattr__ = lazy_exports(__name__, {name: f"mechanisms.{home}" for name, home in _MOVED.items()},
                           base=__package__)

#: Scorer timings, in the order the training loop reaches them, and the bus event each maps to.
#: ``pre_rollout`` scorers read only what is known about a prompt before generating for it (its id,
#: domain and per-prompt history).
TIMINGS: dict[str, str] = {
    "pre_rollout": "on_prompts",
    "post_reward": "on_rollout",
    "post_advantage": "on_advantage",
    "post_update": "on_step_end",
}
GRANULARITIES = ("prompt", "response", "token", "domain")

def resolve_params(
    cls: type[Component], given: Mapping[str, Any], key: str = "params"
) -> tuple[dict[str, Any], list[ConfigIssue]]:
    """Validate ``given`` against ``cls.params``; returns the full parameter dict and every issue."""
    issues: list[ConfigIssue] = []
    values = check_section(given, cls.params, key, issues, owner=cls.__name__)
    if not issues:
        issues.extend(
            ConfigIssue(f"{key}.{param}" if param else key, message)
            for param, message in cls.check_params(values)
        )
    return values, issues


class Component:
    """Base of every scorer and actuator.

    Subclasses declare ``params`` and may override :meth:`check_params` for cross-parameter rules
    (``low <= high``). The instance gets each parameter as an attribute. Stateful components override
    :meth:`state_dict` / :meth:`load_state_dict` so a resumed run continues exactly.
    """

    kind: ClassVar[str] = ""
    params: ClassVar[Mapping[str, Param]] = {}
    #: Batch fields the component reads (verl names; ``uid`` and ``data_source`` are row labels).
    requires: ClassVar[Sequence[str]] = ()
    #: Needs several rollouts per prompt (a group-based advantage estimator such as GRPO).
    needs_groups: ClassVar[bool] = False
    #: Reads the per-prompt history (the ``history_*`` fields): the runtime keeps one when any component
    #: of the block declares this (see :mod:`dataflex_bus.history`).
    uses_history: ClassVar[bool] = False
    #: Set by the registry when built by name; class name otherwise.
    name: str = ""

    def __init__(self, **params: Any) -> None:
        from .errors import ConfigError

        values, issues = resolve_params(type(self), params)
        if issues:
            raise ConfigError(issues)
        self.config: dict[str, Any] = values
        for key, value in values.items():
            setattr(self, key, value)
        self.name = self.name or type(self).__name__

    @property
    def who(self) -> str:
        """How errors name this component: ``"selector 'dapo'"``."""
        return f"{self.kind} {self.name!r}"

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Cross-parameter checks: return ``[(param, message), ...]`` for each violated rule."""
        return []

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        """Checks joining the built component's parameters and the host it is validated for (its group size,
        prompts per step, this machine's memory): ``[(param, message), ...]``, run by ``dataflex validate``,
        ``doctor`` and every host's validation before anything is allocated."""
        return []

    def host_warnings(self, host: HostDescription) -> list[tuple[str, str]]:
        """Like :meth:`check_host`, for settings that run but do less than they say: logged, not refused."""
        return []

    @classmethod
    def requires_for(cls, values: Mapping[str, Any]) -> Sequence[str]:
        """The batch fields a component with parameters ``values`` reads: :attr:`requires`, plus what a
        parameter adds (a token selection over ``scope: minibatch`` reads the host's mini-batches). Validation
        checks these against the host; the runtime asks the host for them."""
        return cls.requires

    def visit_classes(self) -> VisitClasses | None:
        """How this component wants the history to classify a visit (easy / hard / other), or ``None``
        when it does not care. Every component of a block that answers must answer the same."""
        return None

    def prompt_state(self) -> PromptState | None:
        """Per-prompt state this component owns in the history (read at ``on_prompts`` as the field
        ``PromptState.field``), or ``None``. Needs ``uses_history``."""
        return None

    def update_prompt_state(self, state: Tensor, visits: Visits) -> Tensor:
        """The new ``[V, width]`` state of the prompts of ``visits`` (distinct prompts) from their old
        ``state``; called by the history for every rolled-out group, before any selection."""
        raise NotImplementedError(f"{type(self).__name__}.update_prompt_state")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; stateless components return ``{}``."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{self.name}: stateless component got a non-empty state {sorted(state)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{type(self).__name__}({args})"


@dataclass
class Score:
    """What a scorer returns.

    ``values`` is ``[B]`` for ``prompt``/``response`` granularity (a prompt-level score is broadcast to
    every row of its group), ``[B, T]`` for ``token`` and ``[D]`` (one per ``batch.domain_names``
    entry) for ``domain``. Group scorers also hand the integer counts behind a rate (``counts`` per row,
    ``totals`` per row) so actuators can make boundary decisions on integers, not floats.
    """

    values: Tensor
    granularity: str
    counts: Tensor | None = None
    totals: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Scorer(Component):
    """Computes one value per prompt, response, token or domain."""

    kind: ClassVar[str] = "scorer"
    #: Batch fields read by :meth:`score` (verl names; ``uid`` and ``data_source`` are row labels).
    requires: ClassVar[Sequence[str]] = ()
    #: Earliest point of the step at which the scorer can run: a key of :data:`TIMINGS`.
    timing: ClassVar[str] = "post_reward"
    #: Shape of the output: one of :data:`GRANULARITIES`.
    granularity: ClassVar[str] = "response"
    #: Needs several rollouts per prompt (a group-based advantage estimator such as GRPO).
    needs_groups: ClassVar[bool] = False

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score | Tensor:
        """Score ``batch`` at training ``step``: a :class:`Score`, or a plain tensor shaped by
        :attr:`granularity` (``[B]``, ``[B, T]`` or ``[D]``). ``ctx`` is empty today: it keeps the
        signature open for context a later host may pass."""
        raise NotImplementedError(f"{type(self).__name__}.score")


class Actuator(Component):
    """Turns a score into an action under one mechanism."""

    #: Score granularities this actuator can act on.
    accepts: ClassVar[Sequence[str]] = ("prompt", "response")
    #: Earliest timing at which the actuator can act (e.g. subset selectors rewrite advantages).
    min_timing: ClassVar[str] = "post_reward"
    #: Batch fields the actuator itself reads, beyond the scorer's.
    requires: ClassVar[Sequence[str]] = ()
    needs_groups: ClassVar[bool] = False
    #: Scorers whose statistic this actuator is defined on (its paper's); others are warned, not refused.
    intended_scorers: ClassVar[Sequence[str]] = ()

    @classmethod
    def check_block(cls, key: str, method: MethodConfig,
                    block: Sequence[tuple[str, MethodConfig]]) -> list[ConfigIssue]:
        """Rules between this actuator's method (config key ``key``) and the other methods of its block:
        ``block`` holds every method of it with its key, this one included, each validated (``method.resolved``:
        its components and checked parameters). A method whose rule another method applies too (Reinforce-Ada's
        downsampling and its rounds) checks here that the two agree. Default: no rule."""
        return []


def reads(component: Component) -> tuple[str, ...]:
    """The batch fields a built component reads (:meth:`Component.requires_for` its parameters)."""
    # getattr: a component whose __init__ skipped Component's has no checked parameters to add fields.
    return tuple(type(component).requires_for(getattr(component, "config", {})))


# ---------------------------------------------------------------------------- checks the bus relies on
#: Components already warned about returning tensors that require grad (one warning each per process).
_WARNED_GRAD: set[str] = set()


def without_grad(values: Tensor, who: str, what: str) -> Tensor:
    """``values`` detached from autograd, warning once per component when it carried a graph.

    Scores and weights decide what is trained; they are never differentiated. A graph on them would
    join the loss's (its backward then fails on the second mini-batch, naming no plugin).
    """
    if not values.requires_grad:
        return values
    if who not in _WARNED_GRAD:
        _WARNED_GRAD.add(who)
        import logging

        logging.getLogger("dataflex_bus").warning(
            "dataflex: %s returned %s that requires grad; detached (the bus never differentiates through "
            "them): return a detached tensor (torch.no_grad() or .detach())", who, what)
    return values.detach()


def as_score(result: Any, scorer: Scorer, batch: Batch) -> Score:
    """What ``scorer.score(batch, ...)`` returned, as a checked :class:`Score`.

    A scorer may return a :class:`Score` or a plain tensor (the seed's contract); either way the values
    must be a real-valued tensor shaped by the declared granularity: ``[B]`` for ``prompt``/``response``,
    ``[B, T]`` for ``token`` (``T`` the response width), ``[D]`` for ``domain`` (``D`` the batch's domain
    names). Raises :class:`~dataflex_bus.errors.BatchFieldError` naming the scorer and field ``score``.
    """
    import torch

    who = f"scorer {scorer.name or type(scorer).__name__!r}"
    granularity = scorer.granularity
    if isinstance(result, Score):
        score = result
        if score.granularity != granularity:
            raise BatchFieldError(who, "score", f"declares granularity {granularity!r} but returned a "
                                  f"{score.granularity!r} Score")
        if not isinstance(score.values, torch.Tensor):
            raise BatchFieldError(who, "score",
                                  f"Score.values must be a tensor, got {type(score.values).__name__}")
    elif isinstance(result, torch.Tensor):
        score = Score(result, granularity)
    else:
        raise BatchFieldError(who, "score",
                              f"score() must return a Score or a tensor, got {type(result).__name__}")
    values = score.values = without_grad(score.values, who, "a score")
    if values.dtype == torch.bool or values.is_complex():
        raise BatchFieldError(who, "score", f"expected a float or integer tensor, got {values.dtype}")
    rows = len(batch)
    shape = tuple(values.shape)
    if granularity == "token":
        width = batch.width_of("response_mask")
        ok = len(shape) == 2 and shape[0] == rows and (width is None or shape[1] == width)
        expected = f"({rows}, {width if width is not None else 'T'}) (one value per response token)"
    elif granularity == "domain":
        ok = shape == (len(batch.domain_names),)
        expected = f"({len(batch.domain_names)},) (one value per domain of {batch.domain_names})"
    else:
        ok = shape == (rows,)
        expected = f"({rows},) (one value per row)"
    if not ok:
        raise BatchFieldError(who, "score", f"{granularity}-level scores must have shape {expected}, got {shape}")
    for name in ("counts", "totals"):
        extra = getattr(score, name)
        if extra is not None and (not isinstance(extra, torch.Tensor) or tuple(extra.shape) != (rows,)):
            got = tuple(extra.shape) if isinstance(extra, torch.Tensor) else type(extra).__name__
            raise BatchFieldError(who, f"score.{name}", f"expected a tensor of shape ({rows},), got {got}")
    return score


def _is_names(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and all(
        isinstance(v, str) for v in value)


def class_attribute_problems(cls: type[Component]) -> list[str]:
    """Invalid class-level declarations of a component class, each as ``"Class.attr = value: why"``.

    The bus wires and validates methods from these attributes, so a typo (``timing = "after_lunch"``)
    must be refused when the class is loaded, not surface later as a traceback inside a training step.
    """
    problems: list[str] = []

    def bad(attr: str, value: Any, why: str) -> None:
        problems.append(f"{cls.__name__}.{attr} = {value!r}: {why}")

    def one_of(attr: str, allowed: Sequence[str]) -> None:
        value = getattr(cls, attr, None)
        if not isinstance(value, str) or value not in allowed:
            bad(attr, value, f"expected one of {', '.join(allowed)}")

    params = getattr(cls, "params", None)
    if not isinstance(params, Mapping):
        bad("params", params, "expected a mapping of parameter name to Param(...)")
    else:
        for key, spec in params.items():
            if not isinstance(key, str) or not key.isidentifier():
                problems.append(f"{cls.__name__}.params: key {key!r} is not a Python identifier")
            elif not isinstance(spec, Param):
                bad(f"params[{key!r}]", spec, "expected a Param(...) declaration")
            elif not all(isinstance(t, type) for t in spec.types):
                bad(f"params[{key!r}].type", spec.type, "expected a type or a tuple of types")
            elif not spec.required and (issue := spec.coerce(key, spec.default)[1]) is not None:
                bad(f"params[{key!r}].default", spec.default, f"the default breaks its own declaration: "
                    f"{issue.message}")
    requires = getattr(cls, "requires", ())
    if not _is_names(requires):
        bad("requires", requires, "expected a sequence of batch field names, e.g. ('rm_scores',)")
    if not isinstance(getattr(cls, "needs_groups", False), bool):
        bad("needs_groups", cls.needs_groups, "expected True or False")
    if getattr(cls, "kind", "") == "predictor":
        pass  # a predictor has no timing or granularity: the runtime calls it at on_prompts and on_rollout
    elif getattr(cls, "kind", "") == "scorer":
        one_of("timing", list(TIMINGS))
        one_of("granularity", GRANULARITIES)
    else:
        one_of("min_timing", list(TIMINGS))
        accepts = getattr(cls, "accepts", None)
        if not _is_names(accepts) or not accepts or any(g not in GRANULARITIES for g in accepts):
            bad("accepts", accepts, f"expected a non-empty sequence of granularities from "
                f"{', '.join(GRANULARITIES)}")
        intended = getattr(cls, "intended_scorers", ())
        if not _is_names(intended):
            bad("intended_scorers", intended, "expected a sequence of scorer names")
        for flag in ("rewrites_advantages", "filters_zero_variance", "selects_tokens"):
            if not isinstance(getattr(cls, flag, False), bool):
                bad(flag, getattr(cls, flag), "expected True or False")
        if getattr(cls, "selects_tokens", False) is True and list(accepts or ()) != ["token"]:
            bad("accepts", accepts, "a token selector (selects_tokens = True) acts on token-level scores only: "
                "expected ('token',)")
    return problems
