"""Replayed rows in TransferQueue: a stored trajectory's fields into the host kit's replay store, and back.

verl keeps every field of a trajectory in TransferQueue: per-token fields as jagged nested tensors, per-row
ones as tensors, the dataset's columns and the agent loop's extras as non-tensor values. A replayed row must
come back with *every* field its step's fresh rows have (a field present on only some keys of a batch is
dropped from the worker's get), so the adapter stores the trajectory as it was generated: tensors as they are
(the kit's payload; jagged fields packed by the store, sized by their tokens), the non-tensor values and the
key's tags as the row's objects. Text-only trajectories: a per-token field with more than one value per token
(multimodal position ids) is refused, naming it.

:class:`ReplayWrites`, a mixin of :class:`~dataflex_bus.verl.trainer.DataflexTrainer` (before verl's ``PPOTrainer``
in its bases), does the writes: the rows the kit replays (``ReplayPart.replay``) into TransferQueue under new keys
before verl's old-log-prob pass, and the rows the method marks at on_advantage back into the kit's store
(``ReplayPart.store``).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack
from torch import Tensor
from transfer_queue import KVBatchMeta

from ..kit import Batch, BatchFieldError, Record, ReplayPart, Step
from .tqbatch import labels_of

#: The key of a stored row's objects that holds its TransferQueue tags.
TAG = "__tags__"


def generated_fields(meta: KVBatchMeta) -> list[str]:
    """The fields a trajectory of ``meta`` has as generated (before verl's old-log-prob pass adds any): one
    key's full read."""
    if not meta.keys:
        return []
    sample = tq.kv_batch_get(keys=[meta.keys[0]], partition_id=meta.partition_id)
    return sorted(sample.keys())


def payload_of(data: TensorDict, tags: Sequence[dict[str, Any]]) -> tuple[dict[str, Tensor], dict[str, Tensor],
                                                                           list[dict[str, Any]]]:
    """A ``kv_batch_get`` result as the kit's payload: tensors as they are (nested ones jagged: the store
    keeps each row's length from their offsets), every other value and each key's ``tags`` in the row's
    objects. (``lengths`` is empty: a jagged field carries them.)"""
    n = len(tags)
    payload: dict[str, Tensor] = {}
    lengths: dict[str, Tensor] = {}
    objects: list[dict[str, Any]] = [{TAG: dict(tag)} for tag in tags]
    for name in data.keys():
        value = data.get(name)
        if isinstance(value, Tensor):
            if value.is_nested and value.dim() != 2:
                raise BatchFieldError("dataflex replay (verl)", name, f"holds {tuple(value.values().shape[1:])} "
                                      "values per token; replay stores text-only trajectories")
            # Jagged as TransferQueue holds it: the store packs it by its offsets, never padded to the widest.
            payload[name] = value
        elif name != "uid":  # a replayed row gets a new uid (its group per the advantage mode)
            for obj, item in zip(objects, labels_of(value)):
                obj[name] = item
    if any(v.shape[0] != n for v in payload.values()):
        raise BatchFieldError("dataflex replay (verl)", "<fields>", f"TransferQueue returned rows for other than {n} "
                              "keys")
    return payload, lengths, objects


def fields_of(record: Record, uids: Sequence[str]) -> tuple[TensorDict, list[dict]]:
    """The stored rows of ``record`` as TransferQueue fields (nested where they were) under new ``uids``, and
    their tags (never padding)."""
    n = len(record)
    fields: dict[str, Any] = {}
    for name, dense in record.payload.items():
        length = record.lengths.get(name)
        if length is None:
            fields[name] = dense
            continue
        width = dense.shape[1]
        mask = torch.arange(width)[None, :] < length[:, None]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(length, 0)])
        fields[name] = torch.nested.nested_tensor_from_jagged(dense[mask], offsets=offsets,
                                                              max_seqlen=int(length.max()) if n else 0,
                                                              min_seqlen=int(length.min()) if n else 0)
    objects = record.objects or [{TAG: {}} for _ in range(n)]
    names = sorted({k for obj in objects for k in obj if k != TAG})
    for name in names:
        fields[name] = NonTensorStack(*[obj.get(name) for obj in objects])
    # The uid says which group a row's advantage is normalised in; the key's session numbers the rows of a
    # uid (a row's own session_id field is kept as generated).
    fields["uid"] = NonTensorStack(*uids)
    tags = [{**obj[TAG], "is_padding": False} for obj in objects]
    return TensorDict(fields, batch_size=n), tags


class ReplayWrites:
    """The replayed rows of a step of :class:`~dataflex_bus.verl.trainer.DataflexTrainer` (a mixin, before verl's
    ``PPOTrainer`` in its bases): written into TransferQueue before verl's old-log-prob pass, and the rows the
    replay method marks at on_advantage read back into the kit's store."""

    # What it reads of the trainer (the adapter's own), declared for type checking only.
    _fresh: Batch | None
    _replay_rows: dict[str, int]
    _rewards: dict[str, float]
    _generated_fields: list[str]
    _current_step: Callable[[], Step]

    def _add_replayed(self, meta: KVBatchMeta) -> KVBatchMeta:
        """The stored rows the kit replays this step, written into TransferQueue under new keys before verl's
        old-log-prob pass: a row joining a fresh group (``mixed``) takes its uid and the next sessions, the others
        a new uid per new group; ``rollout_log_probs`` is the stored behaviour log-prob as generated."""
        fresh = self._fresh
        assert fresh is not None and fresh.uid is not None
        replay = ReplayPart.of(self._current_step())
        replayed = replay.replay(fresh) if replay is not None else None
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
        replay = ReplayPart.of(self._current_step())
        if replay is not None:
            replay.store(payload, lengths=lengths, objects=objects)
