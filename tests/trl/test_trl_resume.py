"""TRL runs that stop and resume: the last generation batch of a run that ``max_steps`` ends inside is still
counted, logged and recorded (also after a mid-batch resume), and a checkpoint's per-prompt state (history,
replay buffer) resumes only on the dataset it was written for, identified by its content, not its size."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import trl_tiny as T

from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

MIXED, FLAT = T.prompts()
#: Keeps a per-prompt history (GRESO reads it before generation): state keyed by the dataset's rows.
GRESO = {"methods": [
    {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
     "actuator": {"name": "greso", "params": {"p_easy_init": 0.5, "p_hard_init": 0.5, "adapt_from_epoch": 0}}},
    {"name": "dapo", "mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}]}


def _generated(run: dict[str, Any]) -> float:
    return float(run["trainer"].dataflex_kit.counters["generated_rollouts"])


def test_max_steps_inside_a_generation_batch_still_counts_logs_and_records_that_batch():
    """Before: 2 optimizer steps per generation batch and max_steps=3: the second batch's 16 rollouts were
    generated and trained but its step never ended (no metrics, no history step), the last log saying 16."""
    run = T.train(DataflexGRPOTrainer, rows=T.interleave(MIXED[:8], FLAT[:8], 2, 2), rows_per_gen=16, spg=2,
                  steps=3, trainer_kwargs={"dataflex": GRESO})
    trainer = run["trainer"]
    assert len(trainer.dataflex_metrics) == 2
    last = trainer.dataflex_metrics[-1]
    assert last["compute/generated_rollouts"] == _generated(run) >= 32
    assert run["logs"][-1]["step"] == 3 and run["logs"][-1]["compute/generated_rollouts"] == _generated(run)
    assert trainer.dataflex.history.completed[0] == 1  # the history closed the second batch's step


def test_max_steps_inside_a_generation_batch_after_a_mid_batch_resume_still_ends_that_batch(tmp_path):
    kw = dict(rows=T.interleave(MIXED[:8], FLAT[:8], 2, 2), rows_per_gen=16, spg=2, steps=4, save_strategy="steps",
              save_steps=1, trainer_kwargs={"dataflex": GRESO})
    T.train(DataflexGRPOTrainer, out=str(tmp_path / "whole"), **kw)
    # Resumed at step 1, inside the first batch: TRL generates it again (steps 2-3), then a batch cut at step 4.
    resumed = T.train(DataflexGRPOTrainer, out=str(tmp_path / "resumed"), resume=str(tmp_path / "whole" /
                      "checkpoint-1"), **kw)
    trainer = resumed["trainer"]
    assert len(trainer.dataflex_metrics) == 2
    assert resumed["logs"][-1]["step"] == 4
    assert resumed["logs"][-1]["compute/generated_rollouts"] == _generated(resumed)
    assert trainer.dataflex_metrics[-1]["compute/generated_rollouts"] == _generated(resumed)
