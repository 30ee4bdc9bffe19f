"""Method stacks: several methods in one block, run in list order at each event (issue 11)."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus import DataflexConfig, validate
from dataflex_bus.errors import ConfigError
from dataflex_bus.pipeline import build_pipeline

from .toys import toy_batch

BAND = {"mechanism": "select", "scorer": {"name": "toy_reward"},
        "actuator": {"name": "toy_band", "params": {"low": 0.5, "high": 1.0}}}
SCALE = {"mechanism": "reweight", "scorer": {"name": "toy_reward"},
         "actuator": {"name": "toy_scale", "params": {"factor": 3.0}}}


def test_seed_block_and_one_method_list_are_the_same_method(toys):
    seed = DataflexConfig.from_dict(BAND)
    listed = DataflexConfig.from_dict({"methods": [BAND]})
    assert seed.methods == listed.methods and not seed.stacked and listed.stacked
    assert seed.methods[0].name == "select:toy_band"
    a, b = build_pipeline(BAND).apply(toy_batch(), 0), build_pipeline({"methods": [BAND]}).apply(toy_batch(), 0)
    assert torch.equal(a.keep, b.keep) and a.metrics == b.metrics  # un-namespaced: dataflex/...


def test_later_methods_see_the_batch_as_earlier_ones_left_it(toys):
    keep_right = {**BAND, "name": "right"}
    # a band on "wrong" rows after a band on "right" rows: nothing is left, and the second method says so
    keep_wrong = {**BAND, "name": "wrong", "actuator": {"name": "toy_band", "params": {"low": 0.0, "high": 0.4}},
                  "on_empty": "skip"}
    pipe = build_pipeline({"methods": [keep_right, keep_wrong]})
    d = pipe.apply(toy_batch(), 0, event="on_advantage")
    assert d.metrics["dataflex/right/kept_rows"] == 4 and d.metrics["dataflex/wrong/empty_selection"] == 1.0
    assert d.skip_update and not bool(d.keep.any())
    # keep masks AND, weights multiply, each method's metrics under its own name
    pipe = build_pipeline({"methods": [keep_right, {**SCALE, "name": "x3"},
                                       {**SCALE, "name": "x2", "actuator": {"name": "toy_scale"}}]})
    d = pipe.apply(toy_batch(), 0, event="on_advantage")
    assert d.keep.tolist() == [True, False, True, True, False, False, True, False]
    assert bool((d.weights[d.keep] == 6.0).all()) and d.metrics["dataflex/x3/weight_mean"] == 3.0
    # the reweighters saw only the kept rows as real (dropped rows are padding to them)
    assert d.metrics["dataflex/x2/weight_mean"] == 2.0


def test_a_subset_selectors_advantages_are_what_a_later_method_reads(toys):
    from dataflex_bus import Selection, Selector
    from dataflex_bus.registry import register_local, unregister_local

    class Halve(Selector):
        rewrites_advantages = True
        min_timing = "post_advantage"

        def select(self, batch, score, step):
            return Selection(batch.valid_rows.clone(), advantages=batch["advantages"] + 0.5)

    seen = []

    class ReadAdvantages(Selector):
        requires = ("advantages",)

        def select(self, batch, score, step):
            seen.append(batch["advantages"].clone())
            return Selection(batch.valid_rows.clone())

    register_local("selector", "t_halve", Halve)
    register_local("selector", "t_read_adv", ReadAdvantages)
    try:
        pipe = build_pipeline({"methods": [
            {"mechanism": "select", "scorer": {"name": "toy_reward"}, "actuator": {"name": "t_halve"}},
            {"mechanism": "select", "scorer": {"name": "toy_reward"}, "actuator": {"name": "t_read_adv"}}]})
        pipe.apply(toy_batch(), 0, event="on_advantage")
    finally:
        unregister_local("selector", "t_halve")
        unregister_local("selector", "t_read_adv")
    # seen[0] is validation's probe batch; the last call is the real one: toy_batch's advantages are 0 and
    # the subset selector before it added 0.5
    assert bool((seen[-1] == 0.5).all())


def test_stack_validation_reports_every_method_by_its_key(toys):
    with pytest.raises(ConfigError) as err:
        validate({"methods": [
            {**BAND, "name": "a"},
            {**BAND, "name": "a", "actuator": {"name": "toy_bnd"}},
            {"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_mixer"}},
            {"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_mixer"}, "name": "m2"},
            {**SCALE, "warmup_step": -1},
        ]})
    found = {i.key: str(i) for i in err.value.issues}
    assert "already used by dataflex.methods[0]" in found["dataflex.methods[1].name"]
    assert "did you mean 'toy_band'" in found["dataflex.methods[1].actuator.name"]
    assert "one mixer" in found["dataflex.methods[3]"]
    assert "dataflex.methods[4].warmup_step" in found
    with pytest.raises(ConfigError, match="non-empty list"):
        validate({"methods": []})
    with pytest.raises(ConfigError, match="takes no name"):
        validate({**BAND, "name": "solo"})


def test_two_subset_selectors_are_refused():
    pods = {"mechanism": "select", "scorer": {"name": "reward_difficulty"},
            "actuator": {"name": "max_variance", "params": {"keep_fraction": 0.5}}}
    with pytest.raises(ConfigError, match="overwrite each other's advantages"):
        validate({"methods": [{**pods, "name": "a"}, {**pods, "name": "b"}]})


def test_stack_state_is_saved_per_method_and_a_changed_stack_is_refused(toys):
    mix = {"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_mixer"},
           "name": "mix"}
    block = {"methods": [{**BAND, "name": "band"}, mix], "domains": ["a", "b"]}
    pipe = build_pipeline(block)
    pipe.apply(toy_batch(rewards=(0,) * 8, domains=["a"] * 4 + ["b"] * 4), 0, event="on_advantage")
    pipe.apply(toy_batch(domains=["a"] * 4 + ["b"] * 4), 0, event="on_step_end")
    state = pipe.state_dict()
    assert sorted(state["methods"]) == ["band", "mix"]
    assert state["methods"]["band"]["counters"]["empty_selections"] == 1
    fresh = build_pipeline(block)
    fresh.load_state_dict(state)
    assert fresh.methods[0].counters == pipe.methods[0].counters
    assert fresh.domain_probabilities() == pipe.domain_probabilities() == {"a": 0.5, "b": 0.5}
    with pytest.raises(ConfigError, match="different dataflex config"):
        build_pipeline({"methods": [mix, {**BAND, "name": "band"}], "domains": ["a", "b"]}).load_state_dict(state)
