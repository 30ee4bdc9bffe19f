"""What the adapter's writes do to verl's own policy loss (verl 0.9.1 core_algos, no Ray).

The actor normalises token-mean by ``loss_mask.sum()`` (the engines' ``batch_num_tokens``) and masks
the pg loss with ``response_mask``; these tests feed verl's ``compute_policy_loss_vanilla`` exactly
that, with the masks and weights produced by the adapter's on_advantage write-back.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.verl


def actor_config(loss_agg_mode: str = "token-mean"):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8,
                       loss_agg_mode=loss_agg_mode, rollout_n=1)


def grpo_view():
    """8 rows of 2 groups (4+4), varied lengths; group 1 has 16 of 34 tokens."""
    from dataflex_bus import Batch

    lengths = torch.tensor([5, 4, 6, 3, 4, 4, 4, 4])
    T = 6
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8])[:, None] * mask
    return Batch.from_tensors(uid=["a"] * 4 + ["b"] * 4, response_mask=mask, loss_mask=mask.clone(),
                              advantages=adv, rm_scores=torch.zeros(8, T))


def pg_loss(view, *, mask, loss_mask, weights=None, rows=None, mode="token-mean", global_batch_size=8):
    """verl's vanilla policy loss as the actor computes it; returns (loss, grad wrt log_prob)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    cfg = actor_config(mode)
    rows = torch.arange(len(view)) if rows is None else rows
    torch.manual_seed(0)
    old = -torch.rand(8, mask.shape[1])
    log_prob = (old + 0.1 * torch.randn(8, mask.shape[1])).requires_grad_(True)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=loss_mask[rows].sum(),
                                 global_batch_size=global_batch_size,
                                 loss_scale_factor=None)
    loss, _ = compute_policy_loss_vanilla(old_log_prob=old[rows], log_prob=log_prob[rows],
                                          advantages=view["advantages"][rows], response_mask=mask[rows].bool(),
                                          loss_agg_mode=mode, config=cfg,
                                          rollout_is_weights=None if weights is None else weights[rows])
    loss.backward()
    return loss.detach(), log_prob.grad


def adapter_writes(view, *, keep=None, weights=None):
    """The padded tensors the adapter writes back at on_advantage."""
    from dataflex_bus import Decision
    from dataflex_bus.decision import carry_out_advantage
    from dataflex_bus.verl.tqbatch import to_nested

    d = Decision()
    d.keep, d.weights = keep, weights
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), view.lengths.cumsum(0)])
    nested = torch.nested.nested_tensor_from_jagged(view["response_mask"][view["response_mask"].bool()],
                                                    offsets=offsets, max_seqlen=int(view.lengths.max()))
    # What the adapter writes: the shared decision, re-nested like TransferQueue's response mask.
    out = {k: to_nested(v, nested) for k, v in carry_out_advantage(view, d).fields.items()}
    return {k: v.to_padded_tensor(0) if v.is_nested else v for k, v in out.items()}


def test_mask_drop_equals_true_removal_under_token_mean():
    view = grpo_view()
    keep = torch.tensor([True] * 4 + [False] * 4)
    out = adapter_writes(view, keep=keep)
    assert set(out) == {"response_mask", "loss_mask", "advantages"}
    assert int(out["response_mask"][4:].sum()) == 0 and int(out["loss_mask"][4:].sum()) == 0
    view_dropped = view.with_fields(advantages=out["advantages"])
    loss_drop, grad_drop = pg_loss(view_dropped, mask=out["response_mask"], loss_mask=out["loss_mask"])
    loss_removed, grad_removed = pg_loss(view, mask=view["response_mask"], loss_mask=view["loss_mask"],
                                         rows=torch.arange(4))
    assert torch.allclose(loss_drop, loss_removed, atol=1e-7)
    assert torch.allclose(grad_drop, grad_removed, atol=1e-7)


def test_zero_weight_is_not_a_drop_under_token_mean():
    """The prior implementation's "select = weight 0": the kept gradient shrinks by kept/all tokens."""
    view = grpo_view()
    w = torch.ones(8, 6)
    w[4:] = 0.0
    out = adapter_writes(view, weights=w)
    _, grad_w0 = pg_loss(view, mask=view["response_mask"], loss_mask=view["loss_mask"],
                         weights=out["rollout_is_weights"])
    _, grad_removed = pg_loss(view, mask=view["response_mask"], loss_mask=view["loss_mask"],
                              rows=torch.arange(4))
    kept_tokens, all_tokens = int(view.lengths[:4].sum()), int(view.lengths.sum())
    assert torch.allclose(grad_w0, grad_removed * kept_tokens / all_tokens, atol=1e-7)
    assert kept_tokens / all_tokens == pytest.approx(18 / 34)


def test_weights_multiply_the_pg_loss_and_verls_own_weights():
    view = grpo_view()
    w = torch.linspace(0.5, 2.0, 8)[:, None].expand(8, 6).contiguous()
    loss_w, _ = pg_loss(view, mask=view["response_mask"], loss_mask=view["loss_mask"], weights=w)
    # the same loss as verl's unweighted one with every per-token term scaled (vanilla multiplies
    # pg_losses by rollout_is_weights before aggregation)
    loss_1, _ = pg_loss(view, mask=view["response_mask"], loss_mask=view["loss_mask"])
    assert not torch.allclose(loss_w, loss_1)
    verl_is = torch.full((8, 6), 1.25)
    out = adapter_writes(view.with_fields(rollout_is_weights=verl_is), weights=w)
    real = view["response_mask"].bool()
    assert torch.allclose(out["rollout_is_weights"][real], (verl_is * w)[real])


def test_seq_mean_dilution_is_the_documented_limit():
    """Under seq-mean the denominator is the fixed mini-batch size: a masked drop halves the gradient."""
    view = grpo_view()
    keep = torch.tensor([True] * 4 + [False] * 4)
    out = adapter_writes(view, keep=keep)
    mode = "seq-mean-token-mean"
    _, grad_drop = pg_loss(view.with_fields(advantages=out["advantages"]), mask=out["response_mask"],
                           loss_mask=out["loss_mask"], mode=mode)
    # truly removing the group before the update also halves the mini-batch (ppo_mini_batch_size*n = 4)
    _, grad_removed = pg_loss(view, mask=view["response_mask"], loss_mask=view["loss_mask"],
                              rows=torch.arange(4), mode=mode, global_batch_size=4)
    assert float(grad_removed.abs().sum()) > 0
    assert torch.allclose(grad_drop, 0.5 * grad_removed, atol=1e-7)
