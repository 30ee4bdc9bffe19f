"""Tests shipped with dataflex-gfpo; they run against the installed pack (``pip install -e .``)."""

import math

import pytest
import torch
from dataflex_gfpo.selector import GFPO

from dataflex_bus.errors import ConfigError
from dataflex_bus.testing import check_selector, make_batch


def test_plugin_is_discovered_and_active(dataflex_plugin_env):
    plugins = dataflex_plugin_env(load=["dataflex-gfpo"])
    (record,) = [r for r in plugins.records if r.distribution == "dataflex-gfpo"]
    assert record.status == "active", record.error
    assert [(c.kind, c.name) for c in record.components] == [("selector", "gfpo")]
    assert plugins.registry().resolve("actuator", "gfpo").load() is GFPO


def test_keeps_the_two_shortest_and_recomputes_advantages():
    b = make_batch(group_sizes=[4], lengths=[5, 3, 8, 2], rewards=[1, 0, 1, 1], max_len=8)
    sel = GFPO(metric="length", k=2).select(b, None, 0)
    assert sel.keep.tolist() == [False, True, False, True]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(sel.advantages[:, 0], torch.tensor([0.0, -a, 0.0, a]), atol=1e-6)


def test_contract():
    check_selector(GFPO(keep_fraction=0.5))
    check_selector(GFPO(metric="reward_per_token", k=3))


def test_needs_k_or_keep_fraction():
    with pytest.raises(ConfigError, match="keep_fraction"):
        GFPO()


def test_short_training(dataflex_plugin_env, dataflex_run_training):
    pytest.importorskip("dataflex_bus.shim")
    dataflex_plugin_env(load=None)
    metrics = dataflex_run_training(
        {"mechanism": "select", "scorer": {"name": "reward_difficulty"},
         "actuator": {"name": "gfpo", "params": {"metric": "length", "k": 2}}}, steps=2, seed=0)
    assert [m["dataflex/kept_rows"] for m in metrics] == [16.0, 16.0]  # 8 prompts x 2 kept
