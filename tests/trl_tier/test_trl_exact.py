"""Exact drops and weights on TRL: (a) DataflexGRPOTrainer dropping groups vs (b) plain GRPOTrainer on a
dataset that never held them, fed the same scripted completions. Plain SGD with no clipping makes every
normaliser show in the update; every accumulated gradient and the final parameters are compared bit for bit."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch
import trl_tiny as T
from trl_methods import DAPO, KEEP_ALL, TWICE, Once, Twice, assert_twice_the_gradient, even_tokens

from dataflex_bus import Score, Scorer
from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

MIXED, FLAT = T.prompts()
ROWS_A = T.interleave(MIXED[:4], FLAT[:4], 2, 2)  # every generation batch: flat, mixed, flat, mixed groups
ROWS_B = MIXED[:4]  # the same kept groups, and nothing else
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
#: (steps_per_generation, gradient_accumulation_steps, num_iterations)
SCHEDULES = [(1, 1, 1), (2, 2, 1), (2, 1, 1), (1, 1, 2), (4, 2, 2)]
#: Plain TRL's run of its arguments, trained once per module (several tests compare against the same one).
plain = Once(T.train)


def pair(loss_type: str, spg: int, ga: int, it: int, *, block: dict[str, Any] = DAPO,
         rows_a: list[dict[str, Any]] = ROWS_A, rows_b: list[dict[str, Any]] = ROWS_B, gen_a: int = 16,
         gen_b: int = 8, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    steps = 2 * spg * it // ga
    common = dict(spg=spg, ga=ga, num_iterations=it, loss_type=loss_type, steps=steps, **kw)
    a = T.train(DataflexGRPOTrainer, rows=rows_a, rows_per_gen=gen_a, trainer_kwargs={"dataflex": block}, **common)
    return a, plain(rows=rows_b, rows_per_gen=gen_b, **common)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("spg,ga,it", SCHEDULES)
def test_a_dropped_group_leaves_the_update_as_if_never_generated(loss_type, spg, ga, it):
    a, b = pair(loss_type, spg, ga, it)
    metrics = a["trainer"].dataflex_metrics
    assert [m["dataflex/removed_rows"] for m in metrics] == [8.0, 8.0]
    assert [m["dataflex/trained/rows"] for m in metrics] == [8.0, 8.0]
    assert all(float(g.abs().max()) > 0 for g in b["grads"][0].values() if g.dim() > 1)
    assert T.compare(a, b) == 0.0
    assert a["losses"] == b["losses"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_zero_advantage_is_not_a_drop(loss_type):
    """The control: plain TRL with the flat groups present (advantage 0 there) trains otherwise (their rows
    stay in every normaliser), so the exactness above is not vacuous."""
    kw = dict(spg=2, ga=2, loss_type=loss_type, steps=2)
    with_flat = plain(rows=ROWS_A, rows_per_gen=16, **kw)
    without = plain(rows=ROWS_B, rows_per_gen=8, **{**kw, "num_iterations": 1})
    assert T.compare(with_flat, without) > 0


class GroupPosition(Scorer):
    """A group's position in its generation batch (drops by position, whatever the rewards)."""

    timing = "post_reward"
    granularity = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch.group_index.to(torch.float32), "prompt")


#: Per generation batch: two dropped groups, then the two kept ones (positions 2 and 3).
ROWS_BY_POSITION = [r for i in range(2) for r in FLAT[2 * i:2 * i + 2] + MIXED[2 * i:2 * i + 2]]
BY_POSITION = {"mechanism": "select", "scorer": {"name": "test_group_position"},
               "actuator": {"name": "threshold_band", "params": {"low": 1.5, "high": 3.5}}}


@pytest.mark.parametrize("scale_rewards", ["batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_batch_statistics_are_the_kept_batch_s(register, scale_rewards, aggregation):
    """Batch-level reward statistics (``scale_rewards="batch"``, ``normalize_then_sum``) are computed by TRL on
    the kept rows only; two reward functions."""
    register("scorer", "test_group_position", GroupPosition)
    a, b = pair("dapo", 2, 2, 1, block=BY_POSITION, rows_a=ROWS_BY_POSITION, scale_rewards=scale_rewards,
                multi_objective_aggregation=aggregation, reward_funcs=[T.correct, T.length])
    assert T.compare(a, b) == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_reference_log_probs_are_the_kept_rows_own(loss_type):
    """``beta > 0``: TRL computes the reference log-probs on the kept rows."""
    a, b = pair(loss_type, 2, 1, 1, beta=0.1)
    assert T.compare(a, b) == 0.0


def test_entropy_mask_bonus_and_truncation_masking_see_only_the_kept_rows():
    a, b = pair("bnpo", 2, 2, 1, top_entropy_quantile=0.5, entropy_coef=0.01, mask_truncated_completions=True)
    assert T.compare(a, b) == 0.0


def test_a_selection_keeping_everything_replays_plain_trl_bit_for_bit():
    """The whole replay path (rounds stopped at their rewards, TRL's method on the kept rows) with nothing
    dropped: the old-log-prob pass included (ga < spg)."""
    a, b = pair("bnpo", 2, 1, 1, block=KEEP_ALL, rows_b=ROWS_A, gen_b=16)
    assert a["trainer"].dataflex_metrics[0]["dataflex/removed_rows"] == 0
    assert T.compare(a, b) == 0.0


def test_an_uneven_kept_batch_trains_its_real_rows_only():
    """3 of 4 groups kept with 8 micro-batches per generation batch: 12 rows do not split into 8 equal
    chunks, so 4 padding rows carry nothing. dapo's normaliser is global: the update equals plain TRL on the
    12 rows to float rounding (the rows meet in other micro-batches); no TRL run corresponds exactly."""
    rows_a = [FLAT[0], MIXED[0], MIXED[1], MIXED[2], FLAT[1], MIXED[3], MIXED[4], MIXED[5]]
    a = T.train(DataflexGRPOTrainer, rows=rows_a, rows_per_gen=16, spg=8, ga=8, loss_type="dapo", steps=2,
                trainer_kwargs={"dataflex": DAPO})
    b = T.train(rows=MIXED[:6], rows_per_gen=12, spg=6, ga=6, loss_type="dapo", steps=2)
    assert [m["dataflex/trained/rows"] for m in a["trainer"].dataflex_metrics] == [12.0, 12.0]
    assert T.compare(a, b) < 1e-6


def test_an_empty_generation_batch_skips_its_optimizer_steps():
    """Every group flat: nothing trains, AdamW takes no step (its moments would move the weights)."""
    start = {n: p.detach().clone() for n, p in T.model(T.tokenizer()).named_parameters()}
    a = T.train(DataflexGRPOTrainer, rows=FLAT[:8], rows_per_gen=16, spg=2, ga=2, loss_type="dapo", steps=2,
                optim="adamw_torch", trainer_kwargs={"dataflex": DAPO})
    assert all(torch.equal(start[n], p) for n, p in a["params"].items())
    assert [m["dataflex/skipped_update"] for m in a["trainer"].dataflex_metrics] == [1.0, 1.0]
    assert a["trainer"].dataflex_metrics[-1]["dataflex/skipped_updates"] == 2


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weights_multiply_the_policy_gradient_term(register, loss_type):
    register("reweighter", "test_twice", Twice)
    kw = dict(rows=ROWS_A, rows_per_gen=16, spg=2, ga=2, loss_type=loss_type, steps=1)
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": TWICE}, **kw)
    b = T.train(**kw)
    assert_twice_the_gradient(a, b)
    assert a["trainer"].dataflex_metrics[0]["dataflex/weight_mean"] == 2.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_token_mask_out_of_every_term_is_trl_s_own_loss_mask(register, loss_type):
    """A token selection with ``mask_kl`` trains as plain TRL does with those tokens out of its loss mask
    (``env_mask``): the policy-gradient, KL and entropy terms and the normaliser all lose them."""
    block = even_tokens(register)
    kw = dict(rows=ROWS_A, rows_per_gen=16, spg=2, ga=2, loss_type=loss_type, steps=1, beta=0.04)
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": block}, **kw)
    b = T.train(env_mask=lambda ids: [1 - i % 2 for i in range(len(ids))], **kw)
    c = T.train(**kw)
    assert T.compare(a, b) == 0.0 and T.compare(a, c) > 0
    metrics = a["trainer"].dataflex_metrics[0]
    assert metrics["dataflex/trained/tokens"] == metrics["dataflex/kept_tokens"] < metrics["dataflex/trained/rows"] * 6
