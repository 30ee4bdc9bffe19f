"""Knapsack RL's ``solver: dp`` against the authors' own allocations on 200 random batches
(``vectors/knapsack_random.json``: KnapsackRL's ``sampling_budget_by_knapsack``, solver dp, its pure-Python
DP, success rates in a float32 array; params and exclusions inside the file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflex_plugins.methods.allocate import Knapsack

from dataflex_bus.batch import Batch
from dataflex_bus.components import Budget, Score

VECTORS = json.loads((Path(__file__).parent / "vectors" / "knapsack_random.json").read_text())
PARAMS = VECTORS["params"]


def allocate(case: dict, solver: str) -> list[int]:
    rates = case["rates"]
    batch = Batch.from_tensors(uid=torch.arange(len(rates)), prompt_index=torch.arange(len(rates)))
    knapsack = Knapsack(solver=solver, **PARAMS)
    score = Score(torch.tensor(rates, dtype=torch.float64), "prompt")
    return knapsack.allocate(batch, score, 0, Budget(case["budget"], len(rates), case["n"])).counts.tolist()


def test_the_vector_file_is_the_one_these_tests_were_written_for():
    assert len(VECTORS["cases"]) == 200 and VECTORS["code"].startswith("liziniu/KnapsackRL@ca5d5f5")


@pytest.mark.parametrize("index", range(len(VECTORS["cases"])))
def test_solver_dp_is_the_official_allocation_on_every_random_batch(index):
    case = VECTORS["cases"][index]
    assert allocate(case, "dp") == case["official_counts"]
