"""Both hosts carry out the same decision the same way.

The verl trainer's hooks run against a real TransferQueue; every batch and decision they put on the bus is
recorded, and the shim's own carry-out functions are applied to that very batch and decision. What verl
hands its actor (kept keys, masks, advantages, ``rollout_is_weights`` as the worker receives them) must equal
what the shim trains on.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.tq]

CASES = {
    # on_rollout: whole groups removed (math solves 2 of 4: kept; logic 1 of 4, code 0 of 4: dropped)
    "rollout-band": ["+dataflex.mechanism=select", "+dataflex.scorer.name=group_solve_rate",
                     "+dataflex.actuator.name=threshold_band", "+dataflex.actuator.params.low=0.4",
                     "+dataflex.actuator.params.high=0.6"],
    # on_rollout: nothing in the band -> the first group goes on, the update is skipped
    "rollout-empty": ["+dataflex.mechanism=select", "+dataflex.scorer.name=group_solve_rate",
                      "+dataflex.actuator.name=threshold_band", "+dataflex.actuator.params.low=1.5",
                      "+dataflex.actuator.params.high=2.0"],
    # on_advantage: single rows dropped (masks and advantages zeroed)
    "advantage-topk": ["+dataflex.mechanism=select", "+dataflex.scorer.name=advantage_magnitude",
                       "+dataflex.actuator.name=topk_fraction", "+dataflex.actuator.params.fraction=0.5"],
    # on_advantage: a subset selector's recomputed advantages replace verl's
    "advantage-subset": ["+dataflex.mechanism=select", "+dataflex.scorer.name=reward_difficulty",
                         "+dataflex.actuator.name=max_variance", "+dataflex.actuator.params.keep_fraction=0.5"],
    # on_advantage: per-token weights multiplied into verl's own importance weights
    "reweight": ["+dataflex.mechanism=reweight", "+dataflex.scorer.name=token_prob",
                 "+dataflex.actuator.name=advantage_reweight", "+dataflex.actuator.params.alpha=0.5",
                 "algorithm.rollout_correction.rollout_is=token"],
}


def _spy(trainer) -> list:
    """Record (event, batch, decision) of every emit of the trainer's runtime."""
    seen = []
    emit = trainer.dataflex.emit

    def recording(event, batch, step):
        decision = emit(event, batch, step)
        seen.append((event, batch, decision))
        return decision

    trainer.dataflex.emit = recording
    return seen


def _numbered(batch):
    """The batch with each row's position as a field, to see which rows a host kept."""
    return batch.with_fields(row=torch.arange(len(batch)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shim_and_verl_carry_out_the_same_decision(H, tmp_path, clean_partition, case):
    from dataflex_bus.shim.trainer import after_advantage, after_rollout

    run, meta = H.sampled(tmp_path, CASES[case], batch=3)
    t = run.trainer
    seen = _spy(t)

    # on_rollout: verl removes keys from the batch (and TransferQueue); the shim removes rows
    verl_meta = t._balance_batch(meta, metrics={})
    event, batch, decision = seen[0]
    assert event == "on_rollout"
    shim, shim_skip = after_rollout(_numbered(batch), decision)
    kept = [meta.keys[i] for i in shim["row"].tolist()]
    real_keys = [k for k, tag in zip(verl_meta.keys, verl_meta.tags) if not tag.get("is_padding")]
    assert real_keys == kept
    assert t._skip_update == shim_skip == (case == "rollout-empty")
    if case.startswith("rollout"):
        return

    # on_advantage: verl writes fields for every key; the worker's view must equal the shim's batch
    verl_meta = t._compute_old_log_prob(verl_meta, metrics={})
    written = t._compute_advantage(verl_meta, metrics={})
    event, batch, decision = seen[-1]
    assert event == "on_advantage"
    shim, shim_skip = after_advantage(_numbered(batch), decision)
    assert not shim_skip and not t._skip_update
    view = H.worker_view(written)  # exactly what the actor's worker receives
    padding = torch.tensor([bool(tag.get("is_padding")) for tag in written.tags])
    mask = view["response_mask"].to_padded_tensor(0)
    shim = shim.select(shim.valid_rows)  # verl's padding rows travel along in both hosts
    rows = shim["row"]
    # the rows the shim removed are the real rows verl fully masked; the rest train in both
    trained = (~padding) & (mask.sum(-1) > 0)
    assert trained.nonzero().flatten().tolist() == rows.tolist()
    width = shim["response_mask"].shape[1]
    for field in ("response_mask", "loss_mask", "advantages", "rollout_is_weights"):
        if field not in shim.fields:
            assert field not in view.keys()
            continue
        verl_values = view[field].to_padded_tensor(0)[rows][:, :width].to(torch.float32)
        real = shim["response_mask"].bool()
        assert torch.allclose(verl_values[real], shim[field].to(torch.float32)[real], atol=1e-6), field
    if case == "reweight":
        assert "rollout_is_weights" in shim.fields and "rollout_is_weights" in written.fields
