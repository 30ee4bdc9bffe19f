"""`dataflex run` end to end on tiny configs; every example validates and runs (compare: test_compare.py)."""

import json
from pathlib import Path

import pytest
import yaml

from dataflex_bus.cli import main
from dataflex_bus.config import load_config
from dataflex_bus.shim import run_training

from .conftest import tiny

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.eval_every=2", "model.hidden=16",
         "model.pretrain_steps=5"]


def write(path, config):
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.integration
def test_run_writes_metrics_record_and_plot(tmp_path, capsys):
    cfg = write(tmp_path / "plain.yaml", tiny())
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--steps", "3", "--out", str(out), "--no-progress", "trainer.lr=0.01",
                 "trainer.eval_every=2", "data.heldout=30"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and "dataflex/rollout/reward_mean" in lines[0]
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "complete" and record["config"]["trainer"]["lr"] == 0.01
    assert sum(record["split"]["copy"]["heldout"]) == 30
    assert any(p.startswith("dataflex-bus==") for p in record["dataflex"]["plugins"])
    assert {"platform", "torch", "cpu_count"} <= set(record["machine"]) and record["wall_s"] > 0
    assert (out / "curves.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "final reward per domain" in printed
    # evaluated at step 0, after 2 updates (eval_every) and after the last step
    assert ["eval/heldout/learnable" in m for m in lines] == [True, True, True]
    first, last = lines[0]["eval/heldout/learnable"], lines[2]["eval/heldout/learnable"]
    assert f"held-out accuracy on learnable domains: {first:.3f} (step 0) -> {last:.3f} (step 2)" in printed


@pytest.mark.integration
def test_run_refuses_to_overwrite_without_force(tmp_path, capsys):
    cfg = write(tmp_path / "plain.yaml", tiny())
    out = tmp_path / "out"
    args = ["run", str(cfg), "--steps", "1", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    assert main(["run", str(cfg), "--steps", "2", "--out", str(out), "--no-progress", "--resume"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_run_bad_config_fails_before_touching_the_old_run(tmp_path, capsys):
    cfg = write(tmp_path / "plain.yaml", tiny())
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--steps", "1", "--out", str(out), "--no-progress"]) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main(["run", str(cfg), "--out", str(out), "--force", "--no-progress", "trainer.stepz=1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.stepz: unknown key" in err and "steps" in err
    assert (out / "metrics.jsonl").read_text() == before


def test_run_plugin_failure_is_named(tmp_path, capsys, shim_components):
    cfg = write(tmp_path / "bad.yaml", tiny({"mechanism": "select", "scorer": {"name": "t_reward"},
                                             "actuator": {"name": "t_fail_at", "params": {"at": 1}}}))
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--steps", "3", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    # the error first, then what it means for the run directory
    assert err[-2].startswith("dataflex run: error: plugin 'local:t_fail_at' failed")
    assert err[-1] == (f"dataflex run: stopped: the last checkpoint ({out / 'checkpoint.pt'}, step 1) is intact; "
                       "--resume continues from it")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_validates_and_trains(path):
    from dataflex_bus.config import apply_overrides

    config = apply_overrides(load_config(path), SMALL)
    result = run_training(config, steps=2)
    assert len(result.metrics) == 2
    block = load_config(path).get("dataflex")
    if block:
        methods = block.get("methods", [block])
        recorded = result.record["dataflex"]["methods"]
        assert [m["mechanism"] for m in recorded] == [m["mechanism"] for m in methods]
        assert any(k.startswith("dataflex/") for k in result.metrics[-1])


def test_examples_cover_every_seed_method():
    names = {p.stem for p in EXAMPLES.glob("*.yaml")}
    assert {"grpo_baseline", "difficulty_filter", "topk_advantage", "advantage_reweight", "max_variance",
            "dump_ucb"} <= names
    # The README's difficulty filter is the seed's block, run as online-filtering papers run it: refilled.
    block = load_config(EXAMPLES / "difficulty_filter.yaml")["dataflex"]
    refill = block.pop("refill")
    assert block == {"mechanism": "select",
                     "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
                     "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}, "warmup_step": 0}
    assert refill["gen_batch_size"] > load_config(EXAMPLES / "difficulty_filter.yaml")["trainer"]["prompts_per_step"]
    # every example says what it is expected to show, and how to run it
    for path in EXAMPLES.glob("*.yaml"):
        text = path.read_text()
        assert text.startswith("#") and f"examples/{path.name}" in text, path.name
