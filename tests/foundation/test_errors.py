"""Errors keep their type and fields across pickling: Ray hands a worker's exception back to the driver."""

import pickle

import pytest

from dataflex_bus.errors import BatchFieldError, ConfigError, ConfigIssue, PluginRuntimeError, SignalInterrupt


@pytest.mark.parametrize("error", [
    ConfigError([ConfigIssue("dataflex.actuator.params.low", "out of range", [0, 1]),
                 ConfigIssue("dataflex.typo", "unknown key")]),
    BatchFieldError("scorer 'token_prob'", "old_log_probs", "non-finite values (NaN/inf) in rows [3]"),
    PluginRuntimeError("dataflex-bus:threshold_band", "on_rollout", ValueError("boom")),
    SignalInterrupt("SIGTERM", step=3),
])
def test_round_trip(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    if isinstance(error, ConfigError):
        assert [i.key for i in back.issues] == ["dataflex.actuator.params.low", "dataflex.typo"]
        assert back.issues[0].allowed == [0, 1]
    if isinstance(error, PluginRuntimeError):
        assert (back.plugin, back.hook) == ("dataflex-bus:threshold_band", "on_rollout")
    if isinstance(error, SignalInterrupt):
        assert (back.signal_name, back.step) == ("SIGTERM", 3)


class NeedsTwoArgs(Exception):
    def __init__(self, field, value):
        super().__init__(f"{field} got {value}")


def _local_error():
    class LocalError(ValueError):
        pass

    return LocalError("defined inside a function")


@pytest.mark.parametrize(("cause", "type_name", "message"), [
    (NeedsTwoArgs("weights", -1), "NeedsTwoArgs", "weights got -1"),
    (_local_error(), "LocalError", "defined inside a function"),
])
def test_an_unpicklable_cause_travels_as_text_keeping_plugin_and_hook(cause, type_name, message):
    from dataflex_bus.errors import RemoteCause

    try:
        raise cause
    except Exception as exc:  # a real traceback to carry
        error = PluginRuntimeError("dataflex-mine:wonky", "on_advantage", exc)
    with pytest.raises(Exception):  # noqa: B017 - the cause alone does not survive the trip
        pickle.loads(pickle.dumps(cause))
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is PluginRuntimeError and str(back) == str(error)
    assert (back.plugin, back.hook) == ("dataflex-mine:wonky", "on_advantage")
    assert isinstance(back.cause, RemoteCause)
    assert (back.cause.type_name, back.cause.message) == (type_name, message)
    assert "raise cause" in back.cause.traceback_text and type_name in back.cause.traceback_text
    again = pickle.loads(pickle.dumps(back))  # a second hop (driver -> another worker) changes nothing
    assert str(again) == str(error) and again.cause.traceback_text == back.cause.traceback_text


def test_a_picklable_cause_is_kept_as_is():
    error = PluginRuntimeError("p", "on_rollout", KeyError("rm_scores"))
    back = pickle.loads(pickle.dumps(error))
    assert type(back.cause) is KeyError and back.cause.args == ("rm_scores",)
