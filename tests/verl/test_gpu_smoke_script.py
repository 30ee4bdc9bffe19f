"""The GPU smoke script's CPU-checkable parts: its config composes and its reward can tell runs apart.

The smoke compares ``actor/pg_loss`` with the method on and off. With a reward that is constant for a
random model (verl's gsm8k rule) every GRPO advantage is 0 and so is ``pg_loss``, on and off alike;
with a ``data_source`` verl has no rule for, the reward worker raises. Both would make the GPU run
useless, and neither needs a GPU to see.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    pytest.importorskip("verl")
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_config_composes_with_a_reward_every_data_source_gets(smoke, tmp_path):
    import pandas as pd
    import verl_harness as H
    from verl.trainer.ppo.reward import get_custom_reward_fn

    data, reward = smoke.write_data(tmp_path), smoke.write_reward(tmp_path)
    base = smoke.overrides(tmp_path / "model", data, tmp_path, "vllm", 1, reward)
    for method in smoke.METHODS.values():
        cfg = H.compose(base + method)
    assert cfg.trainer.v1.trainer_mode == "dataflex_sync"
    score = get_custom_reward_fn(cfg)  # what verl's reward workers load
    assert score is not None
    sources = set(pd.read_parquet(data)["data_source"])
    assert len(sources) == 2
    # a random model's responses: varied rewards within a group, whatever the data_source
    responses = ["7 12 code 88 3", "93 61 answer 70 51", "1 2 3 4 5", ""]
    for source in sources:
        values = [score(data_source=source, solution_str=r, ground_truth="0", extra_info={}) for r in responses]
        assert values == [0.6, 0.0, 1.0, 0.0]
