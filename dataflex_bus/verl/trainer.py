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
* ``_next_train_batch`` -> **on_prompts**: a step's first prompts and every refill are pulled in
  ``gen_batch_size`` chunks and pre-filtered (:class:`~dataflex_bus.decision.PromptFill`) until enough
  are kept, so only kept prompts reach the agent loop.
* the replay buffer (:class:`~dataflex_bus.verl.buffer.DataflexReplayBuffer`, when a prompt history is
  kept under ``algorithm.filter_groups`` or ``dataflex.refill`` is set): every finished group enters the
  history before anything is evicted, and under ``dataflex.refill`` the ``on_rollout`` selection decides
  which groups verl evicts and refills.

Prompt ids are ``(data_source, extra_info.index)`` (the ``dataflex.domain_key`` column and the index),
checked unique over the training dataset when the dataloader is built. Plugin state (the per-prompt
history included) is saved as ``global_step_N/dataflex_state.pt`` before verl's checkpoint (whose tracker
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
from omegaconf import DictConfig, OmegaConf, open_dict
from tensordict import TensorDict
from torch import Tensor
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.dataset.rl_dataset import collate_fn

from .. import __version__
from ..batch import Batch
from ..decision import (
    Decision,
    PromptCounts,
    PromptFill,
    carry_out_advantage,
    carry_out_prompts,
    carry_out_rollout,
    kept_groups,
    sampling_probabilities,
)
from ..errors import BatchFieldError, ConfigError, ConfigIssue
from ..history import PromptTable
from ..runtime import Runtime
from .buffer import DATAFLEX_METRIC, DataflexReplayBuffer
from .guard import DATAFLEX_MODE_FOR
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


def build_runtime(config: DictConfig) -> Runtime:
    """The runtime of ``config``'s ``dataflex`` block, validated and checked against the verl config."""
    runtime = Runtime(dataflex_block(config), context=host_context(config))
    check_host_config(config, runtime)
    return runtime


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
    verl_dapo = filter_groups is not None and bool(filter_groups.get("enable", False))
    refill = runtime.refill
    if refill is not None:
        if verl_dapo:
            raise ConfigError(ConfigIssue("dataflex.refill", "algorithm.filter_groups already refills zero-variance "
                                          "groups inside verl's replay buffer; use one of the two"))
        if refill.policy != "credit2":
            raise ConfigError(ConfigIssue("dataflex.refill.policy", f"under verl the replay buffer refills two prompts "
                                          f"per evicted group (credit2); {refill.policy!r} cannot be carried out "
                                          "there", ["credit2"]))
        if refill.on_exhaust == "train_short":
            raise ConfigError(ConfigIssue("dataflex.refill.on_exhaust", "verl's sync replay buffer always trains "
                                          "train_batch_size groups; it cannot train short",
                                          ["raise", "pad_with_filtered"]))
    if verl_dapo and runtime.filters_zero_variance():
        log.warning("dataflex: algorithm.filter_groups already evicts zero-variance groups (and refills them); "
                    "a dataflex selector that drops zero-variance groups will find nothing to drop after it")


def check_domain_column(frame: Any, domain_key: str) -> None:
    """Refuse a training dataset without the ``dataflex.domain_key`` column, listing the columns it has."""
    if domain_key not in frame.column_names:
        raise ConfigError(ConfigIssue("dataflex.domain_key", f"column {domain_key!r} is not in the training "
                                      "dataset", list(frame.column_names)))


def dataset_prompt_table(frame: Any, domain_key: str, prompt_key: str = "prompt") -> PromptTable:
    """The training dataset's prompt ids ``(domain_key column, extra_info.index)``, checked once.

    verl's ``RLHFDataset`` gives a row without ``extra_info.index`` the index 0 and each fetch a fresh
    ``uid``, so neither identifies a prompt across steps: every row must carry its own index. Rows
    sharing an id are accepted only when their prompts are identical (a repeated prompt is one prompt).
    """
    columns = list(frame.column_names)
    check_domain_column(frame, domain_key)
    n = len(frame)
    infos = frame["extra_info"] if "extra_info" in columns else [None] * n
    missing = [i for i, info in enumerate(infos) if not isinstance(info, Mapping) or info.get("index") is None]
    if missing:
        raise ConfigError(ConfigIssue(
            "extra_info.index", f"{len(missing)} of {n} training rows (the first: row {missing[0]}) have no "
            "extra_info.index; verl gives them all index 0, so their per-prompt histories would merge. Set a "
            "unique extra_info.index per prompt of a data source"))
    indices = [info["index"] for info in infos if isinstance(info, Mapping)]
    try:
        rows = torch.tensor([int(i) for i in indices], dtype=torch.long)
    except (TypeError, ValueError) as exc:
        raise ConfigError(ConfigIssue("extra_info.index", f"must be an integer in every training row ({exc})")) \
            from None
    labels = [str(x) for x in frame[domain_key]]
    names = sorted(set(labels))
    position = {name: i for i, name in enumerate(names)}
    ids = torch.tensor([position[x] for x in labels], dtype=torch.long)
    keys = ids * (rows.max() + 1) + rows
    uniq, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    if bool((counts > 1).any()):
        repeated = torch.nonzero(counts[inverse] > 1).flatten().tolist()
        prompts = frame[prompt_key] if prompt_key in columns else [None] * n
        first: dict[int, Any] = {}
        for i in repeated:  # only rows whose id repeats: compare their prompts
            key = int(keys[i])
            if key in first and first[key] != prompts[i]:
                raise ConfigError(ConfigIssue(
                    "extra_info.index", f"rows with data source {labels[i]!r} and extra_info.index={int(rows[i])} "
                    "hold different prompts; set a unique extra_info.index per prompt of a data source"))
            first.setdefault(key, prompts[i])
        firsts = torch.full((uniq.numel(),), n, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(n), "amin")
        ids, rows = ids[firsts], rows[firsts]
    return PromptTable(names, ids, rows, column="extra_info.index")


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
        self.dataflex = build_runtime(config)
        self.domain_key = self.dataflex.domain_key
        self.domain_sampler: DomainSampler | None = None
        self._skip_update = False
        self._drawn: dict[str, int] = {}
        self._prompt_counts = PromptCounts()
        #: Metrics of events emitted outside a step method's ``metrics`` dict (prompt fetches, the buffer).
        self._event_metrics: dict[str, float] = {}
        self._refill_dispatched = 0
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
        buffer = super()._build_replay_buffer()
        refill = self.dataflex.refill is not None
        if refill and type(buffer) is not ReplayBuffer:
            raise ConfigError(ConfigIssue(
                "dataflex.refill", f"refill runs through verl's synchronous replay buffer; trainer mode "
                f"{self.verl_mode!r} uses {type(buffer).__name__}", ["trainer.v1.trainer_mode=dataflex_sync"]))
        if type(buffer) is not ReplayBuffer or not (refill or (self.dataflex.keeps_history
                                                               and buffer.filter_groups_metric is not None)):
            return buffer
        if refill:
            buffer.gen_batch_size = 1  # exact refills, as verl sets for its own DAPO
            buffer.train_batch_size = self.config.data.train_batch_size
            buffer.refill_fn = self._refill
        return DataflexReplayBuffer.like(buffer, on_finished=self._on_finished,
                                         filter_groups_metric=DATAFLEX_METRIC if refill else None)

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

    def _read(self, event: str, meta: KVBatchMeta, extra_fields: Iterable[str] = (), *,
              emits: bool = True) -> tuple[Batch, TensorDict]:
        """The batch of ``meta`` at ``event`` from TQ, and the fetched TensorDict (whose nested
        ``response_mask`` gives the row lengths for writing back). ``emits=False``: no event is emitted on
        the batch (metrics, history), so only the base fields are fetched, not what the methods read."""
        fields = (self._event_fields(event) if emits else {*BASE_FIELDS, self.domain_key}) | set(extra_fields)
        data = fetch(meta, fields)
        if len(data.keys()) == 0 or data.batch_size[0] != len(meta.keys):
            raise BatchFieldError("dataflex verl adapter", ",".join(sorted(fields)),
                                  f"TransferQueue returned no rows for {len(meta.keys)} keys at {event}: a field "
                                  "is present on only some keys")
        batch = to_batch(data, meta.tags, domain_key=self.domain_key)
        if self.dataflex.mixes and batch.domain_ids is None:
            raise BatchFieldError("dataflex mix", self.domain_key,
                                  "the trajectories in TransferQueue carry no domain label; set "
                                  "dataflex.domain_key to a dataset column")
        return batch, data

    def _emit(self, event: str, meta: KVBatchMeta,
              extra_fields: Iterable[str] = ()) -> tuple[Decision, Batch, TensorDict]:
        """Read the batch from TQ, emit ``event`` on the bus; returns the decision, the batch and the
        fetched TensorDict."""
        batch, data = self._read(event, meta, extra_fields)
        return self.dataflex.emit(event, batch, self._step_index()), batch, data

    def _balance_batch(self, batch: KVBatchMeta, metrics: dict, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """on_rollout, then verl's padding and sequence balancing on what is left."""
        self._skip_update = False
        batch = self._on_rollout(batch, metrics)
        batch = super()._balance_batch(batch, metrics, *args, **kwargs)
        # What old-log-prob, reference, critic and actor compute will run on: verl pads the kept rows
        # back to a multiple of lcm(dp, ppo_mini_batch_size * n) with synthetic 128-token rows.
        padding = int(padding_flags(batch.tags).sum())
        metrics["dataflex/compute/rows_after_padding"] = float(len(batch))
        metrics["dataflex/compute/padding_rows"] = float(padding)
        metrics["dataflex/compute/tokens_after_padding"] = float(sum(int(tag.get("seq_len", 0)) for tag in batch.tags))
        return batch

    @property
    def _buffer_sees_rollouts(self) -> bool:
        """The replay buffer hands every finished group to :meth:`_on_finished` (history, refill)."""
        return isinstance(getattr(self, "replay_buffer", None), DataflexReplayBuffer)

    def _on_rollout(self, meta: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        metrics.update(self._event_metrics)
        self._event_metrics = {}
        # With refill, the buffer already ran on_rollout (and the history) on every finished group and
        # evicted what it dropped: here only the metrics are left.
        refill = self.dataflex.refill is not None
        history_here = not refill and self.dataflex.keeps_history and not self._buffer_sees_rollouts
        batch, data = self._read("on_rollout", meta, ["index"] if history_here else [], emits=not refill)
        # Rewards are final here; remembered by key for the trained-only metrics after the advantage.
        self._rewards = dict(zip(meta.keys, batch.rewards.tolist()))
        if refill:
            metrics.update(rollout_metrics(batch))
            return meta
        if history_here:
            batch, recorded = self._record_history(batch, data)
            metrics.update(recorded)
        decision = self.dataflex.emit("on_rollout", batch, self._step_index())
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

    # ------------------------------------------------------------------ prompt ids, selection, history
    def _prompt_index(self, data: TensorDict, batch: Batch) -> torch.Tensor:
        """Dense prompt index per trajectory, from its ``data_source`` and ``index`` (extra_info.index);
        0 on padding rows, which are never looked up."""
        table = self.dataflex.prompt_table
        assert table is not None
        valid = batch.valid_rows
        flags = valid.tolist()
        names = list(itertools.compress(labels_of(data[self.domain_key]), flags))
        rows = torch.tensor([int(i) for i in itertools.compress(labels_of(data["index"]), flags)], dtype=torch.long)
        out = torch.zeros(len(flags), dtype=torch.long)
        out[valid] = table.lookup_labels(names, rows)
        return out

    def _record_history(self, batch: Batch, data: TensorDict) -> tuple[Batch, dict[str, float]]:
        """The batch with its prompt ids, and the history's metrics after recording its groups."""
        batch = batch.with_fields(prompt_index=self._prompt_index(data, batch))
        return batch, self.dataflex.record_rollouts(batch, self._step_index())

    def _on_finished(self, keys: list[str], tags: list[dict[str, Any]], partition: str) -> set[str] | None:
        """Newly finished groups, seen by the replay buffer before any eviction: into the history, and
        under ``dataflex.refill`` through on_rollout (the uids it drops are evicted and refilled)."""
        if not keys:
            return None
        meta = KVBatchMeta(partition_id=partition, keys=list(keys), tags=list(tags))
        refill = self.dataflex.refill is not None
        batch, data = self._read("on_rollout", meta, ["index"] if self.dataflex.keeps_history else [], emits=refill)
        step = self._step_index()
        if self.dataflex.keeps_history:
            batch, recorded = self._record_history(batch, data)
            for key, value in recorded.items():
                self._event_metrics[key] = self._event_metrics.get(key, 0.0) + value
        if not refill:
            return None
        decision = self.dataflex.emit("on_rollout", batch, step)
        self._event_metrics.update(decision.metrics)
        keep = kept_groups(batch, decision)
        rows = keep[batch.group_index.clamp_min(0)] | ~batch.valid_rows
        dropped = {k.split("_")[0] for k, kept in zip(keys, rows.tolist()) if not kept}
        return self._exhausted(dropped) if dropped and self._refill_spent() else dropped

    def _refill(self, num_prompts: int) -> int:
        """verl's refill (two prompts per evicted group), counted against ``dataflex.refill.max_rounds``."""
        self._refill_dispatched += num_prompts
        return self._add_prompts_to_generate(num_prompts)

    def _refill_spent(self) -> bool:
        refill = self.dataflex.refill
        assert refill is not None
        # Rounds in units of train_batch_size dispatched prompts; the step's first batch is round 1.
        return refill.max_rounds > 0 and self._refill_dispatched >= (refill.max_rounds - 1) * int(
            self.config.data.train_batch_size)

    def _exhausted(self, dropped: set[str]) -> set[str]:
        refill = self.dataflex.refill
        assert refill is not None
        if refill.on_exhaust == "raise":
            from ..errors import DataflexError

            raise DataflexError(f"dataflex.refill: {refill.max_rounds} rounds of {self.config.data.train_batch_size} "
                                f"prompts were generated at step {self.global_steps} and the selection still drops "
                                "groups the batch needs; raise dataflex.refill.max_rounds or set "
                                "dataflex.refill.on_exhaust=pad_with_filtered")
        self._event_metrics["dataflex/refill/padded_groups"] = (
            self._event_metrics.get("dataflex/refill/padded_groups", 0.0) + len(dropped))
        return set()  # pad_with_filtered: what the selection drops from now on trains

    def _candidate_ids(self, chunk: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Domain ids (into the prompt table's domains) and ``extra_info.index`` of fetched prompts."""
        table = self.dataflex.prompt_table
        assert table is not None
        position = {name: i for i, name in enumerate(table.domains)}
        labels = [str(x) for x in labels_of(chunk[self.domain_key])]
        unknown = sorted(set(labels) - set(position))
        if unknown:
            raise BatchFieldError("dataflex prompt ids", self.domain_key,
                                  f"domain {unknown[0]!r} is not in the training dataset's prompt table")
        ids = torch.tensor([position[label] for label in labels], dtype=torch.long)
        rows = torch.tensor([int(x) for x in labels_of(chunk["index"])], dtype=torch.long)
        return ids, rows

    def _next_train_batch(self, num_prompts: int | None = None) -> TensorDict:
        """verl's prompt fetch (a step's first batch and every refill), through on_prompts when a method
        selects prompts: chunks are pulled and pre-filtered until ``num_prompts`` are kept."""
        if not self.dataflex.selects_prompts:
            return super()._next_train_batch(num_prompts)
        train_batch_size = self.config.data.train_batch_size
        target = num_prompts if num_prompts is not None else train_batch_size
        gen = self.config.data.get("gen_batch_size", None) or train_batch_size
        if target <= 0 or target % gen != 0:
            raise ValueError(f"num_prompts ({target}) must be a positive multiple of gen_batch_size ({gen}); it is "
                             "submitted in whole gen_batch_size dataloader fetches.")
        table = self.dataflex.prompt_table
        assert table is not None
        fill = PromptFill(target, max_oversample=self.dataflex.max_oversample, chunk=gen,
                          on_empty=self.dataflex.prompt_policy, who="dataflex prompt selection")
        chunks: list[TensorDict] = []
        step = self._step_index()
        while (n := fill.request()) > 0:
            drawn = [self._fetch_one_gen_batch() for _ in range(n // gen)]
            candidates = drawn[0] if len(drawn) == 1 else tu.concat_tensordict(drawn)
            domain_ids, rows = self._candidate_ids(candidates)
            batch = self.dataflex.prompt_candidates(domain_ids, rows, table.domains)
            decision = self.dataflex.emit("on_prompts", batch, step)
            self._event_metrics.update(decision.metrics)
            fill.add(carry_out_prompts(batch, decision), batch)
            chunks.append(candidates)
        chosen = fill.chosen()
        self._prompt_counts += fill.counts
        everything = chunks[0] if len(chunks) == 1 else tu.concat_tensordict(chunks)
        out = tu.index_select_tensor_dict(everything, chosen)
        tu.assign_non_tensor_data(out, "global_steps", self.global_steps)
        return out

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
        self._prompt_counts = PromptCounts()
        self._refill_dispatched = 0
        batch = super().step(metrics, timing_raw)
        metrics.update(self._event_metrics)
        self._event_metrics = {}
        if self.dataflex.selects_prompts:
            metrics.update(self._prompt_counts.metrics())
        if self.dataflex.refill is not None:
            metrics["dataflex/refill/dispatched_prompts"] = float(self._refill_dispatched)
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
        if self.dataflex.refill is not None:
            # Exact refills need single-prompt fetches, as verl sets for its own algorithm.filter_groups.
            with open_dict(self.config):
                self.config.data.gen_batch_size = 1
        super()._init_dataloader()
        if self.dataflex.needs_prompt_ids:
            self.dataflex.set_prompts(dataset_prompt_table(self.train_dataset.dataframe, self.domain_key,
                                                           self.config.data.get("prompt_key", "prompt")))
        if not self.dataflex.mixes:
            return
        frame = self.train_dataset.dataframe
        check_domain_column(frame, self.domain_key)
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


for _cls in (DataflexSyncTrainer, DataflexColocateAsyncTrainer, DataflexSeparateAsyncTrainer):
    register_trainer(DATAFLEX_MODE_FOR[_cls.verl_mode])(_cls)
