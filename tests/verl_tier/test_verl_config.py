"""Hydra compose of verl's ppo_trainer with the seed's overrides, and the trainer built in sync mode."""

from __future__ import annotations

import pytest
from seed_config import SEED

pytestmark = pytest.mark.verl



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    pytest.importorskip("verl")
    import verl_harness as H

    return H.write_dataset(tmp_path_factory.mktemp("data") / "train.parquet", {"math": 8, "code": 8})


def build(data, tmp_path, extra):
    import verl_harness as H
    from verl.trainer.ppo.v1 import get_trainer_cls

    cfg = H.compose(H.base_overrides(data, tmp_path / "ckpt") + extra)
    return cfg, get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)


def test_seed_quick_start_validates_and_builds_in_sync_mode(data, tmp_path):
    import verl_harness as H
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils.config import validate_config

    from dataflex_bus.verl.trainer import DataflexSyncTrainer

    cfg, trainer = build(data, tmp_path, SEED)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert isinstance(trainer, DataflexSyncTrainer)
    assert cfg.trainer.v1.trainer_mode == "dataflex_sync"
    assert trainer.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is ReplayBuffer  # not ReplayBufferAsync
    assert trainer.replay_buffer.gen_batch_size == cfg.data.train_batch_size
    assert trainer.dataflex.describe() == ["select:threshold_band: group_solve_rate+threshold_band @ on_rollout"]
    assert trainer.dataflex.pipeline.event == "on_rollout"
    # the real dataloader set-up does not force gen_batch_size=1 (it would in any non-"sync" mode)
    trainer.tokenizer, trainer.processor = H.StubTokenizer(), None
    trainer._init_dataloader()
    assert cfg.data.get("gen_batch_size", None) in (None, cfg.data.train_batch_size)
    assert trainer.train_dataloader.batch_size == cfg.data.train_batch_size


def test_without_dataflex_block_runs_plain_grpo(data, tmp_path):
    _, trainer = build(data, tmp_path, [])
    assert trainer.dataflex.pipeline is None and trainer.trainer_mode == "sync"


def test_invalid_block_fails_at_construction_naming_the_key(data, tmp_path):
    from dataflex_bus.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dataflex\.actuator\.name"):
        build(data, tmp_path, [*SEED[:3], "+dataflex.actuator.name=no_such_selector"])
    with pytest.raises(ConfigError, match=r"dataflex\.bogus: unknown key"):
        build(data, tmp_path, [*SEED, "+dataflex.bogus=1"])


def test_group_method_refused_for_non_group_estimator(data, tmp_path):
    from dataflex_bus.errors import ConfigError

    with pytest.raises(ConfigError, match="not group-based"):
        build(data, tmp_path, [*SEED, "algorithm.adv_estimator=reinforce_plus_plus"])


def test_reweight_refused_when_verl_ignores_the_weights(data, tmp_path, verl_components):
    from dataflex_bus.errors import ConfigError

    reweight = ["+dataflex.mechanism=reweight", "+dataflex.scorer.name=vt_reward",
                "+dataflex.actuator.name=vt_domain_weight", "+dataflex.actuator.params.domain=math",
                "+dataflex.actuator.params.weight=2.0"]
    with pytest.raises(ConfigError, match=r"bypass_mode.*ignores rollout_is_weights"):
        build(data, tmp_path, [*reweight, "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])
    _, trainer = build(data, tmp_path, [*reweight, "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"])
    assert trainer.dataflex.mechanisms == {"reweight"}  # geo_mean: warned, not refused


KNAPSACK = ["+dataflex.mechanism=allocate", "+dataflex.scorer.name=knapsack_rate", "+dataflex.actuator.name=knapsack"]


def test_allocation_needs_the_sync_trainer_and_its_own_group_filter(data, tmp_path):
    from dataflex_bus.errors import ConfigError

    _, trainer = build(data, tmp_path, KNAPSACK)
    assert trainer.dataflex.host.can("ragged_groups")
    with pytest.raises(ConfigError, match=r"host 'verl' cannot carry out: it lacks ragged_groups .*dataflex_sync.*"
                       r"pre_rollout selector"):
        build(data, tmp_path, [*KNAPSACK, "trainer.v1.trainer_mode=dataflex_colocate_async"])
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.enable.*dapo selector"):
        build(data, tmp_path, [*KNAPSACK, "algorithm.filter_groups.enable=true"])


STACK_OVERRIDE = ("+dataflex.methods=[{name: filter, mechanism: select, scorer: {name: reward_difficulty}, "
                  "actuator: {name: dapo}}, {name: curriculum, mechanism: mix, scorer: {name: advantage_magnitude}, "
                  "actuator: {name: dump_ucb}}, {name: ar, mechanism: reweight, scorer: {name: token_prob}, "
                  "actuator: {name: advantage_reweight}}]")


def test_a_method_stack_is_one_hydra_override(data, tmp_path):
    cfg, trainer = build(data, tmp_path, [STACK_OVERRIDE, "+dataflex.domain_key=data_source"])
    assert [m["name"] for m in cfg.dataflex.methods] == ["filter", "curriculum", "ar"]
    assert trainer.dataflex.describe() == [
        "filter: reward_difficulty+dapo @ on_rollout", "curriculum: advantage_magnitude+dump_ucb @ on_step_end",
        "ar: token_prob+advantage_reweight @ on_advantage"]
    assert trainer.dataflex.mechanisms == {"select", "mix", "reweight"} and trainer.dataflex.plan.samples_domains
    # a mistake inside one method is reported under its list key, before any worker starts
    from dataflex_bus.errors import ConfigError

    bad = STACK_OVERRIDE.replace("{name: dapo}", "{name: dapoo}")
    with pytest.raises(ConfigError, match=r"dataflex\.methods\[0\]\.actuator\.name.*did you mean 'dapo'"):
        build(data, tmp_path, [bad])
