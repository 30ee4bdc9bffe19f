"""The verl adapter's batch on the driver: per-token fields come into the bus jagged as TransferQueue holds them
(token masks as bool, an eighth of TransferQueue's int64), the bus reads the same lengths, rewards, token mask
and decisions from them as from the padded batch, pads a field only when a method reads it per token, and a mask
written back goes into TransferQueue in the dtype it came in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transfer_queue")

from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack

from dataflex_bus.verl.tqbatch import to_batch, to_nested

pytestmark = [pytest.mark.verl]


def jagged(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, max_seqlen=int(lengths.max()),
                                                  min_seqlen=int(lengths.min()))


def test_masks_enter_the_bus_as_bool_and_leave_in_transfer_queues_dtype():
    lengths = torch.tensor([3, 1, 5, 2])
    total = int(lengths.sum())
    mask_values = torch.ones(total, dtype=torch.long)
    mask_values[2] = 0  # a tool token inside the first response
    rm = torch.zeros(total)
    rm[torch.cumsum(lengths, 0) - 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    td = TensorDict({"response_mask": jagged(mask_values, lengths), "loss_mask": jagged(mask_values.clone(), lengths),
                     "rm_scores": jagged(rm, lengths), "uid": NonTensorStack("a", "a", "b", "b")}, batch_size=4)
    batch = to_batch(td, [{"is_padding": False}] * 4)
    dense = td.get("response_mask").to_padded_tensor(0)
    assert batch["response_mask"].dtype == torch.bool and batch["loss_mask"].dtype == torch.bool
    assert torch.equal(batch["response_mask"], dense.bool()) and batch["rm_scores"].dtype == torch.float32
    # rewards are verl's (the row's rm_scores summed, mask or no mask: #43): row 0's score sits on a mask-0 token
    assert batch.lengths.tolist() == [2, 1, 5, 2] and batch.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
    back = to_nested(batch["response_mask"], td.get("response_mask"))
    assert back.dtype == torch.long and torch.equal(back.values(), mask_values)


def verl_rollouts(rows: int = 48, group: int = 4, seed: int = 0) -> TensorDict:
    """A GRPO batch as ``kv_batch_get`` hands it to the driver: per-token fields jagged (lengths spread over
    orders of magnitude), the score on each response's last token, ``uid`` and ``data_source`` as lists."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.empty(rows).uniform_(0.0, 6.0, generator=g)).long().clamp(1, 400)
    total = int(lengths.sum())
    rm = torch.zeros(total)
    rm[torch.cumsum(lengths, 0) - 1] = (torch.rand(rows, generator=g) < 0.5).float()
    fields = {"response_mask": jagged(torch.ones(total, dtype=torch.long), lengths), "rm_scores": jagged(rm, lengths),
              "old_log_probs": jagged(-torch.rand(total, generator=g), lengths),
              "entropy": jagged(torch.rand(total, generator=g) * 3, lengths),
              "advantages": jagged(torch.randn(total, generator=g), lengths)}
    return TensorDict({**fields, "uid": NonTensorStack(*[f"p{i // group}" for i in range(rows)]),
                       "data_source": NonTensorStack(*["math"] * rows)}, batch_size=rows)


def padded_copy(td: TensorDict) -> TensorDict:
    """``td`` with its jagged fields padded to ``[B, T]``: what the adapter handed the bus before (#44)."""
    return TensorDict({k: v.to_padded_tensor(0) if isinstance(v, torch.Tensor) and v.is_nested else v
                       for k, v in ((k, td.get(k)) for k in td.keys())}, batch_size=len(td))


@pytest.mark.parametrize("method", [
    {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
     "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}},
    {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}],
    ids=["band", "dapo"])
def test_a_method_reading_row_quantities_pads_no_per_token_field(method):
    """Rewards, lengths and group statistics come from the jagged values: no field is padded to [B, T]."""
    from dataflex_bus.host import ANY_HOST
    from dataflex_bus.runtime import Runtime

    host = ANY_HOST.replace(name="verl", adv_estimator="grpo", group_size=4)
    td = verl_rollouts()
    batch = to_batch(td, [{"is_padding": False}] * len(td))
    runtime = Runtime(method, host=host)
    assert runtime.listens("on_rollout")
    decision = runtime.emit("on_rollout", batch, 1)
    assert decision.keep is not None and not bool(decision.keep.all())  # it did select
    assert all(batch.jagged_field(name) is not None for name in ("rm_scores", "response_mask", "entropy"))
    assert batch.dense_views() == []
    padded = to_batch(padded_copy(td), [{"is_padding": False}] * len(td))
    assert torch.equal(batch.rewards, padded.rewards) and torch.equal(batch.lengths, padded.lengths)
    expected = Runtime(method, host=host).emit("on_rollout", padded, 1)
    assert (decision.keep is None) == (expected.keep is None)
    assert decision.keep is None or torch.equal(decision.keep, expected.keep)


def test_top_entropy_pads_no_float_field_of_the_batch():
    """The 80/20 selection reads the entropy on its jagged values and makes one dense score: of the batch's own
    fields only the (bool) response mask is padded, and it keeps exactly the tokens the padded batch keeps."""
    from dataflex_bus.host import ANY_HOST
    from dataflex_bus.runtime import Runtime

    method = {"mechanism": "select", "scorer": {"name": "token_entropy"},
              "actuator": {"name": "top_entropy", "params": {"rho": 0.2, "form": "topk", "scope": "batch"}}}
    host = ANY_HOST.replace(name="verl", adv_estimator="grpo", group_size=4)
    td = verl_rollouts(seed=2)
    batch = to_batch(td, [{"is_padding": False}] * len(td))
    decision = Runtime(method, host=host).emit("on_advantage", batch, 1)
    assert batch.dense_views() == ["response_mask"]
    padded = to_batch(padded_copy(td), [{"is_padding": False}] * len(td))
    expected = Runtime(method, host=host).emit("on_advantage", padded, 1)
    assert decision.tokens is not None and torch.equal(decision.tokens, expected.tokens)
    assert decision.metrics.keys() == expected.metrics.keys()
    assert all(decision.metrics[k] == pytest.approx(expected.metrics[k], rel=1e-6) for k in expected.metrics)


def test_token_prob_reweighting_pads_no_float_field_of_the_batch():
    """Advantage reweighting by token probability: ``exp(old_log_probs)`` on the jagged tokens, one dense score;
    the weights are the padded batch's."""
    from dataflex_bus.host import ANY_HOST
    from dataflex_bus.runtime import Runtime

    method = {"mechanism": "reweight", "scorer": {"name": "token_prob"},
              "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.5}}}
    host = ANY_HOST.replace(name="verl", adv_estimator="grpo", group_size=4)
    td = verl_rollouts(seed=4)
    tags = [{"is_padding": i >= len(td) - 4} for i in range(len(td))]  # verl's padding rows weigh 1
    batch = to_batch(td, tags)
    decision = Runtime(method, host=host).emit("on_advantage", batch, 1)
    assert batch.dense_views() == ["response_mask"]
    expected = Runtime(method, host=host).emit("on_advantage", to_batch(padded_copy(td), tags), 1)
    assert decision.weights is not None and torch.equal(decision.weights, expected.weights)
