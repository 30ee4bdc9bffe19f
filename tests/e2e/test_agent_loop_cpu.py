"""verl 0.9.1's real agent loop (``AgentLoopWorkerTQ`` through ``main_ppo``) under the kit's generation rounds.

SPEED (continuation rounds through ``__rollout_n__``), dynamic sampling with refill and Knapsack's counts, 2 steps
each, with the ``cpu_hf`` server delaying every request by a seeded wait (requests finish in another order than
they arrived) and one request failing: a continuation request in the SPEED run, a first-round request in the
refill run. The assertions are outcomes (counts, group sizes, the
rows trained), read from the metrics the adapter logs, never the order in which rounds are dispatched.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from conftest import FAILED_CONTINUATION, FAILED_REQUEST, KNAPSACK_ROWS

pytestmark = pytest.mark.e2e

STEPS = (1, 2)


def journal(out: Path, name: str) -> list[tuple[str, int]]:
    """The cpu_hf server's ``arrived/done/failed <ordinal>`` lines of a run, in the order they happened."""
    lines = (out / f"{name}.requests").read_text().split("\n")
    return [(what, int(k)) for what, k in (line.split() for line in lines if line)]


def per_step(metrics: dict, step: int, key: str) -> float:
    """One step's share of a cumulative ``compute/*`` counter."""
    return metrics[step][key] - (metrics[step - 1][key] if step > 1 else 0.0)


@pytest.mark.parametrize("name", ["speed", "refill"])
def test_requests_finish_out_of_dispatch_order(e2e_run, e2e_out, name):
    e2e_run(name)
    events = journal(e2e_out, name)
    arrived = [k for what, k in events if what == "arrived"]
    finished = [k for what, k in events if what in ("done", "failed")]
    assert sorted(arrived) == sorted(finished) == list(range(len(arrived)))
    assert finished != arrived, "the seeded delays left every request finishing in arrival order"


def test_speed_continuation_rounds_generate_the_plan_and_train_what_the_kit_kept(e2e_run, e2e_out, gpu_check):
    speed = e2e_run("speed")
    assert sorted(speed.metrics) == list(STEPS), "the run stopped at the failed continuation request"
    assert ("failed", int(FAILED_CONTINUATION)) in journal(e2e_out, "speed")
    check = gpu_check.check_speed(speed.metrics, STEPS)
    assert check.ok, check.line()
    n, more = gpu_check.N, gpu_check.N_CONTINUE
    for step in STEPS:
        m = speed.metrics[step]
        asked = m["dataflex/speed/continued_groups"]
        lost = m.get("dataflex/refill/failed_continuations", 0.0)
        continued = m["dataflex/alloc/continued"]  # groups a continuation really extended
        assert continued == asked - lost and continued > 0
        # the screening round is every prompt at the group size, its qualified groups continued
        assert m["dataflex/speed/qualified_groups"] >= asked and m["dataflex/alloc/covered"] == gpu_check.BATCH
        # the kit's decision is what verl trained: only the groups it continued, whole, n + n_continue rows each;
        # a group whose continuation failed keeps its n screening rows, none of the failed request's siblings
        assert m["dataflex/trained/groups"] == asked
        assert m["dataflex/trained/rows"] == continued * (n + more) + lost * n
        assert m["dataflex/alloc/max"] == n + more and math.isfinite(m["actor/pg_loss"])
    # the failed continuation was counted once, at step 1 (request 16 is one of step 1's continuations)
    assert speed.metrics[1]["dataflex/refill/failed_continuations"] == 1
    assert "dataflex/refill/failed_continuations" not in speed.metrics[2]
    # the check fails on a run that generated one rollout more than the plan, or trained a smaller group
    for key, delta in (("compute/generated_rollouts", 1.0), ("dataflex/alloc/max", -1.0)):
        broken = copy.deepcopy(speed.metrics)
        broken[2][key] += delta
        assert not gpu_check.check_speed(broken, STEPS).ok, key


def test_refill_rounds_evict_the_failed_group_and_the_step_goes_on(e2e_run, e2e_out, gpu_check):
    refill = e2e_run("refill")
    assert sorted(refill.metrics) == list(STEPS), "the run stopped at the failed request"
    assert ("failed", int(FAILED_REQUEST)) in journal(e2e_out, "refill")
    n, batch = gpu_check.N, gpu_check.BATCH
    first, second = refill.metrics[1], refill.metrics[2]
    assert first["dataflex/refill/failed_groups"] == 1
    assert second.get("dataflex/refill/failed_groups", 0.0) == 0
    for step in STEPS:
        m = refill.metrics[step]
        # every prompt dispatched (verl's train_batch_size, then the refills) was generated, but the failed one
        dispatched = batch + m.get("dataflex/refill/dispatched_prompts", 0.0)
        failed = m.get("dataflex/refill/failed_groups", 0.0)
        assert per_step(refill.metrics, step, "compute/generated_rollouts") == n * (dispatched - failed)
        assert m["dataflex/rollout/rows"] == n * (dispatched - failed)
        # the batch is the fill's: train_batch_size whole groups, no zero-variance (code) group, and not the
        # failed group's surviving sessions
        assert m["dataflex/refill/trained_groups"] == m["dataflex/trained/groups"] == batch
        assert m["dataflex/trained/rows"] == n * batch
        assert m["dataflex/trained/reward_std"] > 0 and math.isfinite(m["actor/pg_loss"])
    # the failed group cost a refill: step 1 dispatched more prompts than the zero-variance groups alone ask for
    assert first["dataflex/refill/dispatched_prompts"] >= 1


def test_knapsack_spends_the_budget_exactly_and_revisits_with_its_rates(e2e_run, gpu_check):
    knapsack = e2e_run("knapsack")
    n, batch = gpu_check.N, gpu_check.BATCH
    budget = n * batch
    for step in STEPS:
        m = knapsack.metrics[step]
        assert per_step(knapsack.metrics, step, "compute/generated_rollouts") == budget
        assert m["dataflex/alloc/rollouts"] == budget and m["dataflex/trained/rows"] == budget
        assert m["dataflex/alloc/covered"] == KNAPSACK_ROWS
    # step 1: every prompt is new, n each; step 2 revisits them with step 1's rates (valid for all four) and
    # spends the same budget unevenly: __rollout_n__ reached verl's agent loop per prompt
    first, second = knapsack.metrics[1], knapsack.metrics[2]
    assert first["dataflex/knapsack/new"] == KNAPSACK_ROWS and first["dataflex/knapsack/valid"] == 0
    assert first["dataflex/alloc/max"] == first["dataflex/alloc/min"] == n
    assert second["dataflex/knapsack/new"] == 0 and second["dataflex/knapsack/valid"] == 1
    assert second["dataflex/knapsack/never_solved"] >= 1  # the code prompt scores 0
    assert second["dataflex/alloc/max"] > n > second["dataflex/alloc/min"]


def test_validation_is_verls_own_and_fires_no_bus_event(e2e_run):
    knapsack = e2e_run("knapsack")
    m = knapsack.metrics
    # val_before_train logs at step 0, test_freq=1 after every step: verl's val-core/* each time
    assert sorted(m) == [0, *STEPS]
    for step in (0, *STEPS):
        assert any(k.startswith("val-core/") for k in m[step]), sorted(m[step])
    assert not any(k.startswith(("dataflex/", "compute/")) for k in m[0]), "the bus reported on a validation"
    # the bus saw the training rollouts only: never the validation prompts' KNAPSACK_ROWS sessions
    for step in STEPS:
        assert m[step]["dataflex/rollout/rows"] == m[step]["dataflex/alloc/rollouts"]
    assert m[2]["compute/generated_rollouts"] == 2 * m[1]["compute/generated_rollouts"]
