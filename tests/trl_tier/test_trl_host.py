"""The TRL host's description and its rules, checked without TRL (the description is import-light)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataflex_bus.config import load_config
from dataflex_bus.errors import ConfigError
from dataflex_bus.trl.host import SUPPORTED_LOSS_TYPES, describe
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
    assert "rollout_log_probs" not in host.fields["on_rollout"]
    assert {"old_log_probs", "advantages", "entropy", "rollout_log_probs"} <= host.fields["on_advantage"]
    assert "ref_log_prob" not in host.fields["on_advantage"] and "beta" in host.why_not("ref_log_prob")
    assert "ref_log_prob" in describe({**ARGS, "beta": 0.04}).fields["on_advantage"]
    assert {"values", "returns", "rollout_is_weights"}.isdisjoint(host.fields["on_advantage"])
    assert host.capabilities == {"prompt_selection", "refill", "domain_sampling", "loss_weights", "ragged_groups",
                                 "replay", "prompt_ids", "regenerates_kept_rows"}
    # what the dataset and environments cannot give is a capability lacked, with the reason a refusal says
    stream, envs = describe(ARGS, dataset=_Stream()), describe(ARGS, environments=True)
    assert host.capabilities - stream.capabilities == {"prompt_ids"}
    assert "IterableDataset" in stream.why_not("prompt_ids")
    assert host.capabilities - envs.capabilities == {"regenerates_kept_rows"}
    assert "environment_factory" in envs.why_not("regenerates_kept_rows")
    # Colocated vLLM: one request per row, and vLLM's sampling log-probs are the behaviour log-probs.
    vllm = describe({**ARGS, "use_vllm": True})
    assert vllm.capabilities == host.capabilities and vllm.fields == host.fields and vllm.rollout_is is None
    # Server mode asks for num_generations completions of every num_generations-th prompt: no per-prompt counts.
    server = describe({**ARGS, "use_vllm": True, "vllm_mode": "server"})
    assert "ragged_groups" not in server.capabilities and "n=num_generations" in server.why_not("ragged_groups")
    assert "replay" in server.capabilities
    # TRL's token_truncate correction without a lower bound is the decoupled weight: the host weights the rows.
    assert describe({**ARGS, "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"}).rollout_is == "token"


VLLM = {**ARGS, "use_vllm": True}


def test_dots_under_vllm_needs_trl_s_correction_to_be_its_own_or_off():
    """DOTS weights every row by min(pi_old / mu, is_cap) per token: TRL's default vLLM correction (sequence_mask)
    would weight the rows a second time; token_truncate at is_cap, or TRL's correction off, is exact."""
    block = load_config(ROOT / "examples" / "dots_replay.yaml")["dataflex"]
    cap = block["actuator"]["params"]["is_cap"]
    with pytest.raises(ConfigError, match=r"(?s)GRPOConfig\.vllm_importance_sampling_mode.*token_truncate"):
        validate(block, host=describe(VLLM))
    with pytest.raises(ConfigError, match=r"GRPOConfig\.vllm_importance_sampling_clip_max"):
        validate(block, host=describe({**VLLM, "vllm_importance_sampling_mode": "token_truncate",
                                       "vllm_importance_sampling_clip_max": cap + 1}))
    with pytest.raises(ConfigError, match=r"GRPOConfig\.vllm_importance_sampling_clip_min"):
        validate(block, host=describe({**VLLM, "vllm_importance_sampling_mode": "token_truncate",
                                       "vllm_importance_sampling_clip_max": cap,
                                       "vllm_importance_sampling_clip_min": 0.5}))
    assert validate(block, host=describe({**VLLM, "vllm_importance_sampling_mode": "token_truncate",
                                          "vllm_importance_sampling_clip_max": cap})).methods
    assert validate(block, host=describe({**VLLM, "vllm_importance_sampling_correction": False})).methods


def test_dots_under_vllm_with_vespo_needs_trl_s_correction_off():
    """vespo folds TRL's vLLM ratio into its sequence gamma weight (not a per-token factor): TRL's token_truncate
    ratio is not DOTS's weight there, so only TRL's correction off (the kit weights the rows) is exact."""
    block = load_config(ROOT / "examples" / "dots_replay.yaml")["dataflex"]
    cap = block["actuator"]["params"]["is_cap"]
    exact_elsewhere = {**VLLM, "vllm_importance_sampling_mode": "token_truncate",
                       "vllm_importance_sampling_clip_max": cap}
    assert validate(block, host=describe(exact_elsewhere)).methods
    assert describe({**exact_elsewhere, "loss_type": "vespo"}).rollout_is is None
    with pytest.raises(ConfigError, match=r"(?s)GRPOConfig\.loss_type.*vespo.*vllm_importance_sampling_correction"):
        validate(block, host=describe({**exact_elsewhere, "loss_type": "vespo"}))
    assert validate(block, host=describe({**VLLM, "loss_type": "vespo",
                                          "vllm_importance_sampling_correction": False})).methods


def test_an_allocation_is_refused_under_server_mode_vllm_naming_the_reason():
    block = load_config(ROOT / "examples" / "speed.yaml")["dataflex"]
    assert validate(block, host=describe(VLLM)).methods
    with pytest.raises(ConfigError, match=r"(?s)trl.*vllm_mode='colocate'"):
        validate(block, host=describe({**VLLM, "vllm_mode": "server"}))


def test_the_allocation_examples_validate_unchanged():
    host = describe(ARGS)
    for name in ("knapsack", "speed", "pilot_commit", "reinforce_ada"):
        block = load_config(ROOT / "examples" / f"{name}.yaml")["dataflex"]
        assert validate(block, host=host).methods, name


def test_the_seed_quick_start_and_the_stack_example_validate_unchanged():
    host = describe(ARGS)
    assert validate(QUICK_START, host=host).methods[0].resolved.event == "on_rollout"
    stack = load_config(ROOT / "examples" / "stack_dapo_dump_ar.yaml")["dataflex"]
    assert [m.name for m in validate(stack, host=host).methods] == ["filter", "curriculum", "ar"]


@pytest.mark.parametrize("loss_type", ["made_up", "GRPO"])
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
    replay = load_config(ROOT / "examples" / "repo_replay.yaml")["dataflex"]
    with pytest.raises(ConfigError, match=r"environment_factory"):  # stored rows join a pass TRL replays
        validate(replay, host=describe(ARGS, environments=True))
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
    # a GRPOConfig the block cannot run under (every loss type TRL 1.16 has is carried out: no longer the example)
    assert main(["doctor", "--host", "trl", "--json", "--config", str(block), "grpo.num_generations=1"]) == 1
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["dataflex block"]["status"] == "FAIL"
    assert "GRPOConfig.num_generations=1" in checks["dataflex block"]["detail"]


NOTHING_KEPT = {**QUICK_START, "actuator": {"name": "threshold_band", "params": {"low": 0.4, "high": 0.45}}}


def test_a_group_method_under_one_generation_says_num_generations():
    """Before: verl's wording, ``rollout n=1``, on the TRL host."""
    with pytest.raises(ConfigError) as err:
        validate(QUICK_START, host=describe({**ARGS, "num_generations": 1}))
    assert "needs groups, but GRPOConfig.num_generations=1 (< 2) on host 'trl'" in str(err.value)
    assert "rollout n" not in str(err.value)


@pytest.mark.parametrize(("fields", "key"), [
    ({"num_generations": 1, "per_device_train_batch_size": 2}, "GRPOConfig.num_generations"),
    ({"num_generations": 3}, "GRPOConfig.num_generations"),  # 8 rows a batch: no whole groups of 3
    ({"generation_batch_size": 16, "steps_per_generation": 2}, "GRPOConfig.generation_batch_size"),
    ({"generation_batch_size": 12}, "GRPOConfig.generation_batch_size"),  # not a multiple of 8 rows
])
def test_what_grpo_config_refuses_of_the_batch_shape_is_refused_by_name(fields, key):
    from dataflex_bus.trl.host import config_issues

    assert key in {i.key for i in config_issues(fields)}


@pytest.mark.parametrize("fields", [
    {}, {"num_generations": 1, "per_device_train_batch_size": 2},
    {"num_generations": 2, "per_device_train_batch_size": 2},
    {"num_generations": 3}, {"num_generations": 3, "per_device_train_batch_size": 3},
    {"num_generations": 4, "per_device_train_batch_size": 2, "steps_per_generation": 2},
    {"num_generations": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 3},
    {"num_generations": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 3},
    {"generation_batch_size": 16, "steps_per_generation": 2}, {"generation_batch_size": 12},
    {"generation_batch_size": 24, "num_generations": 6}, {"generation_batch_size": 16, "num_generations": 6},
])
@pytest.mark.trl
def test_the_grpo_config_check_refuses_exactly_what_trl_refuses(fields, tmp_path):
    """``dataflex doctor --host trl`` checks a mapping of fields without building a GRPOConfig; what it refuses
    of a batch's shape is what TRL 1.16's GRPOConfig refuses (once: ``[ok] GRPOConfig ... num_generations=1``)."""
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from dataflex_bus.trl.host import config_issues

    try:
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **fields)
        refused = False
    except ValueError:
        refused = True
    assert bool(config_issues(fields)) == refused, (fields, config_issues(fields))


@pytest.mark.trl
def test_doctor_warns_on_a_block_whose_probe_keeps_nothing_and_strict_fails_on_it(capsys, tmp_path, monkeypatch):
    """Before: the probe's warning as a log line, then ``[  ok] dataflex block ... all checks passed`` (and the
    log line read ``dataflex: dataflex: ...``)."""
    pytest.importorskip("trl")
    import json

    import yaml

    from dataflex_bus import logs
    from dataflex_bus.cli import main

    monkeypatch.setattr(logs, "configure", lambda **_: None)
    block = tmp_path / "block.yaml"
    block.write_text(yaml.safe_dump({"dataflex": NOTHING_KEPT}))
    assert main(["doctor", "--host", "trl", "--json", "--config", str(block)]) == 0
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["dataflex block"]["status"] == "warn"
    assert "every update would be skipped" in checks["dataflex block"]["detail"]
    assert "dataflex: dataflex:" not in checks["dataflex block"]["detail"]
    assert main(["doctor", "--host", "trl", "--strict", "--config", str(block)]) == 1
    out = capsys.readouterr()
    assert "failing under --strict" in out.out and "all checks passed" not in out.out
    assert "every update would be skipped" not in out.err  # said once, in the table
    assert main(["doctor", "--host", "trl", "--config", str(block), "grpo.num_generations=1"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] GRPOConfig" in out and "at least 2 completions" in out and "rollout n" not in out


def test_a_bare_name_for_dataflex_says_what_is_expected_and_where_the_examples_are(monkeypatch):
    """Before: ``dynamic_sampling: no such config file``, no word of a path or a mapping."""
    from dataflex_bus.trl.block import load_block

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        load_block("dynamic_sampling")
    text = str(err.value)
    assert "'dynamic_sampling' is no file; dataflex= takes a block (a mapping" in text
    assert "the path of a YAML file holding one" in text and "or None" in text
    assert "did you mean 'examples/dynamic_sampling.yaml' or 'examples/trl/dynamic_sampling.yaml'?" in text
    with pytest.raises(ConfigError, match=r"'greso' is a component: `dataflex info greso` prints a block"):
        load_block("greso")
    with pytest.raises(ConfigError, match="got int 3; expected a block"):
        load_block(3)  # type: ignore[arg-type]
    assert load_block("examples/trl/dynamic_sampling.yaml")["actuator"] == {"name": "dapo"}


# ---------------------------------------------------------------------------- the run's plan, read by refusals too
EXAMPLES = ("knapsack", "speed", "pilot_commit", "reinforce_ada", "repo_replay", "dots_replay", "dapo_filter",
            "greso", "mopps", "dump_ucb", "advantage_reweight", "entropy_8020", "stack_dapo_dump_ar")


def _example(name: str) -> dict:
    return load_config(ROOT / "examples" / f"{name}.yaml")["dataflex"]


def _refused(block: dict, **context) -> bool:
    try:
        validate(block, host=describe(ARGS, **context))
    except ConfigError:
        return True
    return False


@pytest.mark.parametrize("name", ["repo_replay", "dots_replay"])
def test_a_replay_block_over_an_iterable_dataset_is_refused_by_the_description(name):
    """Before: accepted, then ``TypeError: object of type 'IterableDataset' has no len()`` once TRL built the model
    (the replay buffer keys rows by prompt id, which an IterableDataset cannot give)."""
    with pytest.raises(ConfigError) as err:
        validate(_example(name), host=describe(ARGS, dataset=_Stream()))
    message = str(err.value)
    assert "dataflex.mechanism" in message and "replay" in message
    assert "train_dataset is an IterableDataset" in message and "datasets.Dataset" in message


@pytest.mark.parametrize("name", EXAMPLES)
def test_what_the_trainer_draws_by_row_and_runs_again_is_what_the_description_refuses(name):
    """The refusals over an IterableDataset and under environment_factory read the plan the trainer runs by:
    a block is refused there exactly when the trainer would index the dataset / run TRL's generation again."""
    from dataflex_bus.runtime import Runtime

    plan = Runtime(_example(name), host=describe(ARGS)).plan
    assert _refused(_example(name), dataset=_Stream()) == plan.draws_prompts, name
    assert _refused(_example(name), environments=True) == plan.regenerates, name


def test_an_allocation_before_generation_under_environments_is_refused_like_the_other_allocations():
    """Before: Knapsack (allocating at on_prompts) was accepted under environment_factory while SPEED,
    Pilot-Commit and Reinforce-Ada were refused; TRL's generation runs again on the kept rows for every one."""
    for name in ("knapsack", "speed", "pilot_commit", "reinforce_ada"):
        with pytest.raises(ConfigError) as err:
            validate(_example(name), host=describe(ARGS, environments=True))
        assert "environment_factory" in str(err.value) and "rollout_func" in str(err.value), name
    with pytest.raises(ConfigError, match=r"dataflex\.mechanism: allocates rollouts per prompt.*lacks "
                                          r"regenerates_kept_rows \(environment_factory"):
        validate(_example("knapsack"), host=describe(ARGS, environments=True))


class _Sized(_Rows):
    """A dataset-like object of ``n`` rows."""

    def __init__(self, n: int, *columns: str) -> None:
        super().__init__(*columns)
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_a_selection_round_larger_than_the_dataset_is_refused_naming_gen_batch_size_and_the_size():
    """Before: Pilot-Commit's 192-prompt pilot round on a 100-row dataset failed at step 0 with the kit's internal
    "draw what request() asks for"."""
    args = {**ARGS, "generation_batch_size": 64}
    block = _example("pilot_commit")
    with pytest.raises(ConfigError) as err:
        validate(block, host=describe(args, dataset=_Sized(100, "prompt")))
    message = str(err.value)
    assert "dataflex.refill.gen_batch_size" in message and "192" in message and "100 rows" in message
    validate(block, host=describe(args, dataset=_Sized(192, "prompt")))
    # Without refill, a selection's round is the generation batch's prompts (64 / 8 = 8).
    greso = GRESO  # (its example refills in rounds of 96)
    with pytest.raises(ConfigError, match=r"GRPOConfig\.generation_batch_size.*8 distinct prompts.*7 rows"):
        validate(greso, host=describe(args, dataset=_Sized(7, "prompt")))
    validate(greso, host=describe(args, dataset=_Sized(8, "prompt")))
    # TRL's own prompts (no selection before generation) may repeat: nothing to refuse.
    validate(_example("speed"), host=describe(args, dataset=_Sized(3, "prompt")))


@pytest.mark.parametrize("text", ["dataflex:\nmechanism: select\nscorer: {name: reward_difficulty}\n"
                                  "actuator: {name: dapo}\n", "dataflex:\n", "dataflex: {}\n",
                                  "# a comment\ndataflex:\n  # nothing indented under it\n"],
                         ids=["mis-indented", "bare", "empty-mapping", "comments-only"])
def test_a_yaml_file_whose_dataflex_block_is_empty_is_refused_naming_the_file(tmp_path, text):
    """Before: load_block returned None (or {}) and the trainer trained plain TRL without a word."""
    from dataflex_bus.trl.block import load_block

    path = tmp_path / "method.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_block(path)
    message = str(err.value)
    assert str(path) in message and "'dataflex:' block is empty" in message and "dataflex=None" in message
    if text.startswith("dataflex:\nmechanism"):
        assert "'mechanism', 'scorer', 'actuator'" in message and "indent" in message


def test_an_empty_mapping_for_dataflex_is_refused_and_none_is_plain_trl():
    from dataflex_bus.trl.block import load_block

    assert load_block(None) is None
    with pytest.raises(ConfigError, match=r"dataflex: an empty block.*dataflex=None"):
        load_block({})
