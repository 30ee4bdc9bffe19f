"""Filling a step's prompts and groups when a selection drops some (the host kit).

:class:`PromptFill` gets a step its prompts through a pre-rollout selection (bounded over-sampling);
:class:`GroupFill` generates rounds of prompts until an ``on_rollout`` selection kept a full batch of groups
(dynamic sampling with refill: the ``fixed``, ``credit2`` and ``greso`` round-size policies). Every host
runs them through the step drivers of :mod:`dataflex_bus.steps`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .carry import BEFORE_ADVANTAGES, keep_only
from .errors import DataflexError
from .ops import segment_sum
from .visits import CLASS_NAMES

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .block import RefillConfig
    from .decision import Decision


@dataclass
class PromptCounts:
    """What pre-rollout selection did in one step (summed over its draws): candidates considered,
    skipped by the selection, generated anyway to fill a shortfall (``forced``), kept but beyond what was
    needed (``trimmed``), kept but already chosen earlier in the same fill (``duplicate``), generated,
    draws, and per history class (``new``, ``other``, ``easy``, ``hard``) the candidates considered and
    skipped. ``considered = generated + skipped + trimmed + duplicate``."""

    considered: int = 0
    skipped: int = 0
    forced: int = 0
    trimmed: int = 0
    duplicate: int = 0
    generated: int = 0
    draws: int = 0
    by_class: dict[str, list[int]] = field(default_factory=dict)

    _NAMES = ("considered", "skipped", "forced", "trimmed", "duplicate", "generated", "draws")

    def __iadd__(self, other: PromptCounts) -> PromptCounts:
        for name in self._NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, (seen, skipped) in other.by_class.items():
            mine = self.by_class.setdefault(name, [0, 0])
            mine[0] += seen
            mine[1] += skipped
        return self

    def metrics(self) -> dict[str, float]:
        """``dataflex/prompts_*`` metrics; ``prompts_skip_rate/<class>`` = skipped / considered per class."""
        out = {f"dataflex/prompts_{name}": float(getattr(self, name)) for name in self._NAMES}
        for name, (seen, skipped) in sorted(self.by_class.items()):
            if seen:
                out[f"dataflex/prompts_skip_rate/{name}"] = skipped / seen
        return out


class PromptFill:
    """How a host gets ``target`` prompts to generate when a pre-rollout selection skips candidates.

    The host draws candidates in rounds of :meth:`request` prompts (a multiple of ``chunk``, its draw unit:
    verl's ``gen_batch_size``), emits ``on_prompts`` on each round and hands the keep mask to :meth:`add`;
    :meth:`chosen` then names the candidates to generate, in draw order. Over-sampling is adaptive (after
    the first round of ``target``, or ``pool x target`` for a selection comparing a pool of candidates, the
    next asks for the deficit divided by the keep rate seen so far, at least ``pool x`` the deficit) and
    bounded: at most ``ceil(max_oversample * target)`` candidates (whole chunks) are considered. If they hold
    fewer kept candidates than needed, the shortfall is filled with skipped candidates, earliest first,
    counted as ``forced`` (a host must generate a full batch, and skipping the update would waste the
    generation), unless nothing at all was kept and ``on_empty`` is ``error``. Kept candidates beyond
    ``target`` are not generated (``trimmed``). Given the candidates' ``prompt_index``, a prompt is chosen
    at most once per fill (a candidate repeating an earlier choice is a ``duplicate``): a sampler drawing with
    replacement, or a fill spanning an epoch boundary, would otherwise generate the same prompt twice.
    """

    def __init__(self, target: int, *, max_oversample: float, chunk: int = 1, on_empty: str = "skip",
                 who: str = "dataflex", pool: float = 1.0) -> None:
        if target < 1 or chunk < 1:
            raise ValueError(f"PromptFill needs target >= 1 and chunk >= 1, got {target} and {chunk}")
        self.target = target
        #: Candidates drawn per prompt still needed, at least (a top-B selection compares a pool of them).
        self.pool = max(float(pool), 1.0)
        self.chunk = chunk
        self.on_empty = on_empty
        self.who = who
        self.budget = max(_round_up(math.ceil(max_oversample * target), chunk), _round_up(target, chunk))
        self.keeps: list[Tensor] = []
        self.ids: list[Tensor] = []
        self.chosen_ids = torch.zeros(0, dtype=torch.long)
        self.counts = PromptCounts()
        self.kept = 0

    def request(self) -> int:
        """How many candidates to draw next (0: enough are kept, or the bound is spent)."""
        deficit = self.target - self.kept
        left = self.budget - self.counts.considered
        if deficit <= 0 or left <= 0:
            return 0
        if not self.keeps:
            want = math.ceil(self.pool * self.target)
        else:  # (kept + 1) / (considered + 1): a keep-rate estimate that is never 0
            want = max(math.ceil(self.pool * deficit),
                       math.ceil(deficit * (self.counts.considered + 1) / (self.kept + 1)))
        return min(_round_up(want, self.chunk), left)

    def add(self, keep: Tensor, batch: Batch | None = None) -> None:
        """Record one round: ``keep`` (bool ``[n]``) over its candidates; ``batch`` (the ``on_prompts``
        batch) gives each candidate's ``prompt_index`` (duplicates) and history class (per-class skip rates)."""
        keep = keep.to(torch.bool)
        c = self.counts
        c.considered += int(keep.numel())
        c.draws += 1
        if batch is not None and batch.has("prompt_index"):
            ids = batch["prompt_index"].to(torch.long)
            fresh = _first_new(ids, keep, self.chosen_ids)
            c.duplicate += int((keep & ~fresh).sum())
            self.chosen_ids = torch.cat([self.chosen_ids, ids[fresh]])
        else:
            ids, fresh = torch.full((keep.numel(),), -1, dtype=torch.long), keep
        self.keeps.append(fresh)
        self.ids.append(ids)
        self.kept += int(fresh.sum())
        if batch is not None:
            add_class_counts(c, batch, keep)

    def chosen(self) -> Tensor:
        """Long ``[target]``: indices, into the concatenation of every round's candidates, of those to
        generate, in draw order."""
        keep = torch.cat(self.keeps) if self.keeps else torch.zeros(0, dtype=torch.bool)
        kept = torch.nonzero(keep).flatten()
        c = self.counts
        c.skipped = int(keep.numel()) - int(kept.numel()) - c.duplicate
        if kept.numel() >= self.target:
            c.trimmed = int(kept.numel()) - self.target
            c.generated = self.target
            return kept[: self.target]
        if kept.numel() == 0 and self.on_empty == "error":
            raise DataflexError(f"{self.who} skipped all {c.considered} candidate prompts (at most "
                                f"dataflex.max_oversample x {self.target} are considered) and "
                                "dataflex.on_empty=error")
        ids = torch.cat(self.ids)
        pool = _first_new(ids, ~keep, self.chosen_ids)
        forced = torch.nonzero(pool).flatten()[: self.target - kept.numel()]
        if kept.numel() + forced.numel() < self.target:
            raise DataflexError(f"PromptFill: {c.considered} candidates (of {int(torch.unique(ids).numel())} "
                             f"distinct prompts) were drawn for {self.target} prompts; draw what request() asks "
                             "for, from a dataset holding at least that many prompts")
        c.forced = int(forced.numel())
        c.skipped -= c.forced
        c.generated = self.target
        return torch.sort(torch.cat([kept, forced])).values


def add_class_counts(counts: PromptCounts, batch: Batch, keep: Tensor) -> None:
    """Add one draw's candidates considered and skipped (not ``keep``) per history class to ``counts``
    (nothing when the ``on_prompts`` batch carries no history)."""
    if not (batch.has("history_visits") and batch.has("history_class")):
        return
    code = torch.where(batch["history_visits"] > 0, batch["history_class"] + 1, 0)
    seen = torch.bincount(code, minlength=4).tolist()
    skipped = torch.bincount(code[~keep], minlength=4).tolist()
    for name, s, k in zip(("new", *CLASS_NAMES), seen, skipped):
        if s:
            mine = counts.by_class.setdefault(name, [0, 0])
            mine[0] += s
            mine[1] += k


def _first_new(ids: Tensor, mask: Tensor, taken: Tensor) -> Tensor:
    """Bool: the candidates of ``mask`` whose id is not in ``taken`` and not repeated earlier among them
    (ids ``-1`` mean unknown and always count as new)."""
    known = ids >= 0
    cand = mask & ~(known & torch.isin(ids, taken))
    if not bool(known.any()):
        return cand
    uniq, inverse = torch.unique(ids, return_inverse=True)
    pos = torch.arange(ids.numel())
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, torch.where(cand, pos, ids.numel()), "amin")
    return cand & ((first[inverse] == pos) | ~known)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


# ---------------------------------------------------------------------------- dynamic sampling with refill
def kept_groups(batch: Batch, decision: Decision) -> Tensor:
    """Bool ``[num_groups]``: the groups of one generation round an ``on_rollout`` decision keeps, for
    dynamic sampling (:class:`GroupFill`). A round whose selection keeps nothing is refilled rather than
    skipped, so ``skip_update`` is not read here; the exhaust policy decides once the rounds are spent."""
    keep_only(decision, BEFORE_ADVANTAGES)
    keep = batch.valid_rows if decision.keep is None else decision.keep & batch.valid_rows
    return segment_sum(keep.to(torch.long), batch.group_index, batch.num_groups) > 0


class GroupFill:
    """Dynamic sampling with refill (DAPO, arXiv 2503.14476 §3.2): generate rounds of prompts until the
    ``on_rollout`` selection has kept ``target`` groups.

    The host asks :meth:`request` how many prompts to generate, generates them (through ``on_prompts``
    when a pre-rollout selection is configured), emits ``on_rollout`` on the round and reports its groups
    and which of them the selection kept with :meth:`add`, until :meth:`request` says 0. :meth:`train`
    then names the groups to train: the first ``target`` kept groups in arrival order (the rest of the kept
    ones are discarded), or, when the rounds ended short, what ``on_exhaust`` says: ``raise``,
    ``train_short`` (every kept group) or ``pad_with_filtered`` (the kept groups, then dropped groups in
    arrival order up to ``target``).

    Round sizes (``config.policy``): the first round is ``gen_batch_size`` (default ``target``); then
    ``fixed``: ``gen_batch_size`` again; ``credit2``: twice the groups dropped in the last round, at most
    ``gen_batch_size`` (verl 0.9.1's sync replay buffer); ``greso`` (GRESO's adaptive batch size, P1.5):
    ``est = floor(beta * deficit / (1 - z))`` with ``z`` the share of the last round's groups dropped, the
    round ``max(min_gen_batch, min(est, gen_batch_size))`` and it is the last one if ``est <= gen_batch_size``
    (``z = 1`` gives ``gen_batch_size`` and more rounds). ``max_rounds`` bounds the rounds (0: unbounded).
    """

    def __init__(self, target: int, config: RefillConfig) -> None:
        self.target = target
        self.config = config
        self.gen = config.gen_batch_size or target
        self.min_gen = config.min_gen_batch or max(1, math.ceil(target / 4))
        self.rounds = 0
        self.generated = 0
        self.kept = 0
        self.group_keeps: list[Tensor] = []
        self._next = self.gen
        self._next_is_last = False
        self._last_done = False

    @property
    def exhausted(self) -> bool:
        """The rounds are spent (``max_rounds``, or the round GRESO's estimate announced as the last)."""
        limit = self.config.max_rounds
        return self._last_done or (limit > 0 and self.rounds >= limit)

    def request(self) -> int:
        """Prompts to generate in the next round (0: done)."""
        if self.kept >= self.target or self.exhausted:
            return 0
        return self._next

    def add(self, kept_groups: Tensor) -> None:
        """One round: bool ``[groups]``, in the round's arrival order, True where the selection kept it."""
        kept_groups = kept_groups.to(torch.bool)
        self.group_keeps.append(kept_groups)
        groups, kept = int(kept_groups.numel()), int(kept_groups.sum())
        self.rounds += 1
        self.generated += groups
        self.kept += kept
        self._last_done = self._next_is_last
        deficit = self.target - self.kept
        if deficit <= 0:
            return
        dropped = groups - kept
        policy = self.config.policy
        if policy == "credit2":
            self._next = min(2 * dropped, self.gen) or min(deficit, self.gen)
        elif policy == "greso":
            z = dropped / groups if groups else 1.0
            if z >= 1 - 1e-6:
                est, last = self.gen, False
            else:  # beta * deficit / (1 - z) with 1 - z = kept / groups, without the float round trip
                est = math.floor(self.config.beta * deficit * groups / kept)
                last = est <= self.gen
            self._next = max(self.min_gen, min(est, self.gen))
            self._next_is_last = last
        else:
            self._next = self.gen

    def train(self, who: str = "dataflex.refill") -> tuple[Tensor, dict[str, float]]:
        """Bool over every group generated (rounds concatenated, arrival order): the groups to train, and
        the ``dataflex/refill/*`` metrics."""
        keep = torch.cat(self.group_keeps) if self.group_keeps else torch.zeros(0, dtype=torch.bool)
        rank = torch.cumsum(keep.to(torch.long), 0)
        train = keep & (rank <= self.target)
        padded = 0
        short = self.target - int(train.sum())
        if short > 0:
            policy = self.config.on_exhaust
            if policy == "raise":
                raise DataflexError(
                    f"{who}: after {self.rounds} generation round(s) ({self.generated} groups) the selection kept "
                    f"{int(train.sum())} of the {self.target} groups a step needs (the data is too easy or too "
                    "hard for it); raise dataflex.refill.max_rounds or set dataflex.refill.on_exhaust to "
                    "train_short or pad_with_filtered")
            if policy == "pad_with_filtered":
                filler = ~keep & (torch.cumsum((~keep).to(torch.long), 0) <= short)
                padded = int(filler.sum())
                train = train | filler
        metrics = {"dataflex/refill/rounds": float(self.rounds),
                   "dataflex/refill/generated_groups": float(self.generated),
                   "dataflex/refill/kept_groups": float(self.kept),
                   "dataflex/refill/trained_groups": float(train.sum()),
                   "dataflex/refill/discarded_groups": float(max(self.kept - self.target, 0)),
                   "dataflex/refill/padded_groups": float(padded),
                   "dataflex/refill/short_groups": float(max(self.target - int(train.sum()), 0))}
        return train, metrics
