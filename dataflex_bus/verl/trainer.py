"""The dataflex trainer modes for verl 0.9.1 (``trainer.v1.trainer_mode=dataflex_sync``, and
``dataflex_colocate_async`` / ``dataflex_separate_async`` for verl's asynchronous trainers).

:class:`DataflexTrainer` runs the configured dataflex method inside verl's real step, at four
single-method hook points that all of verl's v1 trainers share (verl 0.9.1,
``verl/trainer/ppo/v1/trainer_base.py``: ``PPOTrainer._step_once`` is the one step skeleton, and neither
async trainer overrides these hooks); each mode is that class on top of verl's own trainer:

* ``_balance_batch`` -> **on_rollout**: rewards are in TransferQueue, nothing else is computed yet.
  Dropped groups are removed from the batch (``KVBatchMeta.select_keys``) and from TQ (``kv_clear``)
  *before* verl pads the batch, so old-log-prob, reference, critic and actor compute is not spent on
  them.
* ``_compute_advantage`` -> **on_advantage**: weights are multiplied into any ``rollout_is_weights``
  verl wrote, sample-level drops zero ``response_mask``, ``loss_mask`` and ``advantages``, subset
  selectors rewrite ``advantages``; written for every key, padding included, and the meta returned by
  *our* ``kv_batch_put`` is passed on, so the actor's worker really receives the fields. A mini-batch
  whose every row was dropped is handled by ``on_empty`` (see :func:`minibatch_blocks`).
* ``step`` -> **on_step_end**: before ``fit`` saves the step's checkpoint, so mixer/bandit updates are
  in it.
* ``_fetch_one_gen_batch`` -> **mix**: prompts for every generation batch and every refill are drawn
  by the pipeline's domain probabilities (:class:`~dataflex_bus.verl.sampler.DomainSampler`).

Plugin state is saved as ``global_step_N/dataflex_state.pt`` before verl's checkpoint (whose tracker
file is written last) and restored after verl's ``_load_checkpoint``. Each mode sets
``self.trainer_mode`` to the verl mode it runs (``sync``, ``colocate_async``, ``separate_async``), because
verl branches on those literal strings (replay buffer type, forced ``gen_batch_size=1``, TQ snapshots in
checkpoints, the ``trainer.v1.<mode>`` section); any other string silently selects the async paths.

The modes register themselves as the last statements of this module, so a failing import never leaves
a half-working registration behind (see :mod:`dataflex_bus.verl.entry`).
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from torch import Tensor
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.dataset.rl_dataset import collate_fn

from .. import __version__
from ..batch import Batch
from ..decision import Decision, carry_out_advantage, carry_out_rollout, sampling_probabilities
from ..errors import BatchFieldError, ConfigError, ConfigIssue
from ..runtime import Runtime
from . import TRAINER_MODES
from .sampler import DomainSampler
from .tqbatch import fetch, labels_of, padding_flags, put, to_batch, to_nested

log = logging.getLogger("dataflex_bus")

#: File written into every ``global_step_N`` checkpoint folder.
STATE_FILE = "dataflex_state.pt"
#: Fields every event reads, whatever the method: labels, rewards and the response mask.
BASE_FIELDS = ("uid", "response_mask", "rm_scores")
#: verl policy losses that ignore ``rollout_is_weights`` entirely (core_algos.py, bypass_mode).
WEIGHT_IGNORING_LOSSES = frozenset({"bypass_mode"})
#: verl policy losses that collapse per-token weights to a per-sequence geometric mean.
WEIGHT_COLLAPSING_LOSSES = frozenset({"geo_mean"})


# ---------------------------------------------------------------------------- config helpers
def dataflex_block(config: DictConfig | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``dataflex`` block of a verl config as a plain dict (``None`` when absent)."""
    block = config.get("dataflex", None)
    if block is None:
        return None
    if OmegaConf.is_config(block):
        return OmegaConf.to_container(block, resolve=True)  # type: ignore[return-value]
    return dict(block)


def host_context(config: DictConfig) -> dict[str, Any]:
    """What the foundation's validation needs to know about this verl run."""
    return {"adv_estimator": str(config.algorithm.adv_estimator),
            "rollout_n": int(config.actor_rollout_ref.rollout.n)}


def check_host_config(config: DictConfig, runtime: Runtime) -> None:
    """Refuse verl settings under which the configured method would silently do nothing.

    Raises :class:`ConfigError`; logs a warning for settings that weaken, but do not disable, it.
    """
    mechanisms = runtime.mechanisms
    if not mechanisms:
        return
    actor = config.actor_rollout_ref.actor
    loss_mode = str(OmegaConf.select(actor, "policy_loss.loss_mode", default="vanilla"))
    if "reweight" in mechanisms and loss_mode in WEIGHT_IGNORING_LOSSES:
        raise ConfigError(ConfigIssue(
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            f"verl's {loss_mode!r} policy loss ignores rollout_is_weights, so dataflex.mechanism=reweight "
            "would change nothing; use a loss that multiplies the weights",
            ["vanilla", "gspo", "dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "dro", "cispo"]))
    if "reweight" in mechanisms and loss_mode in WEIGHT_COLLAPSING_LOSSES:
        log.warning("dataflex: policy_loss.loss_mode=%s turns rollout_is_weights into one geometric mean per "
                    "sequence: per-token reweighting degrades to per-sequence weights", loss_mode)
    agg = str(actor.get("loss_agg_mode", "token-mean"))
    if (agg == "seq-mean-token-sum-norm" and actor.get("loss_scale_factor", None) is None
            and runtime.drops_rows_at("on_advantage")):
        raise ConfigError(ConfigIssue(
            "actor_rollout_ref.actor.loss_scale_factor",
            "is null, so loss_agg_mode=seq-mean-token-sum-norm divides by the padded response width of each "
            "micro-batch, which still counts the rows a dataflex method masks at on_advantage: such a drop "
            "would not equal removing the row",
            hint="set it to a constant, e.g. actor_rollout_ref.actor.loss_scale_factor="
                 f"{int(config.data.get('max_response_length', 0) or 0) or '<max_response_length>'}"))
    if "select" in mechanisms and agg.startswith("seq-mean"):
        log.warning("dataflex: loss_agg_mode=%s divides by the fixed ppo_mini_batch_size*n, so every dropped "
                    "sample dilutes the remaining gradient (token-mean renormalises; see docs/verl.md)", agg)
    filter_groups = config.algorithm.get("filter_groups", None)
    if filter_groups is not None and filter_groups.get("enable", False) and runtime.filters_zero_variance():
        log.warning("dataflex: algorithm.filter_groups already evicts zero-variance groups (and refills them); "
                    "a dataflex selector that drops zero-variance groups will find nothing to drop after it")


# ---------------------------------------------------------------------------- batch statistics
def row_metrics(prefix: str, rows: Tensor, rewards: Tensor, lengths: Tensor, groups: Tensor) -> dict[str, float]:
    """Rows, groups, reward and response-length statistics over ``rows`` (bool ``[B]``), from per-row
    ``rewards``, response ``lengths`` and group index ``groups``."""
    n = int(rows.sum())
    count = int(torch.unique(groups[rows]).numel()) if n else 0
    out: dict[str, float] = {f"{prefix}rows": float(n), f"{prefix}groups": float(count)}
    if n == 0:
        return out
    rewards = rewards[rows].double()
    lengths = lengths[rows].double()
    out.update({
        f"{prefix}reward_mean": float(rewards.mean()),
        f"{prefix}reward_std": float(rewards.std()) if n > 1 else 0.0,
        f"{prefix}reward_min": float(rewards.min()),
        f"{prefix}reward_max": float(rewards.max()),
        f"{prefix}response_length_mean": float(lengths.mean()),
    })
    return out


def trained_metrics(trained: Tensor, tokens: Tensor, rewards: Tensor, lengths: Tensor,
                    groups: Tensor) -> dict[str, float]:
    """``dataflex/trained/*``: the rows and tokens the actor update really trains on (``trained``: bool
    ``[B]``; ``tokens``: each row's loss-mask tokens as the actor receives them). verl's ``critic/score/*``
    and ``response_length/*`` still count the rows a method masked."""
    out = row_metrics("dataflex/trained/", trained, rewards, lengths, groups)
    out["dataflex/trained/tokens"] = float(tokens[trained].sum())
    return out


def nested_row_counts(t: Tensor) -> Tensor:
    """Float ``[B]``: the non-zero entries of each row of a jagged nested tensor, without padding it
    (one segment reduction over the flat values)."""
    offsets: Tensor = t.offsets()  # type: ignore[attr-defined]  # a jagged NestedTensor method, not in the stubs
    return torch.segment_reduce(t.values().ne(0).to(torch.float32), "sum", offsets=offsets)


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Pre-selection statistics (verl's own metrics only ever see the kept samples)."""
    out = row_metrics("dataflex/rollout/", batch.valid_rows, batch.rewards, batch.lengths, batch.group_index)
    out["dataflex/rollout/groups"] = float(batch.num_groups)
    if not out["dataflex/rollout/rows"]:
        return out
    if batch.domain_ids is not None and batch.domain_names:
        rows, means = batch.per_domain(batch.rewards)
        for name, count, mean in zip(batch.domain_names, rows.tolist(), means.tolist()):
            out[f"dataflex/rollout/rows/{name}"] = float(count)
            if count:
                out[f"dataflex/rollout/reward_mean/{name}"] = mean
    return out


# ---------------------------------------------------------------------------- mini-batches
def minibatch_blocks(rows: int, mini_batch_size: int, dp_size: int, *, epochs: int = 1, shuffle: bool = False,
                     seed: int = 42) -> Tensor:
    """Long ``[K, mini_batch_size]``: the rows of each mini-batch verl's actor update steps on, in the
    order of the batch it receives (``K`` = ``epochs * rows / mini_batch_size``).

    verl hands DP rank ``r`` the ``r``-th contiguous chunk of the batch, and each rank walks its chunk
    with ``tensordict_utils.make_iterator`` (seed ``seed + r``); mini-batch ``j`` is the ``j``-th
    local batch of every rank together, and its token-mean divides by its loss-mask sum over all ranks.
    The same iterator runs here on row numbers, so shuffled orders come out exactly as verl draws them.
    """
    local, per_rank = rows // dp_size, mini_batch_size // dp_size
    index = TensorDict({"row": torch.arange(local)}, batch_size=local)
    ranks = []
    for rank in range(dp_size):  # one iterator per rank, one entry per mini-batch: never per row
        batches = tu.make_iterator(index, mini_batch_size=per_rank, epochs=epochs, seed=seed + rank,
                                   dataloader_kwargs={"shuffle": shuffle})
        ranks.append(torch.stack([b["row"] for b in batches]) + rank * local)
    return torch.cat(ranks, dim=1)


# ---------------------------------------------------------------------------- the trainer
class DataflexTrainer(PPOTrainer):
    """verl's v1 PPO trainer with the dataflex event bus wired into its step. Not registered itself:
    each mode combines it with one of verl's trainers (``DataflexSyncTrainer(DataflexTrainer,
    PPOTrainerSync)``, ...) and names that trainer's mode in :attr:`verl_mode`."""

    #: The verl trainer mode whose code paths this trainer runs.
    verl_mode = "sync"
    #: Tells :mod:`dataflex_bus.verl.guard` that this trainer reads the ``dataflex`` block.
    dataflex_host = True

    def __init__(self, config: DictConfig) -> None:
        # Build (and strictly validate) the method first: errors reach the driver before any worker starts.
        self.dataflex = Runtime(dataflex_block(config), context=host_context(config))
        check_host_config(config, self.dataflex)
        self.domain_key = self.dataflex.domain_key
        self.domain_sampler: DomainSampler | None = None
        self._skip_update = False
        self._drawn: dict[str, int] = {}
        self._empty_blocks_seen = 0
        self._rewards: dict[str, float] = {}
        super().__init__(config)

    # ------------------------------------------------------------------ verl mode
    def _build_replay_buffer(self):
        # verl branches on the literal mode strings (replay buffer type, forced gen_batch_size=1, TQ
        # snapshots in checkpoints, TQ restore on resume, the trainer.v1.<mode> section): run as the verl
        # mode this trainer extends, never as "dataflex_...", which would select the async paths.
        self.trainer_mode = self.verl_mode
        self.parameter_sync_step = self.config.trainer.v1.get(self.verl_mode, {}).get("parameter_sync_step", 1)
        return super()._build_replay_buffer()

    # ------------------------------------------------------------------ events
    def _step_index(self) -> int:
        """0-based step index given to the bus (verl counts global steps from 1)."""
        return max(self.global_steps - 1, 0)

    def _event_fields(self, event: str) -> set[str]:
        """What to fetch from TransferQueue at ``event``: the fields every event guarantees, those
        verl's advantage step wrote (on_advantage), and what the methods and observers asked for."""
        fields = {*BASE_FIELDS, self.domain_key, *self.dataflex.fields(event)}
        if event == "on_advantage":
            fields |= {"loss_mask", "advantages"}
        return fields

    def _emit(self, event: str, meta: KVBatchMeta,
              extra_fields: Iterable[str] = ()) -> tuple[Decision, Batch, TensorDict]:
        """Read the batch from TQ, emit ``event`` on the bus; returns the decision, the batch and the
        fetched TensorDict (whose nested ``response_mask`` gives the row lengths for writing back)."""
        batch, data = self._read(event, meta, self._event_fields(event) | set(extra_fields))
        if self.dataflex.mixes and batch.domain_ids is None:
            raise BatchFieldError("dataflex mix", self.domain_key,
                                  "the trajectories in TransferQueue carry no domain label; set "
                                  "dataflex.domain_key to a dataset column")
        return self.dataflex.emit(event, batch, self._step_index()), batch, data

    def _read(self, event: str, meta: KVBatchMeta, fields: set[str]) -> tuple[Batch, TensorDict]:
        """``fields`` of every key of ``meta`` from TQ, as a batch and as fetched."""
        data = fetch(meta, fields)
        if len(data.keys()) == 0 or data.batch_size[0] != len(meta.keys):
            raise BatchFieldError("dataflex verl adapter", ",".join(sorted(fields)),
                                  f"TransferQueue returned no rows for {len(meta.keys)} keys at {event}: a field "
                                  "is present on only some keys")
        return to_batch(data, meta.tags, domain_key=self.domain_key), data

    def _balance_batch(self, batch: KVBatchMeta, metrics: dict, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """on_rollout, then verl's padding and sequence balancing on what is left."""
        self._skip_update = False
        batch = self._on_rollout(batch, metrics)
        batch = super()._balance_batch(batch, metrics, *args, **kwargs)
        # What old-log-prob, reference, critic and actor compute will run on: verl pads the kept rows
        # back to a multiple of lcm(dp, ppo_mini_batch_size * n) with synthetic 128-token rows.
        padding = sum(bool(tag.get("is_padding", False)) for tag in batch.tags)
        metrics["dataflex/compute/rows_after_padding"] = float(len(batch))
        metrics["dataflex/compute/padding_rows"] = float(padding)
        metrics["dataflex/compute/tokens_after_padding"] = float(sum(int(tag.get("seq_len", 0)) for tag in batch.tags))
        return batch

    def _on_rollout(self, meta: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        decision, batch, _ = self._emit("on_rollout", meta)
        # Rewards are final here; remembered by key for the trained-only metrics after the advantage.
        self._rewards = dict(zip(meta.keys, batch.rewards.tolist()))
        metrics.update(rollout_metrics(batch))
        metrics.update(decision.metrics)
        action = carry_out_rollout(batch, decision)
        self._skip_update = action.skip_update
        if action.keep is None:
            return meta
        flags = action.keep.tolist()
        kept = list(itertools.compress(meta.keys, flags))
        dropped = [k for k, f in zip(meta.keys, flags) if not f]
        tq.kv_clear(keys=dropped, partition_id=meta.partition_id)
        metrics["dataflex/removed_rows"] = float(action.removed)
        return meta.select_keys(kept)

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage, then on_advantage; returns the meta of our own put (see module doc)."""
        return self._on_advantage(super()._compute_advantage(batch, metrics), metrics)

    def _on_advantage(self, meta: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        rewards = torch.tensor([self._rewards.get(key, 0.0) for key in meta.keys], dtype=torch.float32)
        if not self.dataflex.listens("on_advantage"):
            self._trained_without_listeners(meta, rewards, metrics)
            return meta
        extra = ["rollout_is_weights"] if "rollout_is_weights" in (meta.fields or []) else []
        decision, view, data = self._emit("on_advantage", meta, extra)
        metrics.update(decision.metrics)
        blocks, multiple = self._actor_blocks(len(meta))
        action = carry_out_advantage(view, decision, blocks=blocks, block_multiple=multiple)
        self._empty_block_metrics(action.empty_blocks, action.restored_rows, action.remove, action.skip_update,
                                  metrics)
        self._skip_update = self._skip_update or action.skip_update
        loss_mask = action.fields.get("loss_mask", view.get("loss_mask"))
        tokens = (view["response_mask"] if loss_mask is None else loss_mask).ne(0).sum(dim=1)
        trained = view.valid_rows & (tokens > 0) & (not self._skip_update)
        if action.remove is not None:
            trained &= ~action.remove
        metrics.update(trained_metrics(trained, tokens, rewards, view.lengths, view.group_index))
        if self._skip_update:
            return meta
        if not action.fields:
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

    def _trained_without_listeners(self, meta: KVBatchMeta, rewards: Tensor, metrics: dict) -> None:
        """The trained-only metrics when no method or observer acts at on_advantage: nothing is dropped
        here, so read just the loss mask (its row lengths are the response lengths) and the groups."""
        data = fetch(meta, {"uid", "loss_mask"})
        loss_mask = data["loss_mask"]
        if not loss_mask.is_nested:
            raise BatchFieldError("dataflex verl adapter", "loss_mask", "expected a nested (jagged) tensor")
        tokens = nested_row_counts(loss_mask)
        _, groups = np.unique(np.asarray(labels_of(data["uid"]), dtype=object), return_inverse=True)
        trained = ~padding_flags(meta.tags) & (tokens > 0) & (not self._skip_update)
        metrics["dataflex/empty_minibatches"] = 0.0
        metrics.update(trained_metrics(trained, tokens, rewards, loss_mask.offsets().diff(),
                                       torch.from_numpy(groups.reshape(-1))))

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

    def _empty_block_metrics(self, empty: int, restored: int, remove: Tensor | None, skipped: bool,
                             metrics: dict) -> None:
        metrics["dataflex/empty_minibatches"] = float(empty)
        if not empty:
            return
        metrics["dataflex/restored_rows"] = float(restored)
        removed = 0 if remove is None else int(remove.sum())
        metrics["dataflex/removed_minibatch_rows"] = float(removed)
        self._empty_blocks_seen += 1
        n = self._empty_blocks_seen
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, ... step: visible without flooding the log
            action = ("skipping this step's actor update" if skipped else
                      f"taking {removed} rows out of the update" if removed else
                      f"training {restored} dropped rows again (on_empty=keep_all)")
            log.warning("dataflex: step %d: every row of %d mini-batch(es) was dropped; %s (%d such step(s) so "
                        "far, counted in dataflex/empty_minibatches)", self.global_steps, empty, action, n)

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        metrics["dataflex/skipped_update"] = float(self._skip_update)
        metrics["dataflex/compute/actor_rows"] = 0.0 if self._skip_update else float(len(batch))
        if self._skip_update:
            log.warning("dataflex: step %d kept no sample; skipping the actor update (dataflex.on_empty=skip)",
                        self.global_steps)
            return batch
        return super()._update_actor(batch, metrics)

    def _update_critic(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if self._skip_update:
            return batch
        return super()._update_critic(batch, metrics)

    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        """verl's step, then on_step_end (before fit() checkpoints, so the state includes this step)."""
        self._drawn = {}
        batch = super().step(metrics, timing_raw)
        self._on_step_end(batch, metrics)
        for name, count in self._drawn.items():
            metrics[f"dataflex/drawn/{name}"] = float(count)
        return batch

    def _on_step_end(self, batch: KVBatchMeta, metrics: dict) -> None:
        if self.dataflex.listens("on_step_end"):  # else fetching the step's batch would serve no one
            decision, _, _ = self._emit("on_step_end", batch)
            metrics.update(decision.metrics)

    # ------------------------------------------------------------------ mix
    def _init_dataloader(self) -> None:
        super()._init_dataloader()
        if not self.dataflex.mixes:
            return
        frame = self.train_dataset.dataframe
        if self.domain_key not in frame.column_names:
            raise ConfigError(ConfigIssue("dataflex.domain_key", f"column {self.domain_key!r} is not in the "
                                          "training dataset", frame.column_names))
        seed = self.config.data.get("seed", None)
        self.domain_sampler = DomainSampler(list(frame[self.domain_key]), domains=self.dataflex.configured_domains,
                                            seed=0 if seed is None else int(seed))
        self.dataflex.set_domains(self.domain_sampler.domains)

    def _fetch_one_gen_batch(self) -> TensorDict:
        """One ``gen_batch_size`` chunk of prompts drawn by the current domain probabilities."""
        if self.domain_sampler is None:
            return super()._fetch_one_gen_batch()
        n = self.config.data.get("gen_batch_size", None) or self.config.data.train_batch_size
        probs = sampling_probabilities(self.dataflex.domain_probs, self.domain_sampler.domains)
        rows, picks = self.domain_sampler.draw(n, probs)
        for d, count in enumerate(torch.bincount(picks, minlength=len(self.domain_sampler.domains)).tolist()):
            name = self.domain_sampler.domains[d]
            self._drawn[name] = self._drawn.get(name, 0) + count
        batch_dict = collate_fn([self.train_dataset[i] for i in rows.tolist()])
        batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(n)], dtype=object)
        return tu.get_tensordict(batch_dict)

    # ------------------------------------------------------------------ checkpoints
    def dataflex_state_dict(self) -> dict[str, Any]:
        return {
            "format": 1,
            "dataflex_bus": __version__,
            "global_steps": self.global_steps,
            "runtime": self.dataflex.state_dict(),
            "sampler": self.domain_sampler.state_dict() if self.domain_sampler is not None else None,
        }

    def load_dataflex_state(self, state: Mapping[str, Any]) -> None:
        self.dataflex.load_state_dict(state["runtime"])
        saved = state.get("sampler")
        if (saved is None) != (self.domain_sampler is None):
            raise ConfigError(ConfigIssue("dataflex.mechanism", "the checkpoint and this run disagree on whether "
                                          "prompts are drawn by domain (mix)"))
        if saved is not None and self.domain_sampler is not None:
            self.domain_sampler.load_state_dict(saved)

    def _step_folder(self) -> str:
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")

    def _save_checkpoint(self) -> None:
        # Before verl's save: verl writes latest_checkpointed_iteration.txt last, so a checkpoint the
        # tracker points to always holds our state too.
        folder = self._step_folder()
        os.makedirs(folder, exist_ok=True)
        torch.save(self.dataflex_state_dict(), os.path.join(folder, STATE_FILE))
        super()._save_checkpoint()

    def _resume_folder(self) -> str | None:
        """The folder verl's ``_load_checkpoint`` resumed from (same resolution rules)."""
        trainer = self.config.trainer
        if trainer.resume_mode == "auto":
            root = trainer.default_local_dir
            return find_latest_ckpt_path(root if os.path.isabs(root) else os.path.join(os.getcwd(), root))
        if trainer.resume_mode == "resume_path":
            path = trainer.resume_from_path
            return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        return None

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps <= 0:
            return
        folder = self._resume_folder()
        path = os.path.join(folder, STATE_FILE) if folder else None
        if path is None or not os.path.exists(path):
            log.warning("dataflex: resumed verl at step %d but found no %s in %s; the dataflex method starts "
                        "fresh", self.global_steps, STATE_FILE, folder)
            return
        # Our own file, written by _save_checkpoint: plain containers and tensors (generator state).
        self.load_dataflex_state(torch.load(path, weights_only=False))
        log.info("dataflex: restored method state from %s", path)


class DataflexSyncTrainer(DataflexTrainer, PPOTrainerSync):
    """``dataflex_sync``: verl's synchronous trainer (``sync``) with the dataflex events."""

    verl_mode = "sync"


class DataflexColocateAsyncTrainer(DataflexTrainer, PPOTrainerColocateAsync):
    """``dataflex_colocate_async``: verl's ``colocate_async`` trainer (partial rollout, replicas
    colocated with training) with the dataflex events."""

    verl_mode = "colocate_async"


class DataflexSeparateAsyncTrainer(DataflexTrainer, PPOTrainerSeparateAsync):
    """``dataflex_separate_async``: verl's ``separate_async`` trainer (standalone rollout replicas)
    with the dataflex events."""

    verl_mode = "separate_async"


_BY_VERL_MODE = {cls.verl_mode: cls for cls in (DataflexSyncTrainer, DataflexColocateAsyncTrainer,
                                                 DataflexSeparateAsyncTrainer)}
for _name, _verl_mode in TRAINER_MODES.items():
    register_trainer(_name)(_BY_VERL_MODE[_verl_mode])
