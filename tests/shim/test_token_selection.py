"""Token selection by entropy on the shim: ``token_entropy`` reads the entropy the shim computes with its old
log-probs, ``top_entropy`` keeps the top-rho tokens of it, and the update trains on exactly the mask the host
kit wrote; in a stack (DAPO filter + 80/20 + DUMP) each method acts at its event, in list order."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus.shim import run_training
from dataflex_bus.shim.policy import token_log_probs_and_entropy
from dataflex_bus.shim.trainer import ShimTrainer

from .conftest import tiny

BLOCK = {"mechanism": "select", "scorer": {"name": "token_entropy"},
         "actuator": {"name": "top_entropy", "params": {"rho": 0.3}}}


@pytest.fixture
def updates(monkeypatch):
    """The batches the shim's PPO update receives, each with the entropy of the policy about to be updated
    (the old policy), recomputed here."""
    seen = []
    update = ShimTrainer._update

    def recording(self, batch):
        with torch.no_grad():
            _, entropy = token_log_probs_and_entropy(self.policy, batch["prompts"], batch["responses"],
                                                     self.t["temperature"])
        seen.append((batch, entropy))
        return update(self, batch)

    monkeypatch.setattr(ShimTrainer, "_update", recording)
    return seen


def test_the_shim_trains_on_the_top_entropy_tokens_of_its_old_policy(recorder, updates):
    cfg = tiny(BLOCK, trainer={"mini_batches": 1, "temperature": 0.8})
    metrics = run_training(cfg, steps=2).metrics
    advantage = [(batch, decision) for name, _, batch, decision in recorder.events if name == "on_advantage"]
    assert len(advantage) == len(updates) == 2
    for (batch, decision), (update, entropy), m in zip(advantage, updates, metrics):
        valid = batch.token_mask
        # the old policy's entropy, on temperature-scaled logits
        assert torch.allclose(batch["entropy"][valid], entropy[valid], atol=1e-5)
        # exactly ceil(0.3 N) tokens, the largest (continuous entropies: no tie at the cut)
        n = int(valid.sum())
        kept = decision.tokens
        assert int(kept.sum()) == max(1, int(n * 0.3 + 0.9999))
        assert m["dataflex/kept_token_fraction"] == pytest.approx(int(kept.sum()) / n)
        assert float(batch["entropy"][kept].min()) >= float(batch["entropy"][valid & ~kept].max())
        # the update trains on that mask through rollout_is_weights; KL and token-mean keep every token
        assert torch.equal(update["rollout_is_weights"][valid], kept[valid].float())
        assert torch.equal(update["loss_mask"], batch["loss_mask"])
    assert all(0 <= m["dataflex/entropy/below_0.01"] <= 1 and m["dataflex/entropy/mean"] > 0 for m in metrics)


def test_mask_kl_removes_the_rows_left_without_a_kept_token(recorder, updates):
    block = {**BLOCK, "actuator": {"name": "top_entropy", "params": {"rho": 0.05, "mask_kl": True}}}
    (m,) = run_training(tiny(block, trainer={"mini_batches": 1}), steps=1).metrics
    (batch, decision), = [(b, d) for name, _, b, d in recorder.events if name == "on_advantage"]
    (update, _), = updates
    rows = decision.tokens.any(dim=1)
    assert 0 < int(rows.sum()) < len(batch)  # rho 0.05 leaves most rows without a kept token
    assert len(update) == int(rows.sum())  # the shim removes those rows (a real drop)
    assert torch.equal(update["loss_mask"].bool(), decision.tokens[rows])
    # what was trained: the kept tokens, of rows whose generated length and reward the metrics still report
    assert m["dataflex/trained/tokens"] == int(decision.tokens.sum())
    assert m["dataflex/trained/response_length_mean"] == pytest.approx(float(batch.lengths[rows].double().mean()))
    assert m["dataflex/trained/reward_mean"] == pytest.approx(float(batch.rewards[rows].double().mean()))


STACK = {"methods": [
    {"name": "filter", "mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}},
    {"name": "forking", "mechanism": "select", "scorer": {"name": "token_entropy"},
     "actuator": {"name": "top_entropy", "params": {"rho": 0.2}}},
    {"name": "curriculum", "mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
     "actuator": {"name": "dump_ucb", "params": {"window": 50}}},
]}


def test_dapo_then_80_20_then_dump_act_in_list_order(recorder):
    result = run_training(tiny(STACK, trainer={"prompts_per_step": 8}), steps=2)
    events = [(e[0], e[2]) for e in recorder.events]
    assert [name for name, _ in events] == ["on_rollout", "on_advantage", "on_step_end"] * 2
    for step, m in enumerate(result.metrics):
        rollout, advantage = events[3 * step][1], events[3 * step + 1][1]
        # the token selection sees only the groups the filter kept (removed before on_advantage) ...
        assert len(advantage) == len(rollout) - m["dataflex/removed_rows"]
        n = int(advantage.token_mask.sum())
        assert m["dataflex/forking/kept_tokens"] == max(1, int(n * 0.2 + 0.9999))
        # ... and the curriculum publishes its probabilities at the step's end
        assert sum(m[f"dataflex/curriculum/domain_prob/{d}"] for d in ("copy", "sort", "reverse", "random")) == \
            pytest.approx(1.0)
    assert [m["name"] for m in result.record["dataflex"]["methods"]] == ["filter", "forking", "curriculum"]
