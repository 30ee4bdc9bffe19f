"""Reward functions returning ``None`` (TRL's multi-task convention: a function not applicable to a row returns
None; TRL warns, sums the others with ``nansum`` and, where every function returned None, keeps the row's
reward NaN, out of the group baseline, with advantage 0). The bus reads the reward TRL trains on: the
nansum of the applicable functions, and NaN on a row no function scored, which the block's ``on_nonfinite``
handles (``error`` names the rows, ``drop`` trains without them)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch
import trl_tiny as T

from dataflex_bus import Score, Scorer
from dataflex_bus.errors import PluginRuntimeError
from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

MIXED, FLAT = T.prompts()
ROWS = T.interleave(MIXED[:4], FLAT[:4], 2, 2)
KEEP_ALL = {"mechanism": "select", "scorer": {"name": "test_reward_seen"},
            "actuator": {"name": "threshold_band", "params": {"low": -1e9, "high": 1e9}}}
SEEN: list[torch.Tensor] = []
ROWS_PER_GEN = 16


class RewardSeen(Scorer):
    """Each row's reward as the bus reads it (rm_scores summed over the row), recorded for generation batches of
    :data:`ROWS_PER_GEN` rows (validation also runs the block on its probe batch)."""

    requires = ("rm_scores",)
    timing = "post_reward"
    granularity = "response"

    def score(self, batch, step, **ctx):
        reward = batch["rm_scores"].sum(dim=1)
        if len(batch) == ROWS_PER_GEN:
            SEEN.append(reward.clone())
        return Score(reward, "response")


def applicable_to_odd_answers(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    """Scores rows whose answer is odd; None (not applicable) elsewhere."""
    return [float(len(c)) if int(a) % 2 else None for c, a in zip(completions, answer)]


def never(completions: list[str], **_: Any) -> list[float | None]:
    return [None] * len(completions)


def only_even(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    return [1.0 if int(a) % 2 == 0 else None for a in answer]


@pytest.fixture
def seen(register):
    register("scorer", "test_reward_seen", RewardSeen)
    SEEN.clear()
    return SEEN


def test_a_function_returning_none_is_left_out_of_the_sum_as_trl_does(seen):
    kw = dict(rows=ROWS, rows_per_gen=ROWS_PER_GEN, spg=2, ga=2, steps=2,
              reward_funcs=[T.correct, applicable_to_odd_answers])
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": KEEP_ALL}, **kw)
    b = T.train(**kw)
    assert T.compare(a, b) == 0.0
    assert len(seen) == 2 and all(bool(torch.isfinite(r).all()) for r in seen)
    # the bus's reward is TRL's: correct + len(completion) where the second function applies, correct alone elsewhere
    answers = [r["answer"] for r in ROWS[:4] for _ in range(T.G)]
    applicable = torch.tensor([int(x) % 2 == 1 for x in answers])
    assert bool((seen[0][applicable] >= 1).all())
    assert bool((seen[0][~applicable] <= 1).all())


def test_a_row_no_function_scored_is_nan_to_the_bus_and_on_nonfinite_decides(seen):
    kw = dict(rows=ROWS, rows_per_gen=ROWS_PER_GEN, spg=2, ga=2, steps=1, reward_funcs=[only_even, never])
    with pytest.raises(PluginRuntimeError, match=r"test_reward_seen.*non-finite score"):
        T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": KEEP_ALL}, **kw)
    nan_rows = torch.isnan(seen[0])
    answers = [r["answer"] for r in ROWS[:4] for _ in range(T.G)]
    assert nan_rows.tolist() == [int(x) % 2 == 1 for x in answers]
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": {**KEEP_ALL, "on_nonfinite": "drop"}}, **kw)
    assert a["trainer"].dataflex_metrics[0]["dataflex/nonfinite_rows"] == float(nan_rows.sum())
    assert a["trainer"].dataflex_metrics[0]["dataflex/trained/rows"] == float((~nan_rows).sum())
