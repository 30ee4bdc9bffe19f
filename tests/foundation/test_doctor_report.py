"""What every host's ``dataflex doctor`` shares: the verdict, ``--strict``, a block's warnings as a WARN check."""

from __future__ import annotations

import logging

from dataflex_bus import Runtime
from dataflex_bus.doctor import FAIL, OK, WARN, add_block, block_warnings, new_checks, report

NOTHING_KEPT = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                "actuator": {"name": "threshold_band", "params": {"low": 0.4, "high": 0.45}}, "warmup_step": 0}


def test_a_warning_fails_only_under_strict(capsys):
    checks, add = new_checks()
    add("a", OK, "fine")
    add("b", WARN, "hm")
    assert report(checks) == 0
    assert "warnings: b; no check failed" in capsys.readouterr().out
    assert report(checks, strict=True) == 1
    assert "warnings: b (failing under --strict)" in capsys.readouterr().out
    add("c", FAIL, "broken")
    assert report(checks) == 1 and "broken: c; warnings: b" in capsys.readouterr().out


def test_a_block_s_warnings_become_one_warn_check_not_log_lines(caplog):
    """Before: the probe's warning went to the log and the block was ``[  ok]``."""
    checks, add = new_checks()
    with caplog.at_level(logging.WARNING, logger="dataflex_bus"):
        with block_warnings() as warnings:
            Runtime(NOTHING_KEPT)
    assert not [r for r in caplog.records if "would be skipped" in r.getMessage()]
    add_block(add, "runs it", warnings)
    (check,) = checks
    assert check["status"] == WARN and check["detail"].startswith("runs it; but: keeps no row in a probe batch")
    checks, add = new_checks()
    add_block(add, "runs it", [])
    assert checks[0]["status"] == OK


def test_the_runtime_logs_a_block_warning_without_a_doubled_prefix(caplog):
    with caplog.at_level(logging.WARNING, logger="dataflex_bus"):
        Runtime(NOTHING_KEPT)
    (text,) = [r.getMessage() for r in caplog.records if "would be skipped" in r.getMessage()]
    assert text.startswith("dataflex: keeps no row") and "dataflex: dataflex:" not in text
