"""response_length scorer (contrib/dataflex-length)."""

import pytest
import torch
from dataflex_length.scorer import ResponseLength

from dataflex_bus.errors import ConfigError
from dataflex_bus.testing import apply_method, check_scorer, make_batch


def _batch():
    return make_batch(groups=1, group_size=2, lengths=[3, 5], rewards=[1.0, 0.0], max_len=8, padding_rows=1)


@pytest.mark.parametrize(("normalize", "expected"), [
    ("max_len", [3 / 8, 5 / 8, 0.0]),
    ("batch_max", [3 / 5, 1.0, 0.0]),
    ("none", [3.0, 5.0, 0.0]),
])
def test_values_by_hand(normalize, expected):
    score = ResponseLength(normalize=normalize).score(_batch(), 0)
    assert score.granularity == "response"
    assert torch.allclose(score.values, torch.tensor(expected))
    assert score.metrics["length/mean"] == 4.0


@pytest.mark.parametrize("normalize", ["max_len", "batch_max", "none"])
def test_contract(normalize):
    check_scorer(ResponseLength(normalize=normalize))


def test_bad_parameter_names_allowed_values():
    with pytest.raises(ConfigError, match="batch_max"):
        ResponseLength(normalize="tokens")


def test_pairs_with_gfpo_by_name(contrib_components):
    block = {"mechanism": "select", "scorer": {"name": "response_length"},
             "actuator": {"name": "gfpo", "params": {"keep_fraction": 0.5}}}
    decision = apply_method(block, make_batch(groups=3, group_size=4, seed=1))
    assert int(decision.keep.sum()) == 6
    assert decision.metrics["dataflex/length/max"] <= 16
