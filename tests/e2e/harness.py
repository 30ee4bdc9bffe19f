"""Runs verl 0.9.1's real ``python -m verl.trainer.main_ppo`` on a CPU box (test-only, never shipped).

The model, data, reward and verl keys are the GPU check's (``scripts/gpu_check.py``, imported by path);
this module adds what a CPU needs: the backend module :mod:`verl_cpu` loaded into every Ray worker
through ``VERL_USE_EXTERNAL_MODULES``, and the verl keys below.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: The backend module's import name (``tests/e2e/verl_cpu.py``) and its rollout name.
BACKEND_MODULE = "verl_cpu"
ROLLOUT_NAME = "cpu_hf"

#: verl keys for a 2-core CPU box (shared spec verl.md section 14).
CPU_KEYS = [
    "trainer.device=cpu",
    # verl's resource pools always ask Ray for GPUs: declare one logical GPU.
    "+ray_kwargs.ray_init.num_gpus=1",
    "ray_kwargs.ray_init.num_cpus=8",
    "+ray_kwargs.ray_init.include_dashboard=False",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.ref.strategy=fsdp2",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
    "+actor_rollout_ref.model.override_config.attn_implementation=eager",
    "actor_rollout_ref.model.use_remove_padding=False",
    # verl's defaults start 8 agent-loop and 8 reward workers: minutes of imports on two cores.
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
]


def cpu_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus what loads the CPU backend into the driver and every Ray worker."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), out.get("PYTHONPATH", "")) if p)
    modules = [m for m in out.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m and m != BACKEND_MODULE]
    out["VERL_USE_EXTERNAL_MODULES"] = ",".join([BACKEND_MODULE, *modules])
    out.setdefault("PYTHONHASHSEED", "0")
    out.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray's memory monitor kills our workers when the *machine* passes 95% memory, whoever uses it; a shared
    # CI or dev box does. The kernel still stops a run that really runs out of memory.
    out.setdefault("RAY_memory_monitor_refresh_ms", "0")
    return out


def load_gpu_check() -> ModuleType:
    """``scripts/gpu_check.py`` as a module (its writers, overrides, parser and checks)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses resolve their module by name
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def cpu_overrides(gpu_check: ModuleType, inputs, *, steps: int, mode: str = "dataflex_sync",
                  extra: Sequence[str] = (), **keys: object) -> list[str]:
    """The GPU check's keys (``keys``: more arguments of its ``base_overrides``) with the CPU rollout and
    :data:`CPU_KEYS`, plus ``extra``."""
    return [*gpu_check.base_overrides(inputs, steps=steps, rollout=ROLLOUT_NAME, mode=mode, **keys), *CPU_KEYS,
            *extra]


def finished(name: str, result, what: str = ""):
    """``result`` of the ``main_ppo`` run ``name`` when it exited 0; otherwise the test fails with the log's tail."""
    if result.returncode != 0:
        import pytest

        pytest.fail(f"main_ppo run {name!r}{what} exited {result.returncode}; last lines of {result.log}:\n"
                    f"{result.tail()}", pytrace=False)
    return result


def assert_select_removed_rows_before_the_update(gpu_check: ModuleType, plain, select, rows: int) -> None:
    """The seed's select at step 1: the same rollouts as ``plain``, rows removed before verl's update."""
    same = gpu_check.check_same_rollouts(plain.metrics, select.metrics, 1, "select")
    assert same.ok, same.line()
    check = gpu_check.check_select(plain.metrics, select.metrics, 1, rows=rows)
    assert check.ok, check.line()
    step1 = select.metrics[1]
    assert step1["dataflex/kept_fraction"] < 1.0
    assert step1["dataflex/rollout/rows"] == rows
    # verl's own metrics only saw the kept rows: the removed (code) groups scored 0
    assert step1["critic/score/mean"] > step1["dataflex/rollout/reward_mean"]
