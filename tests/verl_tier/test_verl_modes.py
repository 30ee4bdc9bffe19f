"""Every verl trainer that is not a dataflex mode refuses a dataflex block (installed by our
``verl.plugins`` entry point), and the dataflex modes run as the verl mode they extend (no Ray)."""

from __future__ import annotations

import sys

import pytest
from seed_config import SEED

pytestmark = pytest.mark.verl

#: A block with a key no schema knows: a trainer that reads the block would refuse it by name, one
#: that ignores the block would train plain GRPO with it.
IGNORED = [*SEED, "+dataflex.no_such_key=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    pytest.importorskip("verl")
    import verl_harness as H

    return H.write_dataset(tmp_path_factory.mktemp("data") / "train.parquet", {"math": 8, "code": 8})


def compose(data, tmp_path, extra, *, mode="dataflex_sync", batch=4, mini=2):
    import verl_harness as H

    base = [o for o in H.base_overrides(data, tmp_path / "ckpt", batch=batch, mini=mini)
            if not o.startswith("trainer.v1.trainer_mode=")]
    return H.compose([f"trainer.v1.trainer_mode={mode}", *base, *extra])


SEPARATE = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]


def test_the_guard_is_installed_by_verls_own_plugin_loading():
    import verl  # noqa: F401
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    assert "dataflex_bus.verl.entry" in sys.modules
    for cls in (PPOTrainer, RayPPOTrainer):
        assert getattr(cls.__init__, "__dataflex_guarded__", False), cls


@pytest.mark.parametrize("mode, use", [("sync", "dataflex_sync"), ("colocate_async", "dataflex_colocate_async"),
                                       ("separate_async", "dataflex_separate_async")])
def test_verls_own_modes_refuse_the_block_naming_the_mode_to_use(data, tmp_path, mode, use):
    from verl.trainer.ppo.v1 import get_trainer_cls

    from dataflex_bus.errors import ConfigError

    cfg = compose(data, tmp_path, [*IGNORED, *(SEPARATE if mode == "separate_async" else [])], mode=mode,
                  batch=8 if mode == "separate_async" else 4)
    with pytest.raises(ConfigError, match=rf"trainer\.v1\.trainer_mode: verl's '{mode}' trainer ignores the "
                                          rf"dataflex block.*use trainer\.v1\.trainer_mode={use}"):
        get_trainer_cls(mode)(cfg)


def test_a_mode_registered_by_someone_else_refuses_the_block(data, tmp_path):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from dataflex_bus.errors import ConfigError

    class OtherSync(PPOTrainerSync):  # defined after the guard was installed
        def __init__(self, config):
            super().__init__(config)

    cfg = compose(data, tmp_path, IGNORED, mode="other_sync")
    with pytest.raises(ConfigError, match=r"'other_sync' is not a dataflex mode.*dataflex_sync"):
        OtherSync(cfg)


def test_the_legacy_trainer_refuses_the_block(data, tmp_path):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from dataflex_bus.errors import ConfigError

    cfg = compose(data, tmp_path, [*IGNORED, "trainer.use_v1=False"])
    with pytest.raises(ConfigError, match=r"trainer\.use_v1: False runs verl's legacy trainer.*"
                                          r"trainer\.v1\.trainer_mode=dataflex_sync"):
        RayPPOTrainer(cfg, None, {}, None)


@pytest.mark.parametrize("module, name", [
    ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer"),
    ("verl.experimental.fully_async_policy.fully_async_rollouter", "FullyAsyncRollouter"),
    ("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer"),
    ("verl.experimental.separation.ray_trainer", "SeparateRayPPOTrainer"),
])
def test_the_experimental_trainers_refuse_the_block(data, tmp_path, module, name):
    import importlib

    from dataflex_bus.errors import ConfigError

    cls = getattr(importlib.import_module(module), name)
    cls = getattr(cls, "__ray_actor_class__", cls)  # the class a Ray actor process instantiates
    cfg = compose(data, tmp_path, IGNORED)
    with pytest.raises(ConfigError, match=rf"{name} trainer ignores the dataflex block.*dataflex_sync"):
        cls(cfg, None, {}, None) if name != "FullyAsyncRollouter" else cls(cfg, None)


def test_without_a_block_verls_trainers_are_untouched(data, tmp_path):
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cfg = compose(data, tmp_path, [], mode="sync")
    assert type(get_trainer_cls("sync")(cfg)) is PPOTrainerSync
    cfg = compose(data, tmp_path, ["+dataflex={}"], mode="sync")  # an empty block configures nothing
    assert type(get_trainer_cls("sync")(cfg)) is PPOTrainerSync


@pytest.mark.parametrize("mode, verl_mode, sync_step", [("dataflex_colocate_async", "colocate_async", 1),
                                                         ("dataflex_separate_async", "separate_async", 4)])
def test_async_modes_run_as_verls_async_trainer(data, tmp_path, mode, verl_mode, sync_step):
    import verl_harness as H
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from dataflex_bus.verl.trainer import DataflexTrainer

    extra = SEPARATE if verl_mode == "separate_async" else []
    cfg = compose(data, tmp_path, [*SEED, *extra], mode=mode, batch=8 if sync_step == 4 else 4)
    trainer = get_trainer_cls(mode)(cfg)
    base = PPOTrainerColocateAsync if verl_mode == "colocate_async" else PPOTrainerSeparateAsync
    assert isinstance(trainer, DataflexTrainer) and isinstance(trainer, base)
    assert trainer.trainer_mode == verl_mode and trainer.parameter_sync_step == sync_step
    assert type(trainer.replay_buffer) is ReplayBufferAsync
    assert trainer.dataflex.describe() == ["select:threshold_band: group_solve_rate+threshold_band @ on_rollout"]
    trainer.tokenizer, trainer.processor = H.StubTokenizer(), None
    trainer._init_dataloader()
    assert cfg.data.gen_batch_size == 1  # verl's async paths: exact refills, one prompt per fetch
    # the block is still validated strictly
    from dataflex_bus.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dataflex\.no_such_key"):
        get_trainer_cls(mode)(compose(data, tmp_path, [*IGNORED, *extra], mode=mode,
                                      batch=8 if sync_step == 4 else 4))


def test_ignored_issue_judges_a_config_before_anything_is_built(data, tmp_path):
    from dataflex_bus.verl.guard import ignored_issue

    assert ignored_issue(compose(data, tmp_path, SEED)) is None
    assert ignored_issue(compose(data, tmp_path, [], mode="sync")) is None
    issue = ignored_issue(compose(data, tmp_path, SEED, mode="sync"))
    assert issue.key == "trainer.v1.trainer_mode" and "dataflex_sync" in str(issue)
    issue = ignored_issue(compose(data, tmp_path, [*SEED, "trainer.use_v1=False"]))
    assert issue.key == "trainer.use_v1"


def test_sum_norm_without_a_constant_scale_is_refused_for_masked_drops(data, tmp_path):
    from verl.trainer.ppo.v1 import get_trainer_cls

    from dataflex_bus.errors import ConfigError

    topk = ["+dataflex.mechanism=select", "+dataflex.scorer.name=advantage_magnitude",
            "+dataflex.actuator.name=topk_fraction", "+dataflex.actuator.params.fraction=0.5"]
    norm = ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.loss_scale_factor: is null.*"
                                          r"loss_scale_factor=16"):
        get_trainer_cls("dataflex_sync")(compose(data, tmp_path, [*topk, *norm]))
    trainer = get_trainer_cls("dataflex_sync")(compose(
        data, tmp_path, [*topk, *norm, "actor_rollout_ref.actor.loss_scale_factor=16"]))
    assert trainer.dataflex.mechanisms == {"select"}
    # removal at on_rollout never leaves a masked row in a micro-batch: nothing to refuse
    assert get_trainer_cls("dataflex_sync")(compose(data, tmp_path, [*SEED, *norm])).dataflex.mechanisms == {"select"}


# ---------------------------------------------------------------------------- dataflex doctor OVERRIDES
def _block_check(overrides):
    from dataflex_bus.verl.doctor import run_checks

    checks = {c["check"]: c for c in run_checks(overrides)}
    assert checks["config"]["status"] == "ok", checks["config"]
    return checks["dataflex block"]


def test_doctor_fails_a_block_the_configured_trainer_would_ignore():
    check = _block_check(["trainer.v1.trainer_mode=colocate_async", *IGNORED])
    assert check["status"] == "FAIL" and "use trainer.v1.trainer_mode=dataflex_colocate_async" in check["detail"]
    check = _block_check(["trainer.use_v1=False", *SEED])
    assert check["status"] == "FAIL" and "trainer.use_v1" in check["detail"]


def test_doctor_validates_the_block_of_a_dataflex_mode():
    grpo = ["trainer.v1.trainer_mode=dataflex_sync", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]
    check = _block_check([*grpo, *SEED])
    assert check["status"] == "ok" and "group_solve_rate+threshold_band @ on_rollout" in check["detail"]
    check = _block_check([*grpo, *IGNORED])
    assert check["status"] == "FAIL" and "dataflex.no_such_key" in check["detail"]
    # verl's defaults (gae, n=1) cannot run a group method: said before any worker starts
    check = _block_check(["trainer.v1.trainer_mode=dataflex_sync", *SEED])
    assert check["status"] == "FAIL" and "not group-based" in check["detail"]
    check = _block_check(["trainer.v1.trainer_mode=dataflex_sync"])
    assert check["status"] == "warn" and "plain GRPO" in check["detail"]
    assert _block_check(["trainer.v1.trainer_mode=sync"])["status"] == "ok"


def test_doctor_reports_overrides_verl_cannot_compose():
    from dataflex_bus.verl.doctor import run_checks

    checks = {c["check"]: c for c in run_checks(["dataflex.mechanism=select"])}  # no leading +
    assert checks["config"]["status"] == "FAIL" and "dataflex" in checks["config"]["detail"]


@pytest.mark.parametrize("policy", ["fixed", "credit2", "greso"])
def test_doctor_accepts_every_refill_policy_in_dataflex_sync(policy):
    dapo = ["trainer.v1.trainer_mode=dataflex_sync", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            "+dataflex.mechanism=select", "+dataflex.scorer.name=reward_difficulty", "+dataflex.actuator.name=dapo",
            f"+dataflex.refill.policy={policy}"]
    assert _block_check(dapo)["status"] == "ok"
    # the asynchronous modes have no synchronous rounds to refill in: refused, naming the host and the mode
    check = _block_check([*dapo, "trainer.v1.trainer_mode=dataflex_colocate_async"])
    assert check["status"] == "FAIL" and "host 'verl'" in check["detail"] and "dataflex_sync" in check["detail"]
