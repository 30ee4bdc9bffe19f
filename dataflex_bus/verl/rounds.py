"""The verl adapter's generation rounds and its use of verl's replay buffer: :class:`GenerationRounds`, a mixin
of :class:`~dataflex_bus.verl.trainer.DataflexTrainer` (before verl's ``PPOTrainer`` in its bases).

* ``_build_replay_buffer`` runs the trainer as the verl mode it extends (verl branches on the literal mode
  strings) and, where the kit needs the buffer, wraps it in
  :class:`~dataflex_bus.verl.buffer.DataflexReplayBuffer`: under ``dataflex.refill``, or when a method allocates
  rollouts, its ``sample`` runs :meth:`GenerationRounds._generation_rounds`; under verl's own
  ``algorithm.filter_groups`` it shows every finished group to :meth:`GenerationRounds._on_finished` first.
* ``_generation_rounds``: the step's generation driven by the host kit (:class:`~dataflex_bus.generation.Generation`),
  as on every host: each round is dispatched, waited for until every group of it is terminal, put through
  ``on_rollout``; an allocator's continuation rounds dispatch more rollouts of a group's prompt under a new uid
  and relabel them with the group's; the groups the fill does not train are evicted.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.utils import tensordict_utils as tu

from ..kit import Batch, ConfigError, ConfigIssue, Runtime, Step
from .buffer import DataflexReplayBuffer
from .tqbatch import labels_of, prompt_tokens, uid_of

#: The per-prompt rollout count verl's v1 agent loop reads (``AgentLoopManagerTQ._run_prompt``).
ROLLOUT_N = "__rollout_n__"
#: The first wait between two reads of TransferQueue while a round's groups finish (seconds); each later wait
#: doubles, up to verl's ``poll_interval`` (2 s): a round's end is seen within about its own length (a 0.3 s
#: round at about 0.3 s, not 2 s), and a long round is read no more often than verl reads it.
FIRST_WAIT = 0.01


def terminal_waits(longest: float) -> Iterator[float]:
    """The waits between reads while groups are generated: :data:`FIRST_WAIT`, doubling, at most ``longest``
    (a round whose last group finishes at t is seen by about 2t, not at the next multiple of ``longest``)."""
    wait = min(FIRST_WAIT, longest)
    while True:
        yield wait
        wait = min(2 * wait, longest)


class GenerationRounds:
    """The generation rounds and the replay buffer of :class:`~dataflex_bus.verl.trainer.DataflexTrainer`."""

    # What it reads of the trainer (verl's and the adapter's own), declared for type checking only.
    config: DictConfig
    dataflex: Runtime
    verl_mode: str
    trainer_mode: str
    parameter_sync_step: int
    global_steps: int
    _dispatched: list[str]
    _refill_dispatched: int
    _rounds_skip_update: bool
    _fetched: list[TensorDict]
    _fetched_at: dict[str, tuple[int, int]]
    _current_step: Callable[[], Step]
    _rollouts: Callable[..., Batch]
    _add_prompts_to_generate: Callable[[int], int]

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
        return self.dataflex.plan.generates_in_rounds

    @property
    def _buffer_counts_rollouts(self) -> bool:
        """The replay buffer showed every finished group to the kit already (verl's own filter_groups)."""
        buffer = getattr(self, "replay_buffer", None)
        return isinstance(buffer, DataflexReplayBuffer) and buffer.on_finished is not None

    def _submit_batch_to_rollout(self, batch: TensorDict) -> int:
        self._dispatched.extend(str(u) for u in labels_of(batch["uid"]))
        return super()._submit_batch_to_rollout(batch)  # type: ignore[misc]

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
        lost = 0  # continuation prompts that failed
        while True:
            uids, self._dispatched = self._dispatched, []
            keys, failed = self._terminal_keys(buffer, partition_id, uids)
            if keys:
                tags = [buffer.partitions[partition_id][k] for k in keys]
                gen.add(self._rollouts(KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags), emits=True),
                        prompt_tokens=prompt_tokens(tags))
                while (more := gen.continuation()) is not None:
                    extra, failed_more = self._continue(buffer, partition_id, [keys[r] for r in more.rows.tolist()],
                                                        more.counts.tolist(), owner)
                    lost += len(failed_more)
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
        if lost:
            step.metrics["dataflex/refill/failed_continuations"] = float(lost)
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
                  owner: dict[str, str]) -> tuple[list[str], list[str]]:
        """A continuation round: ``counts[i]`` more rollouts of the prompt of ``first_keys[i]``'s group, dispatched
        as new prompts (verl numbers a prompt's sessions from 0, so the same uid would overwrite the group's
        trajectories) whose trajectories then carry the group's uid (verl's advantage groups by it); returns their
        trajectory keys and the continuation prompts that failed. A continuation prompt that fails adds nothing to
        its group: its surviving sessions leave TransferQueue here (no round reads them, nothing else clears
        them)."""
        groups = [owner.get(uid_of(k), uid_of(k)) for k in first_keys]
        spots = [self._fetched_at[g] for g in groups]
        picked = [tu.index_select_tensor_dict(self._fetched[c], [r]) for c, r in spots]
        batch = picked[0] if len(picked) == 1 else tu.concat_tensordict(picked)
        fresh = [str(uuid.uuid4()) for _ in groups]
        tu.assign_non_tensor_stack(batch, "uid", fresh)
        tu.assign_non_tensor_stack(batch, ROLLOUT_N, [int(c) for c in counts])
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        # not a round of the fill: kept out of self._dispatched
        super()._submit_batch_to_rollout(batch)  # type: ignore[misc]
        keys, failed = self._terminal_keys(buffer, partition_id, fresh)
        if failed:
            buffer._clear_groups(partition_id, set(failed))
        if keys:
            relabel = TensorDict({}, batch_size=len(keys))
            of = dict(zip(fresh, groups))
            tu.assign_non_tensor_stack(relabel, "uid", [of[uid_of(k)] for k in keys])
            tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=relabel)
        owner.update(zip(fresh, groups))
        return keys, failed

    def _wait_terminal(self, buffer: ReplayBuffer, partition_id: str, uids: set[str]) -> None:
        """Read TransferQueue until every prompt of ``uids`` finished or failed: soon after the last one does
        (:func:`terminal_waits`), not up to a whole ``poll_interval`` later."""
        waits = terminal_waits(buffer.poll_interval)
        while True:
            buffer._sync_metadata_from_transfer_queue()
            if uids <= (buffer.finished_keys[partition_id] | buffer.failure_keys[partition_id]):
                return
            time.sleep(next(waits))

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


__all__ = ["ROLLOUT_N", "GenerationRounds", "terminal_waits"]
