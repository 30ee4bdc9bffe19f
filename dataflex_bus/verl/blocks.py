"""verl's actor mini-batches, as row numbers: which rows each optimizer step of the update trains together."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor
from verl.utils import tensordict_utils as tu


def minibatch_blocks(rows: int, mini_batch_size: int, dp_size: int, *, epochs: int = 1, shuffle: bool = False,
                     seed: int = 42) -> Tensor:
    """Long ``[K, mini_batch_size]``: the rows of each mini-batch verl's actor update steps on, in the
    order of the batch it receives (``K`` = ``epochs * rows / mini_batch_size``).

    verl hands DP rank ``r`` the ``r``-th contiguous chunk of the batch, and each rank walks its chunk
    with ``tensordict_utils.make_iterator`` (seed ``seed + r``); mini-batch ``j`` is the ``j``-th
    local batch of every rank together, and its token-mean divides by its loss-mask sum over all ranks.
    The same iterator runs here on row numbers, so shuffled orders come out exactly as verl draws them.
    """
    local, per_rank = rows // dp_size, mini_batch_size // dp_size
    index = TensorDict({"row": torch.arange(local)}, batch_size=local)
    ranks = []
    for rank in range(dp_size):  # one iterator per rank, one entry per mini-batch: never per row
        batches = tu.make_iterator(index, mini_batch_size=per_rank, epochs=epochs, seed=seed + rank,
                                   dataloader_kwargs={"shuffle": shuffle})
        ranks.append(torch.stack([b["row"] for b in batches]) + rank * local)
    return torch.cat(ranks, dim=1)
