"""The shim trainer: event order and data contract, drop/skip/reweight semantics, mix sampling,
determinism, checkpoint and resume, and bad input refused before training."""

import json

import pytest
import torch

from dataflex_bus.errors import ConfigError, PluginRuntimeError
from dataflex_bus.shim import CheckpointError, RunDirError, run_training
from dataflex_bus.shim.files import load_checkpoint, save_checkpoint
from dataflex_bus.shim.tasks import PAD

from .conftest import tiny, without_times

SELECT_EVEN = {"mechanism": "select", "scorer": {"name": "t_reward"}, "actuator": {"name": "t_even_groups"}}


def sel(actuator, scorer="t_reward", **extra):
    return {"mechanism": "select", "scorer": {"name": scorer}, "actuator": actuator, **extra}


def test_events_in_verl_order_with_verl_fields(recorder):
    run_training(tiny(), steps=2)
    names = [(e[0], e[1]) for e in recorder.events]
    assert names == [("on_rollout", 0), ("on_advantage", 0), ("on_step_end", 0),
                     ("on_rollout", 1), ("on_advantage", 1), ("on_step_end", 1)]
    rollout, advantage = recorder.events[0][2], recorder.events[1][2]
    assert {"prompts", "responses", "response_mask", "loss_mask", "rm_scores", "rollout_log_probs"} <= set(
        rollout.fields)
    assert not {"old_log_probs", "advantages"} & set(rollout.fields)
    assert {"old_log_probs", "advantages", "returns", "rollout_is_weights"} <= set(advantage.fields)
    assert "ref_log_prob" not in advantage.fields  # kl_coef = 0: no reference, as in verl
    # groups of group_size rows, the dataset's domains in a fixed order, no padding
    assert rollout.num_groups == 4 and rollout.group_sizes.tolist() == [4, 4, 4, 4]
    assert rollout.domain_names == ["copy", "sort", "reverse", "random"]
    assert not rollout.is_padding.any()
    # reward only on the last valid token; responses PAD after their end
    mask = rollout["response_mask"].bool()
    last = mask.sum(-1) - 1
    rm = rollout["rm_scores"]
    assert torch.equal(rm.sum(-1), rm[torch.arange(len(rm)), last])
    assert torch.all(rollout["responses"][~mask] == PAD)
    # GRPO advantage broadcast over the response tokens
    adv = advantage["advantages"]
    assert torch.all(adv[~advantage["response_mask"].bool()] == 0)


def test_zero_signal_metric_is_the_share_of_groups_with_equal_rewards(recorder):
    m = run_training(tiny(trainer={"prompts_per_step": 16}), steps=3).metrics
    rollouts = [(step, batch) for name, step, batch, _ in recorder.events if name == "on_rollout"]
    assert len(rollouts) == 3
    for step, batch in rollouts:
        flat = 0
        for g in range(batch.num_groups):  # by hand, group by group
            values = batch.rewards[batch.group_index == g].tolist()
            flat += len(set(values)) == 1
        assert m[step]["dataflex/rollout/zero_signal_groups"] == flat / batch.num_groups


def test_heldout_eval_at_step_0_every_eval_every_updates_and_at_the_last_step():
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.shim.config import resolve_config
    from dataflex_bus.shim.host import describe
    from dataflex_bus.shim.trainer import ShimTrainer

    cfg = tiny(trainer={"eval_every": 2}, data={"heldout": 30})
    m = run_training(cfg, steps=5).metrics
    keys = {"eval/heldout/copy", "eval/heldout/sort", "eval/heldout/reverse", "eval/heldout/random",
            "eval/heldout/learnable"}
    assert [keys <= set(x) for x in m] == [True, True, False, True, True]  # the last step, after 5 updates
    # a run shorter than eval_every still ends evaluated
    short = run_training(tiny(trainer={"eval_every": 25}, data={"heldout": 30}), steps=3).metrics
    assert [keys <= set(x) for x in short] == [True, False, True]
    # step 0 scores the warm-started policy before any update
    resolved = resolve_config(cfg)
    base = ShimTrainer(resolved, Runtime(None, host=describe(resolved)))
    assert {k: m[0][k] for k in keys} == base.evaluate()


def test_reference_log_probs_when_kl_is_on(recorder):
    m = run_training(tiny(trainer={"kl_coef": 0.1}), steps=2).metrics
    assert "ref_log_prob" in recorder.events[1][2].fields
    assert "train/kl_loss" in m[1]


def test_on_rollout_select_removes_whole_groups_before_compute(shim_components, recorder):
    result = run_training(tiny(SELECT_EVEN), steps=1)
    rollout, advantage, end = (e[2] for e in recorder.events[:3])
    kept_uids = set(advantage.group_index.tolist())
    assert len(advantage) == 8 and len(end) == 8 and len(rollout) == 16
    assert advantage.num_groups == 2 and all(s == 4 for s in advantage.group_sizes.tolist())
    assert kept_uids == {0, 1}
    m = result.metrics[0]
    assert m["dataflex/kept_fraction"] == 0.5 and m["dataflex/kept_fraction"] == 0.5
    assert m["dataflex/skipped_update"] == 0.0


def test_on_advantage_subset_selector_replaces_advantages_and_drops(shim_components, recorder):
    run_training(tiny(sel({"name": "t_first_half"}, scorer="t_adv")), steps=1)
    advantage, end = recorder.events[1][2], recorder.events[2][2]
    assert len(end) == len(advantage) // 2
    assert torch.allclose(end["advantages"], advantage["advantages"][: len(end)] * 2)


def test_on_advantage_decision_multiplies_weights_and_drops_rows():
    from dataflex_bus import Batch
    from dataflex_bus.carry import carry_out_advantage
    from dataflex_bus.decision import Decision

    b = Batch.from_tensors(uid=torch.tensor([0, 0, 1, 1]), response_mask=torch.ones(4, 2),
                           advantages=torch.ones(4, 2), returns=torch.ones(4, 2),
                           rollout_is_weights=torch.full((4, 2), 2.0))
    d = Decision()
    d.weights = torch.tensor([[0.5, 1.0]] * 4)
    d.keep = torch.tensor([True, False, True, True])
    action = carry_out_advantage(b, d)
    out = b.with_fields(**action.fields).select(action.keep)
    assert len(out) == 3
    assert torch.equal(out["rollout_is_weights"], torch.tensor([[1.0, 2.0]] * 3))


def test_reweight_method_reaches_the_loss(shim_components, recorder):
    from dataflex_bus.components import Reweighter, Reweighting
    from dataflex_bus.registry import register_local, unregister_local

    class Half(Reweighter):
        def reweight(self, batch, score, step_id):
            return Reweighting(torch.full((len(batch),), 0.5))

    register_local("reweighter", "t_half", Half)
    try:
        block = {"mechanism": "reweight", "scorer": {"name": "t_adv"}, "actuator": {"name": "t_half"}}
        plain = run_training(tiny(), steps=1).metrics[0]
        half = run_training(tiny(block), steps=1).metrics[0]
    finally:
        unregister_local("reweighter", "t_half")
    end = recorder.events[-1][2]
    real = end["response_mask"].bool()
    assert torch.all(end["rollout_is_weights"][real] == 0.5)
    # same rollout and advantages; the weights halve the policy-gradient loss
    assert half["dataflex/rollout/reward_mean"] == plain["dataflex/rollout/reward_mean"]
    assert half["train/pg_loss"] == pytest.approx(plain["train/pg_loss"] * 0.5, rel=1e-5)


def test_empty_selection_skips_the_update(shim_components):
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.shim.config import resolve_config
    from dataflex_bus.shim.host import describe
    from dataflex_bus.shim.trainer import ShimTrainer

    resolved = resolve_config(tiny(sel({"name": "t_keep_none"})))
    trainer = ShimTrainer(resolved, Runtime(resolved["dataflex"], host=describe(resolved)))
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    m = trainer.train_step()
    assert m["dataflex/skipped_update"] == 1.0 and m["dataflex/kept_fraction"] == 0.0
    assert m["dataflex/empty_selection"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_mix_draws_prompts_by_the_mixer(shim_components):
    block = {"mechanism": "mix", "scorer": {"name": "t_reward"}, "actuator": {"name": "t_all_on_first"},
             "warmup_step": 2}
    m = run_training(tiny(block), steps=4).metrics
    assert m[0]["dataflex/sample_prob/copy"] == 0.25  # uniform until the mixer publishes
    assert m[3]["dataflex/sample_prob/copy"] == 1.0 and m[3]["dataflex/sample_prob/random"] == 0.0
    assert "dataflex/rollout/reward_mean/copy" in m[3] and "dataflex/rollout/reward_mean/random" not in m[3]
    assert m[3]["dataflex/updates"] == 4.0


def test_same_seed_same_metrics_other_seed_differs():
    a = without_times(run_training(tiny(), steps=2).metrics)
    b = without_times(run_training(tiny(), steps=2).metrics)
    c = without_times(run_training(tiny(), steps=2, seed=7).metrics)
    assert a == b
    assert a != c


@pytest.mark.parametrize("block", [None, "mix"])
def test_resume_continues_bit_for_bit(tmp_path, shim_components, block):
    dataflex = None
    if block == "mix":
        dataflex = {"mechanism": "mix", "scorer": {"name": "t_reward"}, "actuator": {"name": "t_all_on_first"},
                    "warmup_step": 1}
    cfg = tiny(dataflex, trainer={"mini_batches": 2, "kl_coef": 0.05, "save_every": 2})
    full = without_times(run_training(cfg, steps=4, out=tmp_path / "full").metrics)
    run_training(cfg, steps=2, out=tmp_path / "half")
    resumed = run_training(cfg, steps=4, out=tmp_path / "half", resume=True)
    assert without_times(resumed.metrics) == full
    lines = (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()
    assert without_times([json.loads(x) for x in lines]) == full
    record = json.loads((tmp_path / "half" / "run.json").read_text())
    assert [s["end_step"] for s in record["sessions"]] == [2, 4] and record["status"] == "complete"


def test_resume_redoes_steps_after_the_last_checkpoint(tmp_path):
    cfg = tiny(trainer={"save_every": 2})
    full = without_times(run_training(cfg, steps=4, out=tmp_path / "full").metrics)
    run_training(cfg, steps=3, out=tmp_path / "crash")  # checkpoints at 2 and 3 (the end)
    ckpt = tmp_path / "crash" / "checkpoint.pt"
    state = load_checkpoint(ckpt)
    assert state["step"] == 3
    # pretend the run died after step 3 was logged but before any save past step 2
    run_training(cfg, steps=2, out=tmp_path / "two")
    (tmp_path / "crash" / "checkpoint.pt").write_bytes((tmp_path / "two" / "checkpoint.pt").read_bytes())
    assert without_times(run_training(cfg, steps=4, out=tmp_path / "crash", resume=True).metrics) == full


def test_out_is_never_overwritten(tmp_path):
    run_training(tiny(), steps=1, out=tmp_path)
    with pytest.raises(RunDirError, match="already holds a run"):
        run_training(tiny(), steps=1, out=tmp_path)


def test_out_none_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_training(tiny(), steps=1)
    assert result.out is None and list(tmp_path.iterdir()) == []
    assert len(result.metrics) == 1 and "dataflex/rollout/reward_mean" in result.metrics[0]
    assert result.record["status"] == "complete"


def test_mismatched_checkpoint_is_refused(tmp_path, shim_components):
    run_training(tiny(SELECT_EVEN), steps=2, out=tmp_path)
    with pytest.raises(CheckpointError, match=r"trainer\.lr: checkpoint 0\.0005, config 0\.01"):
        run_training(tiny(SELECT_EVEN, trainer={"lr": 0.01}), steps=4, out=tmp_path, resume=True)
    with pytest.raises(CheckpointError, match=r"dataflex\.actuator\.name"):
        run_training(tiny(sel({"name": "t_first_half"}, scorer="t_adv")), steps=4, out=tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="different config") as err:
        run_training(tiny(), steps=4, out=tmp_path, resume=True)
    # Which side has the block, in one line (once: "dataflex: checkpoint {...whole block...}, config None").
    assert "dataflex: checkpoint: a dataflex block (select t_reward+t_even_groups); config: none" in str(err.value)


def test_corrupt_or_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(RunDirError, match="no checkpoint"):
        run_training(tiny(), steps=2, out=tmp_path, resume=True)
    run_training(tiny(), steps=1, out=tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read the checkpoint"):
        run_training(tiny(), steps=2, out=tmp_path, resume=True)
    save_checkpoint({"format": "something else"}, tmp_path)
    with pytest.raises(CheckpointError, match="not a dataflex shim checkpoint"):
        run_training(tiny(), steps=2, out=tmp_path, resume=True)


def test_plugin_failure_names_the_plugin_and_keeps_the_checkpoint(tmp_path, shim_components):
    cfg = tiny(sel({"name": "t_fail_at", "params": {"at": 2}}), trainer={"save_every": 1})
    with pytest.raises(PluginRuntimeError, match="t_fail_at") as info:
        run_training(cfg, steps=4, out=tmp_path)
    assert "boom at step 2" in str(info.value)
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state["step"] == 2
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "failed" and "t_fail_at" in record["error"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(("config", "key"), [
    ({"trainer": {"stepz": 3}}, "trainer.stepz"),
    ({"trianer": {}}, "trianer"),
    ({"model": {"hidden": 0}}, "model.hidden"),
    ({"trainer": {"lr": "fast"}}, "trainer.lr"),
    ({"data": {"domains": ["copy", "division"]}}, "data.domains"),
    ({"data": {"domain": ["copy"]}}, "data.domain"),
    ({"dataflex": {"mechanism": "select", "scorer": {"name": "no_such_scorer"},
                   "actuator": {"name": "t_even_groups"}}}, "dataflex.scorer.name"),
    ({"dataflex": {"mechanism": "select", "scorer": {"name": "t_reward"},
                   "actuator": {"name": "t_fail_at", "params": {"at": -1}}}}, "dataflex.actuator.params.at"),
    ({"dataflex": {"mechanism": "select", "scorer": {"name": "t_reward"}, "actuator": {"name": "t_even_groups"},
                   "warmup": 3}}, "dataflex.warmup"),
])
def test_bad_config_fails_before_training(tmp_path, shim_components, config, key):
    with pytest.raises(ConfigError) as info:
        run_training(config, out=tmp_path / "run")
    assert any(issue.key == key for issue in info.value.issues), str(info.value)
    assert not (tmp_path / "run").exists()


def test_unknown_key_message_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"trainer\.stepz: unknown key \(allowed: .*steps"):
        run_training({"trainer": {"stepz": 3}})


def test_a_shared_base_policy_gives_the_run_a_fresh_warm_start_would(tmp_path, monkeypatch):
    from dataflex_bus.shim import warmstart

    monkeypatch.setenv("DATAFLEX_CACHE_DIR", "")  # this process's memory only (the disk: test_warmstart.py)
    cfg = tiny(trainer={"save_every": 1})
    warmstart._MEMORY.clear()
    fresh = run_training(cfg, steps=2, seed=1, out=tmp_path / "fresh")
    warmstart._MEMORY.clear()
    run_training(cfg, steps=1, seed=0)  # warms the base policy up once
    assert len(warmstart._MEMORY) == 1
    shared = run_training(cfg, steps=2, seed=1, out=tmp_path / "shared")
    assert without_times(shared.metrics) == without_times(fresh.metrics)
    from dataflex_bus.shim.files import load_checkpoint

    a, b = (load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("fresh", "shared"))
    assert all(torch.equal(a["rng"][k], b["rng"][k]) for k in a["rng"])
    # another model is another base policy
    run_training(tiny(model={"hidden": 8}), steps=1)
    assert len(warmstart._MEMORY) == 2
