"""The TRL host's view of its processes: what every process's rows are, in TRL's global order (rank-major),
and what each process's slice of a global field is.

Every process builds the same global batch from gathered rows, so every process decides the same
(:meth:`Processes.agree` checks it, one small gather per event); each then carries the decision out on its
own rows of the :class:`~dataflex_bus.trl.rows.Layout`.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object
from torch import Tensor

from ..kit import DataflexError, fingerprint
from .rows import REAL, Layout


class Processes:
    """The processes of one TRL run, through its ``accelerate`` accelerator."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    @property
    def count(self) -> int:
        return int(self.accelerator.num_processes)

    @property
    def rank(self) -> int:
        return int(self.accelerator.process_index)

    def gather_lists(self, local: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Per-row lists of every process, concatenated in rank order (TRL's global order)."""
        if self.count == 1:
            return local
        parts = gather_object([local])
        # A column one process lacks (a reward function logging only on some rows) is None on its rows.
        keys = sorted({k for part in parts for k in part})
        return {k: [x for part in parts for x in part.get(k, [None] * len(part["completion_ids"]))] for k in keys}

    def gather_rows(self, t: Tensor, layout: Layout, *, left: bool = False) -> Tensor:
        """A per-row tensor of every process's real rows, in global order, widths padded to the widest."""
        if layout.processes == 1:
            return t[:layout.total].detach().cpu()
        acc = self.accelerator
        if t.dim() >= 2:
            t = acc.pad_across_processes(t.contiguous(), dim=1, pad_index=0, pad_first=left)
        everything = acc.gather(t.contiguous()).detach().cpu()
        real = torch.cat([torch.arange(layout.per_rank) < (layout.span(r)[1] - layout.span(r)[0])
                          for r in range(layout.processes)])
        return everything[real]

    def local(self, values: Tensor, layout: Layout, width: int, pad: float) -> Tensor:
        """This process's rows of a global ``[K, T]`` field, as ``[per_rank, width]`` (padding rows and columns
        ``pad``), on the process's device."""
        lo, hi = layout.span(self.rank)
        part = values[lo:hi, :width].to(torch.float32)
        if part.size(1) < width:
            part = torch.cat([part, part.new_full((part.size(0), width - part.size(1)), pad)], dim=1)
        if part.size(0) < layout.per_rank:
            part = torch.cat([part, part.new_full((layout.per_rank - part.size(0), width), pad)])
        return part.to(self.accelerator.device)

    def num_items(self, out: dict[str, Any]) -> None:
        """``num_items_in_batch`` of the rows now in the batch: TRL's own formula (grpo_trainer.py: the valid
        tokens of the whole generation batch, every process)."""
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()

    def mark_padding(self, out: dict[str, Any], n: int, layout: Layout) -> None:
        """Rows ``n:`` of this process are padding: nothing to train, marked on every process (TRL's per-row
        metric gathers in the loss must then match everywhere)."""
        real = torch.zeros(layout.per_rank, dtype=torch.bool, device=out["completion_mask"].device)
        real[:n] = True
        out[REAL] = real
        out["completion_mask"] = out["completion_mask"] * real[:, None].to(out["completion_mask"].dtype)
        out["advantages"] = out["advantages"] * real.view(-1, *([1] * (out["advantages"].dim() - 1)))
        self.num_items(out)

    def agree(self, event: str, *tensors: Tensor) -> None:
        """Every process decided the same (each builds the same global batch; a method reading something of its
        own process, or an unseeded random source, would make them diverge)."""
        if self.count == 1:
            return
        value = 0
        for t in tensors:
            value = (value * 1000003 + fingerprint(t.detach().cpu().contiguous())) % (2**61 - 1)
        seen = self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).tolist()
        if len(set(seen)) > 1:
            raise DataflexError(f"dataflex: the processes decided differently at {event} (fingerprints {seen}): a "
                                "method must decide from the batch alone, with seeded randomness")


def unlog_padding(logs: Any, layout: Layout) -> None:
    """TRL logged every process's rows' prompt and completion but only the real rows' rewards: drop the
    padding rows' entries from its logs (``trainer._logs``) so its completion table stays aligned."""
    real = [i < layout.span(r)[1] - layout.span(r)[0] for r in range(layout.processes)
            for i in range(layout.per_rank)]
    for dq in [logs["prompt"], logs["completion"], *logs["extra"].values()]:
        if len(dq) >= len(real):
            tail = [dq.pop() for _ in range(len(real))][::-1]
            dq.extend(x for x, keep in zip(tail, real) if keep)
