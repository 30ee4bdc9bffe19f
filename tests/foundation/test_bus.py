"""The event bus: participants fail fast and are named; observers are isolated; pipelines act."""

from __future__ import annotations

import logging

import pytest
import torch

from dataflex_bus import EventBus, Runtime, hookimpl
from dataflex_bus.errors import PluginRuntimeError
from dataflex_bus.pipeline import build_pipeline

from .toys import toy_batch


class Recorder:
    def __init__(self):
        self.seen = []

    @hookimpl
    def on_rollout(self, batch, step, decision):
        self.seen.append(("on_rollout", step, None if decision.keep is None else decision.keep.tolist()))

    @hookimpl
    def on_advantage(self, batch, step, decision):
        self.seen.append(("on_advantage", step, None if decision.keep is None else decision.keep.tolist()))

    @hookimpl
    def on_step_end(self, step):
        self.seen.append(("on_step_end", step, None))


class Exploding:
    @hookimpl
    def on_advantage(self, batch):
        raise ValueError("observer bug")


def select_block(actuator="toy_band", **params):
    return {"mechanism": "select", "scorer": {"name": "toy_reward"},
            "actuator": {"name": actuator, "params": params}}


def test_observers_run_after_participants_and_are_isolated(toys, caplog):
    runtime = Runtime(select_block(low=0.5, high=1.0))
    rec = Recorder()
    runtime.bus.add_observer(Exploding(), "exploding")
    runtime.bus.add_observer(rec, "recorder")
    # A per-row band splits groups, so it acts after the advantage, not at on_rollout.
    assert runtime.pipeline.event == "on_advantage"
    with caplog.at_level(logging.ERROR, logger="dataflex_bus"):
        assert _nothing_decided(runtime.emit("on_rollout", toy_batch(), 3))
        decision = runtime.emit("on_advantage", toy_batch(), 3)
    assert decision.keep.tolist() == [True, False, True, True, False, False, True, False]
    # The recorder saw the participant's decision: it ran after it.
    assert rec.seen == [("on_rollout", 3, None), ("on_advantage", 3, decision.keep.tolist())]
    assert "observer 'exploding' failed in on_advantage" in caplog.text
    runtime.emit("on_step_end", toy_batch(), 3)
    assert rec.seen[-1] == ("on_step_end", 3, None)


def test_participant_failure_names_plugin_and_hook(toys):
    runtime = Runtime(select_block(actuator="toy_explode"))
    with pytest.raises(PluginRuntimeError) as err:
        runtime.emit("on_advantage", toy_batch(), 0)
    assert err.value.plugin == "local:toy_explode" and err.value.hook == "on_advantage"
    assert "kaboom" in str(err.value)


def test_misspelt_hook_on_a_participant_is_visible():
    class Typo:
        @hookimpl
        def on_rollout(self, batch):
            pass

        @hookimpl
        def on_advantge(self, batch):
            pass

    bus = EventBus()
    bus.add_participant(Typo(), "typo")  # only known events are wired ...
    assert bus.participants == ["typo"]
    from dataflex_bus.discovery import new_plugin_manager

    pm = new_plugin_manager()
    pm.register(Typo())
    from pluggy import PluginValidationError

    with pytest.raises(PluginValidationError, match="on_advantge"):
        pm.check_pending()  # ... and discovery rejects the unknown one (see test_discovery typo pack)


def test_plain_run_without_method_still_reaches_observers():
    runtime = Runtime(None)
    rec = Recorder()
    runtime.bus.add_observer(rec, "recorder")
    decision = runtime.emit("on_rollout", toy_batch(), 0)
    assert _nothing_decided(decision) and rec.seen == [("on_rollout", 0, None)]
    assert runtime.provenance()["dataflex"] is None and "dataflex-bus==0.1.0" in runtime.provenance()["plugins"]


def test_padding_rows_are_never_kept(toys):
    pipe = build_pipeline(select_block(low=0.0, high=1.0))
    batch = toy_batch(padding=[0, 0, 0, 0, 0, 0, 1, 1])
    d = pipe.apply(batch, 0)
    assert d.keep.tolist() == [True] * 6 + [False, False]
    assert d.metrics["dataflex/kept_fraction"] == 1.0 and d.metrics["dataflex/kept_rows"] == 6


@pytest.mark.parametrize("policy", ["skip", "keep_all", "error"])
def test_empty_selection_policy(toys, policy, caplog):
    pipe = build_pipeline({**select_block(low=0.9, high=1.0), "on_empty": policy})
    batch = toy_batch(rewards=(0,) * 8)
    if policy == "error":
        with pytest.raises(Exception, match="kept no row"):
            pipe.apply(batch, 0)
        return
    with caplog.at_level(logging.WARNING, logger="dataflex_bus"):
        d = pipe.apply(batch, 0)
    assert d.metrics["dataflex/empty_selection"] == 1.0 and "kept no row" in caplog.text
    if policy == "skip":
        assert d.skip_update and d.keep.sum() == 0
    else:
        assert not d.skip_update and d.keep is None
    assert pipe.counters["empty_selections"] == 1


def test_nonfinite_scores_error_or_drop(toys):
    batch = toy_batch()
    batch.fields["rm_scores"][1, -1] = float("nan")
    with pytest.raises(PluginRuntimeError, match=r"non-finite score.*rows \[1\]"):
        Runtime(select_block()).emit("on_advantage", batch, 0)
    batch = toy_batch()
    batch.fields["rm_scores"][1, -1] = float("nan")
    d = build_pipeline({**select_block(), "on_nonfinite": "drop"}).apply(batch, 0)
    assert d.keep.tolist()[1] is False and d.metrics["dataflex/nonfinite_rows"] == 1.0


def test_reweight_weights_are_neutral_off_real_tokens(toys):
    pipe = build_pipeline({"mechanism": "reweight", "scorer": {"name": "toy_reward"},
                           "actuator": {"name": "toy_scale", "params": {"factor": 3.0}}})
    batch = toy_batch(padding=[0] * 7 + [1])
    batch.fields["response_mask"][0, :2] = 0
    d = pipe.apply(batch, 0)
    assert d.weights.shape == (8, 4)
    assert d.weights[0].tolist() == [1.0, 1.0, 3.0, 3.0] and d.weights[7].tolist() == [1.0] * 4
    assert d.metrics["dataflex/weight_mean"] == 3.0


def test_warmup_holds_the_actuator(toys):
    pipe = build_pipeline({**select_block(low=0.9, high=1.0), "warmup_step": 2})
    assert pipe.apply(toy_batch(), 1).keep is None
    assert pipe.apply(toy_batch(), 2).keep is not None


def test_mix_pipeline_state_round_trip(toys):
    cfg = {"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_mixer"},
           "domains": ["a", "b"]}
    pipe = build_pipeline(cfg)
    batch = toy_batch(domains=["a"] * 4 + ["b"] * 4)
    d = pipe.apply(batch, 0)
    assert d.domain_probs == {"a": 0.5, "b": 0.5} and d.metrics["dataflex/seen"] == 1.0
    state = pipe.state_dict()
    fresh = build_pipeline(cfg)
    fresh.load_state_dict(state)
    assert fresh.domain_probabilities() == pipe.domain_probabilities()
    other = build_pipeline({**cfg, "update_step": 3})
    with pytest.raises(Exception, match="different dataflex config"):
        other.load_state_dict(state)


def test_decision_keep_combines_with_and(toys):
    pipe = build_pipeline(select_block(low=0.5, high=1.0))
    from dataflex_bus.pipeline import Decision

    d = Decision()
    d.keep = torch.tensor([True, True, False, True, True, True, True, True])
    pipe.apply(toy_batch(), 0, d)
    assert d.keep.tolist() == [True, False, False, True, False, False, True, False]


def test_empty_selection_warnings_do_not_flood(toys, caplog):
    pipe = build_pipeline({**select_block(low=0.9, high=1.0)})
    batch = toy_batch(rewards=(0,) * 8)
    with caplog.at_level(logging.WARNING, logger="dataflex_bus"):
        for step in range(9):
            assert pipe.apply(batch, step).skip_update
    warned = [r.getMessage() for r in caplog.records if "kept no row" in r.getMessage()]
    assert [w.split(" at step ")[1].split(";")[0] for w in warned] == ["0", "1", "3", "7"]
    assert "4 empty step(s) so far" in warned[2] and pipe.counters["empty_selections"] == 9


def test_group_selections_act_at_rollout_and_may_not_split_groups(toys):
    rate = {"mechanism": "select", "scorer": {"name": "toy_group_rate"},
            "actuator": {"name": "toy_band", "params": {"low": 0.4, "high": 0.6}}}
    pipe = build_pipeline(rate)
    assert pipe.event == "on_rollout"
    # groups aa, bb, cc, dd with rewards (1,0) (1,1) (0,0) (1,0): rates .5, 1, 0, .5
    assert pipe.apply(toy_batch(), 0).keep.tolist() == [True, True, False, False, False, False, True, True]

    class Splitter(type(pipe.actuator)):
        def select(self, batch, score, step_id):
            from dataflex_bus import Selection

            return Selection(torch.arange(len(batch)) % 2 == 0)

    pipe.actuator.__class__ = Splitter
    with pytest.raises(Exception, match=r"split 4 group\(s\) at on_rollout"):
        pipe.apply(toy_batch(), 0)


def _nothing_decided(d) -> bool:
    return (d.keep is None and d.advantages is None and d.weights is None and d.domain_probs is None
            and not d.skip_update)


class FieldsObserver:
    """An observer asking for fields beyond the guaranteed ones (and one no event has)."""

    @hookimpl
    def dataflex_fields(self, event):
        return {"on_rollout": ["responses", "no_such_field"], "on_advantage": ["old_log_probs"]}.get(event, [])

    @hookimpl
    def on_rollout(self, batch):
        pass


class BrokenFields:
    @hookimpl
    def dataflex_fields(self, event):
        raise RuntimeError("boom")


def test_runtime_fields_join_method_requirements_and_observer_requests(toys, caplog):
    from dataflex_bus.discovery import PluginSet, new_plugin_manager

    pm = new_plugin_manager()
    pm.register(FieldsObserver(), name="fields-observer")
    pm.register(BrokenFields(), name="broken-fields")
    block = {"mechanism": "reweight", "scorer": {"name": "toy_token_prob"}, "actuator": {"name": "toy_scale"}}
    with caplog.at_level(logging.ERROR, logger="dataflex_bus"):
        runtime = Runtime(block, plugins=PluginSet([], pm))
    # the method acts at on_advantage and reads old_log_probs/response_mask; labels are not fields
    assert runtime.fields("on_advantage") == {"old_log_probs", "response_mask"}
    # an observer's request counts where the host has the field; unknown names are left out
    assert runtime.fields("on_rollout") == {"responses"}
    assert runtime.fields("on_step_end") == frozenset()
    assert "broken-fields" in caplog.text and "dataflex_fields" in caplog.text
