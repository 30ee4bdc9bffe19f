"""What a rollout row takes in a TRL step is estimated from the model's shape and the lengths known at construction
(dataflex_bus/trl/sizes.py), not a 1 KiB floor: the estimate stays within a factor of 2 of a real rollout's
measured memory on the tiny Llama, and an allocator's budget the machine cannot hold at that estimate is refused
at construction and by ``dataflex doctor --host trl``, naming the budget, the per-row estimate and the total,
before TRL's forward dies allocating it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("trl")

import trl_tiny as T

from dataflex_bus.cli import main
from dataflex_bus.errors import ConfigError
from dataflex_bus.trl import DataflexGRPOTrainer
from dataflex_bus.trl.host import describe
from dataflex_bus.trl.sizes import model_shape

pytestmark = pytest.mark.trl

GIB = 1024 ** 3
MIXED, FLAT = T.prompts()
#: The tiny Llama's shape (trl_tiny.model).
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": len(T.ALPHABET) + 3}

# One step of `budget` rollouts, in a fresh process: the growth of its peak RSS over the step, and the estimate.
MEASURE = """
import json, sys, tempfile
sys.path.insert(0, sys.argv[3])
import trl_tiny as T
from transformers.trainer_callback import PrinterCallback
from dataflex_bus.trl import DataflexGRPOTrainer
budget, width = int(sys.argv[1]), int(sys.argv[2])
mixed, flat = T.prompts()
rows = (mixed + flat)[:64]
block = {"methods": [{"mechanism": "allocate", "scorer": {"name": "knapsack_rate"},
                      "actuator": {"name": "knapsack", "params": {"budget": budget, "max_n": budget}}}]}
tok = T.tokenizer()
trainer = DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok,
                              args=T.config(tempfile.mkdtemp(), rows_per_gen=16, width=width, steps=1),
                              train_dataset=T.Dataset.from_list(rows), dataflex=block,
                              rollout_func=T.rollout({r["prompt"]: r["answer"] for r in rows}, width))
trainer.remove_callback(PrinterCallback)
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
# The peak is reset to the resident size first: ru_maxrss would keep a peak reached before the step (building
# the model and trainer), and the step's growth would then read as 0.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
trainer.train()
grew = status("VmHWM") - before
print(json.dumps({"grew": grew, "row_bytes": trainer.dataflex.host.row_bytes,
                  "rollouts": trainer.dataflex_metrics[-1]["dataflex/alloc/rollouts"]}))
"""


def _step(budget: int, width: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(budget), str(width), str(Path(__file__).parent)],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_row_estimate_is_within_a_factor_of_two_of_a_real_rollouts_measured_memory():
    """Peak RSS growth per rollout between a step of 512 and one of 3,072 rollouts (68.5 KiB a rollout when
    measured at completions of 6 tokens; the estimate 71 KiB); the 1 KiB floor was 68x too low."""
    small, large = _step(512, 6), _step(3072, 6)
    assert small["rollouts"] == 512 and large["rollouts"] == 3072
    measured = (large["grew"] - small["grew"]) / (3072 - 512)
    estimate = large["row_bytes"]
    assert measured / 2 <= estimate <= 2 * measured, (estimate, measured)


def _knapsack(budget: int) -> dict:
    return {"methods": [{"mechanism": "allocate", "scorer": {"name": "knapsack_rate"},
                         "actuator": {"name": "knapsack", "params": {"budget": budget, "max_n": 128}}}]}


def _trainer(budget: int, width: int) -> DataflexGRPOTrainer:
    tok = T.tokenizer()
    rows = MIXED[:8]
    return DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok,
                               args=T.config(tempfile.mkdtemp(), rows_per_gen=16, width=width, steps=1),
                               train_dataset=T.Dataset.from_list(rows), dataflex=_knapsack(budget),
                               rollout_func=T.rollout({r["prompt"]: r["answer"] for r in rows}, width))


@pytest.mark.parametrize(("budget", "width"), [(400_000, 6), (150_000, 24)])
def test_a_budget_beyond_memory_at_what_a_trl_row_holds_is_refused_at_construction(monkeypatch, budget, width):
    """On a 23 GiB machine: 400,000 rollouts of 6 completion tokens (about 27 GiB) and 150,000 of 24 (about
    29 GiB), both passed by the 1 KiB floor and died in TRL's forward."""
    monkeypatch.setattr("dataflex_bus.memory.machine_memory", lambda: 23 * GIB)
    with pytest.raises(ConfigError) as err:
        _trainer(budget, width)
    message = str(err.value)
    assert "dataflex.methods[0].actuator.params.budget:" in message and f"budget={budget:,}" in message
    assert "KiB a row on host 'trl'" in message and f"{width} completion tokens" in message
    assert "GiB" in message and "this machine has 23.0 GiB" in message


def test_a_budget_that_fits_at_what_a_trl_row_holds_is_accepted(monkeypatch):
    monkeypatch.setattr("dataflex_bus.memory.machine_memory", lambda: 23 * GIB)
    trainer = _trainer(4096, 6)
    assert trainer.dataflex.host.row_bytes == describe(trainer.args, model=model_shape(trainer.model.config),
                                                       prompt_tokens=4).row_bytes


def test_doctor_host_trl_refuses_a_budget_beyond_memory_at_the_models_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dataflex_bus.memory.machine_memory", lambda: 23 * GIB)
    path = tmp_path / "block.yaml"
    path.write_text(json.dumps({"dataflex": _knapsack(400_000), "model": TINY, "prompt_tokens": 4,
                                "grpo": {"max_completion_length": 6, "num_generations": 4,
                                         "per_device_train_batch_size": 16}}))
    assert main(["doctor", "--host", "trl", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "dataflex.methods[0].actuator.params.budget" in out and "a row on host 'trl'" in out
    assert "4 prompt + 6 completion tokens" in out
