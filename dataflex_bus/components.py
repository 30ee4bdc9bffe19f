"""The component model: what a plugin author subclasses.

A method is one :class:`Scorer` (what to score) times one actuator: a :class:`Selector` (mechanism
``select``), a :class:`Reweighter` (``reweight``), a :class:`Mixer` (``mix``) or an :class:`Allocator`
(``allocate``); each mechanism is a
registered object (:mod:`dataflex_bus.mechanisms`) naming the actuator class it takes. Components declare
their parameters with :class:`Param`, so configs are validated before anything trains, and declare what
they read (``requires``), when they can run (``timing``) and what shape their output has
(``granularity``), so the bus can wire them to the right training event and refuse combinations that
cannot work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import BatchFieldError, ConfigIssue
from .schema import Param, check_section

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .block import MethodConfig
    from .host import HostDescription
    from .visits import PromptState, VisitClasses, Visits

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


@dataclass
class Selection:
    """A selector's output: ``keep`` is bool ``[B]`` (padding rows are never kept).

    Subset selectors that keep part of a group also return the recomputed ``advantages`` ``[B, T]``. A token
    selector (:attr:`Selector.selects_tokens`) returns ``tokens``, bool ``[B, T]``: the response tokens whose
    policy-gradient term trains, with ``keep`` the rows left with a kept token; ``token_weights`` (float
    ``[B, T]``, ``None``: 1) multiply the kept tokens' loss (its normalisation, e.g. ``N / K``); ``mask_kl``
    asks for the tokens left out to leave the KL and entropy terms too.
    """

    keep: Tensor
    advantages: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: Tensor | None = None
    token_weights: Tensor | None = None
    mask_kl: bool = False


class Selector(Actuator):
    """Mechanism ``select``: which rows enter the update (at ``on_prompts``: which candidate prompts are
    generated)."""

    kind: ClassVar[str] = "selector"
    #: A selection only needs its score: fed a ``pre_rollout`` score it acts before generation.
    min_timing: ClassVar[str] = "pre_rollout"
    #: Returns recomputed ``advantages`` over the rows it keeps (a subset selector such as PODS).
    rewrites_advantages: ClassVar[bool] = False
    #: Drops exactly the zero-variance groups (what verl's own ``algorithm.filter_groups`` evicts).
    filters_zero_variance: ClassVar[bool] = False
    #: Selects response tokens, not rows (fed token-level scores; acts at ``on_advantage``): its
    #: :class:`Selection` holds ``tokens``.
    selects_tokens: ClassVar[bool] = False

    def candidates_per_prompt(self) -> float:
        """Candidates this selection wants to compare per prompt it keeps, in one draw (a top-B selector over a
        pool of ``ratio x B``); the host kit draws that many at once (bounded by ``dataflex.max_oversample``)."""
        return 1.0

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        """True if, fed scores of ``granularity``, this selector always keeps or drops whole groups.

        Only such a selection may run at ``on_rollout``: dropping single rows before the advantage is
        computed would change the GRPO baseline of the rows left in their group. Any other selection runs
        at ``on_advantage``, where a dropped row is masked out of the loss after its group's advantage.
        """
        return False

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        raise NotImplementedError(f"{type(self).__name__}.select")


@dataclass
class Reweighting:
    """A reweighter's output: non-negative finite weights ``[B]`` or ``[B, T]``, multiplied into the loss."""

    weights: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class Reweighter(Actuator):
    """Mechanism ``reweight``: per-token loss weights (multiplied into ``rollout_is_weights``)."""

    kind: ClassVar[str] = "reweighter"
    min_timing: ClassVar[str] = "post_advantage"
    accepts: ClassVar[Sequence[str]] = ("prompt", "response", "token")

    def reweight(self, batch: Batch, score: Score, step: int) -> Reweighting:
        raise NotImplementedError(f"{type(self).__name__}.reweight")


class Mixer(Actuator):
    """Mechanism ``mix``: sampling probabilities over domains for the *next* prompts.

    The host calls :meth:`set_domains` once with the dataset's domain names, :meth:`update` at the end
    of each step with that step's batch and score, and :meth:`probabilities` when it draws prompts.
    """

    kind: ClassVar[str] = "mixer"
    accepts: ClassVar[Sequence[str]] = ("prompt", "response", "domain")

    domains: list[str]

    def set_domains(self, domains: Sequence[str]) -> None:
        self.domains = list(domains)

    def update(self, batch: Batch, score: Score, step: int) -> dict[str, float]:
        """Fold this step's statistics in; returns metrics."""
        raise NotImplementedError(f"{type(self).__name__}.update")

    def probabilities(self) -> Tensor:
        """Float ``[D]`` summing to 1, aligned with ``self.domains``."""
        raise NotImplementedError(f"{type(self).__name__}.probabilities")


#: How a replayer's rows enter a step (:class:`ReplaySettings`): the values each setting may take.
REPLAY_UNITS = ("group", "prompt")
REPLAY_ADVANTAGES = ("own_group", "split", "mixed")
REPLAY_CORRECTIONS = ("decoupled", "behaviour")


@dataclass(frozen=True)
class ReplaySettings:
    """What the host kit does with a replayer's buffer (read once, when the run starts).

    ``unit``: ``group`` replays whole stored groups in the step's place of fresh ones (DOTS: the step
    generates ``fresh_fraction`` of its prompts and fills the rest from the buffer); ``prompt`` replays, for
    each prompt the step generates, up to ``replays`` of its stored rows once ``min_to_replay`` are stored
    (RePO; the step's fresh prompts are all generated). ``advantage``: the groups replayed rows are normalised
    in by the host's GRPO pass: ``own_group`` (the rows they were generated with), ``split`` (the replayed rows
    of one prompt together, apart from its fresh rows), ``mixed`` (with the fresh rows of their prompt).
    ``correction``: ``decoupled`` weights every row by ``min(pi_old / mu, is_cap)`` (decoupled PPO with
    truncation, DOTS), ``behaviour`` clips the ratio against the stored behaviour log-probs ``mu`` instead of
    ``pi_old`` (``old_log_probs <- mu`` on replayed rows, RePO). ``capacity``: rows stored at most (the oldest
    groups leave first); ``per_prompt``: rows per prompt at most (0: no bound); ``max_age_steps``: a record
    older than this many steps is evicted (0: never); ``dedup``: keep only each prompt's newest group;
    ``off_policy_coef``: a factor on the loss of replayed rows (RePO's ``c_off``).
    """

    unit: str = "group"
    advantage: str = "own_group"
    correction: str = "decoupled"
    capacity: int = 4096
    per_prompt: int = 0
    min_to_replay: int = 1
    replays: int = 8
    max_age_steps: int = 0
    fresh_fraction: float = 1.0
    dedup: bool = False
    is_cap: float = 2.0
    off_policy_coef: float = 1.0


@dataclass
class ReplayPool:
    """The stored rows a replayer may pick from at one step, grouped in ``num_segments`` segments.

    Unit ``prompt``: a segment is one prompt the step generates (in the order of its fresh groups), holding
    that prompt's stored rows, oldest first; ``want[s]`` rows are to be picked from segment ``s``. Unit
    ``group``: a segment is one stored group (oldest first), ``groups`` of them are to be picked, whole.
    Per row: ``reward`` (stored, never re-scored), ``priority`` (the scorer's value when the row was stored),
    ``seq`` (insertion order, larger is newer) and ``age`` (steps since it was generated).
    """

    segment: Tensor
    num_segments: int
    want: Tensor
    groups: int
    reward: Tensor
    priority: Tensor
    seq: Tensor
    age: Tensor


@dataclass
class ReplayPick:
    """A replayer's choice: ``rows`` (long, indices into the pool, in training order) and optional per-row
    importance ``weights`` (non-uniform sampling: PER's ``(N P(i))^-beta / max``), multiplied into the loss."""

    rows: Tensor
    weights: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Replayer(Actuator):
    """Mechanism ``replay``: which fresh rows enter the run's buffer (at ``on_advantage``, with their score as
    priority) and which stored rows a later step trains on again (picked before its old log-probs).

    The host kit keeps the buffer (:mod:`dataflex_bus.replay`); a replayer says how (:meth:`settings`), what to
    store (:meth:`store`, default every fresh row) and what to replay (:meth:`pick`).
    """

    kind: ClassVar[str] = "replayer"
    min_timing: ClassVar[str] = "post_reward"
    accepts: ClassVar[Sequence[str]] = ("prompt", "response")
    #: The behaviour log-probs (mu) and the advantages of what it stores.
    requires: ClassVar[Sequence[str]] = ("rollout_log_probs", "old_log_probs", "advantages", "uid")
    needs_groups: ClassVar[bool] = True

    def settings(self) -> ReplaySettings:
        return ReplaySettings()

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        """The buffer fits this machine (its columns are preallocated) and holds at least one group, else
        nothing it stores could ever be replayed."""
        from .memory import beyond_memory
        from .replay_store import preallocated_bytes

        s = self.settings()
        issues = super().check_host(host)
        refusal = beyond_memory(preallocated_bytes(s.capacity), f"capacity={s.capacity:,} stored rows",
                                "lower capacity", host.memory_limit)
        if refusal:
            return [*issues, ("capacity", refusal)]
        n = host.group_size
        if n is not None and s.capacity < n:
            issues.append(("capacity", f"capacity={s.capacity} rows holds less than one group of {n} rollouts "
                           f"(host {host.name!r}), so no group is ever stored whole and nothing is replayed; set "
                           f"capacity >= {n}"))
        return issues

    def host_warnings(self, host: HostDescription) -> list[tuple[str, str]]:
        """Under unit ``group``, a buffer holding fewer rows than one step replays: a step replays at most what it
        holds and generates the rest fresh, so ``fresh_fraction`` is never reached."""
        s = self.settings()
        n, prompts = host.group_size, host.prompts_per_step
        if n is None or prompts is None or s.unit != "group" or s.capacity < n:
            return []
        groups = self.replay_groups(int(prompts), int(prompts), 0)
        if s.capacity >= groups * n:
            return []
        return [("capacity", f"capacity={s.capacity} rows holds {s.capacity // n} of the {groups} groups of {n} "
                 f"one step replays (unit group, fresh_fraction={s.fresh_fraction} of {prompts} prompts on host "
                 f"{host.name!r}), so a step generates the rest fresh; set capacity >= {groups * n} for the whole "
                 "share")]

    def store(self, batch: Batch, score: Score, step: int) -> Tensor:
        """Bool ``[B]``: the rows to store (the kit stores only fresh real rows whatever this says)."""
        return batch.valid_rows

    def replay_groups(self, target: int, available: int, step: int) -> int:
        """Unit ``group``: how many stored groups replace fresh ones in a step of ``target`` groups, given
        ``available`` eligible stored groups (default: ``(1 - fresh_fraction)`` of the step, as many as there are)."""
        s = self.settings()
        wanted = int((1.0 - s.fresh_fraction) * target + 0.5)
        return max(0, min(wanted, available, target - 1))

    def pick(self, pool: ReplayPool, step: int) -> ReplayPick:
        raise NotImplementedError(f"{type(self).__name__}.pick")


def reads(component: Component) -> tuple[str, ...]:
    """The batch fields a built component reads (:meth:`Component.requires_for` its parameters)."""
    # getattr: a component whose __init__ skipped Component's has no checked parameters to add fields.
    return tuple(type(component).requires_for(getattr(component, "config", {})))


@dataclass(frozen=True)
class Budget:
    """What an allocator may spend at one event (the host kit fills it in).

    ``rollouts``: the budget ``T`` (the method's ``budget``, default ``prompts x group_size``: plain GRPO's
    step); ``prompts``: the groups the step still needs from this batch (``B``); ``group_size``: the host's
    responses per prompt (``G``: verl's ``rollout.n``, the shim's ``trainer.group_size``); ``round``: the
    generation round of the batch's groups (0: the first; at ``on_rollout`` a continuation counts up).
    """

    rollouts: int
    prompts: int
    group_size: int
    round: int = 0


@dataclass
class Allocation:
    """An allocator's output: ``counts`` long ``[B]``, one per row (at ``on_prompts`` a row is a candidate;
    at ``on_rollout`` every row of a group carries the group's count of *more* rollouts), 0 = none.
    ``keep`` (bool ``[B]``, ``on_rollout`` only): the groups to go on with (``None``: all)."""

    counts: Tensor
    keep: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


#: Parameters every allocator takes (subclasses extend them: ``params = {**ALLOCATION_PARAMS, ...}``).
ALLOCATION_PARAMS: dict[str, Param] = {
    "budget": Param((int, type(None)), None, low=1,
                    doc="rollouts per step (at on_prompts); default prompts_per_step x group_size, plain GRPO's"),
    "exact_budget": Param(bool, True, doc="spend the budget exactly (else at most)"),
    "min_n": Param(int, 2, low=1, doc="fewest rollouts of a prompt that is generated at all"),
    "max_n": Param(int, 128, low=1, doc="most rollouts of one prompt in a step"),
    "singletons": Param(bool, False, doc="allow groups of one rollout (min_n=1): GRPO gives them A = r, not 0"),
}


class Allocator(Actuator):
    """Mechanism ``allocate``: how many rollouts each prompt gets (0: skip it).

    Fed a ``pre_rollout`` score it acts at ``on_prompts`` and returns one count per candidate under the
    :class:`Budget`; fed a ``post_reward`` score it acts at ``on_rollout`` after each generation round and
    returns how many *more* rollouts each group gets (a continuation round appended to the same groups,
    SPEED), and which groups go on. The bus checks every count against :meth:`rules`.
    """

    kind: ClassVar[str] = "allocator"
    min_timing: ClassVar[str] = "pre_rollout"
    accepts: ClassVar[Sequence[str]] = ("prompt",)
    params: ClassVar[Mapping[str, Param]] = ALLOCATION_PARAMS
    #: Generation rounds a group may have in one step (1: no continuation; an on_rollout allocator sets more).
    rounds: ClassVar[int] = 1

    budget: int | None
    exact_budget: bool
    min_n: int
    max_n: int
    singletons: bool

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        if values["min_n"] > values["max_n"]:
            return [("min_n", f"min_n={values['min_n']} must be <= max_n={values['max_n']}")]
        if values["min_n"] < 2 and not values["singletons"]:
            return [("min_n", f"min_n={values['min_n']} allows groups of one rollout, whose GRPO advantage is "
                     "r / (1 + eps), not 0 (verl's singleton rule); use min_n >= 2 or set singletons: true")]
        return []

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        """A ``budget`` (rollouts per step) or ``max_n`` (rollouts of one prompt) this machine cannot hold at what a
        row takes on the host (:attr:`~dataflex_bus.host.HostDescription.row_bytes`, else the floor
        :data:`~dataflex_bus.memory.ROLLOUT_ROW_BYTES`) is refused before a step tries to generate it."""
        from .memory import beyond_memory, format_bytes, rollout_row

        issues = super().check_host(host)
        row, basis = rollout_row(host)
        for name, value, what in (("budget", self.budget, "rollouts per step"),
                                  ("max_n", self.max_n, "rollouts of one prompt")):
            refusal = None if value is None else beyond_memory(
                int(value) * row, f"{name}={value:,} {what} (at {format_bytes(row)} a row on host {host.name!r}: "
                f"{basis})", f"lower {name}", host.memory_limit)
            if refusal:
                issues.append((name, refusal))
        return issues

    def allocate(self, batch: Batch, score: Score, step: int, budget: Budget) -> Allocation:
        raise NotImplementedError(f"{type(self).__name__}.allocate")


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
        mask = batch.fields.get("response_mask")
        width = mask.shape[-1] if mask is not None and mask.dim() == 2 else None
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
    if getattr(cls, "kind", "") == "scorer":
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
