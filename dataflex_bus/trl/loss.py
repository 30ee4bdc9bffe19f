"""The TRL host's patches of TRL's update: dataflex weights and padding rows in the loss, and no optimizer step
for a generation batch left with nothing to train."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .rows import BEHAVIOUR, REAL, WEIGHTS


def compute_loss(trl_loss: Callable[[Any, dict[str, Any]], Tensor], accelerator: Any, model: Any,
                 inputs: dict[str, Any]) -> Tensor:
    """TRL's loss (``trl_loss``) on a micro-batch the host wrote to: per-token weights multiplied into the
    advantages, padding rows (``REAL``) left out, per-row gathers across processes of unequal row counts."""
    if BEHAVIOUR in inputs:  # (carried for inspection only)
        inputs = {k: v for k, v in inputs.items() if k != BEHAVIOUR}
    real, weights = inputs.get(REAL), inputs.get(WEIGHTS)
    if real is None and weights is None:
        return trl_loss(model, inputs)
    inputs = {k: v for k, v in inputs.items() if k not in (REAL, WEIGHTS)}
    if weights is not None:
        # -min(r A w, clip(r) A w) = w * -min(r A, clip(r) A) for w >= 0: the policy-gradient term weighted
        # per token exactly; TRL's normalisers never read the advantages.
        adv = inputs["advantages"]
        inputs["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * weights
    if real is None:
        return trl_loss(model, inputs)
    rows = real.numel()
    idx = torch.nonzero(real).flatten()
    if idx.numel() == 0:  # one padding row: a zero loss still connected to the graph
        idx = torch.zeros(1, dtype=torch.long, device=real.device)
    inputs = {k: v[idx] if isinstance(v, Tensor) and v.dim() > 0 and v.size(0) == rows else v
              for k, v in inputs.items()}
    if accelerator.num_processes == 1:
        return trl_loss(model, inputs)
    # Processes now hold different row counts; TRL gathers per-row clip statistics, which needs equal
    # shapes: pad those with NaN (TRL reduces them with nanmin/nanmax).
    plain = accelerator.gather

    def gather(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() == 1 and t.is_floating_point():
            t = accelerator.pad_across_processes(t, dim=0, pad_index=float("nan"))
        return plain(t)

    accelerator.gather = gather
    try:
        return trl_loss(model, inputs)
    finally:
        del accelerator.gather


def skip_when(optimizer: Any, skipping: Callable[[], bool]) -> Any:
    """``optimizer`` whose ``step`` does nothing while ``skipping()``: a generation batch left with nothing to
    train takes no optimizer step (AdamW would still move the weights through its moments on a zero
    gradient); the LR schedule and global_step advance. Wrapped once."""
    if getattr(optimizer, "_dataflex_wrapped", False):
        return optimizer
    inner = optimizer.step

    def step(*a: Any, **k: Any) -> Any:
        if skipping():
            return None
        return inner(*a, **k)

    optimizer.step = step
    optimizer._dataflex_wrapped = True
    return optimizer
