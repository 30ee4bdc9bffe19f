"""How every host carries out a decision on a :class:`~dataflex_bus.Batch` (the host kit).

Every host calls :func:`carry_out_prompts` after ``on_prompts``, :func:`carry_out_rollout` after
``on_rollout`` and :func:`carry_out_advantage` after ``on_advantage`` (through the step drivers of
:mod:`dataflex_bus.steps`), and draws prompts with :func:`sampling_probabilities`; a host only moves tensors
in and out (the shim keeps them in memory, verl in TransferQueue). So a decision means the same thing in
every host:

* at ``on_prompts`` a decision keeps or skips candidate prompts: the host generates only the kept ones
  and draws more until it has what it needs, within ``dataflex.max_oversample``
  (:class:`~dataflex_bus.fill.PromptFill`).
* at ``on_rollout`` a decision keeps or drops whole groups: the host removes the dropped rows before any
  further compute. An empty selection, or a method asking to skip the step, never reaches the trainer as
  an empty batch: the first real group is kept for the (cheap) forward passes and the update is skipped.
* at ``on_advantage`` weights are *multiplied* into ``rollout_is_weights`` (never overwrite the host's
  own), recomputed advantages replace the old ones on real rows, and a dropped row gets ``response_mask``,
  ``loss_mask`` and ``advantages`` zeroed (so token-mean renormalises over the kept tokens and KL/entropy
  skip the row; a weight of 0 would only dilute the loss). A host may also remove those rows physically.
  A host that trains in fixed blocks of rows (verl's mini-batches) passes them in: a block whose every
  row was dropped would average its loss over no token (0/0 under token-mean) while the optimizer still
  steps, so it follows the ``on_empty`` of the methods that dropped its rows instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .batch import first_group as first_group  # (the hosts' step drivers take it from here)
from .errors import BatchFieldError, DataflexError
from .mechanisms.mix import check_probabilities

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .decision import Decision


# ---------------------------------------------------------------------------- on_rollout
@dataclass
class RolloutAction:
    """What a host does after ``on_rollout``: carry on with ``keep`` (``None``: every row) and skip the
    update when ``skip_update``. ``removed``: real rows removed."""

    keep: Tensor | None
    skip_update: bool
    removed: int


BEFORE_ADVANTAGES = "decided at on_rollout, before advantages exist; a method writing them must act at on_advantage"


def keep_only(decision: Decision, why: str) -> None:
    """Refuse a decision holding weights, advantages or a token mask at an event where only a keep mask can act."""
    for name in ("weights", "advantages", "tokens"):
        if getattr(decision, name) is not None:
            raise BatchFieldError("dataflex", name, why)


def carry_out_rollout(batch: Batch, decision: Decision) -> RolloutAction:
    """The rows to carry on with after ``on_rollout``. Raises if a method asked for something that can
    only be done once advantages exist (the validation places such methods at ``on_advantage``)."""
    keep_only(decision, BEFORE_ADVANTAGES)
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

    ``store`` (bool ``[B]``): the rows a replay method stores in the run's buffer; the host hands their
    fields to ``ReplayPart.store`` (``None``: nothing to store).
    """

    fields: dict[str, Tensor] = field(default_factory=dict)
    keep: Tensor | None = None
    skip_update: bool = False
    remove: Tensor | None = None
    empty_blocks: int = 0
    restored_rows: int = 0
    store: Tensor | None = None


def empty_blocks(trained: Tensor, blocks: Tensor) -> Tensor:
    """Bool ``[K]``: the blocks (long ``[K, m]``, the row indices of each) in which no row trains
    (``trained``: bool ``[B]``)."""
    return ~trained[blocks].any(dim=1)


def rows_in(blocks: Tensor, which: Tensor, size: int) -> Tensor:
    """Bool ``[size]``: the rows belonging to the blocks selected by ``which`` (bool ``[K]``)."""
    rows = torch.zeros(size, dtype=torch.bool)
    rows[blocks[which].flatten()] = True
    return rows


def minibatch_index(blocks: Tensor | None, rows: int) -> Tensor:
    """Long ``[rows]``: the first epoch's block of each row (see :func:`carry_out_advantage` for ``blocks``);
    all 0 without blocks, where the host trains the batch as one block."""
    out = torch.zeros(rows, dtype=torch.long)
    if blocks is None:
        return out
    size = blocks.shape[1]
    first = blocks[: rows // size]  # the blocks of one epoch partition the rows
    out[first.flatten()] = torch.arange(first.shape[0]).repeat_interleave(size)
    return out


def unkept_tokens(batch: Batch, decision: Decision) -> Tensor | None:
    """Bool ``[B, T]``: the real response tokens a token selection leaves out of the policy-gradient term
    (``None``: the decision selects no tokens)."""
    if decision.tokens is None:
        return None
    real = batch.token_mask
    if tuple(decision.tokens.shape) != tuple(real.shape):
        raise BatchFieldError("dataflex", "tokens", f"a token mask must have the response mask's shape "
                              f"{tuple(real.shape)}, got {tuple(decision.tokens.shape)}")
    return real & ~decision.tokens.to(torch.bool)


def carry_out_advantage(batch: Batch, decision: Decision, *, blocks: Tensor | None = None,
                        block_multiple: int | None = None) -> AdvantageAction:
    """The fields to write after ``on_advantage``. ``batch`` must hold ``response_mask`` and, when the
    decision drops rows or replaces advantages, ``advantages`` and ``loss_mask``; its
    ``rollout_is_weights`` (if any) are multiplied, never replaced.

    A token mask (``decision.tokens``) is written into ``rollout_is_weights`` (0 on the tokens left out), so
    only the policy-gradient term loses them: KL, entropy bonus and token-mean's denominator keep every token
    (the paper's and TRL's loss); under ``decision.mask_kl`` it is written into ``response_mask`` and
    ``loss_mask`` instead, and those terms lose the tokens too.

    ``blocks`` (long ``[K, m]``): the rows the host trains together, one optimizer step each (verl's
    mini-batches, every epoch). A block in which every row ends up dropped (or, under a token mask, left
    without a kept token: its policy-gradient term would be empty) follows ``decision.on_empty``: ``error``
    raises; ``keep_all`` restores the rows it dropped and their tokens (never rows with a non-finite
    score); ``skip`` (and a ``keep_all`` block with nothing to restore) takes the block out of the update:
    its rows are returned in ``remove`` when ``block_multiple`` is given (the blocks partition the rows the
    same way every epoch, and the batch must stay a multiple of it), otherwise the whole update is skipped.
    """
    if decision.skip_update:
        return AdvantageAction(skip_update=True)
    out: dict[str, Tensor] = {}
    unkept = unkept_tokens(batch, decision)
    masked = unkept is not None and decision.mask_kl
    # What keep_all gives back to the rows of a block without a kept token: the weights before the mask.
    unmasked_weights = None
    if decision.weights is None and unkept is not None and not masked and "rollout_is_weights" not in batch.fields:
        # The mask alone: one conversion pass instead of filling ones.
        out["rollout_is_weights"] = (~unkept).to(torch.float32)
        unmasked_weights = torch.ones(())
    elif decision.weights is not None or (unkept is not None and not masked):
        w = (torch.ones(batch["response_mask"].shape) if decision.weights is None
             else decision.weights.to(torch.float32))
        if "rollout_is_weights" in batch.fields:
            w = batch["rollout_is_weights"].to(torch.float32) * w
        if unkept is not None and not masked:
            unmasked_weights, w = w, w.masked_fill(unkept, 0.0)
        out["rollout_is_weights"] = w
    advantages = None
    if decision.advantages is not None:
        current = batch["advantages"]
        advantages = torch.where(batch.valid_rows[:, None], decision.advantages.to(current.dtype), current)
    drop = None if decision.keep is None else batch.valid_rows & ~decision.keep
    if drop is not None and not bool(drop.any()):
        drop = None
    loss_mask = batch.get("loss_mask")
    loss_mask = batch["response_mask"] if loss_mask is None else loss_mask
    if drop is None and not masked:
        if advantages is not None:
            out["advantages"] = advantages
        if unkept is None or blocks is None:
            return AdvantageAction(out)
    else:
        response_mask, new_loss_mask = batch["response_mask"], loss_mask
        if masked and unkept is not None:
            response_mask, new_loss_mask = response_mask.masked_fill(unkept, 0), new_loss_mask.masked_fill(unkept, 0)
        if drop is not None:
            rows = drop[:, None]
            response_mask, new_loss_mask = response_mask.masked_fill(rows, 0), new_loss_mask.masked_fill(rows, 0)
            advantages = (batch["advantages"] if advantages is None else advantages).masked_fill(rows, 0)
        out["response_mask"], out["loss_mask"] = response_mask, new_loss_mask
        if advantages is not None:
            out["advantages"] = advantages
    if blocks is None:
        return AdvantageAction(out, None if drop is None else ~drop)

    # Rows with a kept token (every row without a token mask): a block of none has no policy-gradient term.
    selected = None if unkept is None else (batch.token_mask & ~unkept).any(dim=1)
    back = torch.zeros(len(batch), dtype=torch.bool)

    def trained() -> Tensor:
        rows = out.get("loss_mask", loss_mask).ne(0).any(dim=1)
        return rows if selected is None else rows & (selected | back)

    empty = empty_blocks(trained(), blocks)
    count = int(empty.sum())
    if count == 0:
        return AdvantageAction(out, None if drop is None else ~drop)
    policy = decision.on_empty or "skip"
    if policy == "error":
        tokens = "" if unkept is None else " or kept no token"
        raise DataflexError(f"dataflex: every row of {count} of {len(blocks)} training block(s) (mini-batches) was "
                            f"dropped{tokens}, so their update would average over no token (dataflex.on_empty=error)")
    restored = 0
    if policy == "keep_all":
        untrained = torch.zeros(len(batch), dtype=torch.bool) if drop is None else drop.clone()
        if selected is not None:
            untrained |= batch.valid_rows & ~selected
        back = rows_in(blocks, empty, len(batch)) & untrained
        if decision.nonfinite is not None:
            back &= ~decision.nonfinite
        restored = int(back.sum())
        if restored:
            # The block trains as if no method had dropped these rows or masked their tokens: verl's own masks,
            # advantages and weights (and the other methods' weights).
            rows = back[:, None]
            if "response_mask" in out:
                out["response_mask"] = torch.where(rows, batch["response_mask"], out["response_mask"])
                out["loss_mask"] = torch.where(rows, loss_mask, out["loss_mask"])
            if drop is not None and "advantages" in out:
                dropped = (back & drop)[:, None]
                out["advantages"] = torch.where(dropped, batch["advantages"].to(out["advantages"].dtype),
                                                out["advantages"])
            if unmasked_weights is not None:
                out["rollout_is_weights"] = torch.where(rows, unmasked_weights.to(torch.float32),
                                                        out["rollout_is_weights"])
            drop = None if drop is None else drop & ~back
            empty = empty_blocks(trained(), blocks)
    keep = None if drop is None else ~drop
    if not bool(empty.any()):
        return AdvantageAction(out, keep, empty_blocks=count, restored_rows=restored)
    remove = rows_in(blocks, empty, len(batch))
    left = len(batch) - int(remove.sum())
    if block_multiple is None or left == 0 or left % block_multiple:
        return AdvantageAction(skip_update=True, empty_blocks=count, restored_rows=restored)
    return AdvantageAction(out, keep, remove=remove, empty_blocks=count, restored_rows=restored)


# ---------------------------------------------------------------------------- mix
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
    keep_only(decision, "decided at on_prompts, before anything is generated; only a keep mask is possible")
    real = batch.valid_rows
    return real if decision.keep is None else decision.keep & real
