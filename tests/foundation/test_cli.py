from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dataflex_bus.cli import main


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_validate_ok_and_overrides(toys, tmp_path, capsys):
    cfg = write(tmp_path, "dataflex:\n  mechanism: select\n  scorer: {name: toy_reward}\n"
                          "  actuator: {name: toy_band, params: {low: 0.2, high: 0.8}}\n")
    assert main(["validate", cfg]) == 0
    assert "ok: mechanism=select" in capsys.readouterr().out
    assert main(["validate", cfg, "dataflex.actuator.params.low=0.9"]) == 2
    err = capsys.readouterr().err
    assert "dataflex.actuator.params.low" in err and "must be <= high" in err
    assert main(["validate", cfg, "+dataflex.scorer.name=toy_rewrd"]) == 2
    assert "did you mean 'toy_reward'" in capsys.readouterr().err


def test_validate_uses_host_context(toys, tmp_path, capsys):
    cfg = write(tmp_path, "algorithm: {adv_estimator: gae}\ndataflex:\n  mechanism: select\n"
                          "  scorer: {name: toy_group_rate}\n  actuator: {name: toy_band}\n")
    assert main(["validate", cfg]) == 2
    assert "not group-based" in capsys.readouterr().err


def test_validate_without_block(tmp_path, capsys):
    assert main(["validate", write(tmp_path, "trainer: {steps: 3}\n")]) == 2
    assert "no `dataflex:` block" in capsys.readouterr().err


def test_unknown_cli_arguments_are_refused():
    with pytest.raises(SystemExit):
        main(["plugins", "--jsn"])


def test_table_lists_first_party_packs(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("scorers", "select", "reweight", "mix"):
        assert name in out
    assert "group_solve_rate (scorer)" in out and "dump_ucb (mixer)" in out


def test_version_and_json_schema_via_console_entry():
    out = subprocess.run([sys.executable, "-m", "dataflex_bus.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.startswith("dataflex-bus ")
    out = subprocess.run([sys.executable, "-m", "dataflex_bus.cli", "plugins", "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert all(r["status"] == "active" and r["distribution"] == "dataflex-bus" for r in report
               if r["name"] in {"scorers", "select", "reweight", "mix"})
