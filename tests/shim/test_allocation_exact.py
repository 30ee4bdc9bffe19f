"""The shim generates exactly what was decided for a step's candidates: an allocation's counts (the whole budget
on the first candidate, a prefix of them, nothing at all under on_empty=skip) and a pre-rollout selection keeping
the first candidates of an oversized draw. Each chose a prefix of one draw, which the shim once mistook for the
whole draw (every candidate generated, or an unnamed repeat_interleave error)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Param, Score, Scorer
from dataflex_bus.shim import run_training

from .conftest import tiny

SMALL = {"trainer": {"prompts_per_step": 8, "group_size": 4, "save_every": 0},
         "data": {"domains": ["copy", "random"]}}


class FirstFirst(Scorer):
    """Higher for earlier candidates of a draw (pre_rollout): a top-B selection keeps the draw's first B."""

    requires: ClassVar = ("prompt_index",)
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"

    def score(self, batch, step, **ctx):
        return Score(-torch.arange(len(batch), dtype=torch.float64), "prompt")


class Fixed(Allocator):
    params: ClassVar = {**ALLOCATION_PARAMS, "counts": Param(list, [], item=int)}

    def allocate(self, batch, score, step, budget):
        counts = torch.zeros(len(batch), dtype=torch.long)
        counts[: len(self.counts)] = torch.tensor(self.counts, dtype=torch.long)
        return Allocation(counts)


@pytest.fixture
def comps(register):
    register("scorer", "t_first_first", FirstFirst)
    register("allocator", "t_fixed_counts", Fixed)


def allocation(counts):
    return {"mechanism": "allocate", "on_empty": "skip", "scorer": {"name": "t_first_first"},
            "actuator": {"name": "t_fixed_counts", "params": {"counts": counts, "max_n": 32}}}


@pytest.mark.parametrize("counts", [[32], [16, 16], [0, 0, 0, 0, 0, 0, 16, 16], [4, 0, 8, 0, 4, 0, 16]],
                         ids=["first", "prefix", "suffix", "scattered"])
def test_an_allocation_generates_its_counts_and_nothing_else(comps, counts):
    (m,) = run_training(tiny(allocation(counts), **SMALL), steps=1).metrics
    given = sum(c > 0 for c in counts)
    assert m["compute/generated_rollouts"] == sum(counts) == m["dataflex/rollout/rows"]
    assert m["dataflex/prompts_generated"] == given == m["dataflex/rollout/groups"]
    assert m["dataflex/alloc/max"] == max(counts) and m["dataflex/alloc/min"] == min(c for c in counts if c)


def test_an_allocation_of_nothing_generates_the_one_candidate_it_counts(comps):
    (m,) = run_training(tiny(allocation([0] * 8), **SMALL), steps=1).metrics
    assert m["dataflex/skipped_update"] == 1 and m["dataflex/prompts_generated"] == 1
    assert m["compute/generated_rollouts"] == 4 == m["dataflex/rollout/rows"]


def test_a_selection_keeping_the_first_candidates_of_a_pool_generates_only_those(comps):
    block = {"mechanism": "select", "scorer": {"name": "t_first_first"},
             "actuator": {"name": "top_b", "params": {"pool": 2.0}}}
    (m,) = run_training(tiny(block, **SMALL), steps=1).metrics
    assert m["dataflex/prompts_considered"] == 16 and m["dataflex/prompts_generated"] == 8
    assert m["compute/generated_rollouts"] == 32 == m["dataflex/rollout/rows"]


def test_counts_that_do_not_match_the_prompts_are_named():
    from dataflex_bus.shim.split import Split

    split = Split(["copy", "random"], 0, 40)
    prompts = split.draw(torch.zeros(3, dtype=torch.long), torch.Generator().manual_seed(1))
    assert len(prompts.repeat(torch.tensor([2, 0, 4])).domains) == 6
    with pytest.raises(ValueError, match=r"shim: 2 rollout counts for 3 prompts"):
        prompts.repeat(torch.tensor([2, 2]))
