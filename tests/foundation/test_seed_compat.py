"""Seed fidelity: scorers may return plain tensors (checked against their granularity), the seed's
``dataflex_verl`` import paths work, and the step argument may be spelt ``step`` or ``step_id``."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dataflex_bus
from dataflex_bus import Score, Scorer
from dataflex_bus.components import Mixer, Reweighter, Selector, as_score
from dataflex_bus.errors import BatchFieldError, PluginRuntimeError
from dataflex_bus.testing import make_batch

ROOT = Path(__file__).resolve().parents[2]

SEED_EXAMPLE = '''
import torch
from dataflex_verl.core.registry import register_scorer
from dataflex_verl.core.scorer import Scorer


@register_scorer("seed_reward_length")
class RewardLengthScorer(Scorer):
    """Reward times response length: a (batch_size,) tensor, as the seed's contract says."""

    requires = ["rm_scores", "response_mask"]
    timing = "post_reward"
    granularity = "response"

    def score(self, batch, step_id, **ctx):
        return batch["rm_scores"].sum(-1) * batch["response_mask"].sum(-1)
'''


def _scorer(granularity: str, fn, name: str = "plain"):
    cls = type("Plain", (Scorer,), {"granularity": granularity, "requires": (),
                                    "score": lambda self, batch, step, **ctx: fn(batch)})
    scorer = cls()
    scorer.name = name
    return scorer


# ---------------------------------------------------------------------------- as_score
@pytest.mark.parametrize(("granularity", "fn"), [
    ("response", lambda b: b.rewards),
    ("prompt", lambda b: b.rewards.round()),
    ("token", lambda b: b["old_log_probs"].exp()),
    ("domain", lambda b: torch.arange(len(b.domain_names), dtype=torch.float32)),
    ("response", lambda b: b.lengths),                      # integer values are real-valued too
])
def test_plain_tensors_become_scores_of_the_declared_granularity(granularity, fn):
    batch = make_batch(groups=3, group_size=2, padding_rows=1, domains=2, seed=1)
    scorer = _scorer(granularity, fn)
    score = as_score(scorer.score(batch, 0), scorer, batch)
    assert isinstance(score, Score) and score.granularity == granularity
    assert torch.equal(score.values, fn(batch))


@pytest.mark.parametrize(("granularity", "result", "message"), [
    ("response", lambda b: b["old_log_probs"], "response-level scores must have shape (7,)"),
    ("token", lambda b: b.rewards, "token-level scores must have shape (7, 16)"),
    ("token", lambda b: b["old_log_probs"][:, :3], "got (7, 3)"),
    ("domain", lambda b: b.rewards, "shape (2,) (one value per domain of ['math', 'code'])"),
    ("response", lambda b: b.rewards[:1], "got (1,)"),
    ("response", lambda b: b.rewards > 0, "expected a float or integer tensor, got torch.bool"),
    ("response", lambda b: b.rewards.tolist(), "must return a Score or a tensor, got list"),
    ("response", lambda b: Score(b.rewards, "prompt"), "declares granularity 'response' but returned a 'prompt'"),
    ("response", lambda b: Score(b.rewards, "response", counts=b.lengths[:2]), "score.counts"),
])
def test_bad_scores_are_refused_naming_the_scorer(granularity, result, message):
    batch = make_batch(groups=3, group_size=2, padding_rows=1, domains=2, seed=1)
    scorer = _scorer(granularity, result, name="wonky")
    with pytest.raises(BatchFieldError) as err:
        as_score(scorer.score(batch, 0), scorer, batch)
    assert message in str(err.value) and "scorer 'wonky'" in str(err.value)


def test_a_plain_tensor_scorer_runs_through_the_pipeline_and_a_bad_one_names_its_plugin(dataflex_register_plugin):
    class Length(Scorer):
        requires = ("response_mask",)

        def score(self, batch, step, **ctx):
            return batch.lengths.float()

    class Wide(Length):
        def score(self, batch, step, **ctx):
            return batch["response_mask"].float()

    dataflex_register_plugin("scorer", "plain_length", Length)
    dataflex_register_plugin("scorer", "wide_length", Wide)
    batch = make_batch(groups=4, group_size=4, seed=3)
    block = {"mechanism": "select", "scorer": {"name": "plain_length"},
             "actuator": {"name": "topk_fraction", "params": {"fraction": 0.25}}}
    keep = dataflex_bus.build_pipeline(block).apply(batch, 0).keep
    assert int(keep.sum()) == 4 and bool(batch.lengths[keep].min() >= batch.lengths[~keep].max())
    with pytest.raises(PluginRuntimeError) as err:
        dataflex_bus.build_pipeline({**block, "scorer": {"name": "wide_length"}}).apply(batch, 0)
    assert err.value.plugin == "local:wide_length"
    assert "response-level scores must have shape (16,)" in str(err.value)


def test_plain_tensor_scores_drive_reweight_and_mix(dataflex_register_plugin):
    class TokenProb(Scorer):
        requires = ("old_log_probs",)
        timing = "post_advantage"
        granularity = "token"

        def score(self, batch, step, **ctx):
            return batch["old_log_probs"].exp()

    class PerDomain(Scorer):
        granularity = "domain"

        def score(self, batch, step, **ctx):
            return torch.linspace(0.0, 1.0, len(batch.domain_names))

    dataflex_register_plugin("scorer", "plain_token_prob", TokenProb)
    dataflex_register_plugin("scorer", "plain_domain", PerDomain)
    batch = make_batch(groups=4, group_size=2, domains=2, seed=5)
    weights = dataflex_bus.build_pipeline({
        "mechanism": "reweight", "scorer": {"name": "plain_token_prob"},
        "actuator": {"name": "advantage_reweight", "params": {"alpha": 1.0}}}).apply(batch, 0).weights
    assert torch.allclose(weights[batch.token_mask], batch["old_log_probs"].exp()[batch.token_mask])
    block = {"mechanism": "mix", "scorer": {"name": "plain_domain"}, "domains": ["math", "code"],
             "actuator": {"name": "static", "params": {"proportions": {"math": 1.0, "code": 3.0}}}}
    assert dataflex_bus.build_pipeline(block).apply(batch, 0).domain_probs == {"math": 0.25, "code": 0.75}

    class RowsNotDomains(PerDomain):
        def score(self, batch, step, **ctx):
            return batch.rewards

    dataflex_register_plugin("scorer", "plain_domain", RowsNotDomains)
    with pytest.raises(PluginRuntimeError, match=r"domain-level scores must have shape \(2,\)"):
        dataflex_bus.build_pipeline(block).apply(batch, 0)


# ---------------------------------------------------------------------------- dataflex_verl
def test_the_seed_example_runs_verbatim_through_the_pipeline():
    namespace: dict = {}
    try:
        exec(compile(SEED_EXAMPLE, "seed_example", "exec"), namespace)
        batch = make_batch(groups=4, group_size=4, seed=0)
        decision = dataflex_bus.build_pipeline({
            "mechanism": "select",
            "scorer": {"name": "seed_reward_length"},
            "actuator": {"name": "threshold_band", "params": {"low": 1.0, "high": 1e9}},
        }).apply(batch, 0)
        assert torch.equal(decision.keep, (batch.rewards * batch.lengths) >= 1.0)
        assert namespace["RewardLengthScorer"].__mro__[1] is dataflex_bus.Scorer
    finally:
        from dataflex_bus.registry import unregister_local

        unregister_local("scorer", "seed_reward_length")


def test_seed_module_paths_reexport_the_same_objects():
    from dataflex_verl.core import mixer, registry, reweighter, scorer, selector

    assert registry.register_scorer is dataflex_bus.register_scorer
    assert registry.register_selector is dataflex_bus.register_selector
    assert registry.register_reweighter is dataflex_bus.register_reweighter
    assert registry.register_mixer is dataflex_bus.register_mixer
    assert scorer.Scorer is dataflex_bus.Scorer and scorer.Score is dataflex_bus.Score
    assert selector.Selector is dataflex_bus.Selector and selector.Selection is dataflex_bus.Selection
    assert reweighter.Reweighter is dataflex_bus.Reweighter and reweighter.Reweighting is dataflex_bus.Reweighting
    assert mixer.Mixer is Mixer
    import dataflex_verl.core as core

    assert core.Param is dataflex_bus.Param and core.Mixer is Mixer


def test_seed_package_is_import_light_and_packaged():
    code = ("import sys, dataflex_verl, dataflex_verl.core.registry, dataflex_verl.core.scorer; "
            "sys.exit('torch imported' if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"dataflex_verl*"' in pyproject


# ---------------------------------------------------------------------------- step / step_id
def test_base_methods_spell_the_step_argument_step():
    for method in (Scorer.score, Selector.select, Reweighter.reweight, Mixer.update):
        assert "step" in inspect.signature(method).parameters, method
        assert "step_id" not in inspect.signature(method).parameters, method
    from dataflex_bus import hookspecs

    for event in hookspecs.EVENTS:
        assert "step" in inspect.signature(getattr(hookspecs, event)).parameters


@pytest.mark.parametrize("spelling", ["step", "step_id", "t"])
def test_components_may_spell_the_step_argument_either_way(spelling, dataflex_register_plugin):
    source = textwrap.dedent(f"""
        from dataflex_bus import Score, Scorer, Selection, Selector

        class StepScorer(Scorer):
            def score(self, batch, {spelling}, **ctx):
                return Score(batch.rewards + {spelling}, "response")

        class StepSelector(Selector):
            def select(self, batch, score, {spelling}):
                return Selection((score.values > {spelling} + 0.5) & batch.valid_rows)
    """)
    namespace: dict = {}
    exec(source, namespace)
    dataflex_register_plugin("scorer", "step_scorer", namespace["StepScorer"])
    dataflex_register_plugin("selector", "step_selector", namespace["StepSelector"])
    batch = make_batch(groups=2, group_size=4, seed=0)
    pipe = dataflex_bus.build_pipeline({"mechanism": "select", "scorer": {"name": "step_scorer"},
                                        "actuator": {"name": "step_selector"}})
    # Both methods must see the same step (r + step > step + 0.5 keeps exactly the rewarded rows).
    for step in (1, 3):
        assert torch.equal(pipe.apply(batch, step).keep, batch.rewards > 0.5)
