"""The 80/20 token selection on verl's side of the loss (verl 0.9.1 ``core_algos``, no Ray): what the adapter
writes at on_advantage, fed to verl's own policy loss (``compute_policy_loss_vanilla``, whose ``agg_loss``
aggregates as the actor does) and KL term, equals the spec's formulas (spec/methods.md P5.4) for both
normalisations, both routes and every ``loss_agg_mode``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.verl

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
T = 7


def view(entropy: torch.Tensor | None = None, lengths=(7, 5, 6, 2, 7, 4), adv=(1.0, -1.0, 0.5, -0.5, 1.5, -0.25)):
    from dataflex_bus import Batch

    lengths = torch.tensor(lengths)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    if entropy is None:
        entropy = torch.rand(len(lengths), T, generator=torch.Generator().manual_seed(3)) * 2
    return Batch.from_tensors(uid=[f"g{i // 3}" for i in range(len(lengths))], response_mask=mask,
                              loss_mask=mask.clone(), advantages=torch.tensor(adv)[:, None] * mask,
                              rm_scores=torch.zeros(len(lengths), T), entropy=entropy)


def written(batch, **params) -> dict[str, torch.Tensor]:
    """The padded fields the adapter writes back: the shared decision and carry-out, re-nested like
    TransferQueue's response mask (``tqbatch.to_nested``) and padded again, as a worker receives them."""
    from dataflex_bus import build_pipeline
    from dataflex_bus.carry import carry_out_advantage
    from dataflex_bus.verl.tqbatch import to_nested

    block = {"mechanism": "select", "scorer": {"name": "token_entropy"},
             "actuator": {"name": "top_entropy", "params": params}}
    decision = build_pipeline(block).apply(batch, 0)
    mask = batch["response_mask"]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), batch.lengths.cumsum(0)])
    like = torch.nested.nested_tensor_from_jagged(mask[mask.bool()], offsets=offsets, max_seqlen=T)
    out = {k: to_nested(v, like).to_padded_tensor(0) for k, v in carry_out_advantage(batch, decision).fields.items()}
    # a worker pads to the longest row: back to T columns
    out = {k: torch.nn.functional.pad(v, (0, T - v.shape[1])) for k, v in out.items()}
    return {**{k: batch[k] for k in ("response_mask", "loss_mask", "advantages")}, **out, "tokens": decision.tokens}


def verl_pg_loss(fields, mode: str) -> float:
    """verl's vanilla policy loss at ratio 1 (so the per-token loss is -A), aggregated by verl as the actor
    does: token-mean over the mini-batch's loss-mask tokens, seq-mean over its rows."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    rows = fields["response_mask"].shape[0]
    cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows,
                      loss_agg_mode=mode, rollout_n=1)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=fields["loss_mask"].sum(), global_batch_size=rows,
                                 loss_scale_factor=None)
    lp = -torch.rand(fields["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    loss, _ = compute_policy_loss_vanilla(old_log_prob=lp, log_prob=lp.clone(), advantages=fields["advantages"],
                                          response_mask=fields["response_mask"].bool(), loss_agg_mode=mode, config=cfg,
                                          rollout_is_weights=fields.get("rollout_is_weights"))
    return float(loss)


def spec_loss(batch, tokens: torch.Tensor, mode: str, *, normalize: str, mask_kl: bool, scope: str) -> float:
    """spec/methods.md P5.4, written out: the policy-gradient term sum m l over the kept tokens, normalised over
    all valid tokens (``all_tokens``) or the kept ones (``selected_tokens``: weights N/K per scope), with the
    mask in the weights (KL keeps every token) or, under mask_kl, in the loss masks (then all_tokens is K/N)."""
    valid = batch.token_mask.double()
    m = tokens.double()
    loss = -batch["advantages"].double()
    per_row = scope == "sequence"
    n = valid.sum(1, keepdim=True) if per_row else valid.sum()
    k = m.sum(1, keepdim=True) if per_row else m.sum()
    if normalize == "selected_tokens" and not mask_kl:
        c = torch.where(k > 0, n / k.clamp_min(1), torch.zeros_like(k))
    elif normalize == "all_tokens" and mask_kl:
        c = k / n.clamp_min(1)
    else:
        c = torch.ones_like(k)
    w = m * c  # the per-token factor on the policy-gradient term
    mask = valid * m if mask_kl else valid  # what the aggregation divides by
    term = w * loss * mask
    rows = len(batch)
    if mode == "token-mean":
        return float(term.sum() / mask.sum())
    if mode == "token-sum":
        return float(term.sum())
    if mode == "seq-mean-token-sum":
        return float(term.sum() / rows)
    if mode == "seq-mean-token-sum-norm":
        return float(term.sum() / rows / T)
    lengths = mask.sum(1)
    return float(torch.where(lengths > 0, term.sum(1) / lengths.clamp_min(1), 0.0).sum() / rows)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("normalize", "mask_kl"), [("all_tokens", False), ("selected_tokens", False),
                                                    ("selected_tokens", True), ("all_tokens", True)])
@pytest.mark.parametrize(("scope", "form"), [("batch", "topk"), ("batch", "quantile"), ("sequence", "topk")])
def test_verls_loss_equals_the_spec_for_every_normalisation_and_aggregation(mode, normalize, mask_kl, scope, form):
    batch = view()
    fields = written(batch, rho=0.3, form=form, scope=scope, normalize=normalize, mask_kl=mask_kl)
    want = spec_loss(batch, fields["tokens"], mode, normalize=normalize, mask_kl=mask_kl, scope=scope)
    assert verl_pg_loss(fields, mode) == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(("params", "mode", "expected"), [
    ({"rho": 1.0}, "token-mean", -0.4375),
    ({"rho": 0.25}, "token-mean", -0.0625),
    ({"rho": 0.25, "normalize": "selected_tokens"}, "token-mean", -0.25),
    ({"rho": 0.25}, "seq-mean-token-mean", -0.016667),
    ({"rho": 0.25, "normalize": "selected_tokens", "mask_kl": True}, "seq-mean-token-mean", -0.25),
])
def test_e6_through_verls_loss(params, mode, expected):
    entropy = torch.tensor([[0.10, 0.90, 0.20, 0.05, 0.70, 0, 0], [0.30, 1.20, 0.01, 0, 0, 0, 0]])
    batch = view(entropy, lengths=(5, 3), adv=(1.0, -0.5))
    assert verl_pg_loss(written(batch, **params), mode) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_kl_keeps_every_valid_token_unless_mask_kl(mode):
    """The KL term (``ppo_loss``: ``agg_loss(kl_penalty(...), response_mask)``) never sees the weights."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

    batch = view()
    g = torch.Generator().manual_seed(1)
    lp, ref = -torch.rand(6, T, generator=g), -torch.rand(6, T, generator=g)
    kld = kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty="low_var_kl")

    def kl(mask):
        return float(agg_loss(kld, mask.bool(), mode, dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=6))

    plain = kl(batch["response_mask"])
    weights = written(batch, rho=0.3)
    assert kl(weights["response_mask"]) == plain
    masked = written(batch, rho=0.3, mask_kl=True)
    assert kl(masked["response_mask"]) == pytest.approx(kl(masked["tokens"] & batch.token_mask))
    assert kl(masked["response_mask"]) != pytest.approx(plain)


def test_verls_composed_config_refuses_entropy_selection_without_an_old_log_prob_pass(tmp_path):
    """bypass_mode skips the pass that writes ``entropy``: the method is refused naming host 'verl' and the key."""
    import verl_harness as H

    from dataflex_bus.errors import ConfigError
    from dataflex_bus.validation import validate
    from dataflex_bus.verl.host import describe

    base = H.base_overrides(tmp_path / "train.parquet", tmp_path / "ckpt")
    block = {"mechanism": "select", "scorer": {"name": "token_entropy"}, "actuator": {"name": "top_entropy"}}
    validate(block, host=describe(H.compose(base)))
    bypass = describe(H.compose([*base, "algorithm.rollout_correction.bypass_mode=true"]))
    with pytest.raises(ConfigError) as err:
        validate(block, host=bypass)
    (issue,) = err.value.issues
    assert issue.key == "dataflex.scorer.name"
    assert "host 'verl'" in str(issue) and "entropy" in str(issue)
    assert "algorithm.rollout_correction.bypass_mode=true" in str(issue)


def _fit(H, tmp_path, *params: str):
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "logic": 4, "code": 4})
    block = ["+dataflex.mechanism=select", "+dataflex.scorer.name=token_entropy",
             "+dataflex.actuator.name=top_entropy", *(f"+dataflex.actuator.params.{p}" for p in params)]
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=4, mini=2) + block).setup()
    return run.fit()


@pytest.mark.tq
@pytest.mark.integration
def test_fit_the_actor_trains_on_the_top_entropy_tokens_of_the_old_log_prob_pass(H, tmp_path):
    """verl's real step: the adapter fetches the ``entropy`` verl's ``_compute_old_log_prob`` wrote to
    TransferQueue, and the actor's update receives exactly the kit's mask in ``rollout_is_weights``."""
    run = _fit(H, tmp_path, "rho=0.3")
    advantage = [(d, b) for event, d, b in run.decisions if event == "on_advantage"]
    updates = run.trainer.actor_rollout_wg.updates
    assert len(advantage) == len(updates) == 2
    for (decision, batch), update in zip(advantage, updates):
        valid = batch.token_mask  # padding rows (verl's synthetic ones) are not valid
        entropy = batch["entropy"]
        n, kept = int(valid.sum()), decision.tokens
        assert int(kept.sum()) == max(1, int(n * 0.3 + 0.9999)) and not bool(kept[batch.is_padding].any())
        assert float(entropy[kept].min()) >= float(entropy[valid & ~kept].max())
        w, mask = update["rollout_is_weights"], update["response_mask"] > 0
        assert len(update["keys"]) == len(batch)
        for i in torch.nonzero(batch.valid_rows).flatten().tolist():
            assert torch.equal(w[i][mask[i]], kept[i][valid[i]].float()), i
        assert torch.equal(update["loss_mask"].clamp_min(0), batch["loss_mask"])  # KL/denominators: every token
        assert all(torch.isfinite(torch.tensor(update["losses"])))


@pytest.mark.tq
@pytest.mark.integration
def test_fit_minibatch_scope_thresholds_each_of_the_actors_mini_batches(H, tmp_path):
    run = _fit(H, tmp_path, "rho=0.3", "scope=minibatch")
    for event, decision, batch in run.decisions:
        if event != "on_advantage":
            continue
        index = batch["minibatch_index"]  # filled in by the host kit from verl's mini-batches: 8 rows each
        assert index.tolist() == [i // 8 for i in range(len(batch))]
        for j in index.unique().tolist():
            rows = index == j
            n = int(batch.token_mask[rows].sum())
            assert int(decision.tokens[rows].sum()) == max(1, int(n * 0.3 + 0.9999))
