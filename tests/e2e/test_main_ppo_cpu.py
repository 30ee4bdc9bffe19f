"""verl 0.9.1's real ``main_ppo`` end to end on CPU: plain GRPO vs the ``dataflex_sync`` methods.

Every run is the real trainer (agent loop, reward workers, FSDP2 actor, TransferQueue, weight sync) with
the test-only ``cpu_hf`` rollout; the checks are the GPU check's (``scripts/gpu_check.py``), so a check
that passes here passes there for the same reason. Rollouts are identical across runs from the same
weights (seeded per request), which the off/off control asserts.
"""

from __future__ import annotations

import math

import harness
import pytest

pytestmark = pytest.mark.e2e

ROWS = 16  # 4 prompts x n=4 per step


def test_off_off_control_adapter_without_method_trains_like_plain_verl(e2e_run, gpu_check):
    plain, off = e2e_run("plain"), e2e_run("off")
    assert sorted(plain.metrics) == sorted(off.metrics) == [1, 2]
    check = gpu_check.check_off_off(plain.metrics, off.metrics, [1, 2])
    assert check.ok, check.line()
    # the gate is meaningful: a method run is told apart from plain
    select = e2e_run("select")
    assert not gpu_check.check_off_off(plain.metrics, select.metrics, [1]).ok


def test_gpu_check_off_checks_rollout_and_actor_log_probs_and_the_state_beside_the_checkpoint(e2e_run, e2e_out,
                                                                                            gpu_check):
    off = e2e_run("off")
    check = gpu_check.check_logprobs_agree(off.metrics, [1, 2])
    assert check.ok, check.line()
    # the mix run checkpoints every step (off does not): dataflex_state.pt beside verl's actor checkpoint
    e2e_run("mix")
    check = gpu_check.check_state_beside_checkpoint(e2e_out / "ckpt_mix", 2)
    assert check.ok, check.line()
    assert not gpu_check.check_state_beside_checkpoint(e2e_out / "ckpt_off", 2).ok


def test_console_parser_reads_what_the_file_logger_wrote(e2e_run, gpu_check):
    off = e2e_run("off")
    console = gpu_check.parse_console(off.log.read_text())
    assert sorted(console) == sorted(off.metrics)
    for step, values in off.metrics.items():
        # the file logger writes NaN as null (dropped on read); the console prints it
        printed = {k: v for k, v in console[step].items() if not math.isnan(v)}
        assert set(printed) == set(values), sorted(set(printed) ^ set(values))
        for key, value in values.items():
            assert printed[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_select_seed_quick_start_removes_rows_before_the_update(e2e_run, gpu_check):
    plain, select = e2e_run("plain"), e2e_run("select")
    assert sorted(select.metrics) == [1, 2]
    harness.assert_select_removed_rows_before_the_update(gpu_check, plain, select, ROWS)
    # the check fails for a run whose adapter removed nothing
    assert not gpu_check.check_select(plain.metrics, e2e_run("off").metrics, 1, rows=ROWS).ok


def test_gpu_check_control_a_warming_up_method_trains_exactly_like_off(e2e_run, gpu_check):
    off, control = e2e_run("off"), e2e_run("control")
    check = gpu_check.check_control(off.metrics, control.metrics, 1)
    assert check.ok, check.line()
    # the check tells a method that acts apart: the same block acting at step 1 (the seed's select) fails it
    assert not gpu_check.check_control(off.metrics, e2e_run("select").metrics, 1).ok


def test_reweight_weights_reach_the_loss_on_identical_rollouts(e2e_run, gpu_check):
    plain, off, reweight = e2e_run("plain"), e2e_run("off"), e2e_run("reweight")
    same = gpu_check.check_same_rollouts(plain.metrics, reweight.metrics, 1, "reweight")
    assert same.ok, same.line()
    noise = gpu_check.pg_loss_noise(plain.metrics, off.metrics, 1)
    check = gpu_check.check_reweight(plain.metrics, reweight.metrics, 1, noise)
    assert check.ok, check.line()
    # a run without the method fails the same check
    assert not gpu_check.check_reweight(plain.metrics, off.metrics, 1, noise).ok


def test_mix_step_two_draws_follow_the_published_domain_probabilities(e2e_run, gpu_check):
    mix = e2e_run("mix")
    check = gpu_check.check_mix(mix.metrics)
    assert check.ok, check.line()
    probs = gpu_check.domain_series(mix.metrics, 1, "dataflex/domain_prob/")
    assert sorted(probs) == sorted(gpu_check.DOMAINS) and sum(probs.values()) == pytest.approx(1.0)
    for step in (1, 2, 3):
        assert sum(gpu_check.domain_series(mix.metrics, step, "dataflex/drawn/").values()) == gpu_check.BATCH


def test_two_steps_resume_one_step_equals_three_steps(e2e_run, gpu_check):
    full, resumed = e2e_run("mix"), e2e_run("mix_resume")
    assert sorted(full.metrics) == [1, 2, 3]
    assert sorted(resumed.metrics) == [3], "the resumed run must start after the step-2 checkpoint"
    check = gpu_check.check_resume(full.metrics, resumed.metrics, 3)
    assert check.ok, check.line()
    # the mixer's state came back: step 3 drew by the probabilities step 2 published
    for key in ("dataflex/domain_prob/math", "dataflex/drawn/math", "actor/pg_loss"):
        assert resumed.metrics[3][key] == pytest.approx(full.metrics[3][key], rel=1e-3, abs=1e-6), key
