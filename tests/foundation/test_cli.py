from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_a_missing_config_file_is_named_as_such(tmp_path, capsys):
    for command in ("validate", "run"):
        assert main([command, str(tmp_path / "nope.yaml")]) == 2
        assert capsys.readouterr().err == f"dataflex {command}: error: {tmp_path / 'nope.yaml'}: no such config file\n"


def test_validate_uses_host_context(toys, tmp_path, capsys):
    cfg = write(tmp_path, "algorithm: {adv_estimator: gae}\ndataflex:\n  mechanism: select\n"
                          "  scorer: {name: toy_group_rate}\n  actuator: {name: toy_band}\n")
    assert main(["validate", cfg]) == 2
    assert "not group-based" in capsys.readouterr().err


def test_validate_without_block_is_plain_grpo(tmp_path, capsys):
    assert main(["validate", write(tmp_path, "trainer: {steps: 3}\n")]) == 0
    assert "no method" in capsys.readouterr().out


MISTAKES = """
trainer: {stepz: 3, lr: abc, steps: -3}
model: {hiden: 3}
data: {domains: [copy, divide]}
dataflex:
  mechanism: select
  scorer: {name: group_solve_rat}
  actuator: {name: threshold_band, params: {low: 0.2, hgh: 0.8}}
  warmup: 1
"""


def test_validate_and_dry_run_report_the_same_problems_in_every_section(tmp_path, capsys):
    cfg = write(tmp_path, MISTAKES)
    assert main(["validate", cfg]) == 2
    validate_err = capsys.readouterr().err
    assert main(["run", cfg, "--dry-run", "--out", str(tmp_path / "run")]) == 2
    run_err = capsys.readouterr().err
    problems = [line for line in validate_err.splitlines() if line.startswith("  - ")]
    assert problems == [line for line in run_err.splitlines() if line.startswith("  - ")]
    keys = [p.split(": ")[0][4:] for p in problems]
    assert keys == ["trainer.stepz", "trainer.steps", "trainer.lr", "model.hiden", "data.domains", "dataflex.warmup",
                    "dataflex.scorer.name", "dataflex.actuator.params.hgh", "dataflex.actuator.params.high"]
    for typo, right in (("stepz", "steps"), ("hiden", "hidden"), ("warmup", "warmup_step"), ("hgh", "high"),
                        ("group_solve_rat", "group_solve_rate")):
        assert f"did you mean '{right}'" in next(p for p in problems if typo in p)
    assert not (tmp_path / "run").exists()


def test_dry_run_of_a_good_config_prints_what_validate_prints(tmp_path, capsys):
    cfg = write(tmp_path, "dataflex:\n  mechanism: select\n  scorer: {name: group_solve_rate}\n"
                          "  actuator: {name: threshold_band, params: {low: 0.2, high: 0.8}}\n")
    assert main(["validate", cfg]) == 0
    out = capsys.readouterr().out
    assert main(["run", cfg, "--dry-run", "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == out and not (tmp_path / "run").exists()


def test_verl_config_context_is_checked_not_crashed(toys, tmp_path, capsys):
    cfg = write(tmp_path, "actor_rollout_ref: {rollout: {n: abc}}\ndataflex:\n  mechanism: select\n"
                          "  scorer: {name: toy_group_rate}\n  actuator: {name: toy_bnd}\n")
    assert main(["validate", cfg]) == 2
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.n: expected an integer >= 1" in err and "dataflex.actuator.name" in err
    assert "Traceback" not in err


def test_unknown_option_shows_the_subcommands_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", write(tmp_path, "trainer: {steps: 1}\n"), "--stepz", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dataflex run" in err and "unrecognized arguments: --stepz" in err


def test_help_describes_the_tool_in_full_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    assert "check a host integration." in out and "``" not in out
    # every mechanism and every host (the help once named three and one)
    assert "(select, reweight, mix, replay, allocate)" in out and "(the CPU shim, verl, TRL)" in out


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


def test_the_parsers_kind_choices_are_the_registered_component_kinds():
    from dataflex_bus import cli
    from dataflex_bus.mechanisms import component_kinds

    info = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["info"]._actions
                if "--kind" in a.option_strings)
    assert info.choices == [*component_kinds(), "actuator"]
    assert component_kinds() == ("scorer", "predictor", "selector", "reweighter", "mixer", "replayer", "allocator")


def dataflex_executable() -> str:
    """The console script installed next to this interpreter (what a user types)."""
    exe = Path(sys.executable).with_name("dataflex")
    if not exe.exists():
        pytest.skip(f"no dataflex console script next to {sys.executable}")
    return str(exe)


@pytest.mark.integration
@pytest.mark.parametrize("args", [["info", "dapo"], ["plugins", "--json"], ["plugins"]], ids=" ".join)
def test_a_reader_that_stops_reading_ends_the_command_quietly(args):
    exe = dataflex_executable()
    # `| head -1` under pipefail: the pipeline succeeds and prints the command's first line.
    shell = subprocess.run(["bash", "-o", "pipefail", "-c", f"{exe} {' '.join(args)} | head -1"],
                           capture_output=True, text=True, timeout=120)
    assert shell.returncode == 0 and shell.stderr == "" and shell.stdout.count("\n") == 1, shell
    # The reader gone before the first byte is written: the write itself fails (no luck with timing).
    proc = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == "", err
