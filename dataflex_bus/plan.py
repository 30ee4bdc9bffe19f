"""What a validated block asks of a host's modes, decided once.

A host runs a block in modes: it draws its own prompts from the training dataset by row (a method acting
before generation, a mixer, refill), keeps stable prompt ids (a selection before generation, the per-prompt
history, a replay buffer), and runs its framework's generation again on a step's kept rows (a method
dropping rows at on_rollout, refill, an allocation, stored rows joining fresh ones). :class:`Plan` derives
each from the validated block and the mechanisms' declarations, naming the config keys that ask for it, so a
host's refusals at validation and its decisions at run time read one answer and cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block import DataflexConfig
    from .mechanisms.base import Needed

#: What each part of a plan means, said in a refusal that names the key asking for it.
WHY = {
    "before_generation": "acts before generation (on_prompts), on candidates the host draws",
    "samples_domains": "draws the next prompts by domain",
    "refill": "refills a step with more prompts",
    "reads_history": "reads the per-prompt history, kept by prompt id",
    "replays": "stores rollouts by prompt id and replays them at later steps",
    "allocates": "allocates rollouts per prompt",
    "drops_at_rollout": "may drop rows at on_rollout",
    "continues_groups": "generates more rollouts of a round's groups (continuation rounds)",
    "reads_whole_round": "decides a round's groups together (its rule reads the whole round)",
}


@dataclass(frozen=True)
class Plan:
    """The modes a block asks of its host; each field holds the config keys asking for it (empty: none)."""

    #: ``<method>.mechanism`` of the methods acting at ``on_prompts``.
    before_generation: tuple[str, ...] = ()
    #: ``<method>.mechanism`` of the mixer.
    samples_domains: tuple[str, ...] = ()
    #: ``dataflex.refill`` when set.
    refill: tuple[str, ...] = ()
    #: ``<method>.<slot>.name`` of the components reading the per-prompt history.
    reads_history: tuple[str, ...] = ()
    #: ``<method>.mechanism`` of the replayer.
    replays: tuple[str, ...] = ()
    #: ``<method>.mechanism`` of the allocator.
    allocates: tuple[str, ...] = ()
    #: ``<method>.mechanism`` of the methods that may drop rows at ``on_rollout`` (selection, allocation,
    #: ``on_nonfinite=drop``).
    drops_at_rollout: tuple[str, ...] = ()
    #: ``<method>.mechanism`` of the allocators acting at ``on_rollout`` (continuation rounds).
    continues_groups: tuple[str, ...] = ()
    #: ``<method>.actuator.name`` of the methods at ``on_rollout`` whose rule reads the whole round: every one but
    #: an allocator declaring :attr:`~dataflex_bus.mechanisms.allocate.Allocator.per_group_rule`.
    reads_whole_round: tuple[str, ...] = ()
    #: The host fills a step's prompts through a selection before generation (skipped candidates replaced by
    #: more draws, each prompt chosen at most once per round: :class:`~dataflex_bus.fill.PromptFill`).
    fills_prompts: bool = False

    @classmethod
    def of(cls, config: DataflexConfig | None, key: str = "dataflex") -> Plan:
        """The plan of a validated block (``None``: plain GRPO, nothing asked); ``key``: the block's config key."""
        if config is None:
            return cls()
        from .block import method_keys
        from .mechanisms import mechanism
        from .mechanisms.allocate import Allocator
        from .mechanisms.replay import Replayer

        parts: dict[str, list[str]] = {name: [] for name in WHY}
        allocates_before = False
        for method, mkey in zip(config.methods, method_keys(config, key)):
            resolved = method.resolved
            if resolved is None:  # (a block validation could not resolve; nothing is run from it)
                continue
            declared = mechanism(method.mechanism)
            actuator = resolved.actuator.load()
            at = f"{mkey}.mechanism"
            if resolved.event == "on_prompts":
                parts["before_generation"].append(at)
                allocates_before |= issubclass(actuator, Allocator)
            if declared.samples_domains:
                parts["samples_domains"].append(at)
            if issubclass(actuator, Replayer):
                parts["replays"].append(at)
            if issubclass(actuator, Allocator):
                parts["allocates"].append(at)
            if resolved.event == "on_rollout" and (declared.drops_rows or method.on_nonfinite == "drop"):
                parts["drops_at_rollout"].append(at)
            if resolved.event == "on_rollout":
                per_group = issubclass(actuator, Allocator) and actuator.per_group_rule
                if issubclass(actuator, Allocator):
                    parts["continues_groups"].append(at)
                if not per_group:
                    parts["reads_whole_round"].append(f"{mkey}.actuator.name")
            for slot in ("scorer", "actuator"):
                if getattr(resolved, slot).load().uses_history:
                    parts["reads_history"].append(f"{mkey}.{slot}.name")
        if config.refill is not None:
            parts["refill"].append(f"{key}.refill")
        return cls(**{name: tuple(keys) for name, keys in parts.items()},
                   fills_prompts=bool(parts["before_generation"]) and not allocates_before)

    @property
    def screens_on_arrival(self) -> bool:
        """A round's groups may be decided as each arrives and their continuations dispatched at once: an
        allocator continues groups at ``on_rollout`` and every method there decides each group on its own rows
        (:meth:`Generation.screen <dataflex_bus.generation.Generation.screen>`; each allocator's
        ``continuation_cap`` says how early a group is sure under the cap of groups still needed)."""
        return bool(self.continues_groups) and not self.reads_whole_round

    @property
    def needs_prompt_ids(self) -> bool:
        """The host must give stable prompt ids (``Runtime.set_prompts``, ``prompt_index``)."""
        return bool(self.before_generation or self.reads_history or self.replays)

    def draws_by_row(self) -> dict[str, str]:
        """What makes the host draw its prompts from the training dataset by row (its own prompt stream, a
        prompt table of every row): config key -> why. Empty: the framework's own prompts are used."""
        return self.reasons("before_generation", "samples_domains", "refill", "reads_history", "replays")

    @property
    def draws_prompts(self) -> bool:
        return bool(self.draws_by_row())

    def runs_again(self) -> dict[str, str]:
        """What makes the host stop a step's generation rounds at their rewards and run its framework's
        generation once more on the kept rows (with stored rows, for a replay): config key -> why."""
        return self.reasons("drops_at_rollout", "refill", "allocates", "replays")

    @property
    def regenerates(self) -> bool:
        return bool(self.runs_again())

    @property
    def generates_in_rounds(self) -> bool:
        """A step's generation may take several rounds (refill tops up what a selection dropped; an allocation
        draws more rollouts of prompts already rolled out)."""
        return bool(self.refill or self.allocates)

    def needed(self) -> list[Needed]:
        """The host capabilities the plan needs (:data:`NEEDS`), one per config key asking, each with what
        for: validation refuses them on a host lacking one through the same loop as a mechanism's needs
        (:func:`~dataflex_bus.validation.refuse_lacking`)."""
        from .mechanisms.base import Need, Needed

        return [Needed(key, capability, Need(why, at=""))
                for capability, reasons in ((c, getattr(self, method)()) for c, method in NEEDS.items())
                for key, why in reasons.items()]

    def reasons(self, *parts: str) -> dict[str, str]:
        """Config key -> why (``WHY``, joined when one key asks for several of ``parts``)."""
        out: dict[str, list[str]] = {}
        for part in parts:
            for key in getattr(self, part):
                out.setdefault(key, []).append(WHY[part])
        return {key: "; ".join(whys) for key, whys in out.items()}


#: Host capabilities (keys of :data:`~dataflex_bus.host.CAPABILITIES`) a plan needs -> the plan's method
#: naming the config keys that need it.
NEEDS = {"prompt_ids": "draws_by_row", "regenerates_kept_rows": "runs_again"}

__all__ = ["NEEDS", "WHY", "Plan"]
