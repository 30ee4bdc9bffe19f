"""TransferQueue <-> :class:`~dataflex_bus.Batch` conversion for the verl trainer.

verl 0.9.1 keeps every trajectory in TransferQueue. Per-token fields come back from
``tq.kv_batch_get`` as jagged nested tensors (even when all lengths agree) and non-tensor fields
(``uid``, ``data_source``) as lists. The bus keeps them jagged (:class:`~dataflex_bus.Batch` reads rewards and
lengths from the values and pads a field to ``[B, T]`` only when a component reads it per token), token masks
as bool (an eighth of verl's int64); what the methods write is re-nested on the way out (masks back in
TransferQueue's dtype), on whole tensors (no per-row loops).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import transfer_queue as tq
from tensordict import TensorDict
from torch import Tensor
from transfer_queue import KVBatchMeta

from ..kit import Batch, BatchFieldError, jagged


def padded(t: Tensor, pad: float = 0) -> Tensor:
    """A right-padded dense tensor from a jagged nested one (dense tensors pass through)."""
    return t.to_padded_tensor(pad) if t.is_nested else t


def is_mask(name: str, t: Tensor) -> bool:
    """Whether field ``name`` is a 0/1 token mask (verl's ``response_mask``, ``loss_mask``, ...: int64 in
    TransferQueue), which the bus holds as bool: an eighth of the bytes."""
    return name.endswith("_mask") and not t.is_floating_point() and t.dtype != torch.bool


def bus_field(name: str, t: Tensor) -> Tensor:
    """Field ``name`` as the bus holds it: jagged as TransferQueue gave it (a mask's values as bool), a dense
    field as it is (a mask as bool); a nested tensor of another layout padded."""
    if jagged.is_jagged(t):
        return jagged.like(t, t.values().ne(0)) if is_mask(name, t) else t
    if t.is_nested:
        t = padded(t)
    return t.ne(0) if is_mask(name, t) else t


def to_nested(dense: Tensor, like: Tensor) -> Tensor:
    """Re-nest a padded ``[B, T]`` tensor with the row lengths of the nested tensor ``like``.

    Equivalent to verl's ``response_to_nested`` but one kernel for the whole batch (the inverse of the
    one ``to_padded_tensor`` runs) instead of a loop over rows.
    """
    if not like.is_nested:
        raise BatchFieldError("dataflex verl adapter", "response_mask", "expected a nested (jagged) tensor")
    offsets = jagged.offsets_of(like)
    width, longest = dense.shape[1], jagged.longest(like)
    if longest > width:
        raise BatchFieldError("dataflex verl adapter", "<re-nest>",
                              f"padded width {width} is shorter than the longest row {longest}")
    values = torch.ops.aten._padded_dense_to_jagged_forward(dense.contiguous(), [offsets.to(dense.device)],
                                                            int(offsets[-1]) if offsets.numel() else 0)
    if values.dtype == torch.bool and like.dtype != torch.bool:
        # A mask the bus held as bool goes back in TransferQueue's dtype: converted on the tokens, not the padding.
        values = values.to(like.dtype)
    return jagged.like(like, values)


def fetch(meta: KVBatchMeta, fields: Iterable[str]) -> TensorDict:
    """Read ``fields`` of every key of ``meta`` (missing fields are silently omitted by TQ)."""
    return tq.kv_batch_get(keys=list(meta.keys), partition_id=meta.partition_id,
                           select_fields=sorted(set(fields)))


def padding_flags(tags: Sequence[Mapping[str, Any]]) -> Tensor:
    """Bool ``[B]``: rows verl added to make the batch divisible (tag ``is_padding``)."""
    return torch.tensor([bool(tag.get("is_padding", False)) for tag in tags], dtype=torch.bool)


def labels_of(value: Any) -> list[Any]:
    """A non-tensor field as a plain list (TQ returns a list, a ``NonTensorStack`` or wrapped items,
    depending on the backend)."""
    # NonTensorStack.tolist() unwraps every item at once; unwrapping item by item goes through the
    # tensorclass attribute machinery and costs milliseconds per thousand rows.
    items = value.tolist() if hasattr(value, "tolist") and not isinstance(value, Tensor) else list(value)
    return [getattr(item, "data", item) if not isinstance(item, str) else item for item in items]


def prompt_tokens(tags: Sequence[Mapping[str, Any]]) -> int | None:
    """The prompt tokens of trajectories, from the ``prompt_len`` verl's agent loop writes in each TransferQueue
    tag (``None`` when a tag lacks it: the kit then reads the batch's ``attention_mask``)."""
    lengths = [tag.get("prompt_len") for tag in tags]
    if any(not isinstance(n, int) for n in lengths):
        return None
    return int(sum(lengths))  # type: ignore[arg-type]


def to_batch(data: TensorDict, tags: Sequence[Mapping[str, Any]], *, domain_key: str = "data_source") -> Batch:
    """Build a :class:`Batch` from a ``kv_batch_get`` result and the keys' tags.

    Group labels come from the ``uid`` field, domain labels from the ``domain_key`` field, padding
    flags from the tags. Tensor fields are held as :func:`bus_field` says (per-token fields stay jagged until a
    component reads them per token); other non-tensor fields (``extra_fields``, ``reward_model``...) are not part
    of the batch.
    """
    fields: dict[str, Tensor] = {}
    labels: dict[str, list[Any]] = {}
    for name in data.keys():
        value = data.get(name)
        if isinstance(value, Tensor):
            fields[name] = bus_field(name, value)
        elif name in ("uid", domain_key):
            labels[name] = labels_of(value)
    if not fields:
        raise BatchFieldError("dataflex verl adapter", "<fields>",
                              f"TransferQueue returned no tensor field (got {sorted(data.keys())})")
    # verl's GRPO sums rm_scores over the whole row (the agent loop puts the score on the last response token
    # whatever its mask): the bus reads that number too.
    return Batch.from_tensors(uid=labels.get("uid"), domains=labels.get(domain_key),
                              is_padding=padding_flags(tags), **cast(dict[str, Any], fields)).with_reward_span("row")


def put(meta: KVBatchMeta, fields: Mapping[str, Tensor]) -> KVBatchMeta:
    """Write ``fields`` for every key of ``meta``; returns TQ's new meta, whose ``fields`` list
    includes the written ones (the worker only receives fields listed there)."""
    td = TensorDict(dict(fields), batch_size=len(meta.keys))
    return tq.kv_batch_put(keys=list(meta.keys), partition_id=meta.partition_id, fields=td)


def uid_of(key: str) -> str:
    """The prompt uid of a trajectory key ``{uid}_{session}_{index}`` (a uid holds no ``_``)."""
    return key.split("_")[0]
