"""Token selection by entropy, "Beyond the 80/20 Rule" (arXiv 2506.01939): ``token_entropy`` x ``top_entropy``.

The spec's vectors E1-E8 (spec/methods.md P5.7), agreement with ``torch.quantile`` (TRL's rule, whose own
function is checked in test_tokens_trl.py) and with the authors' top-k rule, every scope and normalisation,
and the bad inputs: ``rho`` outside (0, 1], a host without entropy, bf16 ties, nothing valid, padding rows.
"""

from __future__ import annotations

import pytest
import torch
from dataflex_plugins.methods.tokens import select_flat, select_rows

from dataflex_bus import Batch, build_pipeline
from dataflex_bus.carry import carry_out_advantage
from dataflex_bus.errors import BatchFieldError, ConfigError
from dataflex_bus.host import ANY_HOST, EVENT_FIELDS
from dataflex_bus.shim.losses import policy_loss
from dataflex_bus.validation import validate

# The spec's fixture: row 0 five tokens, row 1 three (N = 8).
E = torch.tensor([[0.10, 0.90, 0.20, 0.05, 0.70], [0.30, 1.20, 0.01, 0.0, 0.0]])
M = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
A = torch.tensor([[1.0] * 5, [-0.5] * 3 + [0.0] * 2])  # E6: A_row0 = +1, A_row1 = -0.5


def block(**params) -> dict:
    return {"mechanism": "select", "scorer": {"name": "token_entropy"},
            "actuator": {"name": "top_entropy", "params": params}}


def fixture(entropy=E, mask=M, **extra) -> Batch:
    rows = entropy.shape[0]
    return Batch.from_tensors(uid=[f"g{i}" for i in range(rows)], entropy=entropy, response_mask=mask,
                              loss_mask=mask.clone(), rm_scores=torch.zeros(entropy.shape),
                              advantages=extra.pop("advantages", torch.ones(entropy.shape) * mask), **extra)


def decide(batch: Batch, **params):
    return build_pipeline(block(**params)).apply(batch, 0)


def kept(d) -> list[list[int]]:
    return d.tokens.int().tolist()


# ---------------------------------------------------------------------------- E1-E5, E7: which tokens
@pytest.mark.parametrize(("rho", "threshold", "keep"), [
    (0.25, 0.75, [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]),  # E1
    (0.2, 0.82, [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]),   # E2
    (0.5, 0.25, [[0, 1, 0, 0, 1], [1, 1, 0, 0, 0]]),   # E3
])
def test_e1_e2_e3_quantile_and_topk_agree_on_the_fixture(rho, threshold, keep):
    d = decide(fixture(), rho=rho, form="quantile")
    assert d.metrics["dataflex/top_entropy/threshold"] == pytest.approx(threshold, abs=1e-6)
    assert kept(d) == keep
    d = decide(fixture(), rho=rho, form="topk")
    assert kept(d) == keep and d.metrics["dataflex/kept_tokens"] == {0.25: 2, 0.2: 2, 0.5: 4}[rho]


def test_e4_the_forms_differ_at_rho_0_3_over_7_tokens():
    e = torch.arange(1, 8, dtype=torch.float32)[None] / 10
    mask = torch.ones(1, 7, dtype=torch.long)
    q = decide(fixture(e, mask), rho=0.3, form="quantile")
    assert q.metrics["dataflex/top_entropy/threshold"] == pytest.approx(0.52, abs=1e-6)
    assert e[q.tokens].tolist() == pytest.approx([0.6, 0.7])
    t = decide(fixture(e, mask), rho=0.3, form="topk")  # k = ceil(2.1) = 3
    assert e[t.tokens].tolist() == pytest.approx([0.5, 0.6, 0.7])


def test_e5_all_equal_entropies_quantile_keeps_every_tie_topk_exactly_one():
    e, mask = torch.zeros(1, 5), torch.ones(1, 5, dtype=torch.long)
    assert int(decide(fixture(e, mask), rho=0.2, form="quantile").tokens.sum()) == 5
    assert kept(decide(fixture(e, mask), rho=0.2, form="topk")) == [[1, 0, 0, 0, 0]]  # the earliest tie


def test_e7_sequence_scope_keeps_ceil_rho_l_per_response():
    d = decide(fixture(), rho=0.25, form="topk", scope="sequence")
    assert kept(d) == [[0, 1, 0, 0, 1], [0, 1, 0, 0, 0]]  # ceil(1.25) = 2 of 5, ceil(0.75) = 1 of 3


# ---------------------------------------------------------------------------- E6, E8: the loss
def loss_token_mean(action, batch: Batch) -> float:
    """The shim's (verl's) vanilla policy loss at ratio 1, token-mean over the mini-batch's loss mask:
    the per-token loss is -A, as in E6."""
    f = {**batch.fields, **action.fields}
    lp = torch.zeros(f["response_mask"].shape)
    loss, _ = policy_loss(lp, lp, f["advantages"], f["response_mask"], clip_ratio=0.2,
                          rollout_is_weights=f.get("rollout_is_weights"), num_tokens=f["loss_mask"].sum())
    return float(loss)


def loss_seq_mean_token_mean(action, batch: Batch) -> float:
    f = {**batch.fields, **action.fields}
    mask = f["response_mask"].float()
    per_token = -f["advantages"] * f.get("rollout_is_weights", torch.ones(mask.shape))
    rows = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1e-8)
    return float(rows.sum() / len(rows))  # verl divides by the (fixed) global batch size: 2 rows here


@pytest.mark.parametrize(("params", "token_mean", "seq_mean"), [
    ({"rho": 1.0}, -0.4375, None),                                            # no mask
    ({"rho": 0.25}, -0.0625, -0.016667),                                      # all_tokens (weights route)
    ({"rho": 0.25, "normalize": "selected_tokens"}, -0.25, None),             # the authors' normaliser
    ({"rho": 0.25, "normalize": "selected_tokens", "mask_kl": True}, -0.25, -0.25),  # the mask route
    ({"rho": 0.25, "mask_kl": True}, -0.0625, None),                          # mask route, all_tokens
])
def test_e6_the_loss_equals_the_spec_for_each_normalisation(params, token_mean, seq_mean):
    b = fixture(advantages=A)
    action = carry_out_advantage(b, decide(b, **params))
    assert loss_token_mean(action, b) == pytest.approx(token_mean, abs=1e-6)
    if seq_mean is not None:
        assert loss_seq_mean_token_mean(action, b) == pytest.approx(seq_mean, abs=1e-6)


def test_the_weights_route_leaves_the_masks_for_kl_and_entropy_and_the_mask_route_writes_them():
    b = fixture(advantages=A)
    weights = carry_out_advantage(b, decide(b, rho=0.25))
    assert set(weights.fields) == {"rollout_is_weights"} and weights.keep is None
    assert weights.fields["rollout_is_weights"][M.bool()].tolist() == [0, 1, 0, 0, 0, 0, 1, 0]
    masks = carry_out_advantage(b, decide(b, rho=0.25, mask_kl=True, normalize="selected_tokens"))
    assert "rollout_is_weights" not in masks.fields  # the masks divide by the kept tokens: nothing to reweight
    assert masks.fields["response_mask"].tolist() == masks.fields["loss_mask"].tolist() == kept(decide(b, rho=0.25))
    masks = carry_out_advantage(b, decide(b, rho=0.25, mask_kl=True))  # all_tokens over the mask: K / N
    assert masks.fields["rollout_is_weights"][masks.fields["loss_mask"].bool()].tolist() == [0.25, 0.25]


def test_selected_tokens_weights_are_n_over_k_on_kept_tokens_per_scope():
    d = decide(fixture(), rho=0.25, normalize="selected_tokens")
    assert d.weights[d.tokens].tolist() == [4.0, 4.0] and bool((d.weights[~d.tokens] == 1).all())
    d = decide(fixture(), rho=0.25, normalize="selected_tokens", scope="sequence")  # L_i / K_i
    assert d.weights[d.tokens].tolist() == [2.5, 2.5, 3.0]


def test_e8_nothing_valid_keeps_nothing_and_never_gives_nan():
    from dataflex_plugins.methods.tokens import TopEntropy

    mask = torch.zeros(2, 5, dtype=torch.long)
    for form in ("topk", "quantile"):
        keep, threshold = select_flat(E, mask.bool(), 0.2, form)
        assert not bool(keep.any()) and threshold == 0.0
        keep, _ = select_rows(E, mask.bool(), 0.2, form)
        assert not bool(keep.any())
        for normalize in ("all_tokens", "selected_tokens"):
            b = fixture(E, mask)
            sel = TopEntropy(rho=0.2, form=form, normalize=normalize).select(b, decide_score(b), 0)
            assert not bool(sel.tokens.any()) and not bool(sel.keep.any())
            assert sel.token_weights is None or bool(torch.isfinite(sel.token_weights).all())
            assert all(v == v for v in sel.metrics.values())  # no NaN
    d = decide(fixture(E, mask), rho=0.2)  # nothing kept: an empty selection, on_empty=skip
    assert d.skip_update and d.metrics["dataflex/empty_selection"] == 1.0
    assert all(v == v for v in d.metrics.values())
    # a row with no valid token beside one with tokens: it contributes 0, and the loss is finite
    one = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    b = fixture(E, one, advantages=A * one)
    action = carry_out_advantage(b, decide(b, rho=0.25, normalize="selected_tokens"))
    assert loss_token_mean(action, b) == pytest.approx(-2 * 2.5 / 5)  # k = 2 of 5 tokens, weights 5/2


def decide_score(batch: Batch):
    from dataflex_plugins.methods.scorers import TokenEntropy

    return TokenEntropy().score(batch, 0)


def test_a_row_left_without_a_kept_token_is_dropped_under_the_mask_route_only():
    e = torch.tensor([[0.9, 0.8, 0.7], [0.1, 0.2, 0.3]])
    b = fixture(e, torch.ones(2, 3, dtype=torch.long))
    d = decide(b, rho=0.5)  # k = 3: the whole first row
    assert d.keep is None and kept(d) == [[1, 1, 1], [0, 0, 0]]
    d = decide(b, rho=0.5, mask_kl=True)
    assert d.keep.tolist() == [True, False] and d.on_empty == "skip"
    action = carry_out_advantage(b, d)
    assert action.keep.tolist() == [True, False] and int(action.fields["loss_mask"][1].sum()) == 0


# ---------------------------------------------------------------------------- agreement
def authors_topk(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """The authors' rule (``get_global_entropy_top_mask``, verl core_algos.py:53-85, as the spec states it):
    k = max(1, int(N * rho + 0.9999)) of the valid tokens by ``torch.topk``, scattered back; none if N = 0."""
    flat, valid = entropy.flatten(), mask.flatten().bool()
    values = flat[valid]
    out = torch.zeros_like(flat, dtype=torch.bool)
    if values.numel():
        k = max(1, int(values.numel() * rho + 0.9999))
        out[valid.nonzero().flatten()[torch.topk(values, k).indices]] = True
    return out.view_as(entropy)


def random_case(seed: int, rows: int = 37, width: int = 23):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(rows, width, generator=g) * 3
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    return entropy, torch.arange(width)[None] < lengths[:, None]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("rho", [0.2, 0.05, 0.3, 0.5, 0.99, 1.0])
def test_topk_form_equals_the_authors_rule_and_quantile_form_torch_quantile(seed, rho):
    entropy, valid = random_case(seed)
    keep, _ = select_flat(entropy, valid, rho, "topk")
    assert torch.equal(keep, authors_topk(entropy, valid, rho))  # continuous values: no tie at the cut
    keep, threshold = select_flat(entropy, valid, rho, "quantile")
    tau = torch.quantile(entropy[valid], 1 - rho)
    assert threshold == float(tau)  # to the bit: the same float32 rank and interpolation as torch
    assert torch.equal(keep, (entropy >= tau) & valid)


@pytest.mark.parametrize("form", ["topk", "quantile"])
def test_sequence_and_minibatch_scopes_are_the_batch_rule_on_each_part(form):
    entropy, valid = random_case(3)
    keep, _ = select_rows(entropy, valid, 0.3, form)
    for i in range(len(entropy)):
        assert torch.equal(keep[i], select_flat(entropy[i:i + 1], valid[i:i + 1], 0.3, form)[0][0]), i
    index = torch.arange(len(entropy)) % 3
    b = fixture(entropy, valid.long(), minibatch_index=index)
    d = decide(b, rho=0.3, form=form, scope="minibatch", normalize="selected_tokens")
    for j in range(3):
        part, _ = select_flat(entropy[index == j], valid[index == j], 0.3, form)
        assert torch.equal(d.tokens[index == j], part)
        n, k = int(valid[index == j].sum()), int(part.sum())
        assert d.weights[index == j][part].tolist() == pytest.approx([n / k] * k)


def test_minibatch_scope_reads_the_hosts_minibatch_index():
    with pytest.raises(BatchFieldError, match="minibatch_index"):
        decide(fixture(), rho=0.3, scope="minibatch")
    fields = dict(EVENT_FIELDS, on_advantage=EVENT_FIELDS["on_advantage"] - {"minibatch_index"})
    host = ANY_HOST.replace(name="lab", fields=fields, missing={"minibatch_index": "its mini-batches are random"})
    with pytest.raises(ConfigError, match=r"requires \['minibatch_index'\].*host 'lab'.*are random"):
        validate(block(scope="minibatch"), host=host)
    validate(block(scope="batch"), host=host)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("rho", [0.0, -0.1, 1.5])
def test_rho_outside_0_1_is_refused_naming_the_key(rho):
    with pytest.raises(ConfigError, match=r"dataflex\.actuator\.params\.rho"):
        validate(block(rho=rho))


def test_a_host_without_entropy_is_refused_naming_the_host_and_the_field():
    fields = dict(EVENT_FIELDS, on_advantage=EVENT_FIELDS["on_advantage"] - {"entropy"})
    host = ANY_HOST.replace(name="lab", fields=fields, missing={"entropy": "the lab computes no old log-probs"})
    with pytest.raises(ConfigError) as err:
        validate(block(rho=0.2), host=host)
    (issue,) = err.value.issues
    assert issue.key == "dataflex.scorer.name" and "host 'lab'" in str(issue) and "entropy" in str(issue)
    assert "computes no old log-probs" in str(issue)


def test_token_scores_feed_token_selectors_only_and_need_loss_weights():
    with pytest.raises(ConfigError, match="token-level"):
        validate({"mechanism": "select", "scorer": {"name": "token_entropy"}, "actuator": {"name": "topk_fraction"}})
    with pytest.raises(ConfigError, match="token-level"):
        validate({"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "top_entropy"}})
    host = ANY_HOST.replace(name="lab", capabilities=ANY_HOST.capabilities - {"loss_weights"})
    with pytest.raises(ConfigError, match="selects tokens through per-token loss weights, which host 'lab' "
                                         "cannot carry out: it lacks loss_weights"):
        validate(block(), host=host)
    assert validate(block()).methods[0].resolved.event == "on_advantage"


def test_bf16_ties_the_topk_form_keeps_exactly_k_deterministically():
    g = torch.Generator().manual_seed(0)
    entropy = (1 + torch.rand(64, 50, generator=g)).to(torch.bfloat16)  # 128 distinct bf16 values in [1, 2)
    valid = torch.ones(64, 50, dtype=torch.bool)
    valid[::3, 40:] = False
    n = int(valid.sum())
    assert entropy[valid].unique().numel() < n / 10
    for rho in (0.2, 0.3, 0.07):
        keep, threshold = select_flat(entropy, valid, rho, "topk")
        assert int(keep.sum()) == max(1, int(n * rho + 0.9999))
        assert torch.equal(keep, select_flat(entropy, valid, rho, "topk")[0])
        # every token above the threshold is kept, and the ties taken are the earliest ones
        e32 = entropy.float()
        assert bool(keep[(e32 > threshold) & valid].all())
        ties = ((e32 == threshold) & valid).flatten().nonzero().flatten()
        taken = keep.flatten()[ties]
        assert bool(taken[: int(taken.sum())].all())
        rows, _ = select_rows(entropy, valid, rho, "topk")
        assert rows.sum(1).tolist() == [max(1, int(int(v) * rho + 0.9999)) for v in valid.sum(1)]


def test_padding_rows_are_never_counted_nor_kept():
    # verl pads with synthetic rows whose response mask is not zero: they must not move the threshold
    padded = torch.cat([E, torch.full((2, 5), 9.0)])
    mask = torch.cat([M, torch.ones(2, 5, dtype=torch.long)])
    b = fixture(padded, mask, is_padding=torch.tensor([False, False, True, True]))
    for form in ("topk", "quantile"):
        for scope in ("batch", "sequence"):
            d = decide(b, rho=0.25, form=form, scope=scope)
            alone = decide(fixture(), rho=0.25, form=form, scope=scope)
            assert kept(d)[:2] == kept(alone) and not bool(d.tokens[2:].any())
            assert d.metrics["dataflex/top_entropy/threshold"] == alone.metrics["dataflex/top_entropy/threshold"]


def test_nonfinite_entropy_on_a_valid_token_follows_on_nonfinite():
    e = E.clone()
    e[1, 1] = float("nan")
    e[1, 4] = float("inf")  # past row 1's end: never read
    with pytest.raises(BatchFieldError, match=r"token_entropy.*non-finite"):
        decide(fixture(e))
    d = build_pipeline({**block(rho=0.25), "on_nonfinite": "drop"}).apply(fixture(e), 0)
    assert d.keep.tolist() == [True, False] and d.metrics["dataflex/nonfinite_rows"] == 1
    assert kept(d) == [[0, 1, 0, 0, 1], [0, 0, 0, 0, 0]]  # the threshold over row 0 alone: k = ceil(1.25)


def test_the_entropy_scorer_reads_valid_tokens_only_and_reports_the_distribution():
    e = E.clone()
    e[1, 3:] = float("nan")  # past the response's end
    d = decide(fixture(e), rho=0.2)
    assert d.metrics["dataflex/entropy/mean"] == pytest.approx(E[M.bool()].mean().item())
    assert d.metrics["dataflex/entropy/below_0.01"] == 0.0
    d = decide(fixture(torch.full((2, 5), 0.001)), rho=0.2)
    assert d.metrics["dataflex/entropy/below_0.01"] == 1.0


# ---------------------------------------------------------------------------- hosts
@pytest.mark.parametrize(("setting", "key", "says"), [
    ({"algorithm": {"rollout_correction": {"bypass_mode": True}}}, "dataflex.scorer.name",
     "algorithm.rollout_correction.bypass_mode=true"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "bypass_mode"}}}}, "dataflex.actuator.name",
     "loss_mode=bypass_mode ignores rollout_is_weights"),
    ({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "geo_mean"}}}},
     "actor_rollout_ref.actor.policy_loss.loss_mode", "geometric mean per sequence"),
])
def test_verl_settings_without_entropy_or_per_token_weights_are_refused_naming_verl_and_the_key(setting, key, says):
    from dataflex_bus.verl.host import describe

    with pytest.raises(ConfigError) as err:
        validate(block(), host=describe(setting))
    found = {i.key: str(i) for i in err.value.issues}
    assert says in found[key], found
    if key.startswith("dataflex."):
        assert "host 'verl'" in found[key]
    validate(block(), host=describe({}))
