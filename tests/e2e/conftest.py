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


def launch(config: pytest.Config, smoke, run, out: Path, env: dict[str, str], command=None):
    """``smoke.launch`` with a line when the run starts, every ``HEARTBEAT`` seconds while it runs, and at its end
    (``command`` replaces ``python -m verl.trainer.main_ppo``: the progress test's stand-in)."""
    job = smoke.Job(run, out, env, TIMEOUT, *([command] if command is not None else []))
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


def _configurations(smoke, inputs, out: Path) -> dict[str, Callable[[], list[str]]]:
    def run(steps: int, *, mode: str = "dataflex_sync", method: list[str] = (), save: bool = False,
            resume_from: Path | None = None, ckpt: str) -> list[str]:
        keys = smoke.checkpoint_overrides(out / ckpt, save=save, resume_from=resume_from)
        return harness.cpu_overrides(smoke, inputs, steps=steps, mode=mode, extra=[*keys, *method])

    return {
        # verl's own sync trainer: the reference every method is compared with
        "plain": lambda: run(2, mode="sync", ckpt="ckpt_plain"),
        # the adapter without a method: must train exactly like `plain` (off/off control)
        "off": lambda: run(2, ckpt="ckpt_off"),
        # the seed's quick-start overrides, verbatim
        "select": lambda: run(2, method=SEED, ckpt="ckpt_select"),
        "reweight": lambda: run(2, method=smoke.METHODS["reweight"], ckpt="ckpt_reweight"),
        "mix": lambda: run(3, method=smoke.METHODS["mix"], save=True, ckpt="ckpt_mix"),
        "mix_resume": lambda: run(3, method=smoke.METHODS["mix"], ckpt="ckpt_mix_resume",
                                  resume_from=out / "ckpt_mix" / "global_step_2"),
    }


@pytest.fixture(scope="session")
def smoke():
    return harness.load_smoke()


@pytest.fixture(scope="session")
def e2e_run(smoke, tmp_path_factory, pytestconfig):
    """``e2e_run(name)`` -> the finished run's :class:`gpu_smoke.RunResult` (started on first request)."""
    pytest.importorskip("verl")
    out = tmp_path_factory.mktemp("e2e")
    inputs = smoke.write_inputs(out / "inputs")
    configs = _configurations(smoke, inputs, out)
    env = harness.cpu_env(os.environ)
    done: dict[str, object] = {}
    needs = {"mix_resume": "mix"}

    def get(name: str):
        if name not in done:
            if name in needs:
                get(needs[name])
            done[name] = launch(pytestconfig, smoke, smoke.Run(name, configs[name]()), out, env)
        result = done[name]
        if result.returncode != 0:
            pytest.fail(f"main_ppo run {name!r} exited {result.returncode}; last lines of {result.log}:\n"
                        f"{result.tail()}", pytrace=False)
        return result

    return get
