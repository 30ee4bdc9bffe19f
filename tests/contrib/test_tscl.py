"""TSCL mixer (contrib/dataflex-tscl): hand-computed slopes and probabilities, state round-trip."""

import math

import pytest
import torch
from dataflex_tscl.mixer import TSCL, window_slopes

from dataflex_bus import Batch, Score
from dataflex_bus.errors import ConfigError
from dataflex_bus.testing import assert_state_roundtrip, check_mixer, make_batch
from dataflex_bus.testing.contracts import apply_method

DOMAINS = ["a", "b"]


def _step(mixer, scores_by_domain, step):
    """One step whose rows carry the given per-domain scores (each domain's mean is the given value)."""
    labels, values = [], []
    for d, vals in scores_by_domain.items():
        labels += [d] * len(vals)
        values += vals
    b = Batch.from_tensors(domains=labels, domain_names=DOMAINS, response_mask=torch.ones(len(labels), 2),
                           rm_scores=torch.zeros(len(labels), 2))
    return mixer.update(b, Score(torch.tensor(values), "response"), step)


def test_slopes_by_hand_with_window_and_optimism():
    m = TSCL(window=3, temperature=0.1)
    m.set_domains(DOMAINS)
    assert torch.allclose(m.probabilities(), torch.tensor([0.5, 0.5], dtype=torch.float64))
    _step(m, {"a": [0.0], "b": [0.25, 0.75]}, 0)   # b's score is the mean of its rows: 0.5
    assert m.slopes().tolist() == [1.0, 1.0]       # fewer than two points: optimistic Q = 1
    _step(m, {"a": [0.5], "b": [0.5]}, 1)
    assert torch.allclose(m.slopes(), torch.tensor([0.5, 0.0], dtype=torch.float64))
    p = m.probabilities()
    assert math.isclose(float(p[0]), math.exp(5) / (math.exp(5) + 1), rel_tol=1e-9)
    _step(m, {"a": [1.0], "b": [0.2]}, 2)
    # b: points (0, .5), (1, .5), (2, .2): xbar 1, ybar .4, sxy = -.1 - .2, sxx = 2
    assert torch.allclose(m.slopes(), torch.tensor([0.5, -0.15], dtype=torch.float64))
    _step(m, {"a": [1.0]}, 3)                      # b absent: no point for b
    # a's window (K=3) now holds steps 1..3: (1, .5), (2, 1), (3, 1): slope 0.25
    assert torch.allclose(m.slopes(), torch.tensor([0.25, -0.15], dtype=torch.float64))
    assert m.state_dict()["counts"] == [4, 3]
    expected = torch.softmax(torch.tensor([0.25, 0.15], dtype=torch.float64) / 0.1, 0)
    assert torch.allclose(m.probabilities(), expected)


def test_epsilon_greedy_puts_the_greedy_mass_on_argmax_and_splits_ties():
    m = TSCL(window=4, policy="epsilon_greedy", epsilon=0.2)
    m.set_domains(["a", "b", "c", "d"])
    assert torch.allclose(m.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))  # all optimistic
    m._x[:, :2] = torch.tensor([[0.0, 1.0]] * 4, dtype=torch.float64)
    m._y[:, :2] = torch.tensor([[0, .1], [0, -.3], [0, .2], [0, .3]], dtype=torch.float64)
    m._count[:] = 2
    # |Q| = .1, .3, .2, .3: b and d tie for the max
    assert torch.allclose(m.probabilities(), torch.tensor([0.05, 0.45, 0.05, 0.45], dtype=torch.float64))


def test_window_slopes_match_least_squares():
    g = torch.Generator().manual_seed(0)
    x = torch.cumsum(torch.randint(1, 4, (5, 6), generator=g), 1).double()
    y = torch.rand(5, 6, generator=g, dtype=torch.float64)
    filled = torch.tensor([0, 1, 2, 4, 6])
    q = window_slopes(x, y, filled, optimistic=1.0)
    assert q[:2].tolist() == [1.0, 1.0]
    for d in range(2, 5):
        n = int(filled[d])
        A = torch.stack([x[d, :n], torch.ones(n, dtype=torch.float64)], 1)
        slope = torch.linalg.lstsq(A, y[d, :n, None]).solution[0, 0]
        assert math.isclose(float(q[d]), float(slope), rel_tol=1e-9, abs_tol=1e-12)


def test_domain_level_scores_are_used_directly():
    m = TSCL(window=2)
    m.set_domains(DOMAINS)
    b = make_batch(groups=2, group_size=2, domains=DOMAINS, seed=0)
    m.update(b, Score(torch.tensor([0.1, 0.9]), "domain"), 0)
    m.update(b, Score(torch.tensor([0.3, float("nan")]), "domain"), 1)  # NaN: b has no score this step
    assert torch.allclose(m.slopes(), torch.tensor([0.2, 1.0], dtype=torch.float64))


def test_state_round_trip_and_resume_continues_exactly():
    m = TSCL(window=3, policy="boltzmann", temperature=0.05)
    m.set_domains(DOMAINS)
    for step, (a, b) in enumerate([(0.1, 0.5), (0.3, 0.5), (0.2, 0.1), (0.6, 0.4)]):
        _step(m, {"a": [a], "b": [b]}, step)
    twin = assert_state_roundtrip(m)
    assert torch.equal(twin.probabilities(), m.probabilities())
    for model in (m, twin):
        _step(model, {"a": [0.9], "b": [0.0]}, 4)
    assert torch.equal(twin.probabilities(), m.probabilities())
    other = TSCL(window=4)
    other.set_domains(DOMAINS)
    with pytest.raises(ValueError, match="window"):
        other.load_state_dict(m.state_dict())


def test_mixer_contract_from_the_kit():
    history = check_mixer(TSCL(window=3, temperature=0.2))
    assert len(history) == 6
    check_mixer(TSCL(policy="epsilon_greedy", epsilon=0.3))


def test_parameters_are_checked():
    with pytest.raises(ConfigError, match="temperature"):
        TSCL(temperature=0.0)
    with pytest.raises(ConfigError, match="window"):
        TSCL(window=1)
    with pytest.raises(ConfigError, match="policy"):
        TSCL(policy="greedy")


def test_through_the_pipeline_by_name(contrib_components):
    block = {"mechanism": "mix", "scorer": {"name": "outcome_reward"},
             "actuator": {"name": "tscl", "params": {"window": 4, "temperature": 0.5}},
             "domains": ["math", "code", "logic"]}
    b = make_batch(groups=6, group_size=3, domains=3, padding_rows=1, seed=0)
    decision = apply_method(block, b)
    assert set(decision.domain_probs) == {"math", "code", "logic"}
    assert math.isclose(sum(decision.domain_probs.values()), 1.0, rel_tol=1e-9)
    assert "dataflex/tscl/q/math" in decision.metrics
