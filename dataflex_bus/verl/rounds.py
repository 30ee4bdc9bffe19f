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
  and relabel them with the group's; the groups the fill does not train are evicted. Where every rule at
  ``on_rollout`` is per group (:meth:`Generation.begin_screening <dataflex_bus.generation.Generation.begin_screening>`),
  a round's groups are screened as TransferQueue shows them finished and each continuation dispatched as soon as
  the kit releases it (``_pipelined_round``), so the engine is not left idle behind a round's slowest group; the
  round is then put through ``on_rollout`` whole, deciding what it would have decided without the screening.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.utils import tensordict_utils as tu

from ..kit import Batch, ConfigError, ConfigIssue, Runtime, Step
from .buffer import DataflexReplayBuffer
from .tqbatch import labels_of, prompt_tokens, uid_of

if TYPE_CHECKING:
    from ..kit import Generation

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

    #: Decide a round's groups as they arrive and dispatch their continuations at once, where the kit allows it
    #: (:meth:`Generation.begin_screening`); False: every round waited for whole, as before issue 44 (comparisons).
    dispatch_per_group: bool = True

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
        waited for until every group of it is terminal (its continuations dispatched as its groups arrive where
        the kit allows: :meth:`_pipelined_round`), put through ``on_rollout`` and added to the fill, which says
        how many prompts the next round dispatches; then the groups the fill trains are the batch, rounds in
        dispatch order, and every other group is evicted. The step's first round is what verl dispatched
        (``data.train_batch_size`` prompts), plus what a larger ``dataflex.refill.gen_batch_size`` asks."""
        step = self._current_step()
        gen = step.generation(batch_size)
        first = gen.request()
        if self.dataflex.refill is not None and first > len(self._dispatched):
            self._refill(first - len(self._dispatched))
        rounds: list[tuple[list[str], list[str]]] = []  # per round: trajectory keys (row order), failed uids
        #: continuation prompt uid -> the group (prompt uid) its rollouts extend
        owner: dict[str, str] = {}
        lost = 0  # continuation prompts whose request failed
        while True:
            uids, self._dispatched = self._dispatched, []
            ahead: dict[str, str] | None = None  # continuations dispatched as their groups arrived -> group
            if self.dispatch_per_group and gen.begin_screening(uids):
                keys, failed, ahead = self._pipelined_round(buffer, partition_id, uids, gen)
            else:
                keys, failed = self._terminal_keys(buffer, partition_id, uids)
            if keys:
                tags = [buffer.partitions[partition_id][k] for k in keys]
                gen.add(self._rollouts(KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags), emits=True),
                        prompt_tokens=prompt_tokens(tags))
                while (more := gen.continuation()) is not None:
                    first_keys = [keys[r] for r in more.rows.tolist()]
                    if ahead is not None:  # the kit checked that the whole round asks for what was dispatched
                        extra, failed_more = self._rest_of_continuation(buffer, partition_id, uids, first_keys,
                                                                        more.counts.tolist(), ahead, owner)
                        ahead = None
                    else:
                        extra, failed_more = self._continue(buffer, partition_id, first_keys, more.counts.tolist(),
                                                            owner)
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
        trained = list(dict.fromkeys(trained))  # a uid per prompt dispatched, rounds in dispatch order
        if failures:
            step.metrics["dataflex/refill/failed_groups"] = float(failures)
        if lost:
            step.metrics["dataflex/refill/failed_continuations"] = float(lost)
        # The batch in the fill's order (the rounds', each in dispatch order), not in TransferQueue's arrival
        # order: what a step trains does not depend on which request the engine finished first.
        rank = {u: i for i, u in enumerate(trained)}
        snapshot = dict(sorted(((k, tag) for k, tag in buffer.partitions[partition_id].items() if uid_of(k) in rank),
                               key=lambda item: rank[uid_of(item[0])]))
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
        return self._keys_of(buffer, partition_id, uids)

    @staticmethod
    def _keys_of(buffer: ReplayBuffer, partition_id: str, uids: list[str]) -> tuple[list[str], list[str]]:
        """The trajectory keys of the terminal prompts ``uids`` as of the buffer's last read, in the order of
        ``uids``, and those of them that failed."""
        failed = [u for u in uids if u in buffer.failure_keys[partition_id]]
        wanted = set(uids) - set(failed)
        keys = [k for k in buffer.partitions[partition_id] if uid_of(k) in wanted]
        position = {u: i for i, u in enumerate(uids)}
        keys.sort(key=lambda k: position[uid_of(k)])
        return keys, failed

    def _pipelined_round(self, buffer: ReplayBuffer, partition_id: str, uids: list[str],
                         gen: Generation) -> tuple[list[str], list[str], dict[str, str]]:
        """A round whose groups are decided as they arrive (:meth:`Generation.begin_screening`): at every read of
        TransferQueue that shows groups newly finished, the kit screens them (:meth:`Generation.screen`) and the
        continuations it releases are dispatched at once, while the rest of the round is still generated. Returns,
        once every prompt of the round and every continuation dispatched is terminal, the round's trajectory keys
        and failed prompts as :meth:`_terminal_keys` gives them, and the continuations dispatched (their prompt
        uid -> their group's uid, their trajectories relabelled)."""
        continued: dict[str, str] = {}  # continuation prompt uid -> its group's uid
        for arrived in self._arrivals(buffer, partition_id, set(uids), continued):
            fresh = [u for u in arrived if u in continued]
            if fresh:
                self._relabel(buffer, partition_id, fresh, continued)
            finished = [u for u in uids if u in arrived and u not in buffer.failure_keys[partition_id]]
            if not finished:
                continue
            keys, _ = self._keys_of(buffer, partition_id, finished)
            tags = [buffer.partitions[partition_id][k] for k in keys]
            released = gen.screen(self._rollouts(KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags),
                                                 emits=True))
            if released:
                groups = list(released)
                continued.update(zip(self._dispatch_more(groups, [released[g] for g in groups]), groups))
        keys, failed = self._terminal_keys(buffer, partition_id, uids)
        return keys, failed, continued

    def _rest_of_continuation(self, buffer: ReplayBuffer, partition_id: str, uids: list[str], first_keys: list[str],
                              counts: list[int], ahead: dict[str, str],
                              owner: dict[str, str]) -> tuple[list[str], list[str]]:
        """A pipelined round's continuation: the groups of ``first_keys`` not dispatched ahead (``ahead``: prompt
        uid -> group) are dispatched now and waited for (:meth:`_continue`); returns every continuation's keys
        in the order of their groups in the round (``uids``), as :meth:`_continue` gives them, and the
        continuation prompts that failed (dropped: :meth:`_drop_failed`)."""
        sent = set(ahead.values())
        rest = [(k, c) for k, c in zip(first_keys, counts) if uid_of(k) not in sent]
        late, failed = (self._continue(buffer, partition_id, [k for k, _ in rest], [c for _, c in rest], owner)
                        if rest else ([], []))
        failed = failed + self._drop_failed(buffer, partition_id, list(ahead))
        owner.update(ahead)
        position = {u: i for i, u in enumerate(uids)}
        landed = set(ahead) - set(failed)
        extra = [k for k in buffer.partitions[partition_id] if uid_of(k) in landed] + late
        extra.sort(key=lambda k: position[owner[uid_of(k)]])
        return extra, failed

    def _arrivals(self, buffer: ReplayBuffer, partition_id: str, round_: set[str],
                  continued: dict[str, str]) -> Iterator[set[str]]:
        """The prompts of ``round_`` and the continuations in ``continued`` (which grows as the caller
        dispatches) that became terminal since the last read, at each read that shows some, until none is
        left: TransferQueue's terminal status tags are verl's completion events (the agent loop publishes a
        prompt's ``finished`` or ``failure`` once its sessions settle). Reads back off as
        :func:`terminal_waits` does and start short again after an arrival, since more usually follow."""
        seen: set[str] = set()
        waits = terminal_waits(buffer.poll_interval)
        while True:
            wanted = round_ | set(continued)
            if wanted <= seen:
                return
            buffer._sync_metadata_from_transfer_queue()
            new = (buffer.finished_keys[partition_id] | buffer.failure_keys[partition_id]) & wanted - seen
            if new:
                seen |= new
                waits = terminal_waits(buffer.poll_interval)
                yield new
            else:
                time.sleep(next(waits))

    def _dispatch_more(self, groups: list[str], counts: list[int]) -> list[str]:
        """Dispatch ``counts[i]`` more rollouts of the prompt of group ``groups[i]`` as new prompts (verl numbers
        a prompt's sessions from 0, so the same uid would overwrite the group's trajectories); returns their
        uids, one per group."""
        spots = [self._fetched_at[g] for g in groups]
        picked = [tu.index_select_tensor_dict(self._fetched[c], [r]) for c, r in spots]
        batch = picked[0] if len(picked) == 1 else tu.concat_tensordict(picked)
        fresh = [str(uuid.uuid4()) for _ in groups]
        tu.assign_non_tensor_stack(batch, "uid", fresh)
        tu.assign_non_tensor_stack(batch, ROLLOUT_N, [int(c) for c in counts])
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        # not a round of the fill: kept out of self._dispatched
        super()._submit_batch_to_rollout(batch)  # type: ignore[misc]
        return fresh

    @staticmethod
    def _relabel(buffer: ReplayBuffer, partition_id: str, fresh: list[str], group_of: dict[str, str]) -> None:
        """The finished continuation prompts ``fresh``: their trajectories carry their group's uid (``group_of``),
        as verl's advantage groups by it."""
        wanted = set(fresh) - buffer.failure_keys[partition_id]  # a failed continuation adds nothing
        keys = [k for k in buffer.partitions[partition_id] if uid_of(k) in wanted]
        if keys:
            relabel = TensorDict({}, batch_size=len(keys))
            tu.assign_non_tensor_stack(relabel, "uid", [group_of[uid_of(k)] for k in keys])
            tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=relabel)

    def _continue(self, buffer: ReplayBuffer, partition_id: str, first_keys: list[str], counts: list[int],
                  owner: dict[str, str]) -> tuple[list[str], list[str]]:
        """A continuation round: ``counts[i]`` more rollouts of the prompt of ``first_keys[i]``'s group, dispatched
        as new prompts (:meth:`_dispatch_more`) whose trajectories then carry the group's uid (verl's advantage
        groups by it); waited for whole; returns their trajectory keys and the continuation prompts that failed
        (each adds nothing to its group: :meth:`_drop_failed`)."""
        groups = [owner.get(uid_of(k), uid_of(k)) for k in first_keys]
        fresh = self._dispatch_more(groups, counts)
        keys, failed = self._terminal_keys(buffer, partition_id, fresh)
        self._relabel(buffer, partition_id, fresh, dict(zip(fresh, groups)))
        self._drop_failed(buffer, partition_id, failed)
        owner.update(zip(fresh, groups))
        return keys, failed

    @staticmethod
    def _drop_failed(buffer: ReplayBuffer, partition_id: str, continuations: list[str]) -> list[str]:
        """The continuation prompts of ``continuations`` that failed, their surviving sessions cleared from
        TransferQueue (no round reads them and nothing else would clear them); returns them."""
        failed = [u for u in continuations if u in buffer.failure_keys[partition_id]]
        if failed:
            buffer._clear_groups(partition_id, set(failed))
        return failed

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
