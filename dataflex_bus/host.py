"""What a host is to the bus: the fields it provides at each event, what it can carry out, and the context
validation checks a block against.

Every host (the CPU shim, verl's ``dataflex_*`` trainers, TRL's GRPOTrainer) declares one
:class:`HostDescription`. Validation (``dataflex validate``, ``dataflex doctor``, every host before it
trains) checks a ``dataflex`` block against the description of the host that will run it and refuses,
naming the host, a field the host does not provide at the event a component reads it, or a capability
the host lacks. Without a host (``validate(block)`` from Python) the block is checked against
:data:`ANY_HOST`, which provides every field and can do everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .visits import FIELDS as HISTORY_FIELDS

if TYPE_CHECKING:
    from .errors import ConfigIssue

#: Batch-level (0-dimensional) fields of every ``on_prompts`` batch, filled in by the host kit: the step's
#: rollout budget (``prompts x group_size``), the prompts still needed from this draw and the host's group size.
BUDGET_FIELDS = frozenset({"budget_rollouts", "budget_prompts", "budget_group_size"})
#: Every field a host may provide at each event (verl's names); a host declares its own subset.
#: ``uid``/``data_source`` are row labels. At ``on_prompts`` a row is a candidate prompt: its id and
#: history, nothing about responses.
EVENT_FIELDS: dict[str, frozenset[str]] = {
    "on_prompts": HISTORY_FIELDS | BUDGET_FIELDS | {"uid", "data_source"},
    "on_rollout": frozenset({"prompts", "responses", "response_mask", "loss_mask", "attention_mask",
                             "input_ids", "rm_scores", "rollout_log_probs", "uid", "data_source"}),
}
EVENT_FIELDS["on_advantage"] = EVENT_FIELDS["on_rollout"] | {
    "old_log_probs", "ref_log_prob", "advantages", "returns", "rollout_is_weights", "entropy", "values",
    "token_level_rewards"}
EVENT_FIELDS["on_step_end"] = EVENT_FIELDS["on_advantage"]
#: Long ``[B]``: the mini-batch (optimizer step) of the update each row trains in, filled in by the host kit
#: from the host's training blocks; a host provides it where those are fixed before the update (the same
#: partition every epoch). A token selection over ``scope: minibatch`` reads it.
MINIBATCH_INDEX = "minibatch_index"
EVENT_FIELDS["on_advantage"] = EVENT_FIELDS["on_advantage"] | {MINIBATCH_INDEX}

#: Fields every host provides at every event from ``on_rollout`` on, whatever the methods ask for.
GUARANTEED = frozenset({"uid", "data_source", "response_mask", "rm_scores"})

#: What a host may be able to carry out, with what it means. A mechanism (or a block key) that needs a
#: capability the host lacks is refused at validation, naming the host.
CAPABILITIES: dict[str, str] = {
    "prompt_selection": "emit on_prompts before generation and generate only the candidates kept, drawing more",
    "refill": "generate more prompts within a step until an on_rollout selection kept a full batch",
    "domain_sampling": "draw the next prompts by the domain probabilities a mixer publishes",
    "loss_weights": "multiply per-token weights into the policy-gradient term of the loss",
    "replay": "add stored rows of past steps to a step's batch before its old log-probs (and generate fewer prompts)",
    "ragged_groups": "generate a different number of rollouts for each prompt (allocation counts), and more "
                     "rollouts for a prompt already rolled out in the same step (continuation rounds)",
    "prompt_ids": "draw a step's prompts from the training dataset by row, giving each prompt a stable id (an "
                  "indexable dataset)",
    "regenerates_kept_rows": "stop a step's generation at its rewards and run its framework's generation again on "
                             "the rows kept (with stored rows, for a replay)",
}

#: verl advantage estimators that use one rollout per prompt (no groups).
NON_GROUP_ESTIMATORS = frozenset({"gae", "reinforce_plus_plus", "remax"})
GROUP_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "opo")

#: A host's own rules for a block (settings of its framework that would make a method act otherwise):
#: ``(validated DataflexConfig, key) -> issues``. (Typed loosely: the contract sits below the block's schema.)
HostCheck = Callable[[Any, str], "list[ConfigIssue]"]


@dataclass(frozen=True)
class HostDescription:
    """One host, as validation and the host kit see it.

    ``fields``: per event, the fields the host can put in the batch (on request beyond
    :data:`GUARANTEED`). ``capabilities``: keys of :data:`CAPABILITIES`. ``refill_policies`` /
    ``exhaust_policies``: the ``dataflex.refill`` policies it carries out (``None``: all). ``adv_estimator``,
    ``group_size`` (responses per prompt), ``loss_agg`` (how the loss is aggregated) and ``processes``:
    the training context (``None``: not known). ``missing``: why a field or capability is absent (said in
    the refusal, e.g. ``{"entropy": "rollout_correction.bypass_mode=true computes no old log-probs"}``).
    ``check``: the host's own rules for a block (its framework's settings), run with validation.
    ``group_size_name``: what the host's users call the group size, said in a refusal (verl's
    ``rollout n``, TRL's ``GRPOConfig.num_generations``).
    ``rollout_is``: the importance weights the host itself multiplies into every row's loss from its
    ``rollout_log_probs`` (``"token"``: ``min(pi_old / pi_rollout, threshold)`` per token, verl's
    ``algorithm.rollout_correction.rollout_is``; ``None``: none), which a replay method's correction relies on.
    """

    name: str
    fields: Mapping[str, frozenset[str]] = field(default_factory=lambda: dict(EVENT_FIELDS))
    capabilities: frozenset[str] = frozenset(CAPABILITIES)
    refill_policies: frozenset[str] | None = None
    exhaust_policies: frozenset[str] | None = None
    adv_estimator: str | None = None
    group_size: int | None = None
    #: Prompts (groups) a step generates, where the host knows it (bounds a method's sizes at validation).
    prompts_per_step: int | None = None
    loss_agg: str | None = None
    processes: int = 1
    missing: Mapping[str, str] = field(default_factory=dict)
    check: HostCheck | None = field(default=None, compare=False)
    rollout_is: str | None = None
    group_size_name: str = "rollout n"
    row_bytes: int | None = None
    row_bytes_basis: str = ""
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"host {self.name!r}: unknown capabilities {sorted(unknown)} (known: "
                             f"{', '.join(CAPABILITIES)})")
        events = set(self.fields)
        if events != set(EVENT_FIELDS):
            raise ValueError(f"host {self.name!r}: fields must name every event {list(EVENT_FIELDS)}, got "
                             f"{sorted(events)}")

    def provides(self, event: str, name: str) -> bool:
        """True when the host can put field ``name`` in the batch of ``event``."""
        return name in self.fields[event]

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def why_not(self, what: str) -> str:
        """`` (reason)`` for a missing field or capability when the host said why, else ``""``."""
        reason = self.missing.get(what)
        return f" ({reason})" if reason else ""

    def replace(self, **changes: Any) -> HostDescription:
        """A copy with some attributes replaced (``host.replace(group_size=4)``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """What a run record keeps of its host."""
        return {"name": self.name, "capabilities": sorted(self.capabilities),
                "fields": {event: sorted(names) for event, names in self.fields.items()},
                "refill_policies": None if self.refill_policies is None else sorted(self.refill_policies),
                "exhaust_policies": None if self.exhaust_policies is None else sorted(self.exhaust_policies),
                "adv_estimator": self.adv_estimator, "group_size": self.group_size, "loss_agg": self.loss_agg,
                "processes": self.processes, "rollout_is": self.rollout_is}


#: The host of a block checked without one (``validate(block)``): every field, every capability.
ANY_HOST = HostDescription("any host")
