"""What an allocator returns is checked before it is read: anything but an Allocation is refused naming the
allocator and the type it should have returned."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus.components import Allocator, Score, Scorer
from dataflex_bus.errors import PluginRuntimeError
from dataflex_bus.history import PromptTable
from dataflex_bus.host import ANY_HOST
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import Candidates, StepKit


class IndexScore(Scorer):
    requires: ClassVar = ("prompt_index",)
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch["prompt_index"].double(), "prompt")


class Returns(Allocator):
    value: ClassVar = None

    def allocate(self, batch, score, step, budget):
        return Returns.value


@pytest.mark.parametrize("value", [None, torch.full((4,), 4), {"counts": [4, 4, 4, 4]}], ids=["none", "tensor", "dict"])
def test_an_allocator_returning_no_allocation_is_named(register, value):
    register("scorer", "t_index_score", IndexScore)
    register("allocator", "t_returns", Returns)
    Returns.value = value
    rt = Runtime({"mechanism": "allocate", "scorer": {"name": "t_index_score"}, "actuator": {"name": "t_returns"}},
                 host=ANY_HOST.replace(name="lab", group_size=4))
    rt.set_prompts(PromptTable.full(["d"], [10], column="row"))
    step = StepKit(rt).begin(0)
    with pytest.raises(PluginRuntimeError) as err:
        step.prompts(4, lambda n: Candidates(torch.arange(n), torch.zeros(n, dtype=torch.long), torch.arange(n)))
    message = str(err.value)
    assert "allocator 't_returns'" in message and "expected an Allocation" in message
    assert type(value).__name__ in message
