"""Mechanism ``allocate``: how many rollouts each prompt gets (0: skip it), under a budget.

Plain GRPO gives every prompt the same ``n`` rollouts. An allocator spends the same budget (default the
step's ``prompts x group_size``) by what it expects to learn from each prompt: fed a ``pre_rollout`` score
(the prompt's history) it acts at ``on_prompts`` and returns one count per candidate (Knapsack RL); fed a
``post_reward`` score it acts at ``on_rollout`` after each generation round and returns how many more
rollouts each group gets, appended to the same group in a continuation round (SPEED), and which groups go
on. The bus checks every count (:class:`CountRules`, :func:`check_counts`: the budget, ``min_n``, ``max_n``,
never a group of one unless the allocator allows it) and the host kit carries them out
(:mod:`dataflex_bus.steps`); a host must be able to generate ragged groups (capability ``ragged_groups``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..components import Actuator, Scorer
from ..errors import BatchFieldError, ConfigIssue
from ..schema import Param
from .base import Mechanism, MethodRun, MethodSettings, Need, latest_event, timing_after

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch
    from ..components import Score
    from ..decision import Decision
    from ..host import HostDescription

#: The batch-level field the host kit adds to an ``on_rollout`` batch an allocator acts on: the generation
#: round of its groups (0 at the first emission, one more after each continuation).
ROUND_FIELD = "budget_round"
#: What the refusal on a host without ragged groups offers instead.
ALTERNATIVE = ("select prompts with a pre_rollout selector instead (e.g. mopps or greso), which keeps "
               "the host's group size")


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
    #: At ``on_rollout``: each group's continuation count and keep depend on that group's rows alone (and on a
    #: cap of the groups still needed, in arrival order), so the host kit may decide a group as soon as it is
    #: generated and the host dispatch its continuation then (:meth:`Generation.screen
    #: <dataflex_bus.generation.Generation.screen>`). False: the rule reads the whole round, which is waited for.
    per_group_rule: ClassVar[bool] = False

    budget: int | None
    exact_budget: bool
    min_n: int
    max_n: int
    singletons: bool

    def continuation_cap(self) -> str:
        """Under :attr:`per_group_rule`: how the groups still needed are taken among the passing ones, which
        decides how early a group's continuation is certain (:data:`~dataflex_bus.screening.CAP_ORDERS`):
        ``"none"`` (no cap), ``"dispatch"`` (the first in dispatch order) or ``"any"`` (another order: a passing
        group waits until the round cannot hold more passing groups than are needed)."""
        return "any"

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
        from ..memory import beyond_memory, format_bytes, rollout_row

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


class Allocate(Mechanism):
    name: ClassVar[str] = "allocate"
    kind: ClassVar[str] = "allocator"
    base: ClassVar[type[Actuator]] = Allocator
    summary: ClassVar[str] = "how many rollouts each prompt gets (0: skip), under a rollout budget"
    per_block: ClassVar[int | None] = 1
    per_block_reason: ClassVar[str] = "one allocator: the counts of two would not compose"
    before_generation: ClassVar[bool] = True
    drops_rows: ClassVar[bool] = True
    step_part: ClassVar[str] = "dataflex_bus.allocation:AllocationPart"

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        out = {}
        if actuator.min_timing == "pre_rollout":
            out["on_prompts"] = "fed a pre_rollout score: counts per candidate"
        if getattr(actuator, "rounds", 1) > 1:
            out["on_rollout"] = "fed a post_reward score: continuation counts per group"
        return out

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        out: dict[str, Need] = {"ragged_groups": Need("allocates rollouts per prompt", instead=ALTERNATIVE)}
        if latest_event(scorer.timing, actuator.min_timing) == "on_prompts":
            out["prompt_selection"] = Need("allocates before generation (on_prompts)", at="scorer.name")
        return out

    def check(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator], host: HostDescription,
              key: str) -> list[ConfigIssue]:
        issues = []
        sname, aname = method.scorer.name, method.actuator.name
        event = latest_event(scorer.timing, actuator.min_timing)
        if event == "on_prompts" and scorer.needs_groups:
            issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs pre_rollout but needs groups of "
                                      "rollouts, which do not exist before generation"))
        if event == "on_rollout" and getattr(actuator, "rounds", 1) < 2:
            issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs {scorer.timing}, after the "
                                      f"rollouts {actuator.kind} {aname!r} allocates before generation; pair it with "
                                      "a pre_rollout scorer (such as knapsack_rate)"))
        if timing_after(scorer.timing, "post_reward"):
            issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs {scorer.timing}: rollouts are "
                                      "allocated before generation or, for a continuation, after the rewards"))
        return issues

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        view, score, dropped = run.score(batch, step, decision.metrics)
        actuator = run.actuator
        assert isinstance(actuator, Allocator)
        budget = _budget(view, actuator)
        out = run.call("actuator", actuator.allocate, view, score, step, budget)
        if not isinstance(out, Allocation):
            raise BatchFieldError(actuator.who, "allocate", f"returned {type(out).__name__}; expected an "
                                  "Allocation(counts, keep=None, metrics={}) (dataflex_bus.components.Allocation)")
        before = run.event == "on_prompts"
        rules = rules_of(actuator, budget, before_generation=before, key=f"{run.config.name}: actuator.params")
        for k, v in out.metrics.items():
            decision.metrics[f"{run.prefix}{k}"] = float(v)
        if before:
            counts = check_counts(out.counts, view, rules)
            if run.empty(batch, counts > 0, step, decision, dropped):
                if decision.skip_update:  # on_empty=skip: one candidate goes through, its update is skipped
                    first = _first(view)
                    decision.keep = first
                    decision.counts = first.long() * max(budget.group_size, rules.min_n)
                # keep_all: no counts, so every candidate gets the host's group size
                return
            decision.restrict(counts > 0)
            decision.counts = counts
            return
        self._continue(run, batch, view, out.counts, out.keep, budget, rules, decision, step, dropped)

    def _continue(self, run: MethodRun, batch: Batch, view: Batch, counts: Tensor, keep: Tensor | None,
                  budget: Budget, rules: CountRules, decision: Decision, step: int, dropped: Tensor | None) -> None:
        """``on_rollout``: continuation counts per row (the group's), the groups that go on."""
        import torch

        from .select import _check_whole_groups

        actuator = run.actuator
        assert isinstance(actuator, Allocator)
        sizes = view.group_sizes[view.group_index.clamp_min(0)]
        counts = check_counts(counts, view, rules, sizes=sizes)
        if bool((counts > 0).any()) and budget.round + 1 >= actuator.rounds:
            raise BatchFieldError(actuator.who, "counts", f"asked for generation round {budget.round + 2} of a "
                                  f"group, but declares rounds={actuator.rounds}")
        keep = view.valid_rows if keep is None else keep.to(torch.bool) & view.valid_rows
        if keep.shape != (len(view),):
            raise BatchFieldError(actuator.who, "keep", f"expected shape ({len(view)},), got {tuple(keep.shape)}")
        _check_whole_groups(actuator, view, keep)
        decision.counts = torch.where(keep, counts, 0)
        if run.refill:  # an empty round is refilled, not skipped (the host kit's GroupFill)
            if dropped is not None:
                decision.drop(dropped)
            decision.restrict(keep)
        elif not run.empty(batch, keep, step, decision, dropped):
            decision.restrict(keep, on_empty=run.config.on_empty)


def _first(batch: Batch) -> Tensor:
    from ..batch import first_group

    return first_group(batch) & batch.valid_rows


def _budget(batch: Batch, actuator: Allocator) -> Budget:
    """The budget of this batch: what the host kit wrote into it (``budget_*``), the allocator's own ``budget``
    replacing the step's ``prompts x group_size``."""
    def field(name: str, default: int = 0) -> int:
        return int(batch[name]) if batch.has(name) else default

    prompts, group_size = field("budget_prompts", len(batch)), field("budget_group_size")
    total = actuator.budget if actuator.budget is not None else field("budget_rollouts", prompts * group_size)
    if total <= 0:
        raise BatchFieldError(actuator.who, "budget", "the host gives no group size to derive the budget from; set "
                              "the allocator's budget")
    return Budget(rollouts=int(total), prompts=prompts, group_size=group_size, round=field(ROUND_FIELD))


def rules_of(actuator: Allocator, budget: Budget, *, before_generation: bool,
             key: str = "actuator.params") -> CountRules:
    """The rules an allocator's counts must follow at ``budget``; the budget itself binds the counts made
    before generation (a continuation adds to what was generated, bounded by ``max_n`` per group)."""

    total = budget.rollouts if before_generation else None
    return CountRules(total=total, exact=bool(actuator.exact_budget), min_n=int(actuator.min_n),
                      max_n=int(actuator.max_n), who=actuator.who, key=key)


@dataclass(frozen=True)
class CountRules:
    """What the bus checks on an allocator's counts (allocation.md 6.1): at ``on_prompts`` their sum against
    the budget ``total`` (``== total`` when ``exact``, else ``<=``); every non-zero count (at ``on_rollout``:
    every group's size after its continuation) in ``[min_n, max_n]``. ``who`` names the allocator and ``key``
    its parameters in every refusal."""

    total: int | None
    exact: bool
    min_n: int
    max_n: int
    who: str = "allocator"
    key: str = "actuator.params"


def check_counts(counts: Tensor, batch: Batch, rules: CountRules, *, sizes: Tensor | None = None) -> Tensor:
    """``counts`` (one per row of ``batch``) as long, checked: integers ``>= 0``, 0 on padding rows, each
    non-zero count (plus the row's current group size ``sizes``, for a continuation) within
    ``[min_n, max_n]``, and their sum within the budget (unless every count is 0: an empty selection, which
    the method's ``on_empty`` decides). Raises :class:`BatchFieldError` naming the
    allocator, the offending rows and the bound's parameter."""
    import torch

    who = rules.who
    if not isinstance(counts, torch.Tensor) or counts.dtype == torch.bool or counts.is_floating_point() \
            or counts.is_complex():
        got = counts.dtype if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise BatchFieldError(who, "counts", f"expected an integer tensor of rollout counts, got {got}")
    if tuple(counts.shape) != (len(batch),):
        raise BatchFieldError(who, "counts", f"expected one count per row, shape ({len(batch)},), "
                              f"got {tuple(counts.shape)}")
    counts = counts.to(torch.long)
    real = batch.valid_rows
    if bool((counts < 0).any()):
        rows = torch.nonzero(counts < 0).flatten()[:5].tolist()
        raise BatchFieldError(who, "counts", f"negative counts on rows {rows}")
    if bool((counts[~real] != 0).any()):
        raise BatchFieldError(who, "counts", "padding rows must get 0 rollouts")
    total = counts if sizes is None else counts + sizes
    given = counts > 0
    for bad, bound, name in ((given & (total > rules.max_n), rules.max_n, "max_n"),
                             (given & (total < rules.min_n), rules.min_n, "min_n")):
        if bool(bad.any()):
            rows = torch.nonzero(bad).flatten()[:5].tolist()
            what = "group sizes after the continuation" if sizes is not None else "counts"
            raise BatchFieldError(who, "counts", f"{what} {total[bad][:5].tolist()} on rows {rows} break "
                                  f"{name}={bound} ({rules.key}.{name})")
    if rules.total is not None and bool(given.any()):  # nothing at all is an empty selection (on_empty)
        spent = int(counts.sum())
        if (spent != rules.total) if rules.exact else (spent > rules.total):
            relation = "exactly" if rules.exact else "at most"
            raise BatchFieldError(who, "counts", f"allocated {spent} rollouts; the budget is {relation} "
                                  f"{rules.total} ({rules.key}.budget, exact_budget={rules.exact})")
    return counts
