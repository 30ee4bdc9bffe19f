"""The shim's GRPO loss pieces, written to match verl 0.9.1 term by term (a parity test checks this).

* :func:`policy_loss`: verl's ``compute_policy_loss_vanilla``: clipped ratio with dual clip for
  negative advantages, multiplied by ``rollout_is_weights`` *before* aggregation;
* :func:`token_mean`: verl's ``agg_loss(..., "token-mean")``: the sum over the response mask divided by
  the mini-batch's ``loss_mask`` token count (``batch_num_tokens``), so dropped rows (masks zeroed or
  rows removed) renormalise and zero-weight rows would not;
* :func:`low_var_kl`: verl's ``kl_penalty(..., "low_var_kl")`` (k3), the default KL-loss estimator.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_mean(loss: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None) -> Tensor:
    """``sum(loss * mask) / num_tokens``; ``num_tokens`` defaults to ``mask.sum()``."""
    total = (loss * mask).sum()
    denom = mask.sum() if num_tokens is None else num_tokens
    return total / denom


def policy_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                clip_ratio: float, clip_ratio_c: float = 3.0, rollout_is_weights: Tensor | None = None,
                num_tokens: Tensor | float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped policy loss (dual clip), token-mean aggregated; returns ``(loss, metrics)``."""
    mask = response_mask.to(torch.bool)
    neg_kl = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-advantages * clip_ratio_c, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    loss = token_mean(losses, mask, num_tokens)
    with torch.no_grad():
        m = mask.float()
        denom = m.sum().clamp_min(1)
        metrics = {
            "clip_frac": float(((loss2 > loss1).float() * m).sum() / denom),
            "ppo_kl": float((-neg_kl * m).sum() / denom),
        }
    return loss, metrics


def low_var_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 estimator of KL(policy || reference) per token, clamped like verl's."""
    kl = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)
