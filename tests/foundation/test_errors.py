"""Errors keep their type and fields across pickling: Ray hands a worker's exception back to the driver."""

import pickle

import pytest

from dataflex_bus.errors import BatchFieldError, ConfigError, ConfigIssue, PluginRuntimeError


@pytest.mark.parametrize("error", [
    ConfigError([ConfigIssue("dataflex.actuator.params.low", "out of range", [0, 1]),
                 ConfigIssue("dataflex.typo", "unknown key")]),
    BatchFieldError("scorer 'token_prob'", "old_log_probs", "non-finite values (NaN/inf) in rows [3]"),
    PluginRuntimeError("dataflex-bus:threshold_band", "on_rollout", ValueError("boom")),
])
def test_round_trip(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    if isinstance(error, ConfigError):
        assert [i.key for i in back.issues] == ["dataflex.actuator.params.low", "dataflex.typo"]
        assert back.issues[0].allowed == [0, 1]
    if isinstance(error, PluginRuntimeError):
        assert (back.plugin, back.hook) == ("dataflex-bus:threshold_band", "on_rollout")
