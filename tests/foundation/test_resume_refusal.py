"""Resuming under another dataflex block: the refusal names only the keys that differ (dotted paths), says
which side has a block when one has none, and says what to do instead (the same message on every host)."""

from __future__ import annotations

import pytest

from dataflex_bus import Runtime
from dataflex_bus.confdiff import RESUME_FIX, differences, resume_refusal
from dataflex_bus.errors import ConfigError

BAND = {"mechanism": "select", "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
        "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}, "warmup_step": 0}


def test_differences_are_dotted_keys_with_both_values_lists_item_by_item():
    saved = {"a": {"b": 1, "c": [1, {"d": 2}]}, "e": 3}
    now = {"a": {"b": 2, "c": [1, {"d": 5}]}, "e": 3, "f": "x"}
    assert differences(saved, now) == ["a.b: checkpoint 1, config 2", "a.c[1].d: checkpoint 2, config 5",
                                       "f: checkpoint None, config 'x'"]
    assert differences({"l": [1, 2]}, {"l": [1]}) == ["l: checkpoint [1, 2], config [1]"]
    assert differences(saved, saved) == []


def test_a_block_on_one_side_only_is_named_with_the_side_that_has_it():
    (line,) = differences({"dataflex": BAND}, {"dataflex": None})
    assert line == "dataflex: checkpoint: a dataflex block (select group_solve_rate+threshold_band); config: none"
    (line,) = differences({}, {"dataflex": BAND})
    assert line == "dataflex: config: a dataflex block (select group_solve_rate+threshold_band); checkpoint: none"


def test_a_long_value_is_clipped():
    (line,) = differences({"k": "x" * 1000}, {"k": "y"})
    assert len(line) < 250 and line.endswith("config 'y'")


def test_pipeline_refusal_lists_only_the_changed_key_and_the_fix():
    """Before: ``saved {...whole block...}, now {...whole block...}``, no key named, no fix."""
    runtime = Runtime(BAND)
    state = runtime.state_dict()
    other = Runtime({**BAND, "actuator": {"name": "threshold_band", "params": {"low": 0.3, "high": 0.8}}})
    with pytest.raises(ConfigError) as err:
        other.load_state_dict(state)
    text = str(err.value)
    assert "different dataflex config" in text
    assert "dataflex.actuator.params.low: checkpoint 0.2, this run 0.3" in text
    assert "success_threshold" not in text and "warmup_step" not in text  # the keys that agree are not printed
    assert RESUME_FIX in text


def test_runtime_refusal_says_which_side_has_the_block():
    """Before: "checkpoint and config disagree on whether a dataflex method is configured" either way."""
    with pytest.raises(ConfigError) as err:
        Runtime(None).load_state_dict(Runtime(BAND).state_dict())
    text = str(err.value)
    assert "checkpoint: a dataflex block (select group_solve_rate+threshold_band); this run: none" in text
    assert "the checkpoint's block: {" in text and '"low": 0.2' in text  # what to pass to resume
    with pytest.raises(ConfigError) as err:
        Runtime(BAND).load_state_dict(Runtime(None).state_dict())
    assert "this run: a dataflex block (select group_solve_rate+threshold_band); checkpoint: none" in str(err.value)


def test_agreeing_blocks_give_no_refusal():
    assert resume_refusal(BAND, BAND) is None and resume_refusal(None, None) is None
