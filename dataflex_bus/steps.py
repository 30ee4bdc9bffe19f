"""The host kit's step drivers: the step logic every host shares, written once.

A host is an adapter: it moves tensors between its framework and :class:`~dataflex_bus.Batch`, in its
framework's step order, and calls these drivers at each point of a step::

    kit = StepKit(runtime)                       # one per run (checkpointed with the host's state)
    step = kit.begin(i)                          # one per training step
    probs = step.domain_probabilities(domains)   # draw the next prompts by these (a mixer's, or uniform)
    gen = step.generation(prompts_per_step)
    while (n := gen.request()) > 0:              # one generation round (several under dataflex.refill)
        chosen = step.prompts(n, draw)           # candidates drawn, on_prompts, over-sampling, counts
        batch = <generate chosen.counts[i] rollouts (None: the group size) of each chosen prompt, rewarded>
        gen.add(batch)                           # counters, history, on_rollout, refill bookkeeping
        while (more := gen.continuation()) is not None:   # a part asked for more rollouts (SPEED's allocator)
            gen.extend(<more.counts[i] more rollouts of the prompt of row more.rows[i], its uid, rewarded>)
    outcome = gen.finish()                       # the rows to go on with, per round; skip the update?
    action = step.advantage(batch)               # on_advantage, carried out (weights, drops, advantages)
    step.trained(...)                            # what the update trained on (counters, metrics)
    metrics = step.end(batch)                    # on_step_end (mixers), the history's step, every metric

A data-flow mechanism plugs into the step through its part (:mod:`dataflex_bus.step_parts`: :attr:`Step.parts`,
one per such method of the block); the step calls the parts' hooks and names no mechanism. A host reaches a
part's own calls through it (``ReplayPart.of(step)``: how many prompts to generate, the stored rows to add before
the old log-probs, the marked rows to store after :meth:`Step.advantage`).

A host whose framework generates by itself (verl's agent loop and replay buffer) calls only the parts it
reaches: ``gen.add`` where its rollouts are rewarded, ``step.prompts`` where its prompts are fetched. The
metric names are one namespace for every host (:mod:`dataflex_bus.step_metrics`).

This module holds the prompt phase's records (:class:`Candidates`, :class:`Chosen`), :class:`Step` and
:class:`StepKit`; the generation driver and the helpers of its rounds live in :mod:`dataflex_bus.generation`
(re-exported here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch

from .batch import Batch
from .carry import (
    AdvantageAction,
    carry_out_advantage,
    carry_out_prompts,
    minibatch_index,
    sampling_probabilities,
)
from .fill import PromptCounts, PromptFill
from .generation import (
    Continuation,
    Generation,
    RolloutOutcome,
    concat_rounds,
    concat_rows,
    rows_of_groups,
)
from .generation import group_labels as group_labels
from .host import MINIBATCH_INDEX
from .step_metrics import Counters, RolloutStats, count_prompt_tokens, trained_metrics

if TYPE_CHECKING:
    from torch import Tensor

    from .runtime import Runtime
    from .step_parts import StepPart

T = TypeVar("T")
log = logging.getLogger("dataflex_bus")


class Candidates(NamedTuple, Generic[T]):
    """One draw of candidate prompts: the host's own object for them (``items``) and their prompt ids,
    ``(domain_ids, rows)`` into the prompt table (``None`` when no method needs prompt ids)."""

    items: T
    domain_ids: Tensor | None = None
    rows: Tensor | None = None


@dataclass
class Chosen(Generic[T]):
    """The prompts to generate: indices into the concatenation of the draws' ``items``, in draw order, and
    (when a method allocates rollouts) how many rollouts each gets: ``counts``, long, one per index
    (``None``: the host's group size for every one); ``drawn``: how many candidates the draws hold together
    (``None``: unknown, so :attr:`only` never answers for them)."""

    draws: list[T]
    index: Tensor
    counts: Tensor | None = None
    drawn: int | None = None

    @property
    def only(self) -> T | None:
        """The one draw, when exactly one was made and every candidate of it was chosen, in order (nothing to
        index). A chosen prefix of the draw (the first ``k`` of more candidates) is not the draw."""
        k = self.index.numel()
        if len(self.draws) == 1 and self.drawn == k and bool((self.index == torch.arange(k)).all()):
            return self.draws[0]
        return None


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
        #: Rows trained again, not generated (stored rows a part added: ``compute/replayed_rows``).
        self.again_rows = 0
        self.skip_update = False
        #: The prompt phase kept nothing and its on_empty is skip: the step's update is skipped.
        self.skip_at_prompts = False
        #: The block's data-flow parts for this step, by class (:meth:`StepPart.of`), in method order.
        self.parts: dict[type[StepPart], StepPart] = {cls: cls(self) for cls in self.runtime.step_parts}

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
        for part in self.parts.values():
            if (by_part := part.prompts(target, draw, chunk)) is not None:
                return by_part
        if not runtime.plan.before_generation:
            got = draw(target)
            counts.considered += target
            counts.generated += target
            counts.draws += 1
            self.kit.counters.add(considered_prompts=target)
            return Chosen([got.items], torch.arange(target), drawn=target)
        fill = PromptFill(target, max_oversample=runtime.max_oversample, chunk=chunk, on_empty=runtime.prompt_policy,
                          who="dataflex prompt selection", pool=runtime.candidates_per_prompt)
        drawn: list[T] = []
        total = 0
        while (n := fill.request()) > 0:
            got = draw(n)
            total += n
            batch = self.candidate_batch(got, fill.target - fill.kept)
            decision = runtime.emit("on_prompts", batch, self.index)
            self.metrics.update(decision.metrics)
            fill.add(carry_out_prompts(batch, decision), batch)
            drawn.append(got.items)
        chosen = fill.chosen()
        counts += fill.counts
        if fill.counts.forced and not self.kit.warned_forced:
            # By design (a host generates a full batch), but it changes what the method trains: said once.
            self.kit.warned_forced = True
            log.warning("dataflex: step %d: %d of %d prompts generated are skipped candidates (the prompt selection "
                        "kept %d of %d considered, at most dataflex.max_oversample x %d): once the prompts it keeps "
                        "run out, those it skipped (evicted, filtered) fill the batch; counted in "
                        "dataflex/prompts_forced from here on (said once)", self.index, fill.counts.forced, target,
                        fill.kept, fill.counts.considered, target)
        self.kit.counters.add(considered_prompts=fill.counts.considered)
        return Chosen(drawn, chosen, drawn=total)

    def budget_fields(self, prompts: int) -> dict[str, Tensor]:
        """The ``budget_*`` fields of a batch from which ``prompts`` more groups are needed: plain GRPO's
        rollouts for them (``prompts x group_size``), the prompts and the host's group size (0: unknown)."""
        group_size = int(self.runtime.host.group_size or 0)
        return {"budget_rollouts": torch.tensor(prompts * group_size), "budget_prompts": torch.tensor(prompts),
                "budget_group_size": torch.tensor(group_size)}

    def candidate_batch(self, got: Candidates[Any], needed: int) -> Batch:
        """The ``on_prompts`` batch of one draw, ``needed`` prompts still wanted from it."""
        if got.domain_ids is None or got.rows is None:
            raise ValueError("a prompt selection needs each candidate's prompt id: draw() must return "
                             "Candidates(items, domain_ids, rows)")
        return self.runtime.prompt_candidates(got.domain_ids, got.rows).with_fields(**self.budget_fields(needed))

    # ------------------------------------------------------------------ generation
    def generation(self, target: int) -> Generation:
        """The step's generation driver for ``target`` prompts (groups)."""
        return Generation(self, target)

    def count_generated(self, batch: Batch, *, stats: bool = True, groups: bool = True,
                        prompt_tokens: int | None = None) -> None:
        """Count one generation round's rollouts (``compute/generated_*``; ``dataflex/rollout/*`` unless
        ``stats`` is false; ``groups``: its groups are new, not a continuation's). ``prompt_tokens``: the prompt
        tokens of the round's rows (each row's prompt, once per rollout), given by the host; ``None``: read from
        the batch's ``attention_mask`` over its ``prompts`` columns
        (:func:`~dataflex_bus.step_metrics.count_prompt_tokens`)."""
        rows = int(batch.valid_rows.sum())
        self.generated_rows += rows
        response = int(batch.lengths.sum())
        prompt = prompt_tokens if prompt_tokens is not None else count_prompt_tokens(batch)
        if prompt is None:
            if not self.kit.warned_prompt_tokens:
                self.kit.warned_prompt_tokens = True
                log.warning("dataflex: the host gives no prompt lengths (no prompt_tokens, no attention_mask over "
                            "prompts): compute/generated_tokens counts response tokens only (said once)")
            prompt = 0
        self.kit.counters.add(generated_rollouts=rows, generated_tokens=prompt + response,
                              generated_response_tokens=response, generated_groups=batch.num_groups if groups else 0)
        if stats:
            self.rollout.add(batch)

    def record(self, batch: Batch) -> None:
        """Add every rolled-out group of ``batch`` to the prompt history, before any selection."""
        for key, value in self.runtime.record_rollouts(batch, self.index).items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value

    # ------------------------------------------------------------------ advantage and update
    def advantage(self, batch: Batch, *, blocks: Tensor | None = None,
                  block_multiple: int | None = None) -> AdvantageAction:
        """``on_advantage`` emitted (when anyone listens) and carried out on ``batch`` (see
        :func:`~dataflex_bus.carry.carry_out_advantage` for ``blocks``); the parts add their fields to the batch
        first (:meth:`StepPart.advantage_batch`) and see the action after (:meth:`StepPart.after_advantage`:
        a replay's correction, the rows to store). A method reading each row's mini-batch gets
        ``minibatch_index`` from ``blocks`` (without blocks the batch is one mini-batch)."""
        for part in self.parts.values():
            batch = part.advantage_batch(batch)
        if not self.runtime.listens("on_advantage"):
            return AdvantageAction()
        if MINIBATCH_INDEX in self.runtime.fields("on_advantage") and MINIBATCH_INDEX not in batch.fields:
            batch = batch.with_fields(minibatch_index=minibatch_index(blocks, len(batch)))
        decision = self.runtime.emit("on_advantage", batch, self.index)
        self.metrics.update(decision.metrics)
        action = carry_out_advantage(batch, decision, blocks=blocks, block_multiple=block_multiple)
        for part in self.parts.values():
            part.after_advantage(batch, decision, action)
        if blocks is not None:
            self.metrics["dataflex/empty_minibatches"] = float(action.empty_blocks)
            if action.empty_blocks:
                self.metrics["dataflex/restored_rows"] = float(action.restored_rows)
                removed = 0 if action.remove is None else int(action.remove.sum())
                self.metrics["dataflex/removed_minibatch_rows"] = float(removed)
        return action

    def trained(self, trained: Tensor, tokens: Tensor, rewards: Tensor, lengths: Tensor, groups: Tensor, *,
                replayed: Tensor | None = None) -> None:
        """What the update trains on: ``trained`` (bool ``[B]``), each row's loss-mask ``tokens``, its reward,
        response length and group index (``dataflex/trained/*``, ``compute/trained_*``); ``replayed`` (bool
        ``[B]``): the stored rows a part added (trained, not generated: ``compute/replayed_rows``)."""
        out = trained_metrics(trained, tokens, rewards, lengths, groups)
        self.metrics.update(out)
        rows = int(out["dataflex/trained/rows"])
        again = 0 if replayed is None else int((trained & replayed).sum())
        self.trained_rows += rows
        self.again_rows += again
        self.kit.counters.add(trained_rows=rows, trained_tokens=int(out["dataflex/trained/tokens"]),
                              trained_groups=int(out["dataflex/trained/groups"]), replayed_rows=again)

    def trained_batch(self, batch: Batch, *, generated: Batch | None = None) -> None:
        """:meth:`trained` for a host that trains on exactly the real rows of ``batch`` (its ``replay_row`` field,
        where present, marks the replayed ones). ``generated``: the same rows as ``on_advantage`` saw them, whose
        response lengths and rewards the metrics report (a token mask written into ``response_mask`` would
        shorten them, and lose a reward on a token left out)."""
        mask = batch.get("loss_mask")
        tokens = (batch["response_mask"] if mask is None else mask).ne(0).sum(dim=1)
        rows = batch if generated is None else generated
        again = batch.get("replay_row")
        self.trained(batch.valid_rows & (tokens > 0), tokens, rows.rewards, rows.lengths, batch.group_index,
                     replayed=None if again is None else again >= 0)

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
        # Replayed rows are trained, not generated: the fresh rows trained are what generation paid for.
        fresh_trained = self.trained_rows - self.again_rows
        counters.add(dropped_rows=self.generated_rows - fresh_trained)
        out = {"dataflex/trained/rows": 0.0, "dataflex/trained/groups": 0.0, "dataflex/trained/tokens": 0.0,
               **self.metrics}
        out.update(self.rollout.metrics())
        if runtime.plan.before_generation:
            out.update(self.prompt_counts.metrics())
        for part in self.parts.values():
            part.end(out)
        out["dataflex/kept_fraction"] = fresh_trained / self.generated_rows if self.generated_rows else 0.0
        out["dataflex/skipped_update"] = float(self.skip_update)
        out.update(counters.metrics())
        return out


class StepKit:
    """The host kit for one run: the runtime, the cumulative counters, one :class:`Step` per step."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.counters = Counters()
        #: A prompt selection's round was filled with skipped candidates and the run was told (once).
        self.warned_forced = False
        #: The host gave no prompt lengths and the run was told (once).
        self.warned_prompt_tokens = False

    def begin(self, index: int) -> Step:
        """Start step ``index`` (0-based)."""
        return Step(self, index)

    def state_dict(self) -> dict[str, Any]:
        """The counters (the runtime's own state is saved beside, by :meth:`Runtime.state_dict`)."""
        return self.counters.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counters.load_state_dict(state)


__all__ = ["Candidates", "Chosen", "Continuation", "Generation", "RolloutOutcome", "Step", "StepKit", "concat_rounds",
           "concat_rows", "rows_of_groups"]
