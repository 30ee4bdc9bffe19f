"""The verl adapter's on_advantage carry-out: :class:`AdvantageCarryOut`, a mixin of
:class:`~dataflex_bus.verl.trainer.DataflexTrainer` (before verl's ``PPOTrainer`` in its bases), called from its
``_compute_advantage`` after verl's own advantage.

``_on_advantage`` reads the step's rows from TransferQueue, hands them to the kit (``Step.advantage``) with the
actor's mini-batches (:func:`~dataflex_bus.verl.blocks.minibatch_blocks`), and writes what the methods decided
back for every key, padding included: weights multiplied into ``rollout_is_weights``, dropped rows' ``response_mask``,
``loss_mask`` and ``advantages`` zeroed, rewritten ``advantages``; the meta of *our* ``kv_batch_put`` is passed on,
so the actor's worker really receives the fields. Mini-batches whose every row was dropped leave the update and
TransferQueue (``on_empty``); the trained rows are counted (``Step.trained``), from the loss mask alone when nobody
listens at on_advantage.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict
from torch import Tensor
from transfer_queue import KVBatchMeta

from ..kit import Batch, BatchFieldError, ReplayPart, Runtime, Step, jagged
from .blocks import minibatch_blocks
from .tqbatch import fetch, labels_of, padding_flags, put, to_nested

log = logging.getLogger("dataflex_bus")


class AdvantageCarryOut:
    """on_advantage for :class:`~dataflex_bus.verl.trainer.DataflexTrainer`, carried out in TransferQueue."""

    # What it reads of the trainer (verl's and the adapter's own), declared for type checking only.
    config: DictConfig
    dataflex: Runtime
    global_steps: int
    actor_rollout_wg: Any
    _skip_update: bool
    _rewards: dict[str, float]
    _replay_rows: dict[str, int]
    _empty_blocks_seen: int
    _current_step: Callable[[], Step]
    _read: Callable[..., tuple[Batch, TensorDict]]
    _prompt_index: Callable[[TensorDict, Batch], Tensor]
    _store_replay: Callable[[KVBatchMeta, Tensor], None]
    _get_required_batch_multiple: Callable[[int], int]

    def _on_advantage(self, meta: KVBatchMeta) -> KVBatchMeta:
        step = self._current_step()
        rewards = torch.tensor([self._rewards.get(key, 0.0) for key in meta.keys], dtype=torch.float32)
        if not self.dataflex.listens("on_advantage"):
            self._trained_without_listeners(meta, rewards)
            return meta
        extra = ["rollout_is_weights"] if "rollout_is_weights" in (meta.fields or []) else []
        replays = bool(self.dataflex.plan.replays)
        view, data = self._read("on_advantage", meta, [*extra, "index"] if replays else extra)
        replay_rows = None
        if replays:
            view = view.with_fields(prompt_index=self._prompt_index(data, view))
            replay_rows = torch.tensor([self._replay_rows.get(key, -1) for key in meta.keys], dtype=torch.long)
        blocks, multiple = self._actor_blocks(len(meta))
        if (replay := ReplayPart.of(step)) is not None:
            replay.rows = replay_rows
        action = step.advantage(view, blocks=blocks, block_multiple=multiple)
        if action.store is not None:
            self._store_replay(meta, action.store)
        self._warn_empty_blocks(action.empty_blocks, action.restored_rows, action.remove, action.skip_update)
        self._skip_update = self._skip_update or action.skip_update
        # The loss mask the actor trains on: the methods' (dense), else verl's, counted on its jagged values.
        loss_mask = action.fields.get("loss_mask")
        if loss_mask is None:
            loss_mask = view.held("loss_mask" if view.has("loss_mask") else "response_mask")
        tokens = jagged.row_counts(loss_mask) if jagged.is_jagged(loss_mask) else loss_mask.ne(0).sum(dim=1)
        trained = view.valid_rows & (tokens > 0) & (not self._skip_update)
        if action.remove is not None:
            trained &= ~action.remove
        step.trained(trained, tokens, rewards, view.lengths, view.group_index,
                     replayed=None if replay_rows is None else replay_rows >= 0)
        if self._skip_update or not action.fields:
            return meta
        # Nested like the response mask TransferQueue holds, for every key (padding rows included).
        like = data["response_mask"]
        new_meta = put(meta, {name: to_nested(value, like) for name, value in action.fields.items()})
        # TQ's meta carries the stored fields; keep the batch-level info verl attached to the old one.
        new_meta.extra_info = {**(meta.extra_info or {}), **(new_meta.extra_info or {})}
        if action.remove is not None:
            # The emptied mini-batches leave the update (and TransferQueue, which fit() would no longer
            # clear for them); the rest keep verl's order, so every other mini-batch is unchanged.
            flags = action.remove.tolist()
            tq.kv_clear(keys=list(itertools.compress(meta.keys, flags)), partition_id=meta.partition_id)
            new_meta = new_meta.select_keys([k for k, f in zip(meta.keys, flags) if not f])
        return new_meta

    def _trained_without_listeners(self, meta: KVBatchMeta, rewards: Tensor) -> None:
        """The trained-only metrics when no method or observer acts at on_advantage: nothing is dropped
        here, so read just the loss mask (its row lengths are the response lengths) and the groups."""
        data = fetch(meta, {"uid", "loss_mask"})
        loss_mask = data["loss_mask"]
        if not loss_mask.is_nested:
            raise BatchFieldError("dataflex verl adapter", "loss_mask", "expected a nested (jagged) tensor")
        tokens = jagged.row_counts(loss_mask)
        _, groups = np.unique(np.asarray(labels_of(data["uid"]), dtype=object), return_inverse=True)
        trained = ~padding_flags(meta.tags) & (tokens > 0) & (not self._skip_update)
        step = self._current_step()
        step.metrics["dataflex/empty_minibatches"] = 0.0
        step.trained(trained, tokens, rewards, loss_mask.offsets().diff(), torch.from_numpy(groups.reshape(-1)))

    def _actor_blocks(self, rows: int) -> tuple[Tensor | None, int | None]:
        """The actor's mini-batches for a batch of ``rows`` rows (``None`` when the actor does not update
        this step), and the row multiple the batch must keep if whole mini-batches are taken out
        (``None`` when they cannot be: a shuffled order differs in every epoch)."""
        actor = self.config.actor_rollout_ref.actor
        mini = int(actor.ppo_mini_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
        if self.config.trainer.critic_warmup > self.global_steps or rows == 0 or rows % mini:
            return None, None
        dispatch = self.actor_rollout_wg._dispatch_info.get("actor") or [0]
        dp = max(dispatch) + 1
        if mini % dp:
            return None, None
        shuffle = bool(actor.get("shuffle", False))
        blocks = minibatch_blocks(rows, mini, dp, epochs=int(actor.get("ppo_epochs", 1)), shuffle=shuffle,
                                  seed=int(actor.get("data_loader_seed", 42)))
        return blocks, None if shuffle else self._get_required_batch_multiple(dp)

    def _warn_empty_blocks(self, empty: int, restored: int, remove: Tensor | None, skipped: bool) -> None:
        if not empty:
            return
        self._empty_blocks_seen += 1
        n = self._empty_blocks_seen
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, ... step: visible without flooding the log
            removed = 0 if remove is None else int(remove.sum())
            action = ("skipping this step's actor update" if skipped else
                      f"taking {removed} rows out of the update" if removed else
                      f"training {restored} dropped rows again (on_empty=keep_all)")
            log.warning("dataflex: step %d: every row of %d mini-batch(es) was dropped; %s (%d such step(s) so "
                        "far, counted in dataflex/empty_minibatches)", self.global_steps, empty, action, n)


__all__ = ["AdvantageCarryOut"]
