"""The adapter's hardening against a real TransferQueue (Ray + TQ session, see conftest.py): emptied
mini-batches, non-finite drops under reweight, trained-only metrics, the compute actually spent, the
fields fetched per event, and the asynchronous modes."""

from __future__ import annotations

import math

import pytest
import torch
from seed_config import SEED

from dataflex_bus.state_file import read_state

pytestmark = [pytest.mark.verl, pytest.mark.tq]

#: Keeps the top 10 % of rows by |advantage|: 1 row of 12, so at least 2 of 3 mini-batches of 4 rows
#: (ppo_mini_batch_size=1, n=4, shuffle=false) lose every row.
TOPK_ONE_ROW = ["+dataflex.mechanism=select", "+dataflex.scorer.name=advantage_magnitude",
                "+dataflex.actuator.name=topk_fraction", "+dataflex.actuator.params.fraction=0.1"]


def train_one_step(t, meta) -> tuple[dict, object]:
    """verl's _step_once from _balance_batch on, collecting the metrics; returns them and the meta the
    actor received."""
    metrics: dict = {}
    meta = t._balance_batch(meta, metrics=metrics)
    meta = t._compute_old_log_prob(meta, metrics=metrics)
    meta = t._compute_advantage(meta, metrics=metrics)
    actor = t._update_actor(meta, metrics=metrics)
    metrics.update(t._end_step(actor))
    return metrics, actor


def tq_keys(tq):
    return set((tq.kv_list("train") or {}).get("train", {}))


def worker_field(H, meta, name, pad=0):
    return H.worker_view(meta)[name].to_padded_tensor(pad)


# ---------------------------------------------------------------------------- emptied mini-batches
def test_an_emptied_mini_batch_would_be_a_nan_step(H, tmp_path, clean_partition):
    """The scenario of the tests below, without the adapter's block handling: token-mean 0/0."""
    run, meta = H.sampled(tmp_path, TOPK_ONE_ROW, mini=1)
    t = run.trainer
    t._actor_blocks = lambda rows: (None, None)
    train_one_step(t, meta)
    losses = t.actor_rollout_wg.updates[-1]["losses"]
    assert len(losses) == 3 and sum(math.isnan(x) for x in losses) == 2


def test_an_emptied_mini_batch_leaves_the_update_under_on_empty_skip(H, tmp_path, clean_partition):
    tq = clean_partition
    run, meta = H.sampled(tmp_path, TOPK_ONE_ROW, mini=1)
    t = run.trainer
    metrics, _ = train_one_step(t, meta)
    update = t.actor_rollout_wg.updates[-1]
    assert metrics["dataflex/empty_minibatches"] == 2 and metrics["dataflex/removed_minibatch_rows"] == 8
    assert len(update["keys"]) == 4 and update["mini_batch_sizes"] == [4]
    assert all(math.isfinite(x) for x in update["losses"])
    assert metrics["dataflex/compute/actor_rows"] == 4 and metrics["dataflex/compute/rows_after_padding"] == 12
    assert metrics["dataflex/trained/rows"] == 1
    assert tq_keys(tq) >= set(update["keys"]) and not (set(meta.keys) - set(update["keys"])) & tq_keys(tq)


def test_an_emptied_mini_batch_trains_again_under_on_empty_keep_all(H, tmp_path, clean_partition):
    run, meta = H.sampled(tmp_path, [*TOPK_ONE_ROW, "+dataflex.on_empty=keep_all"], mini=1)
    t = run.trainer
    metrics, actor_meta = train_one_step(t, meta)
    update = t.actor_rollout_wg.updates[-1]
    assert metrics["dataflex/empty_minibatches"] == 2 and metrics["dataflex/restored_rows"] == 8
    assert len(update["keys"]) == 12 and all(math.isfinite(x) for x in update["losses"])
    assert metrics["dataflex/trained/rows"] == 9
    assert int((worker_field(H, actor_meta, "loss_mask").sum(-1) > 0).sum()) == 9


def test_an_emptied_mini_batch_raises_under_on_empty_error(H, tmp_path, clean_partition):
    from dataflex_bus.errors import DataflexError

    run, meta = H.sampled(tmp_path, [*TOPK_ONE_ROW, "+dataflex.on_empty=error"], mini=1)
    t = run.trainer
    with pytest.raises(DataflexError, match=r"every row of 2 of 3 training block.*on_empty=error"):
        train_one_step(t, meta)


# ---------------------------------------------------------------------------- reweight, on_nonfinite=drop
def test_reweight_drops_a_nonfinite_row_in_what_the_actor_receives(H, tmp_path, clean_partition):
    from test_verl_tq import domains_of

    tq = clean_partition
    run, meta = H.sampled(tmp_path, [
        "+dataflex.mechanism=reweight", "+dataflex.scorer.name=vt_nan_for", "+dataflex.scorer.params.domain=code",
        "+dataflex.actuator.name=vt_domain_weight", "+dataflex.actuator.params.domain=math",
        "+dataflex.actuator.params.weight=2.0", "+dataflex.on_nonfinite=drop"],
        batch=4, mini=4, domains={"math": 2, "code": 2})
    t = run.trainer
    metrics, actor_meta = train_one_step(t, meta)
    doms = domains_of(tq, actor_meta.keys)
    code = torch.tensor([d == "code" for d in doms])
    assert int(code.sum()) == 8 and metrics["dataflex/nonfinite_rows"] == 8
    view = H.worker_view(actor_meta)  # exactly what the actor's worker receives
    response, loss = (view[f].to_padded_tensor(0) for f in ("response_mask", "loss_mask"))
    advantages, weights = view["advantages"].to_padded_tensor(0.0), view["rollout_is_weights"].to_padded_tensor(0.0)
    assert int(response[code].sum()) == 0 and int(loss[code].sum()) == 0  # dropped, not trained at weight 1
    assert float(advantages[code].abs().sum()) == 0.0
    real = response[~code].bool()
    assert torch.all(weights[~code][real] == 2.0) and int(loss[~code].sum()) == int(response[~code].sum()) > 0
    assert metrics["dataflex/trained/rows"] == 8


# ---------------------------------------------------------------------------- trained-only metrics
@pytest.mark.integration
def test_trained_metrics_count_only_the_rows_the_actor_trains_on(H, tmp_path, clean_partition):
    tq = clean_partition
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 1, "logic": 1, "code": 1})
    topk = ["+dataflex.mechanism=select", "+dataflex.scorer.name=advantage_magnitude",
            "+dataflex.actuator.name=topk_fraction", "+dataflex.actuator.params.fraction=0.5"]
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=3, mini=4, steps=1) + topk).setup()
    rewards: dict[str, float] = {}
    original = run.trainer._compute_old_log_prob

    def remember(batch, metrics):  # trajectories are cleared after the step: note their rewards now
        got = tq.kv_batch_get(keys=list(batch.keys), partition_id="train", select_fields=["rm_scores"])
        rewards.update(zip(batch.keys, got["rm_scores"].to_padded_tensor(0.0).sum(-1).tolist()))
        return original(batch, metrics)

    run.trainer._compute_old_log_prob = remember
    run.fit()
    logged, update = run.logged[0], run.trainer.actor_rollout_wg.updates[0]
    trained = [k for k, pad, mask in zip(update["keys"], update["is_padding"], update["loss_mask"])
               if not pad and bool((mask == 1).any())]
    real = [k for k, pad in zip(update["keys"], update["is_padding"]) if not pad]
    assert logged["dataflex/trained/rows"] == len(trained) == 6
    assert logged["dataflex/trained/tokens"] == int((update["loss_mask"] == 1).sum())
    assert logged["dataflex/trained/reward_mean"] == pytest.approx(sum(rewards[k] for k in trained) / 6)
    # verl's own score still averages over the masked rows too
    assert logged["critic/score/mean"] == pytest.approx(sum(rewards[k] for k in real) / len(real))
    assert logged["critic/score/mean"] != pytest.approx(logged["dataflex/trained/reward_mean"])


# ---------------------------------------------------------------------------- compute actually spent
def test_rows_after_padding_reports_the_compute_of_an_on_rollout_drop(H, tmp_path, clean_partition):
    run, meta = H.sampled(tmp_path, SEED, batch=4, domains={"math": 1, "code": 3})
    t = run.trainer
    real_tokens = {k: tag["seq_len"] for k, tag in zip(meta.keys, meta.tags)}
    metrics: dict = {}
    balanced = t._balance_batch(meta, metrics=metrics)
    kept = [k for k, tag in zip(balanced.keys, balanced.tags) if not tag.get("is_padding")]
    assert H.kit_metrics(t)["dataflex/removed_rows"] == 12 and len(kept) == 4
    # the 4 kept rows are padded back to a whole mini-batch of ppo_mini_batch_size * n = 8 rows
    assert metrics["dataflex/compute/rows_after_padding"] == 8 == len(balanced)
    assert metrics["dataflex/compute/padding_rows"] == 4
    assert metrics["dataflex/compute/tokens_after_padding"] == sum(real_tokens[k] for k in kept) + 4 * 128


# ---------------------------------------------------------------------------- fields fetched
def test_the_adapter_fetches_only_the_declared_fields(H, tmp_path, clean_partition, monkeypatch):
    import dataflex_bus.verl.advantage as carry_out
    import dataflex_bus.verl.trainer as adapter

    run, meta = H.sampled(tmp_path, [
        "+dataflex.mechanism=reweight", "+dataflex.scorer.name=token_prob",
        "+dataflex.actuator.name=advantage_reweight", "+dataflex.actuator.params.alpha=0.5"])
    t = run.trainer
    fetched: list[tuple[str, set]] = []
    real_fetch = adapter.fetch

    def spy(meta, fields):
        fields = set(fields)
        fetched.append(fields)
        return real_fetch(meta, fields)

    for module in (adapter, carry_out):  # the adapter's modules that read TransferQueue
        monkeypatch.setattr(module, "fetch", spy)
    train_one_step(t, meta)  # through the step's end: nobody listens at on_step_end
    base = {"uid", "response_mask", "rm_scores", "data_source"}
    assert t.dataflex.fields("on_rollout") == frozenset()
    assert t.dataflex.fields("on_advantage") == {"old_log_probs", "response_mask"}
    # on_rollout always (its pre-selection statistics); on_step_end not at all: nobody listens there
    assert fetched == [base, base | {"old_log_probs", "loss_mask", "advantages"}]


def test_an_event_nobody_listens_to_reads_only_what_the_metrics_need(H, tmp_path, clean_partition, monkeypatch):
    import dataflex_bus.verl.advantage as carry_out
    import dataflex_bus.verl.trainer as adapter

    run, meta = H.sampled(tmp_path, SEED)
    t = run.trainer
    assert not t.dataflex.listens("on_advantage") and not t.dataflex.listens("on_step_end")
    fetched: list[set] = []
    real_fetch = adapter.fetch
    for module in (adapter, carry_out):  # the adapter's modules that read TransferQueue
        monkeypatch.setattr(module, "fetch", lambda m, f: fetched.append(set(f)) or real_fetch(m, f))
    metrics, _ = train_one_step(t, meta)  # through the step's end: nobody listens at on_step_end
    assert fetched == [{"uid", "response_mask", "rm_scores", "data_source"}, {"uid", "loss_mask"}]
    assert metrics["dataflex/trained/rows"] == metrics["dataflex/kept_rows"] > 0
    assert [e for e in run.events if e.startswith("on_")] == ["on_rollout"]
    # an observer that hears on_step_end gets it, with the guaranteed fields
    from test_verl_tq import Watcher

    watcher = Watcher()
    t.dataflex.bus.add_observer(watcher, "watcher")
    assert t.dataflex.listens("on_step_end")
    t._end_step(meta)
    assert watcher.seen == [("on_step_end", 0)] and fetched[-1] == {"uid", "response_mask", "rm_scores", "data_source"}


# ---------------------------------------------------------------------------- asynchronous modes
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["dataflex_colocate_async", "dataflex_separate_async"])
def test_fit_async_modes_carry_the_events_and_the_removal(H, tmp_path, clean_partition, mode):
    """verl's async trainers share the sync step skeleton: the same hooks fire (per local update when
    separate_async runs parameter_sync_step=4 of them per step), rejected groups never reach compute,
    and verl's async checkpoint (with its TransferQueue snapshot) carries the dataflex state."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "logic": 4, "code": 4})
    band = [s.replace("low=0.2", "low=0.4") for s in SEED]  # keeps math (0.5); logic and code removed
    separate = mode == "dataflex_separate_async"
    extra = (["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
              "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"] if separate else [])
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=4 if separate else 3, mini=1 if separate else 2,
                                 mode=mode) + band + extra).setup()
    from test_verl_tq import Watcher

    t = run.trainer
    assert type(t.replay_buffer) is ReplayBufferAsync and t.trainer_mode == mode.removeprefix("dataflex_")
    watcher = Watcher()  # hears every event, so the trainer emits all three
    t.dataflex.bus.add_observer(watcher, "watcher")
    run.fit()
    updates = 4 if separate else 1  # local updates per step
    order = ["on_rollout", "on_advantage"] * updates + ["on_step_end"]
    assert [event for event, _ in watcher.seen] == order * 2
    assert [n for _, n in watcher.seen] == [0] * len(order) + [1] * len(order)
    from dataflex_bus.carry import carry_out_rollout

    rollouts = [(decision, batch) for event, decision, batch in run.decisions if event == "on_rollout"]
    computed = t.actor_rollout_wg.log_prob_keys
    assert len(rollouts) == len(computed)
    for (decision, batch), keys in zip(rollouts, computed):  # compute saw exactly the kept rows
        action = carry_out_rollout(batch, decision)
        kept = batch.valid_rows if action.keep is None else action.keep & batch.valid_rows
        assert len([k for k in keys if not k.startswith("pad")]) == int(kept.sum())
        if not action.skip_update:
            assert {batch.domain_names[d] for d in batch.domain_index[kept].tolist()} == {"math"}
    assert any(not carry_out_rollout(b, d).skip_update for d, b in rollouts)
    for logged in run.logged:
        assert "dataflex/compute/rows_after_padding" in logged and "dataflex/trained/rows" in logged
    folder = tmp_path / "ckpt" / "global_step_2"
    assert (folder / "dataflex_state.pt").exists() and (folder / "transfer_queue").exists()
    state = read_state(folder / "dataflex_state.pt", "")
    assert state["global_steps"] == 2 and list(state["runtime"]["pipeline"]["methods"]) == ["select:threshold_band"]
