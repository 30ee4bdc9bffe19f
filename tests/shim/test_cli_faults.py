"""Every user error of the fault catalogue through the `dataflex` command line: exit code 2 (130 for an
interrupt), one error line naming the culprit, never a traceback; the real executable for the faults that
need two processes or a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dataflex_bus.cli import main
from dataflex_bus.shim.files import load_checkpoint, save_checkpoint

from . import faults
from .conftest import tiny


def write(path: Path, config) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture
def cfg(tmp_path):
    return write(tmp_path / "tiny.yaml", tiny())


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main(["run", *args, "--no-progress"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "Traceback" not in out.out
    return rc, out.out, out.err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("dataflex run: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_out_is_a_file_or_under_a_file(cfg, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, _, err = run(capsys, cfg, "--out", str(afile))
    assert rc == 2 and "exists and is not a directory" in error_line(err)
    rc, _, err = run(capsys, cfg, "--out", str(afile / "run"))
    assert rc == 2 and f"{afile} is a file" in error_line(err)


def test_read_only_out(cfg, tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    with faults.read_only(out):
        rc, _, err = run(capsys, cfg, "--out", str(out))
    assert rc == 2 and str(out) in error_line(err)
    assert not (out / "run.json").exists()


def test_absurd_group_size(cfg, tmp_path, capsys):
    rc, _, err = run(capsys, cfg, "--out", str(tmp_path / "o"), "trainer.group_size=100000000000")
    assert rc == 2 and "trainer.group_size: 100000000000 makes the run need about" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.integration
@pytest.mark.parametrize("command", [["validate"], ["run", "--dry-run"], ["run", "--no-progress"]])
def test_absurd_group_size_with_a_selection_under_a_memory_limit(tmp_path, command):
    """The selection probe once built (n+1) x n rows before the memory check ran: killed by the kernel, or
    a MemoryError traceback under a limit. Address space is capped at 3 GiB, so a regression fails fast."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 1024 ** 3, resource.getrlimit(resource.RLIMIT_AS)[1]))

    example = str(faults.ROOT / "examples" / "difficulty_filter.yaml")
    proc = subprocess.run([sys.executable, "-m", "dataflex_bus.cli", *command, example,
                           "trainer.group_size=100000000000", *(["--out", str(tmp_path / "o")] if "run" in command
                                                                else [])],
                          capture_output=True, text=True, env=faults.env(), preexec_fn=cap, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "trainer.group_size: 100000000000 makes the run need about" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.integration
def test_locked_out(cfg, tmp_path, capsys):
    out = tmp_path / "o"
    with faults.lock_holder(out) as pid:
        rc, _, err = run(capsys, cfg, "--out", str(out))
        assert rc == 2 and f"in use by another dataflex run (pid {pid}" in error_line(err)
        rc, _, err = run(capsys, cfg, "--out", str(out), "--resume")
        assert rc == 2 and f"pid {pid}" in error_line(err)


@pytest.fixture
def done(cfg, tmp_path, capsys):
    out = tmp_path / "done"
    assert run(capsys, cfg, "--out", str(out), "--steps", "4")[0] == 0
    return out


def test_resume_with_fewer_steps(cfg, done, capsys):
    rc, _, err = run(capsys, cfg, "--out", str(done), "--steps", "2", "--resume")
    assert rc == 2 and "trainer.steps: 2 is below the step of the checkpoint" in err


def test_resume_reports_the_steps_the_record_holds(cfg, done, capsys):
    rc, out, _ = run(capsys, cfg, "--out", str(done), "--steps", "6", "--resume")
    record = json.loads((done / "run.json").read_text())
    assert rc == 0 and out.startswith("done: 6 steps") and record["steps"] == 6
    assert record["counters"]["steps_done"] == 6


def test_damaged_metrics_line(cfg, done, capsys):
    path = done / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:30]
    path.write_text("\n".join(lines) + "\n")
    rc, _, err = run(capsys, cfg, "--out", str(done), "--steps", "6", "--resume")
    assert rc == 2 and f"{path}: line 2 is not valid JSON" in error_line(err)


def test_garbage_run_record_at_resume(cfg, done, capsys):
    (done / "run.json").write_bytes(b"\x00garbage")
    rc, _, err = run(capsys, cfg, "--out", str(done), "--steps", "6", "--resume")
    assert rc == 2 and f"{done / 'run.json'}: is not valid JSON" in error_line(err)
    assert (done / "run.json").read_bytes() == b"\x00garbage"


def test_flipped_byte_and_wrong_type_in_the_checkpoint(cfg, done, capsys):
    path = done / "checkpoint.pt"
    state = load_checkpoint(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    rc, _, err = run(capsys, cfg, "--out", str(done), "--steps", "6", "--resume")
    assert rc == 2 and "checksum mismatch" in error_line(err)
    state["runtime"] = ["not", "a", "mapping"]
    save_checkpoint(state, done)
    rc, _, err = run(capsys, cfg, "--out", str(done), "--steps", "6", "--resume")
    assert rc == 2 and "entry 'runtime' holds list" in error_line(err)


def test_domains_run_would_refuse_after_the_warm_start(tmp_path, capsys):
    config = tiny({"mechanism": "mix", "scorer": {"name": "advantage_magnitude"}, "actuator": {"name": "dump_ucb"},
                   "domains": ["copy", "poetry"]})
    rc, _, err = run(capsys, write(tmp_path / "mix.yaml", config), "--out", str(tmp_path / "o"))
    assert rc == 2 and "dataflex.domains: domains ['poetry'] are not in data.domains" in err
    assert not (tmp_path / "o").exists()


def test_plugin_exit_and_interrupt(tmp_path, capsys, register):
    import torch

    from dataflex_bus import Selection, Selector

    class Quits(Selector):
        def select(self, batch, score, step_id):
            if step_id == 1:
                sys.exit(0)
            return Selection(torch.ones(len(batch), dtype=torch.bool))

    class CtrlC(Selector):
        def select(self, batch, score, step_id):
            if step_id == 1:
                raise KeyboardInterrupt
            return Selection(torch.ones(len(batch), dtype=torch.bool))

    register("selector", "t_quits", Quits)
    register("selector", "t_ctrl_c", CtrlC)
    block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "t_quits"}}
    config = write(tmp_path / "q.yaml", tiny(block))
    rc, _, err = run(capsys, config, "--out", str(tmp_path / "q"))
    assert rc == 2 and "plugin 'local:t_quits' failed in hook 'on_advantage': SystemExit: 0" in error_line(err)
    assert "last checkpoint" in err
    rc, _, err = run(capsys, config, "--out", str(tmp_path / "c"), "dataflex.actuator.name=t_ctrl_c")
    assert rc == 130 and "interrupted (interrupted in plugin 'local:t_ctrl_c'" in err
    assert f"the last checkpoint ({tmp_path / 'c' / 'checkpoint.pt'}, step 1) is intact" in err
    assert json.loads((tmp_path / "c" / "run.json").read_text())["status"] == "interrupted"


def test_a_score_requiring_grad_trains_and_is_named(tmp_path, capsys, register):
    """Without the detach the PPO update fails in autograd (a traceback naming no plugin, exit 1)."""
    import torch

    from dataflex_bus import Scorer

    class GradScore(Scorer):
        requires = ("rm_scores", "response_mask")
        timing = "post_advantage"

        def score(self, batch, step_id, **ctx):
            return torch.ones(len(batch), requires_grad=True) * (1.0 + batch.rewards)

    register("scorer", "t_grad_score", GradScore)
    block = {"mechanism": "reweight", "scorer": {"name": "t_grad_score"}, "actuator": {"name": "softmax"}}
    rc, out, err = run(capsys, write(tmp_path / "g.yaml", tiny(block)), "--out", str(tmp_path / "g"))
    assert rc == 0 and out.startswith("done: 3 steps")
    assert "scorer 't_grad_score' returned a score that requires grad; detached" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_arriving_while_a_plugin_runs_is_not_the_plugins_interrupt(tmp_path, capsys, register, signum):
    """Once reported as "interrupted in plugin 'dataflex-bus:dump_ucb'": the plugin did nothing wrong."""
    import time

    from dataflex_bus import Scorer

    class Busy(Scorer):
        requires = ("rm_scores", "response_mask")

        def score(self, batch, step_id, **ctx):
            if step_id == 1:
                os.kill(os.getpid(), signum)  # a scheduler's stop, or Ctrl-C, while this code runs
                time.sleep(5)
            return batch.rewards

    register("scorer", "t_busy", Busy)
    block = {"mechanism": "select", "scorer": {"name": "t_busy"}, "actuator": {"name": "topk_fraction"}}
    out = tmp_path / "o"
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    rc, _, err = run(capsys, write(tmp_path / "b.yaml", tiny(block)), "--out", str(out))
    name = signal.Signals(signum).name
    (line,) = [line for line in err.splitlines() if line.startswith("dataflex run: interrupted")]
    assert rc == 130 and line.startswith(f"dataflex run: interrupted ({name}) at step 1; the last checkpoint")
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted" and record["error"] == f"interrupted at step 1: {name}"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


# ---------------------------------------------------------------------------- the real executable
def dataflex(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dataflex_bus.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.integration
def test_two_processes_on_one_out_then_sigterm_then_resume(tmp_path):
    config = write(tmp_path / "tiny.yaml", tiny(trainer={"save_every": 1}))
    out = tmp_path / "o"
    env = faults.env()
    first = dataflex("run", config, "--out", str(out), "--steps", "100000", "--no-progress", env=env)
    try:
        faults.wait_for_checkpoint(out, first, at_least=2)
        second = dataflex("run", config, "--out", str(out), "--steps", "3", "--seed", "1", "--no-progress", env=env)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2 and "Traceback" not in err
        assert f"in use by another dataflex run (pid {first.pid}" in err
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=300)
    assert first.returncode == 130 and "interrupted (SIGTERM) at step " in err and "Traceback" not in err
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted" and record["seed"] == 0
    assert [s["pid"] for s in record["sessions"]] == [first.pid]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [float(i) for i in range(len(steps))]  # one run's steps, in order, none twice
    at = load_checkpoint(out / "checkpoint.pt")["step"]
    resumed = dataflex("run", config, "--out", str(out), "--steps", str(at + 1), "--resume", "--no-progress", env=env)
    stdout, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert stdout.startswith(f"done: {at + 1} steps")
    record = json.loads((out / "run.json").read_text())
    assert [s["status"] for s in record["sessions"]] == ["interrupted", "complete"]


@pytest.mark.integration
def test_installed_pack_calling_sys_exit_fails_the_command(tmp_path):
    from foundation.fakedist import make_dist

    make_dist(tmp_path / "site", "dataflex-quitter", "0.1.0", {
        "quitter_pack.plugin": """
from dataflex_bus import hookimpl

@hookimpl
def dataflex_register(register):
    register("selector", "quits", "quitter_pack.comps:Quits")
""",
        "quitter_pack.comps": """
import sys
import torch
from dataflex_bus import Selection, Selector

class Quits(Selector):
    def select(self, batch, score, step_id):
        if step_id == 1:
            sys.exit(0)
        return Selection(torch.ones(len(batch), dtype=torch.bool))
"""}, {"quitter": "quitter_pack.plugin"})
    block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "quits"}}
    config = write(tmp_path / "q.yaml", tiny(block))
    env = faults.env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    proc = dataflex("run", config, "--out", str(tmp_path / "o"), "--no-progress", env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err
    assert "plugin 'dataflex-quitter:quits' failed in hook 'on_advantage': SystemExit: 0" in err
    record = json.loads((tmp_path / "o" / "run.json").read_text())
    assert record["status"] == "failed" and load_checkpoint(tmp_path / "o" / "checkpoint.pt")["step"] == 1


def test_sigterm_handler_is_restored(cfg, tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert run(capsys, cfg, "--out", str(tmp_path / "o"), "--steps", "1")[0] == 0
    assert signal.getsignal(signal.SIGTERM) is before


RAISER = {
    "raiser_pack.plugin": """
from dataflex_bus import hookimpl

@hookimpl
def dataflex_register(register):
    register("scorer", "raises_at_1", "raiser_pack.comps:RaisesAt1")
    register("scorer", "cannot_import", "raiser_pack.broken:Never")
""",
    "raiser_pack.comps": """
from dataflex_bus import Score, Scorer

class RaisesAt1(Scorer):
    requires = ("rm_scores", "response_mask")

    def score(self, batch, step, **ctx):
        if step == 1:
            raise ValueError("scorer bug at step 1")  # RAISES HERE
        return Score(batch.rewards, "response")
""",
    "raiser_pack.broken": """
import math
import raiser_pack_missing_dependency  # IMPORT FAILS HERE
""",
}


def _line_of(source: str, marker: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), start=1) if marker in line)


@pytest.mark.integration
def test_debug_mode_prints_the_plugins_file_and_line_and_the_record_keeps_them(tmp_path):
    from foundation.fakedist import make_dist

    site = make_dist(tmp_path / "site", "dataflex-raiser", "0.1.0", RAISER, {"raiser": "raiser_pack.plugin"})
    env = faults.env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    exe = str(Path(sys.executable).with_name("dataflex"))
    comps = site / "raiser_pack" / "comps.py"
    where = f'File "{comps}", line {_line_of(comps.read_text(), "RAISES HERE")}, in score'
    block = {"mechanism": "select", "scorer": {"name": "raises_at_1"}, "actuator": {"name": "topk_fraction"}}
    config = write(tmp_path / "r.yaml", tiny(block))

    def run(out: str, debug: bool, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, "run", config, "--out", str(tmp_path / out), "--no-progress", *extra],
                              env={**env, "DATAFLEX_DEBUG": "1" if debug else "0"}, capture_output=True, text=True,
                              timeout=300)

    quiet = run("quiet", False)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert "plugin 'dataflex-raiser:raises_at_1' failed in hook 'on_advantage': ValueError: scorer bug" in quiet.stderr
    # run.json keeps where it happened, debug mode or not
    record = json.loads((tmp_path / "quiet" / "run.json").read_text())
    assert record["status"] == "failed" and where in record["traceback"]
    assert where in record["sessions"][-1]["traceback"]

    loud = run("loud", True)
    assert loud.returncode == 2 and "Traceback (most recent call last)" in loud.stderr
    assert where in loud.stderr and 'raise ValueError("scorer bug at step 1")' in loud.stderr
    errors = [line for line in loud.stderr.splitlines() if line.startswith("dataflex run:")]
    assert errors[0].startswith("dataflex run: error: plugin 'dataflex-raiser:raises_at_1' failed")  # still last

    # an import error inside a component module: the module's file and line, under debug only
    broken = site / "raiser_pack" / "broken.py"
    imported = run("imp", True, "dataflex.scorer.name=cannot_import")
    assert imported.returncode == 2
    assert f'File "{broken}", line {_line_of(broken.read_text(), "IMPORT FAILS HERE")}' in imported.stderr
    assert "ModuleNotFoundError: No module named 'raiser_pack_missing_dependency'" in imported.stderr
    assert "Traceback" not in run("imp2", False, "dataflex.scorer.name=cannot_import").stderr
