"""Logging: the library configures nothing; the command line renders console or JSON lines."""

import json
import logging
import subprocess
import sys

import pytest

# What an application does: configure output (the CLI does this), then build a runtime.
SCRIPT = """
from dataflex_bus import Runtime
from dataflex_bus.logs import configure
configure()
Runtime(None)
"""


def run(env_extra, script=SCRIPT):
    import os

    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.integration
def test_json_lines_record_plugins_and_methods():
    out = run({"DATAFLEX_LOG_FORMAT": "json"})
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    rec = next(e for e in events if e["event"] == "dataflex.runtime")
    assert "dataflex-bus==0.1.0" in rec["plugins"] and rec["methods"] == [] and rec["level"] == "info"


@pytest.mark.integration
def test_console_is_the_default():
    out = run({"DATAFLEX_LOG_FORMAT": ""})
    assert "dataflex.runtime" in out.stderr and not out.stderr.lstrip().startswith("{")


@pytest.mark.integration
def test_the_library_alone_prints_nothing_and_configures_nothing():
    out = run({"DATAFLEX_LOG_FORMAT": "json"}, "from dataflex_bus import Runtime\nRuntime(None)\n")
    assert out.returncode == 0 and out.stderr == "" and out.stdout == ""


def _logging_state():
    import structlog

    loggers = {name: logging.getLogger(name) for name in ("", "dataflex_bus")}
    return ({name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for name, lg in loggers.items()},
            structlog.is_configured(), structlog.get_config())


def test_building_a_runtime_changes_no_logging_configuration():
    from dataflex_bus import Runtime

    before = _logging_state()
    Runtime({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
             "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}})
    assert _logging_state() == before


def test_library_records_reach_the_applications_handlers(caplog):
    from dataflex_bus import Runtime

    with caplog.at_level(logging.INFO, logger="dataflex_bus"):
        Runtime(None)
    assert any(r.name == "dataflex_bus" and r.getMessage() == "dataflex.runtime" for r in caplog.records)
