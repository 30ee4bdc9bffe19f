"""Where the TRL host's candidate prompts come from when it draws them itself.

TRL's ``RepeatSampler`` hands each generation batch a fixed set of prompts. A method that skips prompts
before generation, samples them by domain or refills a batch needs more, or other, prompts within a step:
then the host draws them from a :class:`PromptStream` over the training dataset, identically on every process
(its own seeded generator, no communication), and TRL's dataloader only paces the loop (epochs, ``max_steps``,
the batches skipped on resume).

Without a mixer the stream walks TRL's own order: the sampler's seeded permutation (``shuffle_dataset``,
``seed``), epoch after epoch, so a step that skips nothing trains the prompts plain TRL would have. With a
mixer each prompt's domain is drawn from the published probabilities and its row from a seeded walk of that
domain (:class:`~dataflex_bus.sampler.DomainSampler`, the sampler verl's host draws by too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..kit import ConfigError, ConfigIssue, DomainSampler, PromptTable

#: What names a prompt of a TRL dataset: its domain label and its position in the training dataset.
ID_COLUMN = "dataset row"


def prompt_table(labels: Sequence[str] | None, size: int) -> PromptTable:
    """Stable prompt ids ``(domain, dataset row)`` of a training dataset of ``size`` rows."""
    names = list(labels) if labels is not None else ["default"] * size
    return PromptTable.from_labels(names, torch.arange(size), column=ID_COLUMN)


class PromptStream:
    """Candidate prompts as dataset row indices, drawn the same on every process (see the module doc)."""

    def __init__(self, size: int, *, shuffle: bool, seed: int, sampler: DomainSampler | None = None) -> None:
        if size < 1:
            raise ConfigError(ConfigIssue("train_dataset", "the training dataset has no rows"))
        self.size = size
        self.shuffle = shuffle
        # RepeatSampler's generator: seeded once, one permutation per epoch.
        self.generator = torch.Generator().manual_seed(int(seed))
        self.order = self._permutation()
        self.position = 0
        self.epoch = 0
        self.sampler = sampler

    def _permutation(self) -> Tensor:
        if self.shuffle:
            return torch.randperm(self.size, generator=self.generator)
        return torch.arange(self.size)

    def draw(self, n: int, probabilities: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``n`` dataset rows and, with a mixer, their domain ids (``probabilities``: float ``[D]`` over the
        sampler's domains)."""
        if self.sampler is not None:
            if probabilities is None:
                raise ValueError("a domain-sampling stream needs the domain probabilities")
            # One prompt per draw of a domain, as verl's host draws them (data.gen_batch_size=1): the same
            # prompts on every host for the same probabilities and seed.
            picked = [self.sampler.draw(1, probabilities) for _ in range(n)]
            return torch.cat([r for r, _ in picked]), torch.cat([d for _, d in picked])
        out = []
        while n > 0:
            take = min(n, self.size - self.position)
            out.append(self.order[self.position:self.position + take])
            self.position += take
            n -= take
            if self.position == self.size:
                self.order, self.position, self.epoch = self._permutation(), 0, self.epoch + 1
        return (torch.cat(out) if out else torch.empty(0, dtype=torch.long)), None

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "generator": self.generator.get_state(), "order": self.order.clone(),
                "position": self.position, "epoch": self.epoch,
                "sampler": self.sampler.state_dict() if self.sampler is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["size"]) != self.size:
            raise ConfigError(ConfigIssue("train_dataset", f"the checkpoint drew from a dataset of {state['size']} "
                                          f"rows, this run's has {self.size}"))
        if (state.get("sampler") is None) != (self.sampler is None):
            raise ConfigError(ConfigIssue("dataflex.mechanism", "the checkpoint and this run disagree on whether "
                                          "prompts are drawn by domain (mix)"))
        self.generator.set_state(state["generator"])
        self.order = state["order"].clone()
        self.position, self.epoch = int(state["position"]), int(state["epoch"])
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
