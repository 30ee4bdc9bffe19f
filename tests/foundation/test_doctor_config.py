"""``dataflex doctor --config FILE`` without ``--host`` reads the file: a missing one is an error, the host is the
file's (a TRL ``dataflex:``/``grpo:`` file, a verl config), and the command says which host it checked."""

from __future__ import annotations

import json

import pytest

from dataflex_bus import logs
from dataflex_bus.cli import main

BLOCK = "dataflex:\n  mechanism: select\n  scorer: {name: reward_difficulty}\n  actuator: {name: dapo}\n"


@pytest.fixture(autouse=True)
def _no_log_setup(monkeypatch):
    monkeypatch.setattr(logs, "configure", lambda **_: None)  # the command's log set-up would outlive capsys


def test_a_missing_config_file_is_an_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    assert main(["doctor", "--config", str(missing)]) == 2
    captured = capsys.readouterr()
    assert str(missing) in captured.err and "no such config file" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_shim_run_config_is_refused_saying_what_checks_it(tmp_path, capsys):
    path = tmp_path / "shim.yaml"
    path.write_text("trainer: {steps: 2}\n" + BLOCK)
    assert main(["doctor", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "shim run config" in err and "dataflex validate" in err and "--host" in err


@pytest.mark.trl
def test_a_trl_config_file_is_checked_as_trl_and_the_host_is_said(tmp_path, capsys):
    pytest.importorskip("trl")
    path = tmp_path / "trl.yaml"
    path.write_text(BLOCK + "grpo: {num_generations: 1}\n")  # a GRPOConfig the block's selection cannot run under
    assert main(["doctor", "--json", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    checks = {c["check"]: c for c in json.loads(captured.out)}
    assert "DataflexGRPOTrainer" in checks and "GRPOConfig" in checks
    assert checks["dataflex block"]["status"] == "FAIL"
    assert "GRPOConfig.num_generations=1" in checks["dataflex block"]["detail"]
    assert "host 'trl'" in captured.err and str(path) in captured.err and "--host verl" in captured.err


def test_a_trl_file_sizing_its_rows_with_model_and_prompt_tokens_is_still_read_as_trl():
    from dataflex_bus.checkconfig import config_host

    model = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
             "vocab_size": 100}
    assert config_host({"dataflex": {}, "grpo": {}, "model": model, "prompt_tokens": 64})[0] == "trl"
    assert config_host({"dataflex": {}, "model": "my-model", "prompt_tokens": 64})[0] == "trl"
    # A shim run config has a model section too, and never grpo or prompt_tokens.
    assert config_host({"dataflex": {}, "model": {"hidden": 64}})[0] == "shim"


@pytest.mark.trl
def test_a_bare_block_file_is_read_as_trl_s_dataflex_file(tmp_path, capsys):
    pytest.importorskip("trl")
    path = tmp_path / "bare.yaml"
    path.write_text("mechanism: select\nscorer: {name: reward_difficulty}\nactuator: {name: dapo}\n")
    assert main(["doctor", "--json", "--config", str(path)]) == 0
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    assert "reward_difficulty+dapo @ on_rollout" in checks["dataflex block"]["detail"]


def test_a_verl_config_file_is_checked_as_verl_with_its_block(tmp_path, capsys):
    pytest.importorskip("verl")
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref: {rollout: {n: 8}}\nalgorithm: {adv_estimator: grpo}\n"
                    "dataflex:\n  mechanism: select\n  scorer: {name: group_solve_rat}\n  actuator: {name: dapo}\n")
    assert main(["doctor", "--json", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    checks = {c["check"]: c for c in json.loads(captured.out)}
    assert "entry point" in checks and checks["dataflex block"]["status"] == "FAIL"
    assert "did you mean 'group_solve_rate'" in checks["dataflex block"]["detail"]
    assert "host 'verl'" in captured.err and "--host trl" in captured.err
