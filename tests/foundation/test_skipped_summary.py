"""The end-of-training line of a run most of whose updates were skipped: the selection and what it kept."""

from __future__ import annotations

from dataflex_bus import Runtime
from dataflex_bus.step_metrics import skipped_summary

BAND = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
        "actuator": {"name": "threshold_band", "params": {"low": 0.4, "high": 0.45}}, "warmup_step": 0}


def test_most_updates_skipped_names_the_selection_and_its_kept_rate():
    runtime = Runtime(BAND)
    steps = [{"dataflex/skipped_update": 1.0, "dataflex/kept_fraction": 0.0}] * 3 + [
        {"dataflex/skipped_update": 0.0, "dataflex/kept_fraction": 0.2}]
    line = skipped_summary(runtime, steps)
    assert line is not None and line.startswith("dataflex: 3 of 4 updates were skipped")
    assert "select:threshold_band (group_solve_rate+threshold_band @ on_rollout) kept 5.0% of the rows" in line
    assert "dataflex doctor" in line


def test_no_line_when_at_most_half_were_skipped_or_without_a_block():
    runtime = Runtime(BAND)
    half = [{"dataflex/skipped_update": 1.0}, {"dataflex/skipped_update": 0.0}]
    assert skipped_summary(runtime, half) is None and skipped_summary(runtime, []) is None
    assert skipped_summary(Runtime(None), [{"dataflex/skipped_update": 1.0}]) is None


def test_a_stack_names_each_selection_with_its_own_rate():
    runtime = Runtime({"methods": [{**BAND, "name": "band"},
                                   {"name": "ar", "mechanism": "reweight", "scorer": {"name": "token_prob"},
                                    "actuator": {"name": "advantage_reweight"}}]})
    line = skipped_summary(runtime, [{"dataflex/skipped_update": 1.0, "dataflex/band/kept_fraction": 0.0}])
    assert line is not None and "band (group_solve_rate+threshold_band @ on_rollout) kept 0.0%" in line
    assert "ar (" not in line  # a reweighting keeps every row: not a selection
