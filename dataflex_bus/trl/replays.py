"""Replay in TRL (mechanism ``replay``): stored rows join a generation batch as one more round.

TRL's generation batch holds only the rows generated for it; the host kit's store (:mod:`dataflex_bus.replay`)
keeps past rows. The TRL host always runs TRL's method once more on a step's kept rows (the ``replay`` pass of
:mod:`~dataflex_bus.trl.passes`, its generation and rewards given), so a stored row joins there, as a row of
a round of its own (:func:`stored_round`): TRL pads it, computes its old and reference log-probs with the
current policy and its advantage over its group (the kit's groups: its own, its prompt's, or its prompt's
fresh group, per :class:`~dataflex_bus.mechanisms.replay.ReplaySettings`). What TRL needs of a row to train it again is
kept beside the store as one object per row (:func:`stored_object`): its token ids, completion, dataset row,
every reward function's value and what the reward functions logged for it.

Behaviour log-probs ``mu``: without vLLM, TRL generates with the policy that computes the old log-probs of the
same step (nothing moves between the two), so a fresh row's old log-probs *are* its behaviour log-probs, and
those are stored. With vLLM TRL samples with another engine; the host does not read vLLM's sampling log-probs,
so replay is refused there (:mod:`~dataflex_bus.trl.host`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..kit import Batch, ObjectCheck, Replayed, pad_to
from .records import Kept, RoundData

if TYPE_CHECKING:
    from .batches import BatchMaker


def fresh_batch(rounds: Sequence[RoundData], kept: Kept, batches: BatchMaker) -> Batch:
    """The fresh rows a step goes on with, as :meth:`ReplayPart.replay <dataflex_bus.replay.ReplayPart.replay>`
    reads them: their groups (numbered as :func:`joined` numbers them) and prompt ids."""
    rows = torch.stack([rounds[a].rows[b] for a, b in kept.refs])  # type: ignore[index]
    response = (torch.arange(max(1, int(kept.lengths.max())))[None, :] < kept.lengths[:, None]).to(torch.long)
    return Batch.from_tensors(uid=_compact(kept.groups), response_mask=response,
                              prompt_index=batches.prompt_index(rows))


def stored_object(rounds: Sequence[RoundData], ref: tuple[int, int]) -> dict[str, Any]:
    """What TRL needs to train the row ``ref`` (``(round, row)``) again, at a later step."""
    r, i = rounds[ref[0]], ref[1]
    assert r.rows is not None and r.inputs is not None and r.completions is not None
    return {"row": int(r.rows[i]), "label": None if r.labels is None else r.labels[i],
            "prompt_ids": list(r.prompt_ids[i]), "completion_ids": list(r.completion_ids[i]),
            "tool_mask": None if r.tool_mask is None else list(r.tool_mask[i]),
            "completion": r.completions[i], "logprobs": None if r.logprobs is None else r.logprobs[i],
            "extra": {k: v[i] for k, v in r.extra.items() if isinstance(v, list)},
            "input": dict(r.inputs[i]), "rewards": r.rewards[i].clone(),
            "logs": {c: v[i] for c, v in r.pending_logs.items()}}


#: The entries of :func:`stored_object`.
STORED = ("row", "label", "prompt_ids", "completion_ids", "tool_mask", "completion", "logprobs", "extra", "input",
          "rewards", "logs")


def object_check(rows: int, rewards: int) -> ObjectCheck:
    """The store's check of one restored object (:attr:`ReplayStore.object_check
    <dataflex_bus.replay_store.ReplayStore.object_check>`): what :func:`stored_round` reads of it, for a training
    dataset of ``rows`` rows and ``rewards`` reward functions; ``None`` when sound, else what is wrong."""

    def check(obj: Any) -> str | None:
        if obj is None:
            return "is None, not a stored row"
        if not isinstance(obj, Mapping):
            return f"is a {type(obj).__name__}, not a stored row (a mapping of {', '.join(STORED)})"
        missing = [k for k in STORED if k not in obj]
        if missing:
            return f"lacks {missing}"
        row = obj["row"]
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < rows:
            return f"'row' is {row!r}, outside the training dataset's rows [0, {rows})"
        for name in ("prompt_ids", "completion_ids"):
            ids = obj[name]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                return f"{name!r} is a {type(ids).__name__}, not a list of token ids"
        if obj["tool_mask"] is not None and not isinstance(obj["tool_mask"], list):
            return f"'tool_mask' is a {type(obj['tool_mask']).__name__}, not a list"
        value = obj["rewards"]
        if not isinstance(value, Tensor) or value.shape != (rewards,):
            shape = f"holds {value.numel()} values" if isinstance(value, Tensor) else f"is a {type(value).__name__}"
            return f"'rewards' {shape}, not {rewards} (one per reward function)"
        for name in ("extra", "input", "logs"):
            if not isinstance(obj[name], Mapping):
                return f"{name!r} is a {type(obj[name]).__name__}, not a mapping"
        return None

    return check


def stored_round(replayed: Replayed, first: RoundData, batches: BatchMaker) -> RoundData:
    """The replayed rows as a round, in the layout of the step's first round ``first``."""
    objects = replayed.record.objects
    assert objects is not None, "the TRL host stores every row with its object"
    prompt_ids = [o["prompt_ids"] for o in objects]
    completion_ids = [o["completion_ids"] for o in objects]
    tool_mask = None if first.tool_mask is None else [o["tool_mask"] for o in objects]
    labels = None if first.labels is None else [o["label"] for o in objects]
    rows = torch.tensor([o["row"] for o in objects], dtype=torch.long)
    rewards = torch.stack([o["rewards"] for o in objects])
    batch, loss_tokens = batches.rollout(prompt_ids, completion_ids, tool_mask, rewards, labels, rows,
                                         replayed.record.group)
    extra = {k: [o["extra"][k] for o in objects] if isinstance(v, list) else v for k, v in first.extra.items()}
    return RoundData(prompt_ids=prompt_ids, completion_ids=completion_ids, tool_mask=tool_mask, rewards=rewards,
                     labels=labels, batch=batch, loss_tokens=loss_tokens, rows=rows, uid=replayed.record.group,
                     completions=[o["completion"] for o in objects],
                     logprobs=None if first.logprobs is None else [o["logprobs"] for o in objects],
                     extra=extra, inputs=[dict(o["input"]) for o in objects],
                     pending_logs={c: [o["logs"].get(c) for o in objects] for c in first.pending_logs})


def joined(kept: Kept, stored: RoundData, round_index: int, replayed: Replayed) -> Kept:
    """The kept fresh rows followed by the replayed ones (round ``round_index``), each in the group the
    kit gave it (:meth:`Replayed.group_ids`)."""
    fresh = _compact(kept.groups)
    groups = torch.cat([fresh, replayed.group_ids(int(fresh.max()) + 1 if len(kept) else 0)])
    m = len(replayed)
    labels = None if kept.labels is None else [*kept.labels, *(stored.labels or [])]
    return Kept([*kept.refs, *((round_index, i) for i in range(m))], groups, labels,
                torch.cat([kept.rewards, stored.batch.rewards]), torch.cat([kept.lengths, stored.batch.lengths]),
                torch.cat([kept.loss_tokens, stored.loss_tokens]),
                torch.cat([torch.zeros(len(kept), dtype=torch.bool), torch.ones(m, dtype=torch.bool)]))


def behaviour_log_probs(old: Tensor, replayed: Replayed | None, fresh: int) -> Tensor:
    """``rollout_log_probs`` of the on_advantage batch: the fresh rows' old log-probs (their behaviour
    log-probs, see the module doc) and the replayed rows' stored ``mu``, ``old``'s width."""
    if replayed is None:
        return old
    width = old.size(1)
    mu = pad_to(replayed.record.mu, max(width, replayed.record.mu.size(1)))[:, :width].to(old.dtype)
    return torch.cat([old[:fresh], mu])


def replay_rows(total: int, fresh: int) -> Tensor:
    """Each row's index among the replayed rows (-1: fresh), for ``Step.advantage``."""
    rows = torch.full((total,), -1, dtype=torch.long)
    rows[fresh:] = torch.arange(total - fresh)
    return rows


def _compact(groups: Tensor) -> Tensor:
    return torch.unique(groups, return_inverse=True)[1] if groups.numel() else groups
