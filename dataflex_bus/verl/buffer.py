"""verl's sync replay buffer, shown every finished group before anything is evicted.

Two things need to see a group the moment its rollouts finish, inside ``ReplayBuffer.sample``'s polling
loop, before DAPO filtering evicts it (verl 0.9.1, ``trainer/ppo/v1/replay_buffer.py``):

* the per-prompt history (GRESO), which must count every rolled-out group, zero-variance ones included,
  also when verl's own ``algorithm.filter_groups`` evicts them and they never reach ``_balance_batch``;
* ``dataflex.refill`` under verl: the ``on_rollout`` selection decides which groups are evicted and
  refilled (verl's loop then refills two prompts per evicted group, drains and takes the oldest
  ``train_batch_size`` groups), instead of verl's own reward-variance test.

:class:`DataflexReplayBuffer` overrides ``_dapo_filtered_keys`` (called once per poll for the finished
groups) and hands each newly finished group's trajectory keys to the trainer exactly once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

#: ``filter_groups_metric`` that switches verl's DAPO path on when dataflex decides the evictions.
DATAFLEX_METRIC = "dataflex"
#: What the trainer does with newly finished groups: ``(trajectory keys, tags, partition)`` -> the uids
#: to evict (``None``: evict nothing, verl's own classification applies).
OnFinished = Callable[[list[str], list[dict[str, Any]], str], "set[str] | None"]


class DataflexReplayBuffer(ReplayBuffer):
    """``ReplayBuffer`` (sync) calling ``on_finished`` once per newly finished group."""

    def __init__(self, *, on_finished: OnFinished, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.on_finished = on_finished
        self._seen: dict[str, set[str]] = defaultdict(set)
        self._evict: dict[str, set[str]] = defaultdict(set)

    @classmethod
    def like(cls, buffer: ReplayBuffer, *, on_finished: OnFinished,
             filter_groups_metric: str | None = None) -> DataflexReplayBuffer:
        """A buffer built with the arguments verl gave ``buffer`` (``filter_groups_metric`` replaced when
        given): verl chose them from its config, and a custom sampler would get fewer."""
        return cls(on_finished=on_finished, trainer_mode=buffer.trainer_mode, trainer_config=buffer.trainer_config,
                   max_off_policy_threshold=buffer.max_off_policy_threshold,
                   max_off_policy_strategy=buffer.max_off_policy_strategy, sampler_kwargs=buffer.sampler_kwargs,
                   poll_interval=buffer.poll_interval, refill_fn=buffer.refill_fn,
                   filter_groups_metric=filter_groups_metric or buffer.filter_groups_metric,
                   train_batch_size=buffer.train_batch_size, gen_batch_size=buffer.gen_batch_size,
                   max_inflight_gen_batches=buffer.max_inflight_gen_batches,
                   sync_refill_failed_groups=buffer.sync_refill_failed_groups)

    def _dapo_filtered_keys(self, partition_id: str) -> tuple[set[str], Counter]:
        if partition_id == "val":
            return super()._dapo_filtered_keys(partition_id)
        finished = self.finished_keys[partition_id]
        seen, evict = self._seen[partition_id], self._evict[partition_id]
        # uids are fresh uuids: a cleared group never comes back, so forget what is no longer finished
        seen &= finished
        evict &= finished
        new = sorted(finished - seen)
        if new:
            wanted = set(new)
            keys = [k for k in self.partitions[partition_id] if k.split("_")[0] in wanted]
            tags = [self.partitions[partition_id][k] for k in keys]
            dropped = self.on_finished(keys, tags, partition_id)
            seen.update(new)
            if dropped is not None:
                evict.update(dropped)
        if self.filter_groups_metric == DATAFLEX_METRIC:
            return set(evict), Counter()  # no reward-value histogram: the selection, not a value, evicts
        return super()._dapo_filtered_keys(partition_id)
