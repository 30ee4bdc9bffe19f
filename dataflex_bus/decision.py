"""What the methods decided at one event, and how every host carries it out on a :class:`Batch`.

The CPU shim and the verl trainer both call :func:`carry_out_prompts` after ``on_prompts``,
:func:`carry_out_rollout` after ``on_rollout`` and :func:`carry_out_advantage` after ``on_advantage``, draw
prompts with :func:`sampling_probabilities`, fill a step's prompts through a pre-rollout selection with
:class:`PromptFill` and refill a step's groups with :class:`GroupFill`; they only move tensors in and out
(the shim keeps them in memory, verl in TransferQueue). So a decision means the same thing in both places:

* at ``on_prompts`` a decision keeps or skips candidate prompts: the host generates only the kept ones
  and draws more until it has what it needs, within ``dataflex.max_oversample`` (:class:`PromptFill`).

* at ``on_rollout`` a decision keeps or drops whole groups: the host removes the dropped rows before any
  further compute. An empty selection, or a method asking to skip the step, never reaches the trainer as
  an empty batch: the first real group is kept for the (cheap) forward passes and the update is skipped.
* at ``on_advantage`` weights are *multiplied* into ``rollout_is_weights`` (never overwrite verl's own),
  recomputed advantages replace the old ones on real rows, and a dropped row gets ``response_mask``,
  ``loss_mask`` and ``advantages`` zeroed (so token-mean renormalises over the kept tokens and KL/entropy
  skip the row; a weight of 0 would only dilute the loss). A host may also remove those rows physically.
  A host that trains in fixed blocks of rows (verl's mini-batches) passes them in: a block whose every
  row was dropped would average its loss over no token (0/0 under token-mean) while the optimizer still
  steps, so it follows the ``on_empty`` of the methods that dropped its rows instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import BatchFieldError, DataflexError
from .history import CLASS_NAMES
from .ops import segment_sum

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .block import RefillConfig


class Decision:
    """What the participants decided at one event; the host loop carries it out.

    ``keep``: bool ``[B]`` rows to keep (``None``: all). ``advantages``: recomputed ``[B, T]`` (subset
    selectors). ``weights``: ``[B, T]`` multiplied into ``rollout_is_weights`` (1 on tokens that do not
    count). ``domain_probs``: sampling probabilities for the next prompts (mix). ``skip_update``: an
    empty-selection policy asked to skip this step's policy update. ``metrics``: ``dataflex/...``.
    ``on_empty``: the strictest ``on_empty`` of the methods that dropped rows (what a host does with a
    training block all of whose rows were dropped). ``nonfinite``: bool ``[B]`` rows dropped for a
    non-finite score (never trained, whatever ``on_empty`` says).
    """

    __slots__ = ("advantages", "domain_probs", "keep", "metrics", "nonfinite", "on_empty", "skip_update", "weights")

    def __init__(self) -> None:
        self.keep: Tensor | None = None
        self.advantages: Tensor | None = None
        self.weights: Tensor | None = None
        self.domain_probs: dict[str, float] | None = None
        self.skip_update = False
        self.metrics: dict[str, float] = {}
        self.on_empty: str | None = None
        self.nonfinite: Tensor | None = None

    def drop(self, rows: Tensor, *, on_empty: str | None = None, nonfinite: bool = False) -> None:
        """Drop ``rows`` (bool ``[B]``): keep masks of several methods AND. ``on_empty``: the dropping
        method's policy; ``nonfinite``: the rows are dropped because their score is NaN/inf."""
        self.restrict(~rows, on_empty=on_empty)
        if nonfinite:
            self.nonfinite = rows if self.nonfinite is None else self.nonfinite | rows

    def restrict(self, keep: Tensor, *, on_empty: str | None = None) -> None:
        """Keep only ``keep`` (bool ``[B]``) of what is kept so far (``on_empty``: as in :meth:`drop`)."""
        self.keep = keep if self.keep is None else self.keep & keep
        self._note(on_empty)

    def _note(self, policy: str | None) -> None:
        # A block emptied by several methods' drops follows the strictest of their policies: none of
        # them then trains on a row it refused, nor skips what another one asked to raise on.
        if policy is not None and (self.on_empty is None or _STRICTNESS[policy] > _STRICTNESS[self.on_empty]):
            self.on_empty = policy

    def scale(self, weights: Tensor) -> None:
        """Multiply ``[B, T]`` weights in: the weights of several methods multiply."""
        self.weights = weights if self.weights is None else self.weights * weights

    def __repr__(self) -> str:
        keep = None if self.keep is None else f"{int(self.keep.sum())}/{self.keep.numel()}"
        return (f"Decision(keep={keep}, advantages={self.advantages is not None}, "
                f"weights={self.weights is not None}, domain_probs={self.domain_probs}, "
                f"skip_update={self.skip_update})")


#: ``on_empty`` policies from the most lenient to the strictest.
_STRICTNESS = {"keep_all": 0, "skip": 1, "error": 2}


# ---------------------------------------------------------------------------- on_rollout
@dataclass
class RolloutAction:
    """What a host does after ``on_rollout``: carry on with ``keep`` (``None``: every row) and skip the
    update when ``skip_update``. ``removed``: real rows removed."""

    keep: Tensor | None
    skip_update: bool
    removed: int


def first_group(batch: Batch) -> Tensor:
    """Bool ``[B]``: the rows of the first real group (what an empty or skipped step carries on with)."""
    valid = torch.nonzero(batch.valid_rows).flatten()
    if valid.numel() == 0:
        return torch.ones(len(batch), dtype=torch.bool)
    return batch.group_index == batch.group_index[valid[0]]


_BEFORE_ADVANTAGES = "decided at on_rollout, before advantages exist; a method writing them must act at on_advantage"


def _keep_only(decision: Decision, why: str) -> None:
    """Refuse a decision holding weights or advantages at an event where only a keep mask can act."""
    if decision.weights is not None or decision.advantages is not None:
        raise BatchFieldError("dataflex", "weights" if decision.weights is not None else "advantages", why)


def carry_out_rollout(batch: Batch, decision: Decision) -> RolloutAction:
    """The rows to carry on with after ``on_rollout``. Raises if a method asked for something that can
    only be done once advantages exist (the validation places such methods at ``on_advantage``)."""
    _keep_only(decision, _BEFORE_ADVANTAGES)
    keep = decision.keep
    skip = decision.skip_update
    real = batch.valid_rows
    if keep is not None:
        keep = keep & real
    if skip or (keep is not None and bool(real.any()) and not bool(keep.any())):
        keep, skip = first_group(batch), True
    if keep is None or bool(keep[real].all()):
        return RolloutAction(None, skip, 0)
    # Padding rows travel with the batch (the host re-pads anyway); only real rows are removed.
    keep = keep | ~real
    return RolloutAction(keep, skip, int((real & ~keep).sum()))


# ---------------------------------------------------------------------------- on_advantage
@dataclass
class AdvantageAction:
    """What a host does after ``on_advantage``: write ``fields`` (dense ``[B, T]``, every row, padding
    included), optionally remove the rows not in ``keep`` (already fully masked), skip the update when
    ``skip_update`` (then nothing is written).

    With training blocks (see :func:`carry_out_advantage`): ``remove`` (bool ``[B]``) are the rows of
    blocks left empty, which the host must take out of the update; ``empty_blocks`` counts the blocks
    found empty and ``restored_rows`` the dropped rows ``on_empty=keep_all`` put back.
    """

    fields: dict[str, Tensor] = field(default_factory=dict)
    keep: Tensor | None = None
    skip_update: bool = False
    remove: Tensor | None = None
    empty_blocks: int = 0
    restored_rows: int = 0


def empty_blocks(trained: Tensor, blocks: Tensor) -> Tensor:
    """Bool ``[K]``: the blocks (long ``[K, m]``, the row indices of each) in which no row trains
    (``trained``: bool ``[B]``)."""
    return ~trained[blocks].any(dim=1)


def rows_in(blocks: Tensor, which: Tensor, size: int) -> Tensor:
    """Bool ``[size]``: the rows belonging to the blocks selected by ``which`` (bool ``[K]``)."""
    rows = torch.zeros(size, dtype=torch.bool)
    rows[blocks[which].flatten()] = True
    return rows


def carry_out_advantage(batch: Batch, decision: Decision, *, blocks: Tensor | None = None,
                        block_multiple: int | None = None) -> AdvantageAction:
    """The fields to write after ``on_advantage``. ``batch`` must hold ``response_mask`` and, when the
    decision drops rows or replaces advantages, ``advantages`` and ``loss_mask``; its
    ``rollout_is_weights`` (if any) are multiplied, never replaced.

    ``blocks`` (long ``[K, m]``): the rows the host trains together, one optimizer step each (verl's
    mini-batches, every epoch). A block in which every row ends up dropped follows
    ``decision.on_empty``: ``error`` raises; ``keep_all`` restores the rows it dropped (never those with a
    non-finite score); ``skip`` (and a ``keep_all`` block with nothing to restore) takes the block out of
    the update: its rows are returned in ``remove`` when ``block_multiple`` is given (the blocks
    partition the rows the same way every epoch, and the batch must stay a multiple of it), otherwise
    the whole update is skipped.
    """
    if decision.skip_update:
        return AdvantageAction(skip_update=True)
    out: dict[str, Tensor] = {}
    if decision.weights is not None:
        w = decision.weights.to(torch.float32)
        if "rollout_is_weights" in batch.fields:
            w = batch["rollout_is_weights"].to(torch.float32) * w
        out["rollout_is_weights"] = w
    advantages = None
    if decision.advantages is not None:
        current = batch["advantages"]
        advantages = torch.where(batch.valid_rows[:, None], decision.advantages.to(current.dtype), current)
    drop = None if decision.keep is None else batch.valid_rows & ~decision.keep
    if drop is None or not bool(drop.any()):
        if advantages is not None:
            out["advantages"] = advantages
        return AdvantageAction(out)
    rows = drop[:, None]
    loss_mask = batch.get("loss_mask")
    loss_mask = batch["response_mask"] if loss_mask is None else loss_mask
    out["response_mask"] = batch["response_mask"].masked_fill(rows, 0)
    out["loss_mask"] = loss_mask.masked_fill(rows, 0)
    advantages = (batch["advantages"] if advantages is None else advantages).masked_fill(rows, 0)
    out["advantages"] = advantages
    if blocks is None:
        return AdvantageAction(out, ~drop)

    empty = empty_blocks(out["loss_mask"].ne(0).any(dim=1), blocks)
    count = int(empty.sum())
    if count == 0:
        return AdvantageAction(out, ~drop)
    policy = decision.on_empty or "skip"
    if policy == "error":
        raise DataflexError(f"dataflex: every row of {count} of {len(blocks)} training block(s) (mini-batches) was "
                            "dropped, so their update would average over no token (dataflex.on_empty=error)")
    restored = 0
    if policy == "keep_all":
        back = rows_in(blocks, empty, len(batch)) & drop
        if decision.nonfinite is not None:
            back &= ~decision.nonfinite
        restored = int(back.sum())
        if restored:
            # The block trains as if no method had dropped these rows: verl's own masks and advantages.
            rows = back[:, None]
            out["response_mask"] = torch.where(rows, batch["response_mask"], out["response_mask"])
            out["loss_mask"] = torch.where(rows, loss_mask, out["loss_mask"])
            out["advantages"] = torch.where(rows, batch["advantages"].to(advantages.dtype), advantages)
            drop = drop & ~back
            empty = empty_blocks(out["loss_mask"].ne(0).any(dim=1), blocks)
    if not bool(empty.any()):
        return AdvantageAction(out, ~drop, empty_blocks=count, restored_rows=restored)
    remove = rows_in(blocks, empty, len(batch))
    left = len(batch) - int(remove.sum())
    if block_multiple is None or left == 0 or left % block_multiple:
        return AdvantageAction(skip_update=True, empty_blocks=count, restored_rows=restored)
    return AdvantageAction(out, ~drop, remove=remove, empty_blocks=count, restored_rows=restored)


# ---------------------------------------------------------------------------- mix
def check_probabilities(values: Tensor, domains: Sequence[str], who: str) -> None:
    """Raise unless ``values`` are ``len(domains)`` finite, non-negative probabilities with a positive sum
    (checked where a mixer publishes them, so a bad mixer is named at once)."""
    if tuple(values.shape) != (len(domains),):
        raise BatchFieldError(who, "probabilities", f"expected shape ({len(domains)},) for domains {list(domains)}, "
                              f"got {tuple(values.shape)}")
    v = values.double()
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()) or float(v.sum()) <= 0:
        shown = {d: float(x) for d, x in zip(domains, v.tolist())}
        raise BatchFieldError(who, "probabilities",
                              f"must be finite, non-negative and sum to more than 0, got {shown}")


def sampling_probabilities(probs: Mapping[str, float] | None, domains: Sequence[str]) -> Tensor:
    """Float64 ``[D]`` probabilities over ``domains`` (in the sampler's order) for the next prompts:
    uniform without a mixer, else the published ``probs`` renormalised (a domain absent gets 0)."""
    if probs is None:
        return torch.full((len(domains),), 1.0 / len(domains), dtype=torch.float64)
    p = torch.tensor([float(probs.get(d, 0.0)) for d in domains], dtype=torch.float64)
    check_probabilities(p, domains, "dataflex mix")
    return p / p.sum()


# ---------------------------------------------------------------------------- on_prompts
def carry_out_prompts(batch: Batch, decision: Decision) -> Tensor:
    """Bool ``[N]``: the candidates an ``on_prompts`` decision keeps (padding never). A decision at
    ``on_prompts`` can only keep or skip prompts: nothing else exists before generation."""
    _keep_only(decision, "decided at on_prompts, before anything is generated; only a keep mask is possible")
    real = batch.valid_rows
    return real if decision.keep is None else decision.keep & real


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
    the first round of ``target``, the next asks for the deficit divided by the keep rate seen so far) and
    bounded: at most ``ceil(max_oversample * target)`` candidates (whole chunks) are considered. If they hold
    fewer kept candidates than needed, the shortfall is filled with skipped candidates, earliest first,
    counted as ``forced`` (a host must generate a full batch, and skipping the update would waste the
    generation), unless nothing at all was kept and ``on_empty`` is ``error``. Kept candidates beyond
    ``target`` are not generated (``trimmed``). Given the candidates' ``prompt_index``, a prompt is chosen
    at most once per fill (a candidate repeating an earlier choice is a ``duplicate``): a sampler drawing with
    replacement, or a fill spanning an epoch boundary, would otherwise generate the same prompt twice.
    """

    def __init__(self, target: int, *, max_oversample: float, chunk: int = 1, on_empty: str = "skip",
                 who: str = "dataflex") -> None:
        if target < 1 or chunk < 1:
            raise ValueError(f"PromptFill needs target >= 1 and chunk >= 1, got {target} and {chunk}")
        self.target = target
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
            want = self.target
        else:  # (kept + 1) / (considered + 1): a keep-rate estimate that is never 0
            want = max(deficit, math.ceil(deficit * (self.counts.considered + 1) / (self.kept + 1)))
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
        if batch is not None and batch.has("history_visits") and batch.has("history_class"):
            code = torch.where(batch["history_visits"] > 0, batch["history_class"] + 1, 0)
            seen = torch.bincount(code, minlength=4).tolist()
            skipped = torch.bincount(code[~keep], minlength=4).tolist()
            for name, s, k in zip(("new", *CLASS_NAMES), seen, skipped):
                if s:
                    mine = c.by_class.setdefault(name, [0, 0])
                    mine[0] += s
                    mine[1] += k

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
            from .errors import DataflexError

            raise DataflexError(f"{self.who} skipped all {c.considered} candidate prompts (at most "
                                f"dataflex.max_oversample x {self.target} are considered) and "
                                "dataflex.on_empty=error")
        ids = torch.cat(self.ids)
        pool = _first_new(ids, ~keep, self.chosen_ids)
        forced = torch.nonzero(pool).flatten()[: self.target - kept.numel()]
        if kept.numel() + forced.numel() < self.target:
            from .errors import DataflexError

            raise DataflexError(f"PromptFill: {c.considered} candidates (of {int(torch.unique(ids).numel())} "
                             f"distinct prompts) were drawn for {self.target} prompts; draw what request() asks "
                             "for, from a dataset holding at least that many prompts")
        c.forced = int(forced.numel())
        c.skipped -= c.forced
        c.generated = self.target
        return torch.sort(torch.cat([kept, forced])).values


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
    _keep_only(decision, _BEFORE_ADVANTAGES)
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
                from .errors import DataflexError

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
