"""One step's generation rounds, driven by :class:`Generation` (:meth:`Step.generation
<dataflex_bus.steps.Step.generation>`), and the batch helpers of those rounds.

A step generates in one round, or, under ``dataflex.refill``, in rounds of refill until the ``on_rollout``
selection kept a full batch of groups (:class:`~dataflex_bus.fill.GroupFill`). Every round is counted, recorded in
the prompt history and put through ``on_rollout``; an allocator acting there (SPEED) may ask for more rollouts of
a round's groups (:class:`Continuation`, continuation rounds under the same ``uid``). :meth:`Generation.finish`
says which rows of each round the step goes on with (:class:`RolloutOutcome`). :func:`concat_rounds` joins a
step's rounds into one batch, :func:`concat_rows` a continuation's rows to the round it extends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .batch import Batch
from .carry import carry_out_rollout, first_group
from .decision import Decision
from .errors import BatchFieldError, DataflexError
from .fill import GroupFill, kept_groups
from .ops import segment_min
from .screening import RoundScreening, strictest

if TYPE_CHECKING:
    from torch import Tensor

    from .steps import Step


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
                              is_padding=torch.cat([b.is_padding for b in batches]),
                              **fields).with_reward_span(first.reward_span)


@dataclass
class Continuation:
    """More rollouts for groups already generated in this round (an allocator at ``on_rollout``, SPEED):
    for each group, ``rows`` is its first row in the batch the host gave :meth:`Generation.add` (so the host
    finds its prompt and ``uid`` there) and ``counts`` how many more rollouts to generate, under the same
    ``uid``; the host hands them to :meth:`Generation.extend`."""

    rows: Tensor
    counts: Tensor


def group_labels(batch: Batch) -> list[Any] | Tensor | None:
    """The ``uid`` labels of ``batch``'s rows as given (a list, or an integer tensor), ``None`` without."""
    return batch.uid if batch.uid is not None else batch._raw_group_ids


def concat_rows(first: Batch, more: Batch) -> Batch:
    """``more``'s rows appended to ``first``'s, rows of one ``uid`` in one group (a continuation round): per-token
    fields right-padded to the wider of the two, labels and domains carried."""
    labels_a, labels_b = group_labels(first), group_labels(more)
    if labels_a is None or labels_b is None or isinstance(labels_a, torch.Tensor) != isinstance(labels_b, torch.Tensor):
        raise ValueError("concat_rows: both batches need uid labels of one kind (strings or integer ids)")
    uid: list[Any] | Tensor
    if isinstance(labels_a, torch.Tensor) and isinstance(labels_b, torch.Tensor):
        uid = torch.cat([labels_a, labels_b])
    else:
        uid = [*labels_a, *labels_b]
    if set(first.fields) != set(more.fields):
        differ = sorted(set(first.fields) ^ set(more.fields))
        raise ValueError(f"concat_rows: the rounds hold different fields ({differ})")
    if more.domain_ids is not None and first.domain_names:
        more = more.with_domain_names(first.domain_names)
    fields = {}
    for name in first.fields:
        a, b = first[name], more[name]  # dense views of jagged fields
        if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[1]:
            width = max(a.shape[1], b.shape[1])
            a = torch.nn.functional.pad(a, (0, width - a.shape[1]))
            b = torch.nn.functional.pad(b, (0, width - b.shape[1]))
        fields[name] = torch.cat([a, b])
    domains = None if first.domain_ids is None else torch.cat([first.domain_index.clamp_min(0),
                                                              more.domain_index.clamp_min(0)])
    return Batch.from_tensors(uid=uid, domains=domains, domain_names=first.domain_names,
                              is_padding=torch.cat([first.is_padding, more.is_padding]),
                              **fields).with_reward_span(first.reward_span)


@dataclass
class _OpenRound:
    """A generation round whose groups may still be extended: its batch so far, the host's first batch, the
    last on_rollout decision and the round count."""

    batch: Batch
    first: Batch
    decision: Decision
    counted: bool
    round: int = 0


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
        #: A part may extend a round's groups (continuation rounds: an allocator acting at on_rollout).
        self.continues = any(part.continues() for part in step.parts.values())
        #: ``cap_order``: set when every part that continues decides each group on its own rows (read once): a
        #: round's groups may then be screened as they arrive (:meth:`screen`), under the strictest of their caps.
        caps = [part.per_group_cap() for part in step.parts.values() if part.continues()]
        self.cap_order: str | None = (strictest([c for c in caps if c is not None])
                                      if self.continues and None not in caps else None)
        #: The round being screened as it arrives (:meth:`begin_screening`), if any.
        self._screening: RoundScreening | None = None
        #: Continuations :meth:`screen` released for that round, by group label.
        self._screened: dict[Any, int] = {}
        self._open: _OpenRound | None = None

    @property
    def refills(self) -> bool:
        return self.fill is not None

    @property
    def batches(self) -> list[Batch]:
        """Every round's rows so far, continuation rows included (what the kit decided on)."""
        return [batch for batch, _ in self.rounds]

    def request(self) -> int:
        """Prompts to generate in the next round (0: the step's generation is done)."""
        self._close()
        if self.fill is not None:
            return self.fill.request()
        if self._asked:
            return 0
        self._asked = True
        return self.target

    def add(self, batch: Batch, *, counted: bool = False, prompt_tokens: int | None = None) -> Decision:
        """One generation round, rewarded: counted and recorded in the prompt history (unless ``counted``: the
        host showed its groups to :meth:`Step.count_generated` and :meth:`Step.record` already) and put through
        ``on_rollout``. ``prompt_tokens``: the round's prompt tokens (:meth:`Step.count_generated`). Returns the
        decision."""
        step = self.step
        self._close()
        if not self.continues:
            if not counted:
                step.count_generated(batch, prompt_tokens=prompt_tokens)
                step.record(batch)
            decision = step.runtime.emit("on_rollout", batch, step.index)
            step.metrics.update(decision.metrics)
            self._round_done(batch, decision)
            return decision
        # An allocator may extend these groups: the history and the rollout statistics wait for the round's
        # last rows; the counters count every rollout now.
        if not counted:
            step.count_generated(batch, stats=False, prompt_tokens=prompt_tokens)
        decision = self._emit(batch, 0)
        self._open = _OpenRound(batch, batch, decision, counted)
        return decision

    def _emit(self, batch: Batch, round_: int) -> Decision:
        step = self.step
        view = batch.with_fields(**step.budget_fields(self._still_needed()), budget_round=torch.tensor(round_))
        decision = step.runtime.emit("on_rollout", view, step.index)
        step.metrics.update(decision.metrics)
        return decision

    def _still_needed(self) -> int:
        return self.target - (self.fill.kept if self.fill is not None else 0)

    def begin_screening(self, labels: Sequence[Any]) -> bool:
        """The next round's groups (``labels``, their ``uid`` in dispatch order) will be screened as they arrive
        (:meth:`screen`); False, and nothing to screen, when a rule at ``on_rollout`` reads the whole round."""
        if self.cap_order is None or not labels:
            return False
        self._close()
        self._screening = RoundScreening(labels, self._still_needed(), self.cap_order)
        self._screened = {}
        return True

    def screen(self, batch: Batch) -> dict[Any, int]:
        """Some groups of the round :meth:`begin_screening` named, generated before the rest of it:
        ``on_rollout`` decides them now, uncapped (its ``budget_prompts`` covers them all), and the groups whose
        continuation no later arrival can change under the rule's cap (:class:`~dataflex_bus.screening.RoundScreening`)
        are returned, by label, with their counts, each once, so the host can dispatch them at once. Nothing is
        counted or published here: the round goes through :meth:`add` whole once it is generated, as it would
        without screening; :meth:`continuation` checks that it decides what was released and gives the rest."""
        screening = self._screening
        if screening is None:
            raise ValueError("Generation.screen: no round is being screened (call begin_screening() first)")
        needed = max(self._still_needed(), batch.num_groups)
        view = batch.with_fields(**self.step.budget_fields(needed), budget_round=torch.tensor(0))
        # The observers hear the whole round once it is added, not its early groups.
        decision = self.step.runtime.emit("on_rollout", view, self.step.index, observed=False)
        counts = self._per_group(batch, decision)
        more = torch.zeros(batch.num_groups, dtype=torch.long) if counts is None else counts
        released = screening.add(self._group_labels(batch), more)
        self._screened.update(released)
        return released

    def _per_group(self, batch: Batch, decision: Decision) -> Tensor | None:
        return next((more for part in self.step.parts.values() if (more := part.more(batch, decision)) is not None),
                    None)

    @staticmethod
    def _first_rows(batch: Batch) -> Tensor:
        """Long ``[num_groups]``: each group's first row."""
        return segment_min(torch.arange(len(batch), dtype=torch.float64), batch.group_index,
                           batch.num_groups).to(torch.long)

    def _group_labels(self, batch: Batch) -> list[Any]:
        labels = group_labels(batch)
        if labels is None:
            raise BatchFieldError("dataflex allocate", "uid", "screening a round's groups as they arrive needs "
                                  "their uid labels")
        rows = self._first_rows(batch).tolist()
        return [labels[r].item() if isinstance(labels, torch.Tensor) else labels[r] for r in rows]

    def _check_screened(self, batch: Batch, per_group: Tensor | None) -> None:
        """The whole round decided each group's continuation as it was screened on arrival (a method declaring
        a per-group rule that reads the round would otherwise train something else than it said)."""
        screened, self._screened = self._screened, {}
        whole = [0] * batch.num_groups if per_group is None else per_group.tolist()
        differ = [(label, screened[label], int(count)) for label, count in zip(self._group_labels(batch), whole)
                  if label in screened and screened[label] != int(count)]
        if differ:
            names = [m.name for m in self.step.runtime.pipeline.at("on_rollout")] if self.step.runtime.pipeline else []
            label, alone, together = differ[0]
            raise DataflexError(
                f"dataflex allocate: the on_rollout method(s) {names} declare a per-group rule (per_group_rule), "
                f"but group {label!r} got {alone} more rollouts decided on its own rows and {together} on the whole "
                f"round ({len(differ)} group(s) differ); set per_group_rule = False on the allocator whose count "
                "reads other groups")

    def continuation(self) -> Continuation | None:
        """More rollouts the allocator asked for, for groups of the round just added (``None``: none; the round
        is then complete). The continuations :meth:`screen` released are checked against the whole round's and
        are in it (the host dispatched them already)."""
        o = self._open
        if o is None:
            return None
        per_group = self._per_group(o.batch, o.decision)
        if o.round == 0 and self._screening is not None:
            self._screening = None
            self._check_screened(o.batch, per_group)
        if per_group is None:
            self._close()
            return None
        groups = torch.nonzero(per_group > 0).flatten()
        rows = self._first_rows(o.batch)[groups]
        if bool((rows >= len(o.first)).any()):
            raise ValueError("Generation.continuation: a group's first row lies outside the host's batch")
        return Continuation(rows, per_group[groups])

    def extend(self, batch: Batch, *, prompt_tokens: int | None = None) -> Decision:
        """The rollouts of a :meth:`continuation`, rewarded, with the ``uid`` of the groups they extend: counted
        (``prompt_tokens`` as in :meth:`add`), appended to their groups and the round put through ``on_rollout``
        again."""
        o = self._open
        if o is None:
            raise ValueError("Generation.extend: no round is open (call continuation() after add())")
        step = self.step
        step.count_generated(batch, stats=False, groups=False, prompt_tokens=prompt_tokens)
        merged = concat_rows(o.batch, batch)
        if merged.num_groups != o.batch.num_groups:
            raise BatchFieldError("dataflex allocate", "uid", "continuation rollouts must carry the uid of a group "
                                  "of the round they extend")
        for part in step.parts.values():
            part.extended(batch)
        o.batch, o.round = merged, o.round + 1
        o.decision = self._emit(merged, o.round)
        return o.decision

    def _close(self) -> None:
        """Complete the open round: the history and the rollout statistics see its groups whole."""
        o, self._open = self._open, None
        if o is None:
            return
        if not o.counted:
            self.step.record(o.batch)
        self.step.rollout.add(o.batch)
        self._round_done(o.batch, o.decision)

    def _round_done(self, batch: Batch, decision: Decision) -> None:
        if self.fill is not None:
            self.fill.add(kept_groups(batch, decision))
        for part in self.step.parts.values():
            part.round_done(batch)
        self.rounds.append((batch, decision))

    def finish(self) -> RolloutOutcome:
        """The rows to go on with: the single round's ``on_rollout`` decision carried out, or under refill the
        groups :meth:`GroupFill.train` picks (``dataflex/refill/*`` metrics); ``dataflex/removed_rows`` counts
        the real rows removed."""
        self._close()
        outcome = self._outcome()
        if self.step.skip_at_prompts:  # the prompt phase's on_empty=skip (an allocation's)
            outcome.skip_update = True
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


__all__ = ["Continuation", "Generation", "RolloutOutcome", "concat_rounds", "concat_rows", "group_labels",
           "rows_of_groups"]
