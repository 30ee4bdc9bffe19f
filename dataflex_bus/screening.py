"""A generation round's groups decided as they arrive (:meth:`Generation.screen
<dataflex_bus.generation.Generation.screen>`), where every rule at ``on_rollout`` is per group.

A per-group rule (:attr:`~dataflex_bus.mechanisms.allocate.Allocator.per_group_rule`) gives a group more rollouts
from its own rows, except for one cap: at most the groups the step still needs go on. Which ones the cap takes is
the allocator's :meth:`~dataflex_bus.mechanisms.allocate.Allocator.continuation_cap`: ``"none"`` (no cap),
``"dispatch"`` (the first passing groups in dispatch order: SPEED) or ``"any"`` (another order, e.g. by a score).
:class:`RoundScreening` releases a passing group's continuation only once the cap cannot turn it away, whatever
the groups not yet back turn out to be; the rest wait for the whole round's decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: How a cap picks among the passing groups, from the least to the most that a screening must wait for.
CAP_ORDERS = ("none", "dispatch", "any")


def strictest(orders: Sequence[str]) -> str:
    """The cap order a screening must respect when several rules act (the one that waits for the most)."""
    unknown = sorted(set(orders) - set(CAP_ORDERS))
    if unknown:
        raise ValueError(f"unknown continuation cap order(s) {unknown}; allowed: {list(CAP_ORDERS)}")
    return max(orders, key=CAP_ORDERS.index, default="none")


class RoundScreening:
    """The groups of one round (``labels``, in dispatch order) screened as they arrive, under a cap of ``cap``
    passing groups taken in ``order`` (:data:`CAP_ORDERS`). :meth:`add` records a screening's counts and returns
    the continuations now certain, each once."""

    def __init__(self, labels: Sequence[Any], cap: int, order: str) -> None:
        if order not in CAP_ORDERS:
            raise ValueError(f"RoundScreening: order {order!r} is not one of {list(CAP_ORDERS)}")
        self.labels = list(labels)
        self.position = {label: i for i, label in enumerate(self.labels)}
        if len(self.position) != len(self.labels):
            raise ValueError("RoundScreening: a round's group labels must be distinct")
        self.cap, self.order = cap, order
        n = len(self.labels)
        self.screened = torch.zeros(n, dtype=torch.bool)
        self.counts = torch.zeros(n, dtype=torch.long)
        self.released = torch.zeros(n, dtype=torch.bool)

    def add(self, labels: Sequence[Any], counts: torch.Tensor) -> dict[Any, int]:
        """Groups ``labels`` were screened to ``counts`` more rollouts (0: they do not go on); returns the groups
        whose continuation no later arrival can change, by label, with their counts."""
        strangers = [label for label in labels if label not in self.position]
        if strangers:
            raise ValueError(f"RoundScreening: groups {strangers[:3]} are not of this round")
        index = torch.tensor([self.position[label] for label in labels], dtype=torch.long)
        self.screened[index] = True
        self.counts[index] = counts.to(torch.long)
        passing = self.counts > 0
        undecided_or_passing = (~self.screened | passing).to(torch.long)
        if self.order == "none":
            sure = passing
        elif self.order == "dispatch":  # at most cap - 1 groups before it could still pass
            before = torch.cumsum(undecided_or_passing, 0) - undecided_or_passing
            sure = passing & (before < self.cap)
        else:  # whatever the order, the whole round cannot hold more passing groups than the cap
            sure = passing & (int(undecided_or_passing.sum()) <= self.cap)
        new = torch.nonzero(sure & ~self.released).flatten()
        self.released[new] = True
        return {self.labels[i]: int(self.counts[i]) for i in new.tolist()}


__all__ = ["CAP_ORDERS", "RoundScreening", "strictest"]
