"""Tests shipped with dataflex-length; they run against the installed pack (``pip install -e .``)."""

import pytest
import torch
from dataflex_length.scorer import ResponseLength

from dataflex_bus.testing import check_scorer, make_batch


def test_plugin_is_discovered_and_active(dataflex_plugin_env):
    plugins = dataflex_plugin_env(load=["dataflex-length"])
    (record,) = [r for r in plugins.records if r.distribution == "dataflex-length"]
    assert record.status == "active", record.error
    assert [(c.kind, c.name) for c in record.components] == [("scorer", "response_length")]


def test_normalised_by_the_response_width():
    b = make_batch(group_sizes=[2], lengths=[3, 5], max_len=8, padding_rows=1)
    assert torch.allclose(ResponseLength().score(b, 0).values, torch.tensor([0.375, 0.625, 0.0]))


@pytest.mark.parametrize("normalize", ["max_len", "batch_max", "none"])
def test_contract(normalize):
    check_scorer(ResponseLength(normalize=normalize))


def test_short_training(dataflex_plugin_env, dataflex_run_training):
    pytest.importorskip("dataflex_bus.shim")
    dataflex_plugin_env(load=None)
    metrics = dataflex_run_training(
        {"mechanism": "select", "scorer": {"name": "response_length"},
         "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5, "largest": False}}}, steps=2)
    assert all(m["dataflex/kept_rows"] == 16.0 for m in metrics)
