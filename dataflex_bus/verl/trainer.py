"""The dataflex trainer modes for verl 0.9.1 (``trainer.v1.trainer_mode=dataflex_sync``, and
``dataflex_colocate_async`` / ``dataflex_separate_async`` for verl's asynchronous trainers).

:class:`DataflexTrainer` is verl's host adapter: it moves tensors between TransferQueue and
:class:`~dataflex_bus.Batch` and calls the host kit's step drivers (:mod:`dataflex_bus.steps`) at single-method
hook points that all of verl's v1 trainers share (verl 0.9.1, ``verl/trainer/ppo/v1/trainer_base.py``:
``PPOTrainer._step_once`` is the one step skeleton, and neither async trainer overrides these hooks); each
mode is that class on top of verl's own trainer:

* ``_next_train_batch`` -> **prompts** (``Step.prompts``): a step's first prompts and every refill are
  pulled in ``gen_batch_size`` chunks and, when a method selects prompts, put through ``on_prompts`` until
  enough are kept, so only kept prompts reach the agent loop.
* ``_fetch_one_gen_batch`` -> **mix**: prompts for every generation batch and every refill are drawn by
  the published domain probabilities (:class:`~dataflex_bus.sampler.DomainSampler`).
* ``_balance_batch`` -> **on_rollout** (``Generation.add``): rewards are in TransferQueue, nothing else is
  computed yet. Dropped groups are removed from the batch (``KVBatchMeta.select_keys``) and from TQ
  (``kv_clear``) *before* verl pads the batch, so old-log-prob, reference, critic and actor compute is not
  spent on them.
* the replay buffer (:class:`~dataflex_bus.verl.buffer.DataflexReplayBuffer`): under ``dataflex.refill``
  its ``sample`` runs the kit's generation rounds (every refill policy: each round is dispatched, waited
  for, put through ``on_rollout``; the kit's fill decides the next round and which groups train); under
  verl's own ``algorithm.filter_groups`` it shows every finished group to the kit (counters, prompt
  history) before verl evicts it.
* ``_compute_advantage`` -> **on_advantage** (``Step.advantage``): weights are multiplied into any
  ``rollout_is_weights`` verl wrote, sample-level drops zero ``response_mask``, ``loss_mask`` and
  ``advantages``, subset selectors rewrite ``advantages``; written for every key, padding included, and the
  meta returned by *our* ``kv_batch_put`` is passed on, so the actor's worker really receives the fields. A
  mini-batch whose every row was dropped is handled by ``on_empty``
  (:func:`~dataflex_bus.verl.blocks.minibatch_blocks`).
* ``step`` -> **on_step_end** (``Step.end``): before ``fit`` saves the step's checkpoint, so mixer/bandit
  updates are in it; the step's batch is read from TQ only when a method or observer listens there.
* replay (mechanism ``replay``, ``dataflex_sync``): ``_next_train_batch`` and ``_step_once`` ask the kit how many
  prompts the step generates (``ReplayPart.fresh_prompts``); after the on_rollout removal ``_balance_batch`` writes the
  stored rows the kit replays (``ReplayPart.replay``) into TransferQueue under new keys, with their tags and every field
  they were generated with (:mod:`dataflex_bus.verl.replay`), and a ``uid`` per the advantage mode, so verl's own
  old-log-prob, reference, rollout-correction and advantage passes see them; at on_advantage the rows the method
  marks are read back from TQ into the kit's store (``ReplayPart.store``).

Prompt ids are ``(data_source, extra_info.index)``, checked unique when the dataloader is built. Plugin
state is saved beside verl's checkpoints (:mod:`~dataflex_bus.verl.state`). Each mode
sets ``self.trainer_mode`` to the verl mode it runs (``sync``, ``colocate_async``, ``separate_async``),
because verl branches on those literal strings (replay buffer type, forced ``gen_batch_size=1``, TQ
snapshots in checkpoints, the ``trainer.v1.<mode>`` section); any other string silently selects the async
paths.

The generation rounds and the replay buffer (:mod:`~dataflex_bus.verl.rounds`), the replay writes
(:mod:`~dataflex_bus.verl.replay`) and the on_advantage carry-out (:mod:`~dataflex_bus.verl.advantage`) are mixins
of :class:`DataflexTrainer`, in their own modules; this one holds the hook points and the modes.

The modes register themselves as the last statements of this module, so a failing import never leaves
a half-working registration behind (see :mod:`dataflex_bus.verl.entry`).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf, open_dict
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn

from ..kit import (
    Batch,
    BatchFieldError,
    Candidates,
    DomainSampler,
    ReplayPart,
    ReplayRun,
    Runtime,
    Step,
    StepKit,
    allocator,
    domain_labels,
    prepare_prompts,
)
from . import state
from .advantage import AdvantageCarryOut
from .guard import DATAFLEX_MODE_FOR
from .host import describe
from .prompts import ROW_TABLE_PARTS, candidate_ids, dataset_prompt_table, training_frame
from .replay import ReplayWrites, generated_fields
from .rounds import ROLLOUT_N, GenerationRounds
from .sessions import later_outputs, refuse_multi_output
from .tqbatch import fetch, labels_of, padding_flags, prompt_tokens, to_batch

log = logging.getLogger("dataflex_bus")

#: File written into every ``global_step_N`` checkpoint folder (:mod:`~dataflex_bus.verl.state`).
STATE_FILE = state.STATE_FILE
#: Fields every event reads, whatever the method: labels, rewards and the response mask.
BASE_FIELDS = ("uid", "response_mask", "rm_scores")


def dataflex_block(config: DictConfig | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``dataflex`` block of a verl config as a plain dict (``None`` when absent)."""
    block = config.get("dataflex", None)
    if block is None:
        return None
    if OmegaConf.is_config(block):
        return OmegaConf.to_container(block, resolve=True)  # type: ignore[return-value]
    return dict(block)


def build_runtime(config: DictConfig) -> Runtime:
    """The runtime of ``config``'s ``dataflex`` block, validated against verl's host description of it."""
    return Runtime(dataflex_block(config), host=describe(config))


# ---------------------------------------------------------------------------- the trainer
class DataflexTrainer(GenerationRounds, ReplayWrites, AdvantageCarryOut, PPOTrainer):
    """verl's v1 PPO trainer with the dataflex event bus wired into its step. Not registered itself:
    each mode combines it with one of verl's trainers (``DataflexSyncTrainer(DataflexTrainer,
    PPOTrainerSync)``, ...) and names that trainer's mode in :attr:`verl_mode`. Its generation rounds and
    replay buffer (:mod:`~dataflex_bus.verl.rounds`), replay writes (:mod:`~dataflex_bus.verl.replay`) and
    on_advantage carry-out (:mod:`~dataflex_bus.verl.advantage`) are mixins, before ``PPOTrainer`` in its bases."""

    #: The verl trainer mode whose code paths this trainer runs.
    verl_mode = "sync"
    #: Tells :mod:`dataflex_bus.verl.guard` that this trainer reads the ``dataflex`` block.
    dataflex_host = True

    def __init__(self, config: DictConfig) -> None:
        # Build (and strictly validate) the method first: errors reach the driver before any worker starts.
        self.dataflex = build_runtime(config)
        self.kit = StepKit(self.dataflex)
        self._step: Step | None = None
        self.domain_key = self.dataflex.domain_key
        self.domain_sampler: DomainSampler | None = None
        self._skip_update = False
        self._rounds_skip_update = False  # the generation rounds' outcome (an allocation's on_empty=skip)
        self._drawn: dict[str, int] = {}
        self._refill_dispatched = 0
        #: Prompt uids submitted for generation since the last round began (refill rounds).
        self._dispatched: list[str] = []
        #: The step's fetched prompt batches, and where each prompt uid sits in them (continuation rounds).
        self._fetched: list[TensorDict] = []
        self._fetched_at: dict[str, tuple[int, int]] = {}
        self._empty_blocks_seen = 0
        self._rewards: dict[str, float] = {}
        #: Replay: the step's fresh rows after the on_rollout removal, the keys of its replayed rows (their index
        #: in the kit's replay) and the fields its trajectories were generated with.
        self._fresh: Batch | None = None
        self._replay_rows: dict[str, int] = {}
        self._generated_fields: list[str] = []
        super().__init__(config)

    # ------------------------------------------------------------------ events
    def _step_index(self) -> int:
        """0-based step index given to the bus (verl counts global steps from 1)."""
        return max(self.global_steps - 1, 0)

    def _current_step(self) -> Step:
        """The host kit's step being run; begun lazily, since asynchronous modes fetch the next step's
        prompts while the current one trains."""
        if self._step is None:
            self._step = self.kit.begin(self._step_index())
        return self._step

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
        the batch (counters, history), so only the base fields are fetched, not what the methods read."""
        fields = (self._event_fields(event) if emits else {*BASE_FIELDS, self.domain_key}) | set(extra_fields)
        if self.dataflex.pipeline is not None and later_outputs(meta.keys):
            names = fetch(meta, ["agent_name"]).get("agent_name", None)
            refuse_multi_output(meta.keys, [] if names is None else labels_of(names),
                                self.config.actor_rollout_ref.rollout.get("agent", {}).get("default_agent_loop"))
        data = fetch(meta, fields)
        if len(data.keys()) == 0 or data.batch_size[0] != len(meta.keys):
            raise BatchFieldError("dataflex verl adapter", ",".join(sorted(fields)),
                                  f"TransferQueue returned no rows for {len(meta.keys)} keys at {event}: a field "
                                  "is present on only some keys")
        batch = to_batch(data, meta.tags, domain_key=self.domain_key)
        if self.dataflex.plan.samples_domains and batch.domain_ids is None:
            raise BatchFieldError("dataflex mix", self.domain_key,
                                  "the trajectories in TransferQueue carry no domain label; set "
                                  "dataflex.domain_key to a dataset column")
        return batch, data

    def _rollouts(self, meta: KVBatchMeta, *, emits: bool) -> Batch:
        """The rollouts of ``meta`` as the on_rollout batch, with prompt ids when the history is kept."""
        ids = bool(self.dataflex.plan.reads_history or self.dataflex.plan.replays)
        batch, data = self._read("on_rollout", meta, ["index"] if ids else [], emits=emits)
        if ids:
            batch = batch.with_fields(prompt_index=self._prompt_index(data, batch))
        return batch

    def _balance_batch(self, batch: KVBatchMeta, metrics: dict, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """on_rollout, then verl's padding and sequence balancing on what is left."""
        self._skip_update = False
        self._replay_rows = {}
        if self.dataflex.plan.replays:
            self._generated_fields = generated_fields(batch)
        batch = self._on_rollout(batch)
        if self.dataflex.plan.replays and not self._skip_update:
            batch = self._add_replayed(batch)
        batch = super()._balance_batch(batch, metrics, *args, **kwargs)
        # What old-log-prob, reference, critic and actor compute will run on: verl pads the kept rows
        # back to a multiple of lcm(dp, ppo_mini_batch_size * n) with synthetic 128-token rows.
        padding = int(padding_flags(batch.tags).sum())
        metrics["dataflex/compute/rows_after_padding"] = float(len(batch))
        metrics["dataflex/compute/padding_rows"] = float(padding)
        metrics["dataflex/compute/tokens_after_padding"] = float(sum(int(tag.get("seq_len", 0)) for tag in batch.tags))
        return batch

    def _on_rollout(self, meta: KVBatchMeta) -> KVBatchMeta:
        step = self._current_step()
        if self._runs_rounds:
            # The buffer ran the generation rounds (on_rollout, history, counters) and evicted what the fill
            # does not train: only the rewards are left to remember, for the trained-only metrics.
            batch, _ = self._read("on_rollout", meta, emits=False)
            self._rewards = dict(zip(meta.keys, batch.rewards.tolist()))
            self._skip_update = self._rounds_skip_update
            return meta
        gen = step.generation(int(self.config.data.train_batch_size))
        counted = self._buffer_counts_rollouts
        batch = self._rollouts(meta, emits=True) if not counted else self._read("on_rollout", meta)[0]
        # Rewards are final here; remembered by key for the trained-only metrics after the advantage.
        self._rewards = dict(zip(meta.keys, batch.rewards.tolist()))
        gen.add(batch, counted=counted, prompt_tokens=prompt_tokens(meta.tags))
        outcome = gen.finish()
        self._skip_update = outcome.skip_update
        keep = outcome.keeps[0]
        self._fresh = batch if keep is None else batch.select(keep)
        if keep is None:
            return meta
        flags = keep.tolist()
        kept = list(itertools.compress(meta.keys, flags))
        dropped = [k for k, f in zip(meta.keys, flags) if not f]
        tq.kv_clear(keys=dropped, partition_id=meta.partition_id)
        return meta.select_keys(kept)

    # ------------------------------------------------------------------ replay
    def _fresh_prompts(self, target: int) -> int:
        """How many of ``target`` prompts the step generates (the replay fills the rest)."""
        replay = ReplayPart.of(self._current_step())
        return replay.fresh_prompts(target) if replay is not None else target

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        # A replay method may fill part of the step from its buffer: the replay buffer then waits for fewer groups.
        if self.dataflex.plan.replays:
            sample_batch_size = self._fresh_prompts(sample_batch_size)
        return super()._step_once(metrics, timing_raw, sample_batch_size)

    # ------------------------------------------------------------------ prompt ids and selection
    def _prompt_index(self, data: TensorDict, batch: Batch) -> torch.Tensor:
        """Dense prompt index per trajectory, from its ``data_source`` and ``index`` (extra_info.index);
        0 on padding rows, which are never looked up."""
        valid = batch.valid_rows
        flags = valid.tolist()
        names = list(itertools.compress(labels_of(data[self.domain_key]), flags))
        rows = torch.tensor([int(i) for i in itertools.compress(labels_of(data["index"]), flags)], dtype=torch.long)
        out = torch.zeros(len(flags), dtype=torch.long)
        out[valid] = self.dataflex.prompt_index(names, rows)
        return out

    def _candidates(self, n: int, gen: int) -> Candidates[TensorDict]:
        """``n`` prompts (``n / gen`` dataloader fetches) with their prompt ids."""
        table = self.dataflex.prompt_table
        assert table is not None
        drawn = [self._fetch_one_gen_batch() for _ in range(n // gen)]
        chunk = drawn[0] if len(drawn) == 1 else tu.concat_tensordict(drawn)
        return Candidates(chunk, *candidate_ids(table, chunk, self.domain_key))

    def _next_train_batch(self, num_prompts: int | None = None) -> TensorDict:
        """verl's prompt fetch (a step's first batch and every refill), through the kit's prompt driver: when a
        method selects prompts, chunks are pulled and pre-filtered through on_prompts until ``num_prompts`` are
        kept; otherwise verl's own fetch, counted."""
        train_batch_size = self.config.data.train_batch_size
        target = num_prompts if num_prompts is not None else train_batch_size
        if num_prompts is None and self.dataflex.plan.replays:
            target = self._fresh_prompts(target)
        if not self.dataflex.plan.before_generation:
            fetch = super()._next_train_batch
            return self._remember(self._current_step().prompts(target, lambda n: Candidates(fetch(n))).draws[0])
        gen = self.config.data.get("gen_batch_size", None) or train_batch_size
        if target <= 0 or target % gen != 0:
            raise ValueError(f"num_prompts ({target}) must be a positive multiple of gen_batch_size ({gen}); it is "
                             "submitted in whole gen_batch_size dataloader fetches.")
        chosen = self._current_step().prompts(target, lambda n: self._candidates(n, gen), chunk=gen)
        everything = chosen.draws[0] if len(chosen.draws) == 1 else tu.concat_tensordict(chosen.draws)
        out = tu.index_select_tensor_dict(everything, chosen.index)
        tu.assign_non_tensor_data(out, "global_steps", self.global_steps)
        if chosen.counts is not None:
            # verl's v1 agent loop reads a per-prompt __rollout_n__ in place of rollout.n (agent_loop_tq.py
            # _run_prompt); candidates allocated 0 rollouts were left out above, so they take no prompt slot.
            tu.assign_non_tensor_stack(out, ROLLOUT_N, [int(c) for c in chosen.counts.tolist()])
        return self._remember(out)

    def _remember(self, batch: TensorDict) -> TensorDict:
        """Keep the step's fetched prompts by uid when a continuation round may ask for more of them."""
        if allocator(self.dataflex, "on_rollout") is not None:
            chunk = len(self._fetched)
            self._fetched.append(batch)
            self._fetched_at.update((str(u), (chunk, i)) for i, u in enumerate(labels_of(batch["uid"])))
        return batch

    # ------------------------------------------------------------------ advantage and update
    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage, then on_advantage; returns the meta of our own put (see module doc)."""
        return self._on_advantage(super()._compute_advantage(batch, metrics))

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        metrics["dataflex/compute/actor_rows"] = 0.0 if self._skip_update else float(len(batch))
        if self._skip_update:
            self._current_step().skipped()
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
        self._current_step()
        self._drawn = {}
        self._refill_dispatched = 0
        self._dispatched = []
        self._fetched, self._fetched_at = [], {}
        batch = super().step(metrics, timing_raw)
        if self.dataflex.refill is not None:
            metrics["dataflex/refill/dispatched_prompts"] = float(self._refill_dispatched)
        metrics.update(self._end_step(batch))
        for name, count in self._drawn.items():
            metrics[f"dataflex/drawn/{name}"] = float(count)
        return batch

    def _end_step(self, batch: KVBatchMeta) -> dict[str, float]:
        """on_step_end, reading the step's rows only for someone who listens there (the history's step
        closes anyway); returns the kit's metrics of the step."""
        view = self._read("on_step_end", batch)[0] if self.dataflex.listens("on_step_end") else None
        out = self._current_step().end(view)
        self._step = None
        return out

    # ------------------------------------------------------------------ mix
    def _init_dataloader(self) -> None:
        run = ReplayRun.of(self.dataflex)
        replay = None if run is None else run.settings
        if self.dataflex.refill is not None or (replay is not None and replay.fresh_fraction < 1.0):
            # Exact refills need single-prompt fetches, as verl sets for its own algorithm.filter_groups; so does
            # a step that generates only its fresh share (whatever the buffer cannot fill).
            with open_dict(self.config):
                self.config.data.gen_batch_size = 1
        super()._init_dataloader()
        plan = self.dataflex.plan
        # Any dataset verl accepts runs with no block; a block drawing prompts by row reads its table of rows.
        frame = training_frame(self.train_dataset, plan.reasons(*ROW_TABLE_PARTS), self.config.data.get("custom_cls"))
        seed = self.config.data.get("seed", None)
        labels = domain_labels(frame, self.domain_key, required=True) if plan.samples_domains else None
        self.domain_sampler = prepare_prompts(
            self.dataflex, lambda: dataset_prompt_table(frame, self.domain_key, self.config.data.get("prompt_key",
                                                                                                   "prompt")),
            labels=labels, seed=0 if seed is None else int(seed))

    def _fetch_one_gen_batch(self) -> TensorDict:
        """One ``gen_batch_size`` chunk of prompts drawn by the current domain probabilities."""
        if self.domain_sampler is None:
            return super()._fetch_one_gen_batch()
        n = self.config.data.get("gen_batch_size", None) or self.config.data.train_batch_size
        probs = self._current_step().domain_probabilities(self.domain_sampler.domains)
        rows, picks = self.domain_sampler.draw(n, probs)
        for d, count in enumerate(torch.bincount(picks, minlength=len(self.domain_sampler.domains)).tolist()):
            name = self.domain_sampler.domains[d]
            self._drawn[name] = self._drawn.get(name, 0) + count
        batch_dict = collate_fn([self.train_dataset[i] for i in rows.tolist()])
        batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(n)], dtype=object)
        return tu.get_tensordict(batch_dict)

    # ------------------------------------------------------------------ checkpoints (state.py)
    def dataflex_state_dict(self) -> dict[str, Any]:
        return state.state_dict(self)

    def load_dataflex_state(self, saved: Mapping[str, Any], source: str = STATE_FILE) -> None:
        state.load(self, saved, source)

    def _save_checkpoint(self) -> None:
        # Before verl's save: verl writes latest_checkpointed_iteration.txt last, so a checkpoint the
        # tracker points to always holds our state too.
        state.save(self)
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps > 0:
            state.resume(self)


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
