"""TRL's loss types beyond the four of test_trl_exact.py (cispo, sapo, luspo, vespo): dropped groups leave the
update exactly as plain TRL's on a dataset that never held them, and a weight of 2 doubles the gradient exactly.
Schedules with ``num_iterations=2`` move the policy between the old and the current log-probs, so each loss's
ratio-dependent part (cispo's clamp, sapo's soft gate, vespo's gamma weight) is exercised away from ratio 1."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import test_trl_exact as E
import torch
import trl_tiny as T

from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

LOSS_TYPES = ["cispo", "sapo", "luspo", "vespo"]
#: (steps_per_generation, gradient_accumulation_steps, num_iterations)
SCHEDULES = [(2, 2, 1), (1, 1, 2), (4, 2, 2)]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("spg,ga,it", SCHEDULES)
def test_a_dropped_group_leaves_the_update_as_if_never_generated(loss_type, spg, ga, it):
    a, b = E.pair(loss_type, spg, ga, it)
    metrics = a["trainer"].dataflex_metrics
    assert [m["dataflex/removed_rows"] for m in metrics] == [8.0, 8.0]
    assert any(float(g.abs().max()) > 0 for step in b["grads"] for g in step.values())
    assert T.compare(a, b) == 0.0
    assert a["losses"] == b["losses"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weights_multiply_the_policy_gradient_term(register, loss_type):
    register("reweighter", "test_twice", E.Twice)
    block = {"mechanism": "reweight", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "test_twice"}}
    kw = dict(rows=E.ROWS_A, rows_per_gen=16, spg=2, ga=2, loss_type=loss_type, steps=1)
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": block}, **kw)
    b = T.train(**kw)
    (ga,), (gb,) = a["grads"], b["grads"]
    assert any(float(g.abs().max()) > 0 for g in gb.values())
    assert all(torch.equal(ga[n], 2 * gb[n]) for n in gb)
