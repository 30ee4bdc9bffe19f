"""The ``e2e`` tier: verl's real ``main_ppo`` on CPU, each configuration run once per session and shared.

A run is a subprocess with a timeout (``DATAFLEX_E2E_TIMEOUT`` seconds, default 900); its metrics come from
verl's file logger. Runs start lazily, when the first test that needs them asks, so ``-k`` selections pay
only for what they use.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "verl"))

import harness  # noqa: E402
from seed_config import SEED  # noqa: E402

TIMEOUT = float(os.environ.get("DATAFLEX_E2E_TIMEOUT", "900"))


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
def e2e_run(smoke, tmp_path_factory):
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
            done[name] = smoke.launch(smoke.Run(name, configs[name]()), out, env, TIMEOUT)
        result = done[name]
        if result.returncode != 0:
            pytest.fail(f"main_ppo run {name!r} exited {result.returncode}; last lines of {result.log}:\n"
                        f"{result.tail()}", pytrace=False)
        return result

    return get
