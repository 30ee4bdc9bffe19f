"""What the TRL host keeps of a generation batch while it runs: each generation round's rows
(:class:`RoundData`), the call of TRL's method the host is making (:class:`Pass`) and the rows the batch goes
on with (:class:`Kept`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..kit import Batch


class Collected(Exception):
    """Raised from ``_calculate_rewards`` to end a generation round once its rewards are known."""


@dataclass
class RoundData:
    """One generation round, every process's rows in TRL's global order (rank-major): what TRL's
    ``_generate`` returned, the rewards (``[R, F]``, one column per reward function), the dataset rows drawn
    (``None``: TRL's dataloader chose them), the domain labels, each row's group label (``uid``) and the
    on_rollout batch (with an allocator's continuation rounds, the round's rows so far)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tool_mask: list[list[int]] | None
    rewards: Tensor
    labels: list[str] | None
    batch: Batch
    loss_tokens: Tensor
    rows: Tensor | None = None
    uid: Tensor | None = None
    completions: list[Any] | None = None
    logprobs: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tool_images: list[Any] | None = None
    inputs: list[dict[str, Any]] | None = None
    pending_logs: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def extend(self, more: RoundData, batch: Batch) -> None:
        """``more``'s rows (a continuation round of this round's groups) appended; ``batch``: the round's
        on_rollout batch with them (what the kit decided on)."""
        for name in ("prompt_ids", "completion_ids", "tool_mask", "labels", "completions", "logprobs",
                     "tool_images", "inputs"):
            mine, theirs = getattr(self, name), getattr(more, name)
            if mine is not None and theirs is not None:
                setattr(self, name, [*mine, *theirs])
        for name in ("rewards", "loss_tokens", "rows", "uid"):
            mine, theirs = getattr(self, name), getattr(more, name)
            if mine is not None and theirs is not None:
                setattr(self, name, torch.cat([mine, theirs]))
        for key, values in more.extra.items():
            if isinstance(values, list):
                self.extra[key] = [*self.extra[key], *values]
        for column, values in more.pending_logs.items():
            self.pending_logs[column] = [*self.pending_logs.get(column, [None] * (len(self) - len(more))), *values]
        self.batch = batch


@dataclass
class Pass:
    """One call of TRL's ``_generate_and_score_completions`` made by the host: ``native`` (TRL runs it whole),
    ``collect`` (a round, ended after its rewards) or ``replay`` (the kept rows, generation and rewards given).
    ``rows``/``uid``: the dataset row and group label of each real row of a round; ``fillers``: rows after them
    generated only so that every process has as many (left out of everything); ``extends``: the round is a
    continuation of the last one (more rollouts of its groups)."""

    kind: str
    rows: Tensor | None = None
    uid: Tensor | None = None
    fillers: int = 0
    extends: bool = False
    inputs: list[dict[str, Any]] = field(default_factory=list)
    generated: tuple[Any, ...] | None = None
    rewards: Tensor | None = None
    round: RoundData | None = None
    old_entropy: bool = False
    entropies: Tensor | None = None
    no_grad_calls: int = 0
    pending_logs: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class Kept:
    """The real rows a generation batch goes on with, in global order: per row its group (unique over the
    rounds), domain label, reward, response length and loss-mask tokens; ``refs`` are ``(round, row)``."""

    refs: list[tuple[int, int]]
    groups: Tensor
    labels: list[str] | None
    rewards: Tensor
    lengths: Tensor
    loss_tokens: Tensor
    #: The rows a replay added (bool ``[K]``; ``None``: none).
    replayed: Tensor | None = None

    @classmethod
    def of(cls, rounds: Sequence[RoundData], refs: list[tuple[int, int]]) -> Kept:
        offsets = [0]
        for r in rounds:
            offsets.append(offsets[-1] + r.batch.num_groups)
        ri = torch.tensor([a for a, _ in refs], dtype=torch.long)
        ii = torch.tensor([b for _, b in refs], dtype=torch.long)

        def pick(values: Sequence[Tensor]) -> Tensor:
            flat = torch.cat(list(values))
            starts = torch.tensor([0] + [len(r) for r in rounds]).cumsum(0)
            return flat[starts[ri] + ii] if refs else flat[:0]

        groups = pick([r.batch.group_index + off for r, off in zip(rounds, offsets)])
        labels = None if rounds[0].labels is None else [rounds[a].labels[b] for a, b in refs]  # type: ignore[index]
        return cls(refs, groups, labels, pick([r.batch.rewards for r in rounds]),
                   pick([r.batch.lengths for r in rounds]), pick([r.loss_tokens for r in rounds]))

    def select(self, index: Tensor) -> Kept:
        idx = index.tolist()
        return Kept([self.refs[i] for i in idx], self.groups[index], None if self.labels is None else
                    [self.labels[i] for i in idx], self.rewards[index], self.lengths[index], self.loss_tokens[index],
                    None if self.replayed is None else self.replayed[index])

    def __len__(self) -> int:
        return len(self.refs)


def fit(t: Tensor, width: int) -> Tensor:
    """``t`` (``[K, W]``) cut or zero-padded to ``[K, width]``."""
    if t.size(1) >= width:
        return t[:, :width]
    return torch.cat([t, t.new_zeros(t.size(0), width - t.size(1))], dim=1)
