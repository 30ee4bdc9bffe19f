"""The adapter against a real local TransferQueue (Ray + TQ session fixture, see conftest.py).

Contract tests drive the trainer's hook methods one by one on batches written by the fake agent loop;
the semi-end-to-end tests run verl's real ``fit()`` (see verl_harness.py for what is real and what is
faked).
"""

from __future__ import annotations

import os

import pytest
import torch
from seed_config import SEED

from dataflex_bus import hookimpl
from dataflex_bus.state_file import read_state

pytestmark = [pytest.mark.verl, pytest.mark.tq]

REWEIGHT_MATH_X2 = [
    "+dataflex.mechanism=reweight",
    "+dataflex.scorer.name=vt_reward",
    "+dataflex.actuator.name=vt_domain_weight",
    "+dataflex.actuator.params.domain=math",
    "+dataflex.actuator.params.weight=2.0",
]
MIX_FOCUS_HARD = [
    "+dataflex.mechanism=mix",
    "+dataflex.scorer.name=vt_reward",
    "+dataflex.actuator.name=vt_focus_hard",
    "+dataflex.actuator.params.temperature=0.05",
]


def dataset(H, tmp_path, **domains):
    return H.write_dataset(tmp_path / "train.parquet", domains)


def tq_keys(tq):
    return set((tq.kv_list("train") or {}).get("train", {}))


def domains_of(tq, keys):
    data = tq.kv_batch_get(keys=list(keys), partition_id="train", select_fields=["data_source"])
    return [getattr(x, "data", x) for x in data["data_source"]]


# ---------------------------------------------------------------------------- on_advantage
@pytest.mark.parametrize("rollout_is", ["token", "null"])
def test_on_advantage_weights_reach_the_actor_multiplied(H, tmp_path, clean_partition, rollout_is):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    tq = clean_partition
    run, meta = H.sampled(tmp_path, [*REWEIGHT_MATH_X2, f"algorithm.rollout_correction.rollout_is={rollout_is}"])
    t = run.trainer
    meta = t._balance_batch(meta, metrics={})
    assert len(meta) == 16 and sum(tag.get("is_padding", False) for tag in meta.tags) == 4
    meta = t._compute_old_log_prob(meta, metrics={})
    # verl alone: what verl's own rollout correction writes, and what the actor would see from it
    verl_meta = PPOTrainerSync._compute_advantage(t, meta, {})
    verl_view = H.worker_view(verl_meta)
    if rollout_is == "token":
        w_verl = verl_view["rollout_is_weights"].to_padded_tensor(0.0)
        assert not torch.allclose(w_verl, torch.ones_like(w_verl))  # verl really wrote IS weights
    else:
        assert "rollout_is_weights" not in verl_view.keys()
        w_verl = None

    metrics: dict = {}
    new_meta = t._compute_advantage(meta, metrics)
    assert "rollout_is_weights" in new_meta.fields
    assert new_meta.keys == meta.keys and [bool(x.get("is_padding")) for x in new_meta.tags] == \
        [bool(x.get("is_padding")) for x in meta.tags]
    view = H.worker_view(new_meta)  # exactly what the actor's worker receives
    w = view["rollout_is_weights"].to_padded_tensor(-1.0)
    mask = view["response_mask"].to_padded_tensor(0).bool()
    assert w.shape[0] == len(meta.keys)  # every key, padding included
    is_math = torch.tensor([d == "math" for d in domains_of(tq, meta.keys)])
    padding = torch.tensor([bool(x.get("is_padding")) for x in meta.tags])
    factor = torch.where(is_math & ~padding, 2.0, 1.0)[:, None].expand_as(w)
    base = torch.ones_like(w) if w_verl is None else w_verl
    assert torch.allclose(w[mask], (base * factor)[mask])
    assert int((is_math & ~padding).sum()) > 0 and H.kit_metrics(t)["dataflex/weight_max"] == pytest.approx(2.0)
    # the stale meta (what the prior implementation returned) would not deliver our weights
    if rollout_is == "null":
        assert "rollout_is_weights" not in H.worker_view(meta).keys()


def test_on_advantage_subset_selector_masks_and_rewrites_advantages(H, tmp_path, clean_partition):
    run, meta = H.sampled(tmp_path, [
        "+dataflex.mechanism=select", "+dataflex.scorer.name=reward_difficulty",
        "+dataflex.actuator.name=max_variance", "+dataflex.actuator.params.keep_fraction=0.5"])
    t = run.trainer
    assert t.dataflex.pipeline.event == "on_advantage"
    meta = t._balance_batch(meta, metrics={})
    meta = t._compute_old_log_prob(meta, metrics={})
    new_meta = t._compute_advantage(meta, metrics={})
    view = H.worker_view(new_meta)
    rm = view["response_mask"].to_padded_tensor(0)
    lm = view["loss_mask"].to_padded_tensor(0)
    adv = view["advantages"].to_padded_tensor(0.0)
    padding = torch.tensor([bool(x.get("is_padding")) for x in new_meta.tags])
    real_rows = (~padding).nonzero().flatten()
    kept = rm[real_rows].sum(-1) > 0
    assert int(kept.sum()) == 6  # 2 of every group of 4 (3 groups)
    dropped = real_rows[~kept]
    assert int(lm[dropped].sum()) == 0 and float(adv[dropped].abs().sum()) == 0.0
    assert torch.equal(rm.bool(), lm.bool())  # the token-mean denominator drops with the mask
    # kept pairs hold the subset's recomputed advantages: (r - mean_S)/(std_S + eps), +-0.7071 or 0
    kept_adv = adv[real_rows[kept]].abs().amax(-1)
    assert all(v == pytest.approx(0.7071, abs=1e-3) or v == 0.0 for v in kept_adv.tolist())


# ---------------------------------------------------------------------------- on_rollout
def test_on_rollout_removes_groups_before_old_log_prob(H, tmp_path, clean_partition):
    tq = clean_partition
    # the whole 4-row dataset is the batch: math solves 2 of 4 (kept), code 0 of 4 (dropped)
    run, meta = H.sampled(tmp_path, SEED, batch=4, domains={"math": 1, "code": 3})
    t = run.trainer
    before = list(meta.keys)
    doms = dict(zip(before, domains_of(tq, before)))
    metrics: dict = {}
    balanced = t._balance_batch(meta, metrics=metrics)
    expected = {k for k in before if doms[k] == "math"}
    real = [k for k, tag in zip(balanced.keys, balanced.tags) if not tag.get("is_padding")]
    assert set(real) == expected and len(expected) == 4 and len(before) == 16
    dropped = set(before) - expected
    assert not (dropped & tq_keys(tq))  # cleared from TransferQueue, not leaked
    assert len(balanced) == 8  # verl re-padded the 4 kept rows to lcm(dp, mini*n) = 8
    assert sum(bool(tag.get("is_padding")) for tag in balanced.tags) == 4
    assert H.kit_metrics(t)["dataflex/removed_rows"] == len(dropped)
    assert t._end_step(balanced)["dataflex/rollout/rows"] == len(before)  # pre-selection statistics
    t._compute_old_log_prob(balanced, metrics={})
    assert set(t.actor_rollout_wg.log_prob_keys[-1]) == set(balanced.keys)  # no compute for dropped rows


def test_on_rollout_empty_selection_keeps_one_group_and_skips_the_update(H, tmp_path, clean_partition):
    run, meta = H.sampled(tmp_path, SEED, domains={"code": 6})
    t = run.trainer
    balanced = t._balance_batch(meta, metrics={})
    real = [k for k, tag in zip(balanced.keys, balanced.tags) if not tag.get("is_padding")]
    assert len({k.split("_")[0] for k in real}) == 1 and len(real) == 4  # one group, never empty
    assert t._skip_update
    balanced = t._compute_old_log_prob(balanced, metrics={})
    balanced = t._compute_advantage(balanced, metrics={})
    t._update_actor(balanced, {})
    assert t._end_step(balanced)["dataflex/skipped_update"] == 1.0 and t.actor_rollout_wg.updates == []


# ---------------------------------------------------------------------------- semi-e2e fit()
@pytest.mark.integration
class Watcher:
    """An observer plugin hearing every event (so the trainer emits all three)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    @hookimpl
    def on_rollout(self, batch, step):
        self.seen.append(("on_rollout", step))

    @hookimpl
    def on_advantage(self, batch, step):
        self.seen.append(("on_advantage", step))

    @hookimpl
    def on_step_end(self, batch, step):
        self.seen.append(("on_step_end", step))


def test_fit_select_event_order_removal_and_checkpoint(H, tmp_path, clean_partition):
    tq = clean_partition
    data = dataset(H, tmp_path, math=4, logic=4, code=4)
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=3) + SEED)
    watcher = Watcher()
    run.trainer.dataflex.bus.add_observer(watcher, "watcher")
    run.setup().fit()
    step = ["generate", "on_rollout", "compute_log_prob", "on_advantage", "update_actor", "on_step_end"]
    assert run.events == step * 2
    assert watcher.seen == [(event, n) for n in (0, 1) for event in ("on_rollout", "on_advantage", "on_step_end")]
    wg = run.trainer.actor_rollout_wg
    for logged, keys, update in zip(run.logged, wg.log_prob_keys, wg.updates):
        real = [k for k, pad in zip(update["keys"], update["is_padding"]) if not pad]
        assert len(real) == 4 * logged["dataflex/kept_groups"] and set(keys) == set(update["keys"])
        assert logged["dataflex/rollout/rows"] == 12 and "actor/pg_loss" in logged
        assert logged["training/global_step"] in (1, 2)
    assert tq_keys(tq) == set()  # nothing leaked: dropped keys cleared by us, the rest by fit()
    for n in (1, 2):
        folder = tmp_path / "ckpt" / f"global_step_{n}"
        assert (folder / "dataflex_state.pt").exists() and not (folder / "transfer_queue").exists()
    state = read_state(tmp_path / "ckpt" / "global_step_2" / "dataflex_state.pt", "")
    assert state["global_steps"] == 2 and state["runtime"]["pipeline"]["config"]["actuator"]["name"] == \
        "threshold_band" and list(state["runtime"]["pipeline"]["methods"]) == ["select:threshold_band"]


@pytest.mark.integration
def test_fit_reweight_actor_receives_weights(H, tmp_path, clean_partition):
    tq = clean_partition
    data = dataset(H, tmp_path, math=6, code=6)
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=3) + REWEIGHT_MATH_X2).setup()
    doms: dict[str, str] = {}
    original = run.trainer._compute_old_log_prob

    def remember(batch, metrics):  # trajectories are cleared after each step: note their domains now
        doms.update(zip(batch.keys, domains_of(tq, batch.keys)))
        return original(batch, metrics)

    run.trainer._compute_old_log_prob = remember
    run.fit()
    assert len(run.trainer.actor_rollout_wg.updates) == 2
    for update in run.trainer.actor_rollout_wg.updates:
        assert "rollout_is_weights" in update["fields"]
        w, mask = update["rollout_is_weights"], update["response_mask"] > 0
        for i, (key, pad) in enumerate(zip(update["keys"], update["is_padding"])):
            want = 2.0 if doms[key] == "math" and not pad else 1.0
            assert torch.allclose(w[i][mask[i]], torch.full_like(w[i][mask[i]], want))
        assert all(torch.isfinite(torch.tensor(update["losses"])))


def _mix_run(H, tmp_path, data, ckpt, steps):
    return H.Run(H.base_overrides(data, ckpt, batch=4, steps=steps) + MIX_FOCUS_HARD).setup().fit()


@pytest.mark.integration
def test_fit_mix_changes_next_domains_and_resume_equals_uninterrupted(H, tmp_path, clean_partition):
    data = dataset(H, tmp_path, math=6, code=6)
    full = _mix_run(H, tmp_path, data, tmp_path / "full", steps=3)
    drawn = full.agent_loop.generated_domains
    assert set(drawn[0]) == {"math", "code"}  # step 1: uniform over domains
    # after step 1 the mixer saw math at mean reward 0.5, code at 0: all mass on code
    assert drawn[1] == ["code"] * 4 and drawn[2] == ["code"] * 4
    assert full.logged[1]["dataflex/drawn/code"] == 4.0
    assert full.logged[0]["dataflex/domain_prob/code"] == pytest.approx(1.0, abs=1e-3)

    first = _mix_run(H, tmp_path, data, tmp_path / "resumed", steps=2)
    assert first.agent_loop.generated_domains == drawn[:2]
    resumed = H.Run(H.base_overrides(data, tmp_path / "resumed", batch=4, steps=3) + MIX_FOCUS_HARD).setup()
    assert resumed.trainer.global_steps == 2
    resumed.fit()
    assert resumed.agent_loop.generated_domains == drawn[2:]
    a, b = full.trainer.dataflex_state_dict(), resumed.trainer.dataflex_state_dict()
    assert a["global_steps"] == b["global_steps"] == 4  # fit() counts past its last step
    sa, sb = (state["runtime"]["pipeline"]["methods"]["mix:vt_focus_hard"] for state in (a, b))
    assert torch.equal(sa["actuator"]["counts"], sb["actuator"]["counts"])
    assert torch.equal(sa["actuator"]["sums"], sb["actuator"]["sums"])
    assert sa["domain_probs"] == sb["domain_probs"]
    assert torch.equal(a["sampler"]["generator"], b["sampler"]["generator"])
    assert a["sampler"]["positions"] == b["sampler"]["positions"]
    assert all(torch.equal(x, y) for x, y in zip(a["sampler"]["orders"], b["sampler"]["orders"]))


@pytest.mark.integration
def test_fit_composes_with_verl_dapo_filter_groups(H, tmp_path, clean_partition):
    """verl's DAPO evicts zero-variance groups (code) and refills in the replay buffer; dataflex then
    removes what its band rejects from the full batch (nothing is evicted twice)."""
    tq = clean_partition
    data = dataset(H, tmp_path, math=4, logic=4, code=4)
    band = [s.replace("low=0.2", "low=0.4") for s in SEED]  # keeps math (0.5), rejects logic (0.25)
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=3, steps=2) + band + [
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=reward"]).setup()
    assert run.trainer.trainer_mode == "sync" and run.trainer.replay_buffer.filter_groups_metric == "reward"
    run.fit()
    for logged, update in zip(run.logged, run.trainer.actor_rollout_wg.updates):
        assert logged["dataflex/rollout/groups"] == 3  # DAPO refilled the batch to train_batch_size
        assert logged.get("dataflex/rollout/rows/code", 0.0) == 0.0  # code never reaches dataflex
        logic = logged.get("dataflex/rollout/rows/logic", 0.0)
        assert logged.get("dataflex/removed_rows", 0.0) == logic
        real = [k for k, pad in zip(update["keys"], update["is_padding"]) if not pad]
        assert len(real) == logged["dataflex/rollout/rows/math"]
    assert any(logged.get("training/filter_groups/evicted_samples", 0) > 0 for logged in run.logged)
    assert tq_keys(tq) == set()
    assert os.path.exists(tmp_path / "ckpt" / "global_step_2" / "dataflex_state.pt")


STACK = ["+dataflex.methods=[{name: filter, mechanism: select, scorer: {name: reward_difficulty}, "
         "actuator: {name: dapo}}, {name: curriculum, mechanism: mix, scorer: {name: advantage_magnitude}, "
         "actuator: {name: dump_ucb, params: {c: 0.0, temperature: 0.05}}, warmup_step: 1}, "
         "{name: ar, mechanism: reweight, scorer: {name: token_prob}, "
         "actuator: {name: advantage_reweight, params: {alpha: 0.5}}}]"]


def _stack_run(H, data, ckpt, steps):
    return H.Run(H.base_overrides(data, ckpt, batch=3, steps=steps) + STACK).setup()


@pytest.mark.integration
def test_fit_three_method_stack_acts_and_resumes_exactly(H, tmp_path, clean_partition):
    """DAPO filter + DUMP curriculum + AR reweighting in one run (one Hydra override): each method acts at
    its event, in order, and 2 steps + resume + 1 equal 3 uninterrupted steps."""
    tq = clean_partition
    data = dataset(H, tmp_path, math=6, logic=6, code=6)
    full = _stack_run(H, data, tmp_path / "full", 3).fit()
    assert full.trainer.dataflex.describe() == [
        "filter: reward_difficulty+dapo @ on_rollout", "curriculum: advantage_magnitude+dump_ucb @ on_step_end",
        "ar: token_prob+advantage_reweight @ on_advantage"]
    step = ["generate", "on_rollout", "compute_log_prob", "on_advantage", "update_actor", "on_step_end"]
    assert full.events == step * 3
    for logged in full.logged:
        # each method's metrics under its own name: the filter dropped the all-wrong code groups,
        # AR weighted tokens by 0.5 * p + 0.5, the curriculum published domain probabilities
        assert 0.0 < logged["dataflex/filter/kept_fraction"] <= 1.0
        assert 0.5 <= logged["dataflex/ar/weight_min"] <= logged["dataflex/ar/weight_max"] <= 1.0
        probs = [logged[f"dataflex/curriculum/domain_prob/{d}"] for d in ("code", "logic", "math")]
        assert sum(probs) == pytest.approx(1.0)
    for update in full.trainer.actor_rollout_wg.updates:
        w, mask = update["rollout_is_weights"], update["response_mask"] > 0
        assert bool((w[mask] >= 0.5).all()) and bool((w[mask] <= 1.0).all()) and float(w[mask].std()) > 0
    assert tq_keys(tq) == set()

    first = _stack_run(H, data, tmp_path / "resumed", 2).fit()
    resumed = _stack_run(H, data, tmp_path / "resumed", 3)
    assert resumed.trainer.global_steps == 2
    resumed.fit()
    assert first.agent_loop.generated_domains + resumed.agent_loop.generated_domains == \
        full.agent_loop.generated_domains
    a, b = full.trainer.dataflex_state_dict(), resumed.trainer.dataflex_state_dict()
    assert sorted(a["runtime"]["pipeline"]["methods"]) == ["ar", "curriculum", "filter"]
    sa, sb = (s["runtime"]["pipeline"]["methods"]["curriculum"] for s in (a, b))
    assert torch.equal(sa["actuator"]["buffer"], sb["actuator"]["buffer"])
    assert torch.equal(sa["actuator"]["counts"], sb["actuator"]["counts"]) and sa["domain_probs"] == sb["domain_probs"]
    for key in ("dataflex/filter/kept_fraction", "dataflex/ar/weight_mean", "dataflex/curriculum/domain_prob/code"):
        assert resumed.logged[-1][key] == pytest.approx(full.logged[-1][key])
