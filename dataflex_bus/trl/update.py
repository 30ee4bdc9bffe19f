"""on_advantage carried out on TRL's generation batch: weights ride in the batch and multiply the advantages
in ``_compute_loss``, recomputed advantages replace TRL's, a token mask enters TRL's loss mask, and dropped
rows leave the batch, the rows left laid out over the processes again (:func:`relayout`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object
from torch import Tensor
from trl.models.utils import disable_gradient_checkpointing

from ..kit import AdvantageAction, DataflexError, ReplayPart, RolloutOutcome, Step
from . import replays, vllm
from .records import Kept, RoundData
from .rows import BEHAVIOUR, MULTIMODAL, REAL, WEIGHTS, Layout, cat_rows, row_fields, trim

if TYPE_CHECKING:
    from .trainer import DataflexGRPOTrainer


def after_generation(trainer: DataflexGRPOTrainer, step: Step, out: dict[str, Any], rounds: Sequence[RoundData],
                     kept: Kept, layout: Layout, outcome: RolloutOutcome) -> dict[str, Any]:
    """on_advantage carried out on TRL's generation batch; ``step.trained``; what on_step_end will read."""
    bad = [k for k in MULTIMODAL if k in out]
    if bad:
        raise DataflexError(f"dataflex TRL host: multimodal fields {bad} are not supported")
    runtime, processes = trainer.dataflex, trainer.dataflex_settings.processes
    skip = outcome.skip_update
    wanted = runtime.fields("on_advantage") | runtime.fields("on_step_end")
    behaviour = bool(runtime.plan.replays) or "rollout_log_probs" in wanted
    if behaviour:  # the behaviour log-probs (stored by a replay; vLLM's, or the old ones); the correction's pi_old
        wanted = wanted | {"old_log_probs", "rollout_log_probs"}
    batch = None
    if runtime.listens("on_advantage") or runtime.listens("on_step_end"):
        old_pass(trainer, out, layout, wanted)
        batch = trainer.dataflex_settings.batches.advantage(out, rounds, kept, layout, wanted, processes)
    out.pop("_dfx_entropy", None)
    out.pop("_dfx_old_logps", None)
    replay = ReplayPart.of(step)
    replayed = replay.replayed if kept.replayed is not None and replay is not None else None
    rows = None
    if behaviour and batch is not None:
        fresh = len(kept) - (0 if replayed is None else len(replayed))
        old = batch["old_log_probs"]
        sampled = vllm.behaviour_log_probs(batch["rollout_log_probs"], old) if batch.has("rollout_log_probs") else old
        batch = batch.with_fields(rollout_log_probs=replays.behaviour_log_probs(sampled, replayed, fresh))
        rows = replays.replay_rows(len(kept), fresh) if runtime.plan.replays else None
    if replay is not None:
        replay.rows = rows
    action = step.advantage(batch) if batch is not None and runtime.listens("on_advantage") else AdvantageAction()
    if action.store is not None:
        assert batch is not None
        marked = torch.nonzero(action.store & batch.valid_rows).flatten().tolist()
        assert replay is not None  # only a replay part marks rows to store
        replay.store({}, objects=[replays.stored_object(rounds, kept.refs[i]) for i in marked])
    keep = action.keep
    processes.agree("on_advantage", *(t for t in (keep, *action.fields.values()) if t is not None),
                    torch.tensor([action.skip_update]))
    skip = skip or action.skip_update
    width = out["completion_ids"].size(1)
    masked = "loss_mask" in action.fields and not action.skip_update
    if not action.skip_update:
        if "advantages" in action.fields:
            out["advantages"] = processes.local(action.fields["advantages"], layout, width, 0.0)
        if "rollout_is_weights" in action.fields:
            out[WEIGHTS] = processes.local(action.fields["rollout_is_weights"], layout, width, 1.0)
        if replayed is not None and batch is not None:
            # The ratio of every row is taken against the old log-probs the correction used (``behaviour``: a
            # replayed row's own mu); steps that replay nothing keep TRL's own ratio (bit-identical to TRL).
            old = action.fields.get("old_log_probs", batch["old_log_probs"])
            out["old_per_token_logps"] = processes.local(old, layout, width, 0.0)
            # Rows whose PPO ratio is now taken against their behaviour log-probs: TRL's vLLM ratio stands down.
            replaced = (old != batch["old_log_probs"]).any(dim=1, keepdim=True)
            vllm.own_correction(out, processes.local(replaced, layout, 1, 0.0)[:, 0].bool())
            out[BEHAVIOUR] = processes.local(batch["rollout_log_probs"], layout, width, 0.0)
        if masked:
            # A token mask taking tokens out of every loss term (or dropped rows, removed below): TRL's
            # tool_mask is multiplied into the loss mask only, where completion_mask would also cut the
            # attention. Kept rows' tool_mask x completion_mask is what TRL's loss mask was, minus the masked
            # tokens, so the loss, its normaliser and the trained-token counts follow the mask.
            loss_mask = action.fields["loss_mask"].ne(0)
            out["tool_mask"] = processes.local(loss_mask, layout, width, 1.0).to(out["completion_mask"].dtype)
            kept = dataclasses.replace(kept, loss_tokens=loss_mask.sum(dim=1).to(kept.loss_tokens.dtype))
    end = batch if runtime.listens("on_step_end") else None
    if end is not None and action.fields:
        end = end.with_fields(**action.fields)
    if keep is not None and not action.skip_update:
        index = torch.nonzero(keep).flatten()
        if end is not None:
            end = end.select(keep)
        if index.numel() == 0:  # nothing left to train (the shim's batch is empty too)
            skip = True
        elif index.numel() < len(kept):  # (counts num_items_in_batch of the rows left)
            out, kept, layout = relayout(trainer, out, kept, layout, index)
            masked = False
    if masked:  # the same rows, fewer tokens in the loss mask: TRL's normaliser counts them again
        processes.num_items(out)
    if skip:
        step.skipped()
    trainer.dataflex_batch.skip = skip
    trained = (kept.loss_tokens > 0) & (not skip)
    step.trained(trained, kept.loss_tokens, kept.rewards, kept.lengths, kept.groups, replayed=kept.replayed)
    trainer.dataflex_batch.step, trainer.dataflex_batch.end_batch = step, end
    return out


def old_pass(trainer: DataflexGRPOTrainer, out: dict[str, Any], layout: Layout, wanted: frozenset[str]) -> None:
    """The old policy's log-probs and entropy when a method asks and TRL did not compute them: one no-grad
    pass over this process's rows (the policy has not moved since generation). Never fed to the loss."""
    need_logps = "old_log_probs" in wanted and "old_per_token_logps" not in out
    need_entropy = "entropy" in wanted and "_dfx_entropy" not in out
    if not (need_logps or need_entropy):
        return
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    chunk = max(layout.per_rank // trainer.dataflex_settings.steps_per_generation, 1)
    model: Any = trainer.model
    checkpointing: Any = trainer.args.gradient_checkpointing_kwargs
    with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing):
        logps, entropies, _ = trainer._dfx_trl_logps(model, ids, mask, out["completion_ids"].size(1),
                                                     batch_size=chunk, compute_entropy=need_entropy)
    if need_logps:
        out["_dfx_old_logps"] = logps
    if need_entropy:
        out["_dfx_entropy"] = entropies


def relayout(trainer: DataflexGRPOTrainer, out: dict[str, Any], kept: Kept, layout: Layout,
             index: Tensor) -> tuple[dict[str, Any], Kept, Layout]:
    """Rows removed at on_advantage: the rows left (``index`` into the kept rows) laid out over the processes
    again, as TRL lays out a batch of that many rows."""
    processes = trainer.dataflex_settings.processes
    P, rank = processes.count, processes.rank
    lo, hi = layout.span(rank)
    local = {k: v[:hi - lo].detach().cpu() for k, v in row_fields(out).items() if k != REAL}
    glob = local if P == 1 else cat_rows(gather_object([local]), trainer.dataflex_settings.batches.pad_id)
    glob = {k: v[index] for k, v in glob.items()}
    kept = kept.select(index)
    new = Layout(len(kept), P, trainer.dataflex_settings.steps_per_generation)
    lo, hi = new.span(rank)
    mine = [*range(lo, hi)]
    source = mine[-1] if mine else 0
    rows = {k: v[mine + [source] * (new.per_rank - len(mine))] for k, v in glob.items()}
    lengths = kept.lengths[lo:hi] if hi > lo else kept.lengths[:1]
    prompt_width = int(rows["prompt_mask"].sum(dim=1).max())
    completion_width = max(int(lengths.max()), 1)
    multiple: Any = trainer.pad_to_multiple_of
    if multiple:
        prompt_width = -(-prompt_width // multiple) * multiple
        completion_width = -(-completion_width // multiple) * multiple
    rows = trim(rows, min(prompt_width, rows["prompt_ids"].size(1)), completion_width)
    device = trainer.accelerator.device
    # TRL's key order: its shuffle sizes the batch by the first field (a 0-d value there would fail).
    result = {k: rows[k].to(device) if k in rows else v for k, v in out.items() if k != REAL}
    if new.padded:
        processes.mark_padding(result, hi - lo, new)
    else:
        processes.num_items(result)
    return result, kept, new
