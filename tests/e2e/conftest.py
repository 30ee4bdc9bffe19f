"""The ``e2e`` tier: verl's real ``main_ppo`` on CPU, each configuration run once per session and shared.

A run is a subprocess with a timeout (``DATAFLEX_E2E_TIMEOUT`` seconds, default 900); its metrics come from
verl's file logger. Runs start lazily, when the first test that needs them asks, so ``-k`` selections pay
only for what they use. A run takes minutes on a CPU, so the tier reports on the terminal (past pytest's
output capture) which test starts, which run it waits for, how many steps that run has logged every
``DATAFLEX_E2E_HEARTBEAT`` seconds (default 30), and how it ended.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "verl_tier"))

import harness  # noqa: E402
from seed_config import SEED  # noqa: E402

TIMEOUT = float(os.environ.get("DATAFLEX_E2E_TIMEOUT", "900"))
HEARTBEAT = float(os.environ.get("DATAFLEX_E2E_HEARTBEAT", "30"))


def say(config: pytest.Config, text: str) -> None:
    """One line on the terminal now, even while pytest captures the test's output."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"e2e: {text}")


#: The session's config, for the per-test line (``pytest_runtest_logstart`` gets no config).
_CONFIG: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # A per-test line, as -v would print it: the tier's dots come minutes apart.
    if _CONFIG is not None:
        say(_CONFIG, f"{nodeid} ...")


def _steps_logged(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
    except OSError:
        return 0


def launch(config: pytest.Config, gpu_check, run, out: Path, env: dict[str, str], command=None):
    """``gpu_check.launch`` with a line when the run starts, every ``HEARTBEAT`` seconds while it runs, and at its
    end (``command`` replaces ``python -m verl.trainer.main_ppo``: the progress test's stand-in)."""
    job = gpu_check.Job(run, out, env, TIMEOUT, *([command] if command is not None else []))
    say(config, f"main_ppo run {run.name!r} started (timeout {TIMEOUT:g} s; log {job.log})")
    beat = time.monotonic()
    while not job.finished():
        time.sleep(1.0)
        if time.monotonic() - beat >= HEARTBEAT:
            beat = time.monotonic()
            say(config, f"main_ppo run {run.name!r}: {beat - job.start:.0f} s, {_steps_logged(job.metrics_file)} "
                        "step(s) logged")
    result = job.result()
    took = time.monotonic() - job.start
    say(config, f"main_ppo run {run.name!r} ended: exit {result.returncode} after {took:.0f} s, "
                f"{len(result.metrics)} step(s) logged")
    return result


#: Requests wait up to this long (seconds, drawn from their seed) before the cpu_hf server generates them, so
#: they finish out of dispatch order (verl_cpu.DELAY_ENV); the runs of the real agent loop's rounds use it.
DELAY = "0.4"
#: The request of the ``refill`` run that fails (arrival order, 0-based: one of step 1's first round).
FAILED_REQUEST = "2"
#: The request of the ``speed`` run that fails: the first after step 1's 4 x 4 screening requests, which all
#: arrive at once, so one of its continuation requests (whatever order continuations are dispatched in).
FAILED_CONTINUATION = "16"

#: Dynamic sampling with refill: DAPO's zero-variance filter, fixed rounds of train_batch_size prompts.
REFILL = ["+dataflex.mechanism=select", "+dataflex.scorer.name=reward_difficulty", "+dataflex.actuator.name=dapo",
          "+dataflex.refill.policy=fixed", "+dataflex.refill.max_rounds=4", "+dataflex.refill.on_exhaust=train_short"]
#: Knapsack's counts at plain GRPO's budget; a prompt's estimate is valid after one visit's 4 rewards.
KNAPSACK = ["+dataflex.mechanism=allocate", "+dataflex.scorer.name=knapsack_rate",
            "+dataflex.scorer.params.min_buffer_length=4", "+dataflex.actuator.name=knapsack"]
#: Rows of the knapsack run's dataset: one step's prompts, so step 2 revisits them with step 1's rates.
KNAPSACK_ROWS = 4


def _configurations(gpu_check, inputs, out: Path) -> dict[str, Callable[[], tuple[list[str], dict[str, str]]]]:
    """name -> (overrides, environment additions) of each run, built when first asked for."""

    def run(steps: int, *, mode: str = "dataflex_sync", method: list[str] = (), save: bool = False,
            resume_from: Path | None = None, ckpt: str, env: dict[str, str] | None = None, data=inputs,
            **keys: object) -> tuple[list[str], dict[str, str]]:
        saving = gpu_check.checkpoint_overrides(out / ckpt, save=save, resume_from=resume_from)
        overrides = harness.cpu_overrides(gpu_check, data, steps=steps, mode=mode, extra=[*saving, *method], **keys)
        return overrides, dict(env or {})

    def rounds_env(name: str, **more: str) -> dict[str, str]:
        return {"DATAFLEX_CPU_HF_DELAY": DELAY, "DATAFLEX_CPU_HF_JOURNAL": str(out / f"{name}.requests"), **more}

    def knapsack():
        # its own 4-row dataset (and validation set): the model and reward rule are the others'
        root = out / "inputs_knapsack"
        root.mkdir(exist_ok=True)
        data = gpu_check.Inputs(inputs.model, gpu_check.write_data(root, rows=KNAPSACK_ROWS), inputs.reward)
        return run(2, method=KNAPSACK, ckpt="ckpt_knapsack", data=data, validate=True, env=rounds_env("knapsack"))

    return {
        # verl's own sync trainer: the reference every method is compared with
        "plain": lambda: run(2, mode="sync", ckpt="ckpt_plain"),
        # the adapter without a method: must train exactly like `plain` (off/off control)
        "off": lambda: run(2, ckpt="ckpt_off"),
        # the seed's quick-start overrides, verbatim
        "select": lambda: run(2, method=SEED, ckpt="ckpt_select"),
        # the GPU check's control: the same block warming up at step 1 must train exactly like `off`
        "control": lambda: run(1, method=gpu_check.METHODS["control"], ckpt="ckpt_control"),
        "reweight": lambda: run(2, method=gpu_check.METHODS["reweight"], ckpt="ckpt_reweight"),
        "mix": lambda: run(3, method=gpu_check.METHODS["mix"], save=True, ckpt="ckpt_mix"),
        "mix_resume": lambda: run(3, method=gpu_check.METHODS["mix"], ckpt="ckpt_mix_resume",
                                  resume_from=out / "ckpt_mix" / "global_step_2"),
        # the real agent loop under the kit's rounds, requests finishing out of dispatch order: SPEED in bf16
        # (the GPU check's run) with a failed continuation request, dynamic sampling with refill and a failed
        # screening request, Knapsack with validation
        "speed": lambda: run(2, method=gpu_check.METHODS["speed"], ckpt="ckpt_speed", precision="bf16",
                             env=rounds_env("speed", DATAFLEX_CPU_HF_FAIL=FAILED_CONTINUATION)),
        "refill": lambda: run(2, method=REFILL, ckpt="ckpt_refill",
                              env=rounds_env("refill", DATAFLEX_CPU_HF_FAIL=FAILED_REQUEST)),
        "knapsack": knapsack,
    }


@pytest.fixture(scope="session")
def gpu_check():
    return harness.load_gpu_check()


@pytest.fixture(scope="session")
def e2e_out(tmp_path_factory) -> Path:
    """The session's work folder: inputs, logs, checkpoints and the cpu_hf request journals of every run."""
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def e2e_run(gpu_check, e2e_out, pytestconfig):
    """``e2e_run(name)`` -> the finished run's :class:`gpu_check.RunResult` (started on first request)."""
    pytest.importorskip("verl")
    out = e2e_out
    inputs = gpu_check.write_inputs(out / "inputs")
    configs = _configurations(gpu_check, inputs, out)
    env = harness.cpu_env(os.environ)
    done: dict[str, object] = {}
    needs = {"mix_resume": "mix"}

    def get(name: str):
        if name not in done:
            if name in needs:
                get(needs[name])
            overrides, more = configs[name]()
            done[name] = launch(pytestconfig, gpu_check, gpu_check.Run(name, overrides), out, {**env, **more})
        return harness.finished(name, done[name])

    return get
