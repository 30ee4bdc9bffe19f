"""The verl adapter's batch on the driver: token masks come into the bus as bool (an eighth of TransferQueue's
int64, padded from their bool values), the bus reads the same lengths, rewards and token mask from them, and a
mask written back goes into TransferQueue in the dtype it came in."""

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
