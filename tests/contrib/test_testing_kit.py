"""The testing kit shipped for plugin authors: factories, fixtures, contracts, import cost."""

import subprocess
import sys

import pytest
import torch

from dataflex_bus import Score, Scorer
from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.testing import check_scorer, make_batch

pytest_plugins = ["pytester"]


def test_make_batch_is_grpo_shaped():
    b = make_batch(groups=5, group_size=4, max_len=12, padding_rows=3, domains=2, seed=11)
    assert len(b) == 23 and b.num_groups == 5 and b.group_sizes.tolist() == [4] * 5
    real, pad = b.valid_rows, b.is_padding
    assert int(pad.sum()) == 3 and bool(pad[-3:].all())
    L = b.lengths
    assert bool((L[real] >= 1).all()) and bool((L[real] <= 12).all()) and bool((L[pad] == 0).all())
    assert len(set(L[real].tolist())) > 1  # variable lengths
    assert set(b.rewards[real].tolist()) <= {0.0, 1.0}
    # the reward sits on the last valid token only
    rm = b["rm_scores"]
    assert torch.equal((rm != 0).sum(-1), b.rewards.ne(0).long())
    last = rm[torch.arange(len(b)), (L - 1).clamp_min(0)]
    assert torch.equal(last[real], b.rewards[real])
    adv = grpo_outcome_advantage(b.rewards, b.group_index, b.num_groups)
    assert torch.allclose(b["advantages"], adv[:, None] * b.token_mask)
    olp = b["old_log_probs"]
    assert bool((olp[b.token_mask] < 0).all()) and bool((olp[~b.token_mask] == 0).all())
    assert b.domain_names == ["math", "code"]
    assert b.domain_index[real].tolist() == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4 + [0] * 4
    assert bool((b.domain_index[pad] == -1).all())
    assert b["response_mask"][pad].sum() == 0 and b["loss_mask"][pad].sum() == 0


def test_make_batch_is_deterministic_per_seed_and_options_work():
    a, b = make_batch(seed=3), make_batch(seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a.fields)
    assert not torch.equal(make_batch(seed=4)["response_mask"], a["response_mask"])
    mixed = make_batch(groups=30, group_size=5, mixed_group_sizes=True, seed=0)
    sizes = mixed.group_sizes
    assert int(sizes.min()) == 1 and int(sizes.max()) == 5  # singletons and full groups
    given = make_batch(group_sizes=[3, 1], lengths=[1, 2, 3, 4], rewards=[1, 0, 0, 1], max_len=4,
                       with_advantages=False, with_is_weights=True)
    assert given.lengths.tolist() == [1, 2, 3, 4] and given.rewards.tolist() == [1, 0, 0, 1]
    assert "advantages" not in given and "rollout_is_weights" in given
    assert given["rollout_is_weights"].shape == (4, 4)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"groups": 0}, "groups"), ({"min_len": 20, "max_len": 8}, "min_len"),
    ({"domains": ["a", "a"]}, "distinct"), ({"group_sizes": [2, 0]}, "positive"),
    ({"groups": 1, "group_size": 2, "rewards": [1.0]}, "rewards"),
    ({"groups": 1, "group_size": 2, "lengths": [1, 99]}, "lengths"),
])
def test_make_batch_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_batch(**kwargs)


class _Good(Scorer):
    requires = ("rm_scores",)

    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards, "response")


class _CountsPadding(Scorer):
    """Normalises by the row count including padding: the contract must catch it."""

    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards / len(batch), "response")


class _WrongShape(Scorer):
    granularity = "token"

    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards, "token")


def test_scorer_contract_accepts_good_and_catches_bad():
    check_scorer(_Good())
    with pytest.raises(AssertionError, match="padding rows changed"):
        check_scorer(_CountsPadding())
    with pytest.raises(AssertionError, match="shape"):
        check_scorer(_WrongShape())


def test_kit_is_import_light():
    code = ("import sys, dataflex_bus.testing, dataflex_bus.testing.pytest_plugin; "
            "bad = [m for m in ('torch', 'dataflex_bus.discovery') if m in sys.modules]; "
            "sys.exit(f'imported at load: {bad}' if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


INNER = '''
import os
from dataflex_bus import Score, Scorer, get_plugins
from dataflex_bus.registry import local_specs

class Mine(Scorer):
    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards, "response")

def test_a_register(dataflex_register_plugin, dataflex_isolated_plugins):
    dataflex_register_plugin("scorer", "kit_probe", Mine)
    assert os.environ["DATAFLEX_LOAD_PLUGINS"] == ""
    assert get_plugins().active == []
    assert get_plugins().registry().resolve("scorer", "kit_probe").load() is Mine

def test_b_cleaned_up():
    assert "kit_probe" not in {s.name for s in local_specs()}
    assert os.environ.get("DATAFLEX_LOAD_PLUGINS") == "sentinel"

def test_c_env(dataflex_plugin_env):
    plugins = dataflex_plugin_env(load=["nothing-like-this"], disable=["x"])
    assert os.environ["DATAFLEX_DISABLE_PLUGINS"] == "x"
    assert all(r.status == "disabled" for r in plugins.records)

def test_d_restored():
    assert os.environ.get("DATAFLEX_LOAD_PLUGINS") == "sentinel"
    assert "DATAFLEX_DISABLE_PLUGINS" not in os.environ

def test_e_batch(dataflex_batch):
    assert dataflex_batch(groups=2, group_size=3).num_groups == 2
'''


def test_fixtures_register_isolate_and_restore(pytester, monkeypatch):
    """Run a test file through pytest with only the entry-point-loaded plugin providing the fixtures."""
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "sentinel")
    monkeypatch.delenv("DATAFLEX_DISABLE_PLUGINS", raising=False)
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=5)


def test_register_fixture_restores_a_shadowed_registration(pytester):
    pytester.makepyfile(test_shadow='''
from dataflex_bus import Score, Scorer, register_scorer
from dataflex_bus.registry import local_specs

@register_scorer("shadowed")
class Original(Scorer):
    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards, "response")

class Replacement(Original):
    pass

def test_a(dataflex_register_plugin):
    dataflex_register_plugin("scorer", "shadowed", Replacement)
    assert [s.target for s in local_specs() if s.name == "shadowed"] == [Replacement]

def test_b():
    assert [s.target for s in local_specs() if s.name == "shadowed"] == [Original]
''')
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=2)


@pytest.mark.integration
def test_run_short_training_uses_the_shim(contrib_components):
    pytest.importorskip("dataflex_bus.shim")
    from dataflex_bus.testing import run_short_training

    metrics = run_short_training({"mechanism": "select", "scorer": {"name": "outcome_reward"},
                                  "actuator": {"name": "gfpo", "params": {"k": 2}}}, steps=2, seed=1)
    assert len(metrics) == 2
    assert all(m["dataflex/kept_rows"] == 16.0 for m in metrics)  # 8 prompts x k=2
    with pytest.raises(ValueError, match="steps"):
        run_short_training({"mechanism": "select"}, steps=0)


