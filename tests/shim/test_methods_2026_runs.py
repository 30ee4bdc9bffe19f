"""The 2026 methods train on the shim: each example's block runs, a resumed run continues exactly (the
predictor's state in the checkpoint included) and the predictor's calibration reaches metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dataflex_bus.shim import run_training

from .conftest import tiny, without_times

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = {"trainer": {"prompts_per_step": 8, "group_size": 4, "save_every": 3},
         "data": {"domains": ["copy", "random"]}}
NAMES = ["dps", "cures", "cures_sampling", "vip", "no_positive_resampling", "snr_filter", "learnability", "sec"]
PREDICTS = {"dps", "cures", "cures_sampling", "vip", "learnability"}


def block_of(name: str) -> dict:
    block = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())["dataflex"]
    if name in ("cures", "vip"):  # 8 prompts x 4: the allocator's max_n stays within a tiny step
        block["actuator"]["params"]["max_n"] = 8
    return block


def run(block, steps, **kw):
    return run_training(tiny(block, **SMALL), steps=steps, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_a_resumed_run_continues_exactly(tmp_path, name):
    block = block_of(name)
    full = without_times(run(block, 6, out=tmp_path / "full").metrics)
    run(block, 3, out=tmp_path / "half")
    resumed = without_times(run(block, 6, out=tmp_path / "half", resume=True).metrics)
    assert resumed == full
    if name in PREDICTS:
        lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
        rows = [x for x in lines if "dataflex/predictor/brier" in x]
        assert len(rows) == 6
        assert all(0.0 <= x["dataflex/predictor/brier"] <= 1.0 for x in rows)
        # left out while undefined (every outcome or every prediction equal, as on a tiny policy)
        assert all(-1.0 <= x.get("dataflex/predictor/spearman", 0.0) <= 1.0 for x in rows)


def test_the_allocators_spend_plain_grpos_budget():
    for name in ("cures", "vip"):
        for x in run(block_of(name), 3).metrics:
            assert x["compute/generated_rollouts"] % 32 == 0
            assert x["dataflex/alloc/rollouts"] == 32.0
