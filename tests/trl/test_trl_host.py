"""The TRL host's description and its rules, checked without TRL (the description is import-light)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataflex_bus.config import load_config
from dataflex_bus.errors import ConfigError
from dataflex_bus.trl.host import OTHER_LOSS_TYPES, SUPPORTED_LOSS_TYPES, describe
from dataflex_bus.validation import validate

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = {"mechanism": "select", "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
               "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}, "warmup_step": 0}
ARGS = {"num_generations": 8, "loss_type": "dapo", "gradient_accumulation_steps": 1, "steps_per_generation": 1}


def test_the_description_is_trl_s_batch():
    host = describe(ARGS)
    assert (host.name, host.adv_estimator, host.group_size, host.loss_agg, host.processes) == (
        "trl", "grpo", 8, "dapo", 1)
    assert {"prompts", "responses", "response_mask", "loss_mask", "rm_scores"} <= host.fields["on_rollout"]
    assert "rollout_log_probs" not in host.fields["on_rollout"] and "vLLM" in host.why_not("rollout_log_probs")
    assert {"old_log_probs", "advantages", "entropy"} <= host.fields["on_advantage"]
    assert "ref_log_prob" not in host.fields["on_advantage"] and "beta" in host.why_not("ref_log_prob")
    assert "ref_log_prob" in describe({**ARGS, "beta": 0.04}).fields["on_advantage"]
    assert {"values", "returns", "rollout_is_weights"}.isdisjoint(host.fields["on_advantage"])
    assert host.capabilities == {"prompt_selection", "refill", "domain_sampling", "loss_weights"}
    assert "RepeatSampler" in host.why_not("replay") and "num_generations" in host.why_not("ragged_groups")


def test_the_seed_quick_start_and_the_stack_example_validate_unchanged():
    host = describe(ARGS)
    assert validate(QUICK_START, host=host).methods[0].resolved.event == "on_rollout"
    stack = load_config(ROOT / "examples" / "stack_dapo_dump_ar.yaml")["dataflex"]
    assert [m.name for m in validate(stack, host=host).methods] == ["filter", "curriculum", "ar"]


@pytest.mark.parametrize("loss_type", [*OTHER_LOSS_TYPES, "made_up"])
def test_a_loss_type_without_proven_exact_drops_is_refused_by_name(loss_type):
    with pytest.raises(ConfigError) as err:
        validate(QUICK_START, host=describe({**ARGS, "loss_type": loss_type}))
    message = str(err.value)
    assert "GRPOConfig.loss_type" in message and repr(loss_type) in message
    assert all(t in message for t in SUPPORTED_LOSS_TYPES)


def test_an_optimizer_step_spanning_two_generation_batches_is_refused():
    with pytest.raises(ConfigError) as err:
        validate(QUICK_START, host=describe({**ARGS, "gradient_accumulation_steps": 4, "steps_per_generation": 2}))
    assert "GRPOConfig.gradient_accumulation_steps" in str(err.value)
    # A generation batch of whole optimizer steps is fine (steps_per_generation defaults to the accumulation).
    validate(QUICK_START, host=describe({**ARGS, "gradient_accumulation_steps": 2, "steps_per_generation": 4}))
    validate(QUICK_START, host=describe({"num_generations": 4, "gradient_accumulation_steps": 4}))


def test_a_field_trl_lacks_is_refused_naming_the_host():
    block = {"mechanism": "reweight", "scorer": {"name": "token_prob"}, "actuator": {"name": "advantage_reweight"}}
    validate(block, host=describe(ARGS))  # old log-probs: TRL's, or one no-grad pass of the host's
    with pytest.raises(ConfigError) as err:
        validate({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                  "actuator": {"name": "threshold_band", "params": {"low": 0.1, "high": 0.9}}},
                 host=describe({**ARGS, "num_generations": 1}))
    assert "host 'trl'" in str(err.value)


DAPO = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}
GRESO = {"methods": [
    {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"}, "actuator": {"name": "greso"}},
    {"name": "dapo", **DAPO}]}


class _Stream(torch.utils.data.IterableDataset):
    """A dataset of prompts that can only be iterated (as ``datasets.Dataset.to_iterable_dataset()``)."""

    def __iter__(self):
        return iter([{"prompt": "1+1="}])


class _Rows:
    """A dataset-like object with columns (what the description reads of a ``datasets.Dataset``)."""

    def __init__(self, *columns: str) -> None:
        self.column_names = list(columns)


@pytest.mark.parametrize(("block", "key"), [
    ({**DAPO, "refill": {"max_rounds": 2}}, "dataflex.refill"),
    (GRESO, "dataflex.methods[0].scorer.name"),
    ({"mechanism": "mix", "scorer": {"name": "advantage_magnitude"}, "actuator": {"name": "dump_ucb"}},
     "dataflex.mechanism"),
])
def test_a_block_drawing_its_own_prompts_over_an_iterable_dataset_is_refused_by_the_description(block, key):
    """The refusal the trainer gives at construction comes from the description, so doctor gives it too."""
    validate(block, host=describe(ARGS, dataset=_Rows("prompt", "data_source")))
    with pytest.raises(ConfigError) as err:
        validate(block, host=describe(ARGS, dataset=_Stream()))
    message = str(err.value)
    assert key in message and "IterableDataset" in message and "datasets.Dataset" in message
    validate(DAPO, host=describe(ARGS, dataset=_Stream()))  # TRL's own prompts: nothing to index


def test_image_columns_and_environments_under_replayed_rounds_are_refused_by_the_description():
    with pytest.raises(ConfigError, match=r"train_dataset.*column 'image'"):
        validate(DAPO, host=describe(ARGS, dataset=_Rows("prompt", "image")))
    with pytest.raises(ConfigError, match=r"environment_factory.*rollout_func"):
        validate(DAPO, host=describe(ARGS, environments=True))
    # A block that drops nothing at on_rollout runs TRL's generation once: environments are fine.
    validate({"mechanism": "reweight", "scorer": {"name": "token_prob"}, "actuator": {"name": "advantage_reweight"}},
             host=describe(ARGS, environments=True))


def test_importing_the_package_imports_no_trl():
    code = ("import sys, dataflex_bus, dataflex_bus.trl, dataflex_bus.trl.host, dataflex_bus.trl.doctor; "
            "assert 'trl' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.trl
def test_doctor_checks_a_block_against_the_grpo_config(capsys, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import json

    from dataflex_bus import logs
    from dataflex_bus.cli import main

    monkeypatch.setattr(logs, "configure", lambda **_: None)  # the command's log set-up would outlive capsys

    block = tmp_path / "block.yaml"
    block.write_text("dataflex:\n  mechanism: select\n  scorer: {name: reward_difficulty}\n  actuator: {name: dapo}\n")
    assert main(["doctor", "--host", "trl", "--json", "--config", str(block)]) == 0
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["trl"]["status"] == "ok" and checks["DataflexGRPOTrainer"]["status"] == "ok"
    assert "reward_difficulty+dapo @ on_rollout" in checks["dataflex block"]["detail"]
    assert main(["doctor", "--host", "trl", "--json", "--config", str(block), "grpo.loss_type=sapo"]) == 1
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["dataflex block"]["status"] == "FAIL" and "GRPOConfig.loss_type" in checks["dataflex block"]["detail"]
