"""verl's sync replay buffer, under the host kit's control where a dataflex method needs it.

Two things need the buffer (verl 0.9.1, ``trainer/ppo/v1/replay_buffer.py``):

* ``dataflex.refill``: :meth:`ReplayBuffer.sample` is where a step's groups are waited for, evicted and
  refilled. :class:`DataflexReplayBuffer` hands the training partition's ``sample`` to ``rounds``, the
  trainer's generation rounds, which the host kit drives exactly as on every other host (every refill
  policy, ``max_rounds``, ``on_exhaust``); validation still goes through verl's own ``sample``.
* verl's own ``algorithm.filter_groups`` (DAPO inside the buffer) evicts zero-variance groups before they
  reach ``_balance_batch``: the buffer shows each newly finished group to ``on_finished`` first, so the kit
  counts every generated rollout and the per-prompt history (GRESO) sees every visit. It overrides
  ``_dapo_filtered_keys``, called once per poll for the finished groups, and hands each newly finished
  group's trajectory keys on exactly once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

#: Newly finished groups: ``(trajectory keys, tags, partition)``.
OnFinished = Callable[[list[str], list[dict[str, Any]], str], None]
#: A step's generation rounds: ``(buffer, partition, batch size)`` -> the batch to train.
Rounds = Callable[[ReplayBuffer, str, int], KVBatchMeta]


class DataflexReplayBuffer(ReplayBuffer):
    """``ReplayBuffer`` (sync) running the kit's generation ``rounds`` for the training partition, or
    calling ``on_finished`` once per newly finished group before verl's own filter evicts any."""

    def __init__(self, *, on_finished: OnFinished | None = None, rounds: Rounds | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.on_finished = on_finished
        self.rounds = rounds
        self._seen: dict[str, set[str]] = defaultdict(set)

    @classmethod
    def like(cls, buffer: ReplayBuffer, *, on_finished: OnFinished | None = None,
             rounds: Rounds | None = None) -> DataflexReplayBuffer:
        """A buffer built with the arguments verl gave ``buffer``: verl chose them from its config, and a
        custom sampler would get fewer."""
        return cls(on_finished=on_finished, rounds=rounds, trainer_mode=buffer.trainer_mode,
                   trainer_config=buffer.trainer_config, max_off_policy_threshold=buffer.max_off_policy_threshold,
                   max_off_policy_strategy=buffer.max_off_policy_strategy, sampler_kwargs=buffer.sampler_kwargs,
                   poll_interval=buffer.poll_interval, refill_fn=buffer.refill_fn,
                   filter_groups_metric=buffer.filter_groups_metric, train_batch_size=buffer.train_batch_size,
                   gen_batch_size=buffer.gen_batch_size, max_inflight_gen_batches=buffer.max_inflight_gen_batches,
                   sync_refill_failed_groups=buffer.sync_refill_failed_groups)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if self.rounds is None or partition_id == "val":
            return super().sample(global_steps, partition_id, batch_size)
        self._sync_metadata_from_transfer_queue()
        return self.rounds(self, partition_id, batch_size), {}

    def _dapo_filtered_keys(self, partition_id: str) -> tuple[set[str], Counter]:
        if partition_id != "val" and self.on_finished is not None:
            finished = self.finished_keys[partition_id]
            seen = self._seen[partition_id]
            # uids are fresh uuids: a cleared group never comes back, so forget what is no longer finished
            seen &= finished
            new = set(finished - seen)
            if new:
                keys = [k for k in self.partitions[partition_id] if k.split("_")[0] in new]
                self.on_finished(keys, [self.partitions[partition_id][k] for k in keys], partition_id)
                seen.update(new)
        return super()._dapo_filtered_keys(partition_id)
