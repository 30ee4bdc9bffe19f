"""Parity with verl 0.9.1: the shim's GRPO advantages and policy loss equal verl's own functions."""

import numpy as np
import pytest
import torch

from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.shim.losses import low_var_kl, policy_loss

pytestmark = pytest.mark.verl


def _inputs(seed=0, rows=24, T=3):
    g = torch.Generator().manual_seed(seed)
    uid = torch.tensor([0] * 8 + [1] * 8 + [2] * 5 + [3] * 2 + [4])  # mixed sizes and a singleton
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    reward = (torch.rand(rows, generator=g) < 0.5).float()
    rm = torch.zeros(rows, T)
    rm[torch.arange(rows), lengths - 1] = reward
    return uid, mask, rm, g


def test_grpo_advantages_match_verl():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    uid, mask, rm, _ = _inputs()
    theirs, _ = compute_grpo_outcome_advantage(rm, mask, np.array([f"u{u}" for u in uid.tolist()]))
    rewards = (rm * mask).sum(-1)
    ours = grpo_outcome_advantage(rewards, uid, int(uid.max()) + 1)[:, None] * mask
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_and_token_mean_match_verl(seed):
    from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, kl_penalty
    from verl.workers.config.actor import ActorConfig

    _, mask, _, g = _inputs(seed)
    rows, T = mask.shape
    adv = torch.randn(rows, 1, generator=g) * mask
    old = torch.randn(rows, T, generator=g) - 1.0
    # ratios far outside [1-eps, 1+eps] and beyond the dual clip, so every branch is exercised
    new = old + torch.randn(rows, T, generator=g) * 1.5
    weights = torch.rand(rows, T, generator=g) * 2
    loss_mask = mask.clone()
    loss_mask[:4] = 0  # rows dropped by zeroing both masks, as the shim and the adapter do
    response_mask = mask * (loss_mask > 0)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_c=3.0,
                         rollout_n=1)
    config.global_batch_info.update(dp_size=1, batch_num_tokens=loss_mask.sum(), global_batch_size=None,
                                    loss_scale_factor=None)
    theirs, their_metrics = compute_policy_loss_vanilla(old, new, adv, response_mask.bool(), "token-mean",
                                                        config=config, rollout_is_weights=weights)
    ours, our_metrics = policy_loss(new, old, adv, response_mask, clip_ratio=0.2, clip_ratio_c=3.0,
                                    rollout_is_weights=weights, num_tokens=loss_mask.sum())
    torch.testing.assert_close(ours, theirs)
    assert our_metrics["clip_frac"] == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert our_metrics["ppo_kl"] == pytest.approx(their_metrics["actor/ppo_kl"], abs=1e-5)
    # the KL-loss term: k3 estimator, token-mean over the same tokens
    ref = old + 0.3 * torch.randn(rows, T, generator=g)
    their_kl = agg_loss(kl_penalty(new, ref, "low_var_kl"), response_mask.bool(), "token-mean",
                        batch_num_tokens=loss_mask.sum())
    our_kl = (low_var_kl(new, ref) * response_mask).sum() / loss_mask.sum()
    torch.testing.assert_close(our_kl, their_kl)
