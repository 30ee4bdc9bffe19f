"""Faults at the bus: participants that exit or are interrupted, observers that raise, write the decision or
the batch, components that write the batch in place, and the policies for non-finite scores and mixers."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dataflex_bus import EventBus, Reweighter, Reweighting, Runtime, Score, Scorer, hookimpl
from dataflex_bus.bus import PluginInterrupt
from dataflex_bus.components import Mixer
from dataflex_bus.errors import PluginRuntimeError
from dataflex_bus.pipeline import build_pipeline

from .toys import toy_batch


def select_block(actuator="toy_band", scorer="toy_reward", **params):
    return {"mechanism": "select", "scorer": {"name": scorer}, "actuator": {"name": actuator, "params": params}}




# ---------------------------------------------------------------------------- participants
class Exits:
    def __init__(self, exc):
        self.exc = exc

    @hookimpl
    def on_advantage(self, batch):
        raise self.exc


@pytest.mark.parametrize("code", [0, None, "bye"])
def test_participant_sys_exit_is_a_named_failure(code):
    bus = EventBus()
    bus.add_participant(Exits(SystemExit(code)), "quitter")
    with pytest.raises(PluginRuntimeError) as info:
        bus.emit("on_advantage", toy_batch(), 0)
    assert info.value.plugin == "quitter" and info.value.hook == "on_advantage"
    assert "SystemExit" in str(info.value)


def test_participant_keyboard_interrupt_stays_an_interrupt_naming_the_plugin():
    bus = EventBus()
    bus.add_participant(Exits(KeyboardInterrupt()), "sleepy")
    with pytest.raises(KeyboardInterrupt) as info:
        bus.emit("on_advantage", toy_batch(), 0)
    assert isinstance(info.value, PluginInterrupt)
    assert (info.value.plugin, info.value.hook) == ("sleepy", "on_advantage")


class ExitingScorer(Scorer):
    """Calls sys.exit(0) from step 1 on (step 0 is also where validation probes a selection)."""

    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        if step_id >= 1:
            sys.exit(0)
        return Score(batch.rewards, "response")


class InterruptedScorer(ExitingScorer):
    def score(self, batch, step_id, **ctx):
        if step_id >= 1:
            raise KeyboardInterrupt
        return Score(batch.rewards, "response")


def test_component_sys_exit_and_interrupt_name_the_component(toys, register):
    register("scorer", "t_exits", ExitingScorer)
    register("scorer", "t_interrupted", InterruptedScorer)
    with pytest.raises(PluginRuntimeError) as info:
        Runtime(select_block(scorer="t_exits")).emit("on_advantage", toy_batch(), 1)
    assert info.value.plugin == "local:t_exits" and isinstance(info.value.cause, SystemExit)
    with pytest.raises(PluginInterrupt) as interrupted:
        Runtime(select_block(scorer="t_interrupted")).emit("on_advantage", toy_batch(), 1)
    assert interrupted.value.plugin == "local:t_interrupted"


class ExitsAlways(Scorer):
    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        sys.exit(0)


def test_sys_exit_in_the_validation_probe_does_not_end_validation(toys, register):
    """Validation runs a selection on a probe batch (an advisory check); a plugin exiting there must not
    end `dataflex validate` or `run` with status 0: the probe gives up, training then names the plugin."""
    from dataflex_bus.validation import validate

    register("scorer", "t_exits_always", ExitsAlways)
    cfg = validate(select_block(scorer="t_exits_always", low=0.5, high=1.0))
    assert cfg.warnings == []
    with pytest.raises(PluginRuntimeError, match="t_exits_always"):
        Runtime(cfg).emit("on_advantage", toy_batch(), 0)


def test_hook_with_an_unknown_argument_is_refused_at_registration():
    from pluggy import PluginValidationError

    class Odd:
        @hookimpl
        def on_rollout(self, batch, when):
            pass

    with pytest.raises(PluginValidationError, match=r"participant:odd(.|\n)*\{'when'\}"):
        EventBus().add_participant(Odd(), "odd")


# ---------------------------------------------------------------------------- observers
class Raises:
    def __init__(self, exc=None):
        self.exc = exc or ValueError("observer bug")
        self.calls = 0

    @hookimpl
    def on_advantage(self, step):
        self.calls += 1
        raise self.exc


def test_observer_failures_are_rate_limited_and_counted(dataflex_log):
    runtime = Runtime(None)
    noisy = Raises()
    runtime.bus.add_observer(noisy, "noisy")
    for step in range(9):
        runtime.emit("on_advantage", toy_batch(), step)
    assert noisy.calls == 9
    records = [r for r in dataflex_log.records if "noisy" in r.getMessage()]
    # the 1st with its traceback, then the 2nd, 4th and 8th as one line each: 4 of 9
    assert len(records) == 4
    assert records[0].exc_info is not None and all(r.exc_info is None for r in records[1:])
    assert [r.getMessage().split("(")[-1].split(" ")[0] for r in records[1:]] == ["2", "4", "8"]
    assert runtime.observer_failures == [{"observer": "noisy", "hook": "on_advantage", "count": 9, "first_step": 0,
                                          "last_step": 8, "last_error": "ValueError: observer bug"}]


def test_observer_sys_exit_is_isolated_like_any_failure(dataflex_log):
    runtime = Runtime(None)
    runtime.bus.add_observer(Raises(SystemExit(0)), "quitter")
    runtime.emit("on_advantage", toy_batch(), 0)  # the run goes on
    assert runtime.observer_failures[0]["last_error"] == "SystemExit: 0"


def test_observer_keyboard_interrupt_is_an_interrupt():
    runtime = Runtime(None)
    runtime.bus.add_observer(Raises(KeyboardInterrupt()), "sleepy")
    with pytest.raises(PluginInterrupt, match="sleepy"):
        runtime.emit("on_advantage", toy_batch(), 0)


class Meddler:
    """Tries every way of changing the decision it watches."""

    def __init__(self, how):
        self.how = how
        self.metrics_seen = None

    @hookimpl
    def on_advantage(self, decision):
        self.metrics_seen = json.dumps(decision.metrics)  # a metric sink serialises what it sees
        if self.how == "attribute":
            decision.skip_update = True
        elif self.how == "method":
            decision.drop(torch.ones(8, dtype=torch.bool))
        elif self.how == "metrics":
            decision.metrics["dataflex/forged"] = 1.0
        elif self.how == "keep_in_place":
            decision.keep[:] = True


@pytest.mark.parametrize("how", ["attribute", "method", "metrics"])
def test_observer_cannot_change_the_decision(toys, how, dataflex_log):
    runtime = Runtime(select_block(low=0.5, high=1.0))
    meddler = Meddler(how)
    runtime.bus.add_observer(meddler, "meddler")
    decision = runtime.emit("on_advantage", toy_batch(), 0)
    assert decision.keep.tolist() == [True, False, True, True, False, False, True, False]
    assert not decision.skip_update and "dataflex/forged" not in decision.metrics
    assert "read-only" in runtime.observer_failures[0]["last_error"]
    assert "dataflex/kept_fraction" in json.loads(meddler.metrics_seen)


def test_observer_writing_decision_tensors_in_place_stops_the_run(toys):
    runtime = Runtime(select_block(low=0.5, high=1.0), check_writes=True)
    runtime.bus.add_observer(Meddler("keep_in_place"), "meddler")
    with pytest.raises(PluginRuntimeError, match=r"'meddler'.*Decision\.keep.*written in place"):
        runtime.emit("on_advantage", toy_batch(), 0)


class BatchScribbler:
    def __init__(self, how):
        self.how = how

    @hookimpl
    def on_advantage(self, batch):
        if self.how == "in_place":
            batch["advantages"].add_(1.0)
        elif self.how == "replace":
            batch.fields["advantages"] = torch.ones(len(batch), 4)
        elif self.how == "add":
            batch.fields["extra"] = torch.ones(len(batch))
        elif self.how == "label":
            batch.is_padding[0] = True
        elif self.how == "derived":
            batch.rewards.mul_(0)


@pytest.mark.parametrize(("how", "what"), [("in_place", "'advantages': written in place"),
                                           ("replace", "'advantages': replaced"),
                                           ("add", "'extra': added"),
                                           ("label", "'Batch.is_padding': written in place"),
                                           ("derived", "'Batch.rewards': written in place")])
@pytest.mark.parametrize("role", ["participant", "observer"])
def test_hooks_writing_the_batch_stop_the_run_named(how, what, role):
    bus = EventBus(check_writes=True)
    getattr(bus, f"add_{role}")(BatchScribbler(how), "scribbler")
    batch = toy_batch()
    batch.rewards  # noqa: B018 - computed before the event, as the host's reward metrics do
    with pytest.raises(PluginRuntimeError) as info:
        bus.emit("on_advantage", batch, 0)
    assert info.value.plugin == "scribbler" and what in str(info.value)


def test_the_bus_wide_check_is_opt_in(monkeypatch):
    """Off by default (a bus hook may be cheaper than the check); on in debug mode (DATAFLEX_DEBUG=1)."""
    monkeypatch.delenv("DATAFLEX_DEBUG", raising=False)
    bus = EventBus()
    bus.add_observer(BatchScribbler("in_place"), "scribbler")
    bus.emit("on_advantage", toy_batch(), 0)  # not checked: the contract is documented, not enforced here
    monkeypatch.setenv("DATAFLEX_DEBUG", "1")
    bus = EventBus()
    bus.add_observer(BatchScribbler("in_place"), "scribbler")
    with pytest.raises(PluginRuntimeError, match="'advantages': written in place"):
        bus.emit("on_advantage", toy_batch(), 0)


def test_observers_run_in_pluggy_order_after_participants():
    order = []

    def named(tag, **opts):
        class Hook:
            @hookimpl(**opts)
            def on_rollout(self, decision):
                order.append((tag, decision.keep is not None))

        return Hook()

    class Keeps:
        @hookimpl
        def on_rollout(self, batch, decision):
            order.append(("participant", False))
            decision.restrict(torch.ones(len(batch), dtype=torch.bool))

    bus = EventBus()
    bus.add_observer(named("first-registered"), "a")
    bus.add_observer(named("last-registered"), "b")
    bus.add_observer(named("tryfirst", tryfirst=True), "c")
    bus.add_participant(Keeps(), "p")
    bus.emit("on_rollout", toy_batch(), 0)
    assert order == [("participant", False), ("tryfirst", True), ("last-registered", True),
                     ("first-registered", True)]


def test_a_hook_wrapper_on_an_event_is_refused():
    from pluggy import PluginValidationError

    class Wraps:
        @hookimpl(hookwrapper=True)
        def on_rollout(self):
            yield

    with pytest.raises(PluginValidationError, match="hook wrapper"):
        EventBus().add_observer(Wraps(), "wraps")


class InPlaceScorer(Scorer):
    """Zeroes the rewards it scores: what a careless scorer would do to 'normalise' them."""

    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        batch["rm_scores"].sub_(batch["rm_scores"].mean())
        return Score(batch.rewards, "response")


def test_component_writing_the_batch_is_named_not_obeyed(toys, register):
    register("scorer", "t_in_place", InPlaceScorer)
    batch = toy_batch()
    before = batch["rm_scores"].clone()
    with pytest.raises(PluginRuntimeError) as info:
        Runtime(select_block(scorer="t_in_place")).emit("on_advantage", batch, 0)
    assert info.value.plugin == "local:t_in_place" and "'rm_scores': written in place" in str(info.value)
    assert not torch.equal(batch["rm_scores"], before)  # it did write: the run must stop, not train on it


class DataWriter(Scorer):
    """Writes a field it declared it reads behind torch's version counter (``.data`` or a NumPy view)."""

    requires = ("rm_scores", "response_mask")
    how = "data"

    def score(self, batch, step_id, **ctx):
        rewards = batch.rewards.clone()
        if self.how == "data":
            batch["rm_scores"].data.zero_()
        else:
            batch["rm_scores"].numpy()[:] = 0.0
        return Score(rewards, "response")


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_write_behind_the_version_counter_is_named_always(toys, register, monkeypatch, how):
    """A stacked method's writer zeroed the caller's rm_scores through .data, and the next method (DAPO)
    then skipped the update, silently: the fields a component declares it reads are fingerprinted."""
    monkeypatch.delenv("DATAFLEX_DEBUG", raising=False)
    register("scorer", f"t_writes_{how}", type(f"Writes_{how}", (DataWriter,), {"how": how}))
    block = {"methods": [
        {"name": "writer", "mechanism": "select", "scorer": {"name": f"t_writes_{how}"},
         "actuator": {"name": "toy_band", "params": {"low": 0.0, "high": 1.0}}},
        {"name": "dapo", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
         "actuator": {"name": "dapo"}}]}
    runtime = Runtime(block)
    batch = toy_batch()
    before = batch["rm_scores"].clone()
    with pytest.raises(PluginRuntimeError) as info:
        runtime.emit("on_advantage", batch, 0)
    assert info.value.plugin == f"local:t_writes_{how}"
    assert "'rm_scores': written in place behind torch's version counter" in str(info.value)
    assert not torch.equal(batch["rm_scores"], before)  # it did write: the run must stop, not train on it


def test_undeclared_fields_are_fingerprinted_in_debug_mode(toys, register, monkeypatch):
    class Sneaky(Scorer):
        requires = ("rm_scores", "response_mask")

        def score(self, batch, step_id, **ctx):
            batch["advantages"].data.mul_(2.0)   # a field it never declared
            return Score(batch.rewards, "response")

    register("scorer", "t_sneaky", Sneaky)
    block = select_block(scorer="t_sneaky", low=0.0, high=1.0)
    monkeypatch.delenv("DATAFLEX_DEBUG", raising=False)
    batch = toy_batch()
    batch.fields["advantages"] = torch.ones_like(batch["advantages"])
    Runtime(block).emit("on_advantage", batch, 0)    # not declared: not checked (the documented cost bound)
    monkeypatch.setenv("DATAFLEX_DEBUG", "1")
    with pytest.raises(PluginRuntimeError, match="'advantages': written in place behind"):
        Runtime(block).emit("on_advantage", batch, 0)


def test_reading_components_pass_the_write_check(toys):
    """The check costs nothing to honest plugins: a selection, a reweight and a mix run as before."""
    batch = toy_batch(domains=list("aabbaabb"))
    snapshot = {k: v.clone() for k, v in batch.fields.items()}
    for block in (select_block(low=0.5, high=1.0),
                  {"mechanism": "reweight", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_scale"}},
                  {"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_mixer"}}):
        runtime = Runtime(block)
        for event in ("on_rollout", "on_advantage", "on_step_end"):
            runtime.emit(event, batch, 0)
    assert all(torch.equal(batch[k], v) for k, v in snapshot.items())


# ---------------------------------------------------------------------------- policies fixed in the core
class NaNOnRowOne(Scorer):
    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        values = batch.rewards.clone()
        values[1] = float("nan") if bool(batch.valid_rows[1]) else 0.0
        return Score(values, "response")


class AllNaN(Scorer):
    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        return Score(torch.where(batch.valid_rows, float("nan"), 0.0), "response")


class Halve(Reweighter):
    def reweight(self, batch, score, step_id):
        return Reweighting(torch.full((len(batch),), 0.5))


def test_reweight_nonfinite_drop_removes_the_row_from_the_update(toys, register):
    """Regression: the dropped row was trained at the neutral weight; now it leaves the update."""
    from dataflex_bus.carry import carry_out_advantage

    register("scorer", "t_nan_row1", NaNOnRowOne)
    register("reweighter", "t_halve", Halve)
    pipe = build_pipeline({"mechanism": "reweight", "scorer": {"name": "t_nan_row1"},
                           "actuator": {"name": "t_halve"}, "on_nonfinite": "drop"})
    batch = toy_batch()
    decision = pipe.apply(batch, 0)
    assert decision.keep.tolist() == [True, False] + [True] * 6
    action = carry_out_advantage(batch.with_fields(advantages=torch.ones(8, 4)), decision)
    assert action.fields["loss_mask"][1].sum() == 0 and action.fields["advantages"][1].abs().sum() == 0
    assert action.fields["loss_mask"][0].sum() == 4 and action.keep.tolist()[1] is False


@pytest.mark.parametrize("mechanism", ["select", "reweight"])
@pytest.mark.parametrize("policy", ["skip", "keep_all", "error"])
def test_every_row_nonfinite_with_drop_follows_on_empty(toys, register, mechanism, policy):
    """Regression: with every row dropped, on_empty was ignored; now it applies (keep_all keeps no
    non-finite row: the update is skipped)."""
    register("scorer", "t_all_nan", AllNaN)
    register("reweighter", "t_halve", Halve)
    actuator = {"name": "toy_band"} if mechanism == "select" else {"name": "t_halve"}
    pipe = build_pipeline({"mechanism": mechanism, "scorer": {"name": "t_all_nan"}, "actuator": actuator,
                           "on_nonfinite": "drop", "on_empty": policy})
    if policy == "error":
        with pytest.raises(Exception, match="kept no row"):
            pipe.apply(toy_batch(), 0)
        return
    decision = pipe.apply(toy_batch(), 0)
    assert decision.skip_update and not bool(decision.keep.any())
    assert decision.metrics["dataflex/empty_selection"] == 1.0


class NaNMixer(Mixer):
    def update(self, batch, score, step_id):
        return {}

    def probabilities(self):
        return torch.full((len(self.domains),), float("nan"))


def test_mixer_publishing_nan_is_refused_naming_the_mixer(toys, register):
    """Regression: NaN probabilities reached the sampler; now they are refused where they are published."""
    register("mixer", "t_nan_mixer", NaNMixer)
    runtime = Runtime({"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "t_nan_mixer"}})
    runtime.set_domains(["a", "b"])
    with pytest.raises(PluginRuntimeError) as info:
        runtime.emit("on_step_end", toy_batch(domains=list("aabbaabb")), 0)
    assert info.value.plugin == "local:t_nan_mixer" and "probabilities" in str(info.value)
    assert runtime.domain_probs == {"a": 0.5, "b": 0.5}  # nothing NaN was published


# ---------------------------------------------------------------------------- domains absent from the data
MIX = {"mechanism": "mix", "scorer": {"name": "toy_reward"}, "actuator": {"name": "toy_mixer"}}


def test_configured_domain_absent_from_the_first_batch_is_warned_once(toys, dataflex_log):
    pipe = build_pipeline({**MIX, "domains": ["a", "b", "poetry"]})
    for step in range(3):
        pipe.apply(toy_batch(domains=list("aabbaabb")), step)
    warnings = [r for r in dataflex_log.records if "do not occur in the first batch" in r.getMessage()]
    assert len(warnings) == 1 and "poetry" in warnings[0].getMessage()


def test_no_warning_when_every_domain_is_seen_or_the_host_stated_them(toys, dataflex_log):
    build_pipeline({**MIX, "domains": ["a", "b"]}).apply(toy_batch(domains=list("aabbaabb")), 0)
    runtime = Runtime({**MIX, "domains": ["a", "b", "c"]})
    runtime.set_domains(["a", "b", "c"])  # the host's sampler has all three
    runtime.emit("on_step_end", toy_batch(domains=list("aabbaabb")), 0)
    assert "do not occur" not in dataflex_log.text


def test_host_domains_missing_a_configured_one_are_refused(toys):
    from dataflex_bus.errors import ConfigError

    runtime = Runtime({**MIX, "domains": ["a", "b", "poetry"]})
    with pytest.raises(ConfigError, match=r"dataflex\.domains.*\['poetry'\] are not in the dataset"):
        runtime.set_domains(["a", "b"])


# ---------------------------------------------------------------------------- scores that require grad
class GradScore(Scorer):
    """A score computed with autograd on (say, through a model): it carries a graph."""

    requires = ("rm_scores", "response_mask")
    timing = "post_advantage"

    def score(self, batch, step_id, **ctx):
        return torch.ones(len(batch), requires_grad=True) * (1.0 + batch.rewards)


class GradWeights(Reweighter):
    def reweight(self, batch, score, step_id):
        return Reweighting(torch.ones(len(batch), requires_grad=True) * 2.0)


@pytest.mark.parametrize(("mechanism", "scorer", "actuator", "named"), [
    ("reweight", GradScore, "softmax", "t_grad_a"),
    ("select", GradScore, "topk_fraction", "t_grad_b"),
    ("reweight", None, "t_grad_weights", "t_grad_weights"),
])
def test_a_score_or_weights_requiring_grad_are_detached_and_named(toys, register, dataflex_log, mechanism, scorer,
                                                                   actuator, named):
    """Without the detach the weights carry a graph and the policy update fails in autograd (backward
    through the graph a second time), naming no plugin."""
    if scorer is not None:
        register("scorer", named, scorer)
    register("reweighter", "t_grad_weights", GradWeights)
    block = {"mechanism": mechanism, "scorer": {"name": named if scorer else "toy_reward"},
             "actuator": {"name": actuator}}
    runtime = Runtime(block)
    for _ in range(2):
        decision = runtime.emit("on_advantage", toy_batch(), 0)
        for tensor in (decision.weights, decision.keep, decision.advantages):
            assert tensor is None or (not tensor.requires_grad and tensor.grad_fn is None)
    warned = [r.getMessage() for r in dataflex_log.records if "requires grad" in r.getMessage()]
    assert len(warned) == 1 and f"'{named}'" in warned[0]
