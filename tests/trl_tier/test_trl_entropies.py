"""Entropies without TRL's entropy bonus: they only feed metrics and the top-entropy mask, so the subclass lets
their gradient graph go (TRL 1.16's fused head returns them attached whatever the bonus); with the bonus they
keep it. Either way the update is plain TRL's, bit for bit."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import test_trl_exact as E
import torch
import trl_tiny as T
from datasets import Dataset

from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl


def entropies(trainer: DataflexGRPOTrainer) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    logps, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3,
                                                               compute_entropy=True)
    return logps, ent


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_entropies_carry_a_graph_only_when_the_entropy_bonus_needs_one(tmp_path, coef):
    tok = T.tokenizer()
    trainer = DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok,
                                  train_dataset=Dataset.from_list(E.MIXED[:4]),
                                  args=T.config(str(tmp_path), rows_per_gen=8, entropy_coef=coef))
    logps, ent = entropies(trainer)
    assert logps.requires_grad
    assert ent.requires_grad == (coef != 0.0)
    plain = T.GRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok,
                          train_dataset=Dataset.from_list(E.MIXED[:4]),
                          args=T.config(str(tmp_path / "plain"), rows_per_gen=8, entropy_coef=coef))
    plain_logps, plain_ent = entropies(plain)
    assert torch.equal(logps, plain_logps) and torch.equal(ent, plain_ent)


def test_the_top_entropy_mask_trains_as_plain_trl_with_detached_entropies():
    kw = dict(rows=E.ROWS_A, rows_per_gen=16, spg=2, ga=2, loss_type="grpo", steps=2, top_entropy_quantile=0.5)
    a = T.train(DataflexGRPOTrainer, **kw)
    b = T.train(**kw)
    assert T.compare(a, b) == 0.0
