"""Tests shipped with dataflex-tscl; they run against the installed pack (``pip install -e .``)."""

import pytest
import torch
from dataflex_tscl.mixer import TSCL

from dataflex_bus import Batch, Score
from dataflex_bus.testing import assert_state_roundtrip, check_mixer


def test_plugin_is_discovered_and_active(dataflex_plugin_env):
    plugins = dataflex_plugin_env(load=["dataflex-tscl"])
    (record,) = [r for r in plugins.records if r.distribution == "dataflex-tscl"]
    assert record.status == "active", record.error
    assert [(c.kind, c.name) for c in record.components] == [("mixer", "tscl")]


def _update(mixer, a, b, step):
    batch = Batch.from_tensors(domains=["a", "b"], domain_names=["a", "b"], response_mask=torch.ones(2, 1),
                               rm_scores=torch.zeros(2, 1))
    mixer.update(batch, Score(torch.tensor([a, b]), "response"), step)


def test_favours_the_domain_whose_score_moves():
    m = TSCL(window=3, policy="epsilon_greedy", epsilon=0.2)
    m.set_domains(["a", "b"])
    for step, (a, b) in enumerate([(0.0, 0.5), (0.4, 0.5), (0.8, 0.5)]):
        _update(m, a, b, step)
    assert torch.allclose(m.slopes(), torch.tensor([0.4, 0.0], dtype=torch.float64))
    assert torch.allclose(m.probabilities(), torch.tensor([0.9, 0.1], dtype=torch.float64))
    assert torch.equal(assert_state_roundtrip(m).probabilities(), m.probabilities())


def test_contract():
    check_mixer(TSCL(window=3))


def test_short_training(dataflex_plugin_env, dataflex_run_training):
    pytest.importorskip("dataflex_bus.shim")
    dataflex_plugin_env(load=None)
    metrics = dataflex_run_training(
        {"mechanism": "mix", "scorer": {"name": "reward_difficulty"},
         "actuator": {"name": "tscl", "params": {"window": 4}}}, steps=3, seed=0)
    probs = [k for k in metrics[-1] if k.startswith("dataflex/domain_prob/")]
    assert probs and abs(sum(metrics[-1][k] for k in probs) - 1.0) < 1e-6
