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
    from dataflex_bus.carry import carry_out_advantage
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


# ---------------------------------------------------------------------------- every loss_agg_mode
#: verl 0.9.1's five aggregation modes (core_algos.agg_loss).
LOSS_AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def long_drop_view():
    """8 rows of 2 groups; the group to drop holds the longest rows (6), the kept group's longest is 4."""
    from dataflex_bus import Batch

    lengths = torch.tensor([3, 4, 2, 3, 6, 5, 4, 6])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8])[:, None] * mask
    return Batch.from_tensors(uid=["a"] * 4 + ["b"] * 4, response_mask=mask, loss_mask=mask.clone(),
                              advantages=adv, rm_scores=torch.zeros(8, 6))


def actor_loss(lengths, mask, loss_mask, advantages, old, log_prob, *, mode, scale):
    """verl's vanilla policy loss as its actor runs it on one mini-batch: the per-token fields padded to
    the longest row present (``to_padded_tensor`` of the nested fields, whose ``lengths`` a mask does not
    change), token-mean over ``loss_mask.sum()``, seq-mean over the fixed ``ppo_mini_batch_size * n``."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    width = int(lengths.max())
    cfg = actor_config(mode)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=loss_mask.sum(), global_batch_size=8,
                                 loss_scale_factor=scale)
    loss, _ = compute_policy_loss_vanilla(old_log_prob=old[:, :width], log_prob=log_prob[:, :width],
                                          advantages=advantages[:, :width], response_mask=mask[:, :width].bool(),
                                          loss_agg_mode=mode, config=cfg)
    return loss


@pytest.mark.parametrize("scale", [None, 16.0])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_drop_equals_verls_own_removal_in_every_loss_agg_mode(mode, scale):
    """A masked drop (on_advantage) against verl's own removal (on_rollout: the rows leave, and verl pads
    the batch back with 1-token rows whose masks are 0): the same loss and the same gradient on every
    kept token, in all five modes, except seq-mean-token-sum-norm with ``loss_scale_factor=null``, which
    divides by the padded width and so still sees the masked rows (the adapter refuses that setting)."""
    view = long_drop_view()
    keep = torch.tensor([True] * 4 + [False] * 4)
    out = adapter_writes(view, keep=keep)
    torch.manual_seed(0)
    old = -torch.rand(8, 6)
    log_prob = (old + 0.1 * torch.randn(8, 6)).requires_grad_(True)

    loss_drop = actor_loss(view.lengths, out["response_mask"], out["loss_mask"], out["advantages"], old, log_prob,
                           mode=mode, scale=scale)
    (grad_drop,) = torch.autograd.grad(loss_drop, log_prob)

    # verl's removal: rows 4-7 replaced by its synthetic padding rows (response length 1, masks 0)
    pad_mask = view["response_mask"].masked_fill(~keep[:, None], 0)
    adv = view["advantages"].masked_fill(~keep[:, None], 0.0)
    lengths = torch.where(keep, view.lengths, 1)
    loss_removed = actor_loss(lengths, pad_mask, pad_mask, adv, old, log_prob, mode=mode, scale=scale)
    (grad_removed,) = torch.autograd.grad(loss_removed, log_prob)

    assert float(grad_removed[:4].abs().sum()) > 0 and float(grad_drop[4:].abs().sum()) == 0.0
    if mode == "seq-mean-token-sum-norm" and scale is None:
        # normalised by the padded width: 6 (the masked rows are still there) instead of 4
        assert torch.allclose(loss_drop * 6, loss_removed * 4, atol=1e-7)
        assert not torch.allclose(grad_drop[:4], grad_removed[:4], atol=1e-7)
    else:
        assert torch.allclose(loss_drop, loss_removed, atol=1e-7)
        assert torch.allclose(grad_drop[:4], grad_removed[:4], atol=1e-7)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_fully_dropped_mini_batch_trains_on_nothing_in_every_mode(mode):
    """Why the adapter takes an emptied mini-batch out of the update: with every row masked the loss
    has no gradient at all (AdamW would still step on its moments), and token-mean is 0/0 = NaN."""
    view = long_drop_view()
    out = adapter_writes(view, keep=torch.zeros(8, dtype=torch.bool))
    torch.manual_seed(0)
    old = -torch.rand(8, 6)
    log_prob = (old + 0.1 * torch.randn(8, 6)).requires_grad_(True)
    loss = actor_loss(view.lengths, out["response_mask"], out["loss_mask"], out["advantages"], old, log_prob,
                      mode=mode, scale=None)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert float(grad.nan_to_num().abs().sum()) == 0.0
    assert bool(torch.isnan(loss)) == (mode == "token-mean")


# ---------------------------------------------------------------------------- compute
def test_dynamic_batch_size_turns_an_on_rollout_drop_into_fewer_micro_batches():
    """The configuration docs/verl.md offers: with ``use_dynamic_bsz`` verl packs micro-batches by
    tokens, so the 128-token rows that pad a batch after a drop cost their tokens, not a slot each."""
    from tensordict import TensorDict
    from verl.trainer.ppo.padding_utils import SYNTHETIC_PADDING_SEQ_LEN
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    def micro_batches(lengths: list[int], dynamic: bool) -> int:
        ids = torch.nested.nested_tensor([torch.ones(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
        td = TensorDict({"input_ids": ids}, batch_size=len(lengths))
        tu.assign_non_tensor(td, use_dynamic_bsz=dynamic, max_token_len_per_gpu=4096, micro_batch_size_per_gpu=2)
        return len(prepare_micro_batches(td)[0])

    full = [2048] * 16  # 4 groups of 4 rows of 2,048 tokens: one mini-batch of 16 rows
    dropped = [2048] * 12 + [SYNTHETIC_PADDING_SEQ_LEN] * 4  # a group removed at on_rollout, padded back
    # a fixed micro-batch size gives every padding row a slot: nothing saved
    assert micro_batches(full, dynamic=False) == micro_batches(dropped, dynamic=False) == 8
    # a token budget of 4,096 per micro-batch: the dropped group's tokens free a micro-batch
    assert micro_batches(full, dynamic=True) == 8 and micro_batches(dropped, dynamic=True) == 7


def test_minibatch_blocks_follow_verls_dispatch_and_iterator():
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from dataflex_bus.verl.blocks import minibatch_blocks

    # 2 DP ranks: rank r trains the r-th contiguous half, 2 rows of it per mini-batch
    assert minibatch_blocks(8, 4, 2).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # shuffled, 2 epochs: every epoch's blocks partition the rows, in the order verl's iterator draws them
    blocks = minibatch_blocks(16, 4, 1, epochs=2, shuffle=True, seed=3)
    assert blocks.shape == (8, 4)
    assert all(sorted(blocks[e * 4:(e + 1) * 4].flatten().tolist()) == list(range(16)) for e in (0, 1))
    assert not torch.equal(blocks[:4], blocks[4:]) and not torch.equal(blocks[:4].flatten(), torch.arange(16))
    data = TensorDict({"x": torch.arange(16) * 10}, batch_size=16)
    drawn = [mb["x"] // 10 for mb in tu.make_iterator(data, mini_batch_size=4, epochs=2, seed=3,
                                                       dataloader_kwargs={"shuffle": True})]
    assert torch.equal(torch.stack(drawn), blocks)
