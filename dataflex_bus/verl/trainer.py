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
  prompts the step generates (``Step.fresh_prompts``); after the on_rollout removal ``_balance_batch`` writes the
  stored rows the kit replays (``Step.replay``) into TransferQueue under new keys, with their tags and every field
  they were generated with (:mod:`dataflex_bus.verl.replay`), and a ``uid`` per the advantage mode, so verl's own
  old-log-prob, reference, rollout-correction and advantage passes see them; at on_advantage the rows the method
  marks are read back from TQ into the kit's store (``Step.store``).

Prompt ids are ``(data_source, extra_info.index)``, checked unique when the dataloader is built. Plugin
state is saved beside verl's checkpoints (:mod:`~dataflex_bus.verl.state`). Each mode
sets ``self.trainer_mode`` to the verl mode it runs (``sync``, ``colocate_async``, ``separate_async``),
because verl branches on those literal strings (replay buffer type, forced ``gen_batch_size=1``, TQ
snapshots in checkpoints, the ``trainer.v1.<mode>`` section); any other string silently selects the async
paths.

The modes register themselves as the last statements of this module, so a failing import never leaves
a half-working registration behind (see :mod:`dataflex_bus.verl.entry`).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
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
from verl.utils.dataset.rl_dataset import collate_fn

from ..batch import Batch
from ..errors import BatchFieldError, ConfigError, ConfigIssue
from ..runtime import Runtime
from ..sampler import DomainSampler, domain_labels, prepare_prompts
from ..steps import Candidates, Step, StepKit
from . import state
from .blocks import minibatch_blocks
from .buffer import DataflexReplayBuffer
from .guard import DATAFLEX_MODE_FOR
from .host import describe
from .prompts import candidate_ids, dataset_prompt_table
from .replay import fields_of, generated_fields, payload_of
from .tqbatch import fetch, labels_of, nested_row_counts, padding_flags, put, to_batch, to_nested, uid_of

log = logging.getLogger("dataflex_bus")

#: File written into every ``global_step_N`` checkpoint folder (:mod:`~dataflex_bus.verl.state`).
STATE_FILE = state.STATE_FILE
#: Fields every event reads, whatever the method: labels, rewards and the response mask.
BASE_FIELDS = ("uid", "response_mask", "rm_scores")


def prompt_tokens(tags: Sequence[Mapping[str, Any]]) -> int | None:
    """The prompt tokens of trajectories, from the ``prompt_len`` verl's agent loop writes in each TransferQueue
    tag (``None`` when a tag lacks it: the kit then reads the batch's ``attention_mask``)."""
    lengths = [tag.get("prompt_len") for tag in tags]
    if any(not isinstance(n, int) for n in lengths):
        return None
    return int(sum(lengths))  # type: ignore[arg-type]
#: The per-prompt rollout count verl's v1 agent loop reads (``AgentLoopManagerTQ._run_prompt``).
ROLLOUT_N = "__rollout_n__"


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

    # ------------------------------------------------------------------ verl mode
    def _build_replay_buffer(self):
        # verl branches on the literal mode strings (replay buffer type, forced gen_batch_size=1, TQ
        # snapshots in checkpoints, TQ restore on resume, the trainer.v1.<mode> section): run as the verl
        # mode this trainer extends, never as "dataflex_...", which would select the async paths.
        self.trainer_mode = self.verl_mode
        self.parameter_sync_step = self.config.trainer.v1.get(self.verl_mode, {}).get("parameter_sync_step", 1)
        buffer = super()._build_replay_buffer()
        refill = self._runs_rounds
        if refill and type(buffer) is not ReplayBuffer:
            raise ConfigError(ConfigIssue(
                "dataflex.refill", f"refill runs through verl's synchronous replay buffer; trainer mode "
                f"{self.verl_mode!r} uses {type(buffer).__name__}", ["trainer.v1.trainer_mode=dataflex_sync"]))
        # verl's own filter_groups evicts groups inside the buffer: show them to the kit first (counters,
        # history); under dataflex.refill the buffer runs the kit's rounds.
        if type(buffer) is not ReplayBuffer or not (refill or buffer.filter_groups_metric is not None):
            return buffer
        if self.dataflex.refill is not None:
            buffer.gen_batch_size = 1  # exact refills, as verl sets for its own DAPO
            buffer.train_batch_size = self.config.data.train_batch_size
            buffer.refill_fn = self._refill
        return DataflexReplayBuffer.like(buffer, on_finished=None if refill else self._on_finished,
                                         rounds=self._generation_rounds if refill else None)

    @property
    def _runs_rounds(self) -> bool:
        """The replay buffer's sample runs the kit's generation rounds: under ``dataflex.refill``, and whenever
        a method allocates rollouts (a round's prompts are the ones dispatched, however many an allocation left:
        verl's own sample would wait for ``train_batch_size`` of them; a continuation generates more)."""
        return self.dataflex.refill is not None or self.dataflex.allocates

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

    def _rollouts(self, meta: KVBatchMeta, *, emits: bool) -> Batch:
        """The rollouts of ``meta`` as the on_rollout batch, with prompt ids when the history is kept."""
        ids = self.dataflex.keeps_history or self.dataflex.replays
        batch, data = self._read("on_rollout", meta, ["index"] if ids else [], emits=emits)
        if ids:
            batch = batch.with_fields(prompt_index=self._prompt_index(data, batch))
        return batch

    def _balance_batch(self, batch: KVBatchMeta, metrics: dict, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """on_rollout, then verl's padding and sequence balancing on what is left."""
        self._skip_update = False
        self._replay_rows = {}
        if self.dataflex.replays:
            self._generated_fields = generated_fields(batch)
        batch = self._on_rollout(batch)
        if self.dataflex.replays and not self._skip_update:
            batch = self._add_replayed(batch)
        batch = super()._balance_batch(batch, metrics, *args, **kwargs)
        # What old-log-prob, reference, critic and actor compute will run on: verl pads the kept rows
        # back to a multiple of lcm(dp, ppo_mini_batch_size * n) with synthetic 128-token rows.
        padding = int(padding_flags(batch.tags).sum())
        metrics["dataflex/compute/rows_after_padding"] = float(len(batch))
        metrics["dataflex/compute/padding_rows"] = float(padding)
        metrics["dataflex/compute/tokens_after_padding"] = float(sum(int(tag.get("seq_len", 0)) for tag in batch.tags))
        return batch

    @property
    def _buffer_counts_rollouts(self) -> bool:
        """The replay buffer showed every finished group to the kit already (verl's own filter_groups)."""
        buffer = getattr(self, "replay_buffer", None)
        return isinstance(buffer, DataflexReplayBuffer) and buffer.on_finished is not None

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
    def _add_replayed(self, meta: KVBatchMeta) -> KVBatchMeta:
        """The stored rows the kit replays this step, written into TransferQueue under new keys before verl's
        old-log-prob pass: a row joining a fresh group (``mixed``) takes its uid and the next sessions, the others
        a new uid per new group; ``rollout_log_probs`` is the stored behaviour log-prob as generated."""
        fresh = self._fresh
        assert fresh is not None and fresh.uid is not None
        replayed = self._current_step().replay(fresh)
        if replayed is None:
            return meta
        first = torch.full((fresh.num_groups,), len(fresh), dtype=torch.long).scatter_reduce(
            0, fresh.group_index.clamp_min(0), torch.arange(len(fresh)), "amin")
        fresh_uids = [str(fresh.uid[i]) for i in first.tolist()]
        sizes = torch.bincount(fresh.group_index[fresh.valid_rows], minlength=fresh.num_groups).tolist()
        new_uids = [f"replay{uuid.uuid4().hex}" for _ in range(replayed.num_blocks)]
        taken: dict[str, int] = {}
        uids, keys = [], []
        for join, block in zip(replayed.join.tolist(), replayed.block.tolist()):
            uid = fresh_uids[join] if join >= 0 else new_uids[block]
            session = taken.get(uid, sizes[join] if join >= 0 else 0)
            taken[uid] = session + 1
            uids.append(uid)
            keys.append(f"{uid}_{session}_0")
        fields, tags = fields_of(replayed.record, uids)
        tq.kv_batch_put(keys=keys, partition_id=meta.partition_id, fields=fields, tags=tags)
        self._replay_rows = {key: i for i, key in enumerate(keys)}
        self._rewards.update(zip(keys, replayed.record.reward.tolist()))
        return KVBatchMeta(partition_id=meta.partition_id, keys=[*meta.keys, *keys], tags=[*meta.tags, *tags],
                           fields=meta.fields, extra_info=meta.extra_info)

    def _store_replay(self, meta: KVBatchMeta, store: Tensor) -> None:
        """The rows the replay method marked at on_advantage, read back from TransferQueue with the fields they
        were generated with (before the trainer writes its own), into the kit's store."""
        flags = store.tolist()
        keys = list(itertools.compress(meta.keys, flags))
        tags = list(itertools.compress(meta.tags, flags))
        data = tq.kv_batch_get(keys=keys, partition_id=meta.partition_id, select_fields=self._generated_fields)
        payload, lengths, objects = payload_of(data, tags)
        self._current_step().store(payload, lengths=lengths, objects=objects)

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        # A replay method may fill part of the step from its buffer: the replay buffer then waits for fewer groups.
        if self.dataflex.replays:
            sample_batch_size = self._current_step().fresh_prompts(sample_batch_size)
        return super()._step_once(metrics, timing_raw, sample_batch_size)

    # ------------------------------------------------------------------ generation rounds (dataflex.refill)
    def _submit_batch_to_rollout(self, batch: TensorDict) -> int:
        self._dispatched.extend(str(u) for u in labels_of(batch["uid"]))
        return super()._submit_batch_to_rollout(batch)

    def _refill(self, num_prompts: int) -> int:
        """Dispatch ``num_prompts`` more prompts for generation (counted in ``dataflex/refill/dispatched_prompts``)."""
        self._refill_dispatched += num_prompts
        return self._add_prompts_to_generate(num_prompts)

    def _generation_rounds(self, buffer: ReplayBuffer, partition_id: str, batch_size: int) -> KVBatchMeta:
        """The step's generation under ``dataflex.refill``, run by the host kit as on every host: each round is
        waited for until every group of it is terminal, put through ``on_rollout`` and added to the fill, which
        says how many prompts the next round dispatches; then the groups the fill trains are the batch, in
        arrival order, and every other group is evicted. The step's first round is what verl dispatched
        (``data.train_batch_size`` prompts), plus what a larger ``dataflex.refill.gen_batch_size`` asks."""
        step = self._current_step()
        gen = step.generation(batch_size)
        first = gen.request()
        if self.dataflex.refill is not None and first > len(self._dispatched):
            self._refill(first - len(self._dispatched))
        rounds: list[tuple[list[str], list[str]]] = []  # per round: trajectory keys (row order), failed uids
        #: continuation prompt uid -> the group (prompt uid) its rollouts extend
        owner: dict[str, str] = {}
        while True:
            uids, self._dispatched = self._dispatched, []
            keys, failed = self._terminal_keys(buffer, partition_id, uids)
            if keys:
                tags = [buffer.partitions[partition_id][k] for k in keys]
                gen.add(self._rollouts(KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags), emits=True),
                        prompt_tokens=prompt_tokens(tags))
                while (more := gen.continuation()) is not None:
                    extra = self._continue(buffer, partition_id, [keys[r] for r in more.rows.tolist()],
                                           more.counts.tolist(), owner)
                    keys = keys + extra
                    tags = [buffer.partitions[partition_id][k] for k in extra]
                    gen.extend(self._rollouts(KVBatchMeta(partition_id=partition_id, keys=extra, tags=tags),
                                              emits=True), prompt_tokens=prompt_tokens(tags))
            rounds.append((keys, failed))
            n = gen.request()
            if n == 0:
                break
            self._refill(n)
        outcome = gen.finish()
        self._rounds_skip_update = outcome.skip_update
        keeps = iter(outcome.keeps)
        trained: list[str] = []
        evicted: set[str] = set()
        failures = 0
        for keys, failed in rounds:
            evicted.update(failed)
            failures += len(failed)
            if not keys:
                continue
            keep = next(keeps)
            flags = itertools.repeat(True) if keep is None else keep.tolist()
            for key, kept in zip(keys, flags):
                # a continuation's rows are kept or evicted with their group, under their own prompt uid
                if kept:
                    trained.append(uid_of(key))
                else:
                    evicted.add(uid_of(key))
        trained = list(dict.fromkeys(trained))  # a uid per prompt dispatched, in arrival order
        if failures:
            step.metrics["dataflex/refill/failed_groups"] = float(failures)
        snapshot = dict(buffer.partitions[partition_id])
        if evicted:
            buffer._clear_groups(partition_id, evicted)
        if not trained:
            raise RuntimeError("dataflex.refill: the generation rounds left no group with trajectories to train "
                               "(every dispatched prompt failed)")
        return buffer._materialize_batch(partition_id, trained, snapshot)

    def _terminal_keys(self, buffer: ReplayBuffer, partition_id: str, uids: list[str]) -> tuple[list[str], list[str]]:
        """Wait until every prompt of ``uids`` is terminal; its trajectory keys in dispatch order of their prompts
        (the fill's arrival order), and the prompts that failed."""
        self._wait_terminal(buffer, partition_id, set(uids))
        failed = [u for u in uids if u in buffer.failure_keys[partition_id]]
        wanted = set(uids) - set(failed)
        keys = [k for k in buffer.partitions[partition_id] if uid_of(k) in wanted]
        position = {u: i for i, u in enumerate(uids)}
        keys.sort(key=lambda k: position[uid_of(k)])
        return keys, failed

    def _continue(self, buffer: ReplayBuffer, partition_id: str, first_keys: list[str], counts: list[int],
                  owner: dict[str, str]) -> list[str]:
        """A continuation round: ``counts[i]`` more rollouts of the prompt of ``first_keys[i]``'s group, dispatched
        as new prompts (verl numbers a prompt's sessions from 0, so the same uid would overwrite the group's
        trajectories) whose trajectories then carry the group's uid (verl's advantage groups by it); returns their
        trajectory keys. A continuation prompt that fails adds nothing to its group."""
        groups = [owner.get(uid_of(k), uid_of(k)) for k in first_keys]
        spots = [self._fetched_at[g] for g in groups]
        picked = [tu.index_select_tensor_dict(self._fetched[c], [r]) for c, r in spots]
        batch = picked[0] if len(picked) == 1 else tu.concat_tensordict(picked)
        fresh = [str(uuid.uuid4()) for _ in groups]
        tu.assign_non_tensor_stack(batch, "uid", fresh)
        tu.assign_non_tensor_stack(batch, ROLLOUT_N, [int(c) for c in counts])
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        super()._submit_batch_to_rollout(batch)  # not a round of the fill: kept out of self._dispatched
        keys, _ = self._terminal_keys(buffer, partition_id, fresh)
        if keys:
            relabel = TensorDict({}, batch_size=len(keys))
            of = dict(zip(fresh, groups))
            tu.assign_non_tensor_stack(relabel, "uid", [of[uid_of(k)] for k in keys])
            tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=relabel)
        owner.update(zip(fresh, groups))
        return keys

    def _wait_terminal(self, buffer: ReplayBuffer, partition_id: str, uids: set[str]) -> None:
        """Poll TransferQueue until every prompt of ``uids`` finished or failed."""
        while True:
            buffer._sync_metadata_from_transfer_queue()
            if uids <= (buffer.finished_keys[partition_id] | buffer.failure_keys[partition_id]):
                return
            time.sleep(buffer.poll_interval)

    def _on_finished(self, keys: list[str], tags: list[dict[str, Any]], partition: str) -> None:
        """Newly finished groups, seen by the replay buffer before verl's own filter_groups evicts any: counted
        and recorded in the prompt history like every generated group."""
        if not keys:
            return
        meta = KVBatchMeta(partition_id=partition, keys=list(keys), tags=list(tags))
        step = self._current_step()
        batch = self._rollouts(meta, emits=False)
        step.count_generated(batch, prompt_tokens=prompt_tokens(tags))
        step.record(batch)

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
        if num_prompts is None and self.dataflex.replays:
            target = self._current_step().fresh_prompts(target)
        if not self.dataflex.selects_prompts:
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
        if self.dataflex.allocator("on_rollout") is not None:
            chunk = len(self._fetched)
            self._fetched.append(batch)
            self._fetched_at.update((str(u), (chunk, i)) for i, u in enumerate(labels_of(batch["uid"])))
        return batch

    # ------------------------------------------------------------------ advantage and update
    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage, then on_advantage; returns the meta of our own put (see module doc)."""
        return self._on_advantage(super()._compute_advantage(batch, metrics))

    def _on_advantage(self, meta: KVBatchMeta) -> KVBatchMeta:
        step = self._current_step()
        rewards = torch.tensor([self._rewards.get(key, 0.0) for key in meta.keys], dtype=torch.float32)
        if not self.dataflex.listens("on_advantage"):
            self._trained_without_listeners(meta, rewards)
            return meta
        extra = ["rollout_is_weights"] if "rollout_is_weights" in (meta.fields or []) else []
        replays = self.dataflex.replays
        view, data = self._read("on_advantage", meta, [*extra, "index"] if replays else extra)
        replay_rows = None
        if replays:
            view = view.with_fields(prompt_index=self._prompt_index(data, view))
            replay_rows = torch.tensor([self._replay_rows.get(key, -1) for key in meta.keys], dtype=torch.long)
        blocks, multiple = self._actor_blocks(len(meta))
        action = step.advantage(view, blocks=blocks, block_multiple=multiple, replay_rows=replay_rows)
        if action.store is not None:
            self._store_replay(meta, action.store)
        self._warn_empty_blocks(action.empty_blocks, action.restored_rows, action.remove, action.skip_update)
        self._skip_update = self._skip_update or action.skip_update
        loss_mask = action.fields.get("loss_mask", view.get("loss_mask"))
        tokens = (view["response_mask"] if loss_mask is None else loss_mask).ne(0).sum(dim=1)
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
        tokens = nested_row_counts(loss_mask)
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
        replay = self.dataflex.replay_settings
        if self.dataflex.refill is not None or (replay is not None and replay.fresh_fraction < 1.0):
            # Exact refills need single-prompt fetches, as verl sets for its own algorithm.filter_groups; so does
            # a step that generates only its fresh share (whatever the buffer cannot fill).
            with open_dict(self.config):
                self.config.data.gen_batch_size = 1
        super()._init_dataloader()
        frame = self.train_dataset.dataframe
        seed = self.config.data.get("seed", None)
        labels = domain_labels(frame, self.domain_key, required=True) if self.dataflex.mixes else None
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
