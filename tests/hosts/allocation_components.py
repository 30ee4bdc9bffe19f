"""Components of the allocation contract case: an allocator handing out counts fixed in its parameters, one per
candidate in draw order, fed a pre-rollout score of the candidates' prompt ids (every host draws the world's
dataset rows in dataset order, so the same candidate gets the same count everywhere)."""

from __future__ import annotations

from typing import ClassVar

import torch

from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Param, Score, Scorer
from dataflex_bus.registry import register_local


class PromptIndexScore(Scorer):
    """The candidate's prompt id (pre_rollout): any allocator fed with it sees the candidates themselves."""

    requires: ClassVar = ("prompt_index",)
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch["prompt_index"].double(), "prompt")


class FixedCounts(Allocator):
    """Allocates ``counts`` (one per candidate, in draw order; missing ones get 0)."""

    params: ClassVar = {**ALLOCATION_PARAMS, "counts": Param(list, [], item=int, doc="rollouts per candidate")}
    counts: list[int]

    def allocate(self, batch, score, step, budget):
        counts = torch.zeros(len(batch), dtype=torch.long)
        given = torch.tensor(self.counts[: len(batch)], dtype=torch.long)
        counts[: given.numel()] = given
        return Allocation(counts)


register_local("scorer", "contract_prompt_index", PromptIndexScore)
register_local("allocator", "contract_counts", FixedCounts)
