"""The host kit's step drivers: the step logic every host shares, written once.

A host is an adapter: it moves tensors between its framework and :class:`~dataflex_bus.Batch`, in its
framework's step order, and calls these drivers at each point of a step::

    kit = StepKit(runtime)                       # one per run (checkpointed with the host's state)
    step = kit.begin(i)                          # one per training step
    probs = step.domain_probabilities(domains)   # draw the next prompts by these (a mixer's, or uniform)
    gen = step.generation(prompts_per_step)
    while (n := gen.request()) > 0:              # one generation round (several under dataflex.refill)
        chosen = step.prompts(n, draw)           # candidates drawn, on_prompts, over-sampling
        batch = <generate and reward chosen prompts: one Batch>
        gen.add(batch)                           # counters, history, on_rollout, refill bookkeeping
    outcome = gen.finish()                       # the rows to go on with, per round; skip the update?
    action = step.advantage(batch)               # on_advantage, carried out (weights, drops, advantages)
    step.trained(...)                            # what the update trained on (counters, metrics)
    metrics = step.end(batch)                    # on_step_end (mixers), the history's step, every metric

A host whose framework generates by itself (verl's agent loop and replay buffer) calls only the parts it
reaches: ``gen.add`` where its rollouts are rewarded, ``step.prompts`` where its prompts are fetched. The
metric names are one namespace for every host (:mod:`dataflex_bus.step_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch

from .batch import Batch
from .carry import (
    AdvantageAction,
    carry_out_advantage,
    carry_out_prompts,
    carry_out_rollout,
    first_group,
    sampling_probabilities,
)
from .decision import Decision
from .fill import GroupFill, PromptCounts, PromptFill, kept_groups
from .step_metrics import Counters, RolloutStats, trained_metrics

if TYPE_CHECKING:
    from torch import Tensor

    from .runtime import Runtime

T = TypeVar("T")


class Candidates(NamedTuple, Generic[T]):
    """One draw of candidate prompts: the host's own object for them (``items``) and their prompt ids,
    ``(domain_ids, rows)`` into the prompt table (``None`` when no method needs prompt ids)."""

    items: T
    domain_ids: Tensor | None = None
    rows: Tensor | None = None


@dataclass
class Chosen(Generic[T]):
    """The prompts to generate: indices into the concatenation of the draws' ``items``, in draw order."""

    draws: list[T]
    index: Tensor

    @property
    def only(self) -> T | None:
        """The one draw, when exactly one was made and every candidate of it was chosen (nothing to index)."""
        if len(self.draws) == 1 and bool((self.index == torch.arange(self.index.numel())).all()):
            return self.draws[0]
        return None


def rows_of_groups(batch: Batch, groups: Tensor) -> Tensor:
    """Bool ``[B]``: the real rows of the groups ``groups`` (bool ``[num_groups]``) selects."""
    return groups[batch.group_index.clamp_min(0)] & batch.valid_rows


def concat_rounds(batches: Sequence[Batch]) -> Batch:
    """The generation rounds of one step as one batch (the rounds share every field's shape): group ids
    offset per round, so rounds keep their groups apart and in arrival order."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    fields = {name: torch.cat([b[name] for b in batches]) for name in first.fields}
    offsets = torch.cumsum(torch.tensor([0] + [b.num_groups for b in batches[:-1]]), 0).tolist()
    # Padding rows belong to no group whatever their id says.
    uid = torch.cat([torch.where(b.valid_rows, b.group_index + off, -1) for b, off in zip(batches, offsets)])
    domains = None if first.domain_ids is None else torch.cat([b.domain_index.clamp_min(0) for b in batches])
    return Batch.from_tensors(uid=uid, domains=domains, domain_names=first.domain_names,
                              is_padding=torch.cat([b.is_padding for b in batches]), **fields)


@dataclass
class RolloutOutcome:
    """What a step goes on with after its generation: per round, the rows kept (``None``: every row),
    whether to skip the update, and the real rows removed."""

    keeps: list[Tensor | None]
    skip_update: bool
    removed: int = 0

    def keep(self, batch_sizes: Sequence[int]) -> Tensor | None:
        """The rows kept over the rounds concatenated (``None``: every row of every round)."""
        if all(k is None for k in self.keeps):
            return None
        parts = [torch.ones(n, dtype=torch.bool) if k is None else k for k, n in zip(self.keeps, batch_sizes)]
        return torch.cat(parts)


class Generation:
    """One step's generation: one round, or rounds of refill until the on_rollout selection kept a full
    batch of groups (:class:`~dataflex_bus.fill.GroupFill`, every policy), every rollout counted."""

    def __init__(self, step: Step, target: int) -> None:
        self.step = step
        self.target = target
        refill = step.runtime.refill
        self.fill = GroupFill(target, refill) if refill is not None else None
        self.rounds: list[tuple[Batch, Decision]] = []
        self._asked = False

    @property
    def refills(self) -> bool:
        return self.fill is not None

    def request(self) -> int:
        """Prompts to generate in the next round (0: the step's generation is done)."""
        if self.fill is not None:
            return self.fill.request()
        if self._asked:
            return 0
        self._asked = True
        return self.target

    def add(self, batch: Batch, *, counted: bool = False) -> Decision:
        """One generation round, rewarded: counted and recorded in the prompt history (unless ``counted``: the
        host showed its groups to :meth:`Step.count_generated` and :meth:`Step.record` already) and put through
        ``on_rollout``. Returns the decision."""
        step = self.step
        if not counted:
            step.count_generated(batch)
            step.record(batch)
        decision = step.runtime.emit("on_rollout", batch, step.index)
        step.metrics.update(decision.metrics)
        if self.fill is not None:
            self.fill.add(kept_groups(batch, decision))
        self.rounds.append((batch, decision))
        return decision

    def finish(self) -> RolloutOutcome:
        """The rows to go on with: the single round's ``on_rollout`` decision carried out, or under refill the
        groups :meth:`GroupFill.train` picks (``dataflex/refill/*`` metrics); ``dataflex/removed_rows`` counts
        the real rows removed."""
        outcome = self._outcome()
        self.step.metrics["dataflex/removed_rows"] = float(outcome.removed)
        return outcome

    def _outcome(self) -> RolloutOutcome:
        if not self.rounds:
            return RolloutOutcome([], False)
        if self.fill is None:
            actions = [carry_out_rollout(batch, decision) for batch, decision in self.rounds]
            return RolloutOutcome([a.keep for a in actions], any(a.skip_update for a in actions),
                                  sum(a.removed for a in actions))
        train, refill_metrics = self.fill.train()
        self.step.metrics.update(refill_metrics)
        batches = [batch for batch, _ in self.rounds]
        offsets = torch.cumsum(torch.tensor([0] + [b.num_groups for b in batches]), 0).tolist()
        keeps: list[Tensor] = [rows_of_groups(b, train[lo:hi]) for b, lo, hi in zip(batches, offsets, offsets[1:])]
        skip = not bool(train.any())
        if skip:
            # Nothing to train in the whole step (only possible with on_exhaust=train_short): as for an empty
            # selection, the first group goes through the forward passes and the update is skipped.
            keeps = [first_group(batches[0]) & batches[0].valid_rows] + [torch.zeros(len(b), dtype=torch.bool)
                                                                         for b in batches[1:]]
        removed = sum(int((b.valid_rows & ~k).sum()) for b, k in zip(batches, keeps))
        # Padding rows travel with the batch (the host re-pads anyway); only real rows are removed.
        out: list[Tensor | None] = [None if bool(k[b.valid_rows].all()) else k | ~b.valid_rows
                                    for b, k in zip(batches, keeps)]
        return RolloutOutcome(out, skip, removed)


class Step:
    """The host kit for one training step (see the module doc). ``index`` is the 0-based step the bus sees."""

    def __init__(self, kit: StepKit, index: int) -> None:
        self.kit = kit
        self.runtime = kit.runtime
        self.index = index
        self.metrics: dict[str, float] = {}
        self.prompt_counts = PromptCounts()
        self.rollout = RolloutStats()
        self.generated_rows = 0
        self.trained_rows = 0
        self.skip_update = False

    # ------------------------------------------------------------------ prompts
    def domain_probabilities(self, domains: Sequence[str]) -> Tensor:
        """Float64 ``[D]`` over ``domains`` (the sampler's order) for the next prompts: the mixer's published
        probabilities, else uniform (``dataflex/sample_prob/<domain>``)."""
        probs = sampling_probabilities(self.runtime.domain_probs, domains)
        for name, p in zip(domains, probs.tolist()):
            self.metrics[f"dataflex/sample_prob/{name}"] = p
        return probs

    def prompts(self, target: int, draw: Callable[[int], Candidates[T]], *, chunk: int = 1) -> Chosen[T]:
        """``target`` prompts to generate. Without a prompt selection: one draw of ``target``. With one:
        candidates drawn in rounds of ``draw(n)`` (``n`` a multiple of ``chunk``, the host's draw unit),
        ``on_prompts`` emitted on each, until ``target`` are kept (:class:`~dataflex_bus.fill.PromptFill`:
        bounded over-sampling, then skipped candidates fill the shortfall)."""
        runtime = self.runtime
        counts = self.prompt_counts
        if not runtime.selects_prompts:
            got = draw(target)
            counts.considered += target
            counts.generated += target
            counts.draws += 1
            self.kit.counters.add(considered_prompts=target)
            return Chosen([got.items], torch.arange(target))
        fill = PromptFill(target, max_oversample=runtime.max_oversample, chunk=chunk, on_empty=runtime.prompt_policy,
                          who="dataflex prompt selection")
        drawn: list[T] = []
        while (n := fill.request()) > 0:
            got = draw(n)
            if got.domain_ids is None or got.rows is None:
                raise ValueError("a prompt selection needs each candidate's prompt id: draw() must return "
                                 "Candidates(items, domain_ids, rows)")
            batch = runtime.prompt_candidates(got.domain_ids, got.rows)
            decision = runtime.emit("on_prompts", batch, self.index)
            self.metrics.update(decision.metrics)
            fill.add(carry_out_prompts(batch, decision), batch)
            drawn.append(got.items)
        chosen = fill.chosen()
        counts += fill.counts
        self.kit.counters.add(considered_prompts=fill.counts.considered)
        return Chosen(drawn, chosen)

    # ------------------------------------------------------------------ generation
    def generation(self, target: int) -> Generation:
        """The step's generation driver for ``target`` prompts (groups)."""
        return Generation(self, target)

    def count_generated(self, batch: Batch) -> None:
        """Count one generation round's rollouts (``compute/generated_*``, ``dataflex/rollout/*``)."""
        rows = int(batch.valid_rows.sum())
        self.generated_rows += rows
        self.kit.counters.add(generated_rollouts=rows, generated_tokens=int(batch.lengths.sum()),
                              generated_groups=batch.num_groups)
        self.rollout.add(batch)

    def record(self, batch: Batch) -> None:
        """Add every rolled-out group of ``batch`` to the prompt history, before any selection."""
        for key, value in self.runtime.record_rollouts(batch, self.index).items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value

    # ------------------------------------------------------------------ advantage and update
    def advantage(self, batch: Batch, *, blocks: Tensor | None = None,
                  block_multiple: int | None = None) -> AdvantageAction:
        """``on_advantage`` emitted (when anyone listens) and carried out on ``batch`` (see
        :func:`~dataflex_bus.carry.carry_out_advantage` for ``blocks``)."""
        if not self.runtime.listens("on_advantage"):
            return AdvantageAction()
        decision = self.runtime.emit("on_advantage", batch, self.index)
        self.metrics.update(decision.metrics)
        action = carry_out_advantage(batch, decision, blocks=blocks, block_multiple=block_multiple)
        if blocks is not None:
            self.metrics["dataflex/empty_minibatches"] = float(action.empty_blocks)
            if action.empty_blocks:
                self.metrics["dataflex/restored_rows"] = float(action.restored_rows)
                removed = 0 if action.remove is None else int(action.remove.sum())
                self.metrics["dataflex/removed_minibatch_rows"] = float(removed)
        return action

    def trained(self, trained: Tensor, tokens: Tensor, rewards: Tensor, lengths: Tensor, groups: Tensor) -> None:
        """What the update trains on: ``trained`` (bool ``[B]``), each row's loss-mask ``tokens``, its reward,
        response length and group index (``dataflex/trained/*``, ``compute/trained_*``)."""
        out = trained_metrics(trained, tokens, rewards, lengths, groups)
        self.metrics.update(out)
        rows = int(out["dataflex/trained/rows"])
        self.trained_rows += rows
        self.kit.counters.add(trained_rows=rows, trained_tokens=int(out["dataflex/trained/tokens"]),
                              trained_groups=int(out["dataflex/trained/groups"]))

    def trained_batch(self, batch: Batch) -> None:
        """:meth:`trained` for a host that trains on exactly the real rows of ``batch``."""
        mask = batch.get("loss_mask")
        tokens = (batch["response_mask"] if mask is None else mask).ne(0).sum(dim=1)
        self.trained(batch.valid_rows & (tokens > 0), tokens, batch.rewards, batch.lengths, batch.group_index)

    def skipped(self) -> None:
        """The step's update was skipped (an empty selection, every mini-batch emptied, ...)."""
        self.skip_update = True

    # ------------------------------------------------------------------ step end
    def end(self, batch: Batch | None) -> dict[str, float]:
        """``on_step_end`` on the rows that went through the step (when anyone listens; ``batch`` may then
        not be ``None``), the history's step closed; returns every kit metric of the step."""
        runtime = self.runtime
        if runtime.listens("on_step_end"):
            if batch is None:
                raise ValueError("on_step_end has listeners: Step.end needs the step's batch")
            decision = runtime.emit("on_step_end", batch, self.index)
            self.metrics.update(decision.metrics)
        else:
            runtime.end_step(self.index)
        counters = self.kit.counters
        if self.skip_update:
            counters.skipped_updates += 1
        counters.add(dropped_rows=self.generated_rows - self.trained_rows)
        out = {"dataflex/trained/rows": 0.0, "dataflex/trained/groups": 0.0, "dataflex/trained/tokens": 0.0,
               **self.metrics}
        out.update(self.rollout.metrics())
        if runtime.selects_prompts:
            out.update(self.prompt_counts.metrics())
        out["dataflex/kept_fraction"] = self.trained_rows / self.generated_rows if self.generated_rows else 0.0
        out["dataflex/skipped_update"] = float(self.skip_update)
        out.update(counters.metrics())
        return out


class StepKit:
    """The host kit for one run: the runtime, the cumulative counters, one :class:`Step` per step."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.counters = Counters()

    def begin(self, index: int) -> Step:
        """Start step ``index`` (0-based)."""
        return Step(self, index)

    def state_dict(self) -> dict[str, Any]:
        """The counters (the runtime's own state is saved beside, by :meth:`Runtime.state_dict`)."""
        return self.counters.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counters.load_state_dict(state)


__all__ = ["Candidates", "Chosen", "Generation", "RolloutOutcome", "Step", "StepKit", "concat_rounds",
           "rows_of_groups"]
