"""The host kit: host descriptions checked by validation, mechanisms as registered objects, the step drivers
and their one metric namespace (the contract between hosts is tests/hosts)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus import Score, Scorer
from dataflex_bus.block import RefillConfig
from dataflex_bus.components import Actuator
from dataflex_bus.decision import Decision
from dataflex_bus.errors import ConfigError, ConfigIssue
from dataflex_bus.host import ANY_HOST, CAPABILITIES, EVENT_FIELDS, HostDescription
from dataflex_bus.mechanisms import (
    Mechanism,
    component_kinds,
    mechanism,
    mechanism_names,
    register_mechanism,
    unregister_mechanism,
)
from dataflex_bus.pipeline import build_pipeline
from dataflex_bus.runtime import Runtime
from dataflex_bus.step_metrics import RolloutStats, row_metrics
from dataflex_bus.steps import StepKit, concat_rounds
from dataflex_bus.testing import make_batch
from dataflex_bus.validation import validate

BAND = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
        "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}}


def issues(block, host) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate(block, host=host)
    return {i.key: str(i) for i in err.value.issues}


# ---------------------------------------------------------------------------- host descriptions
def test_a_description_names_known_capabilities_and_every_event():
    with pytest.raises(ValueError, match="unknown capabilities"):
        HostDescription("h", capabilities=frozenset({"teleport"}))
    with pytest.raises(ValueError, match="every event"):
        HostDescription("h", fields={"on_rollout": frozenset()})
    assert ANY_HOST.capabilities == frozenset(CAPABILITIES) and ANY_HOST.fields == EVENT_FIELDS


def test_a_field_the_host_lacks_is_refused_naming_the_host_and_why(register):
    class NeedsEntropy(Scorer):
        requires = ("entropy", "response_mask")
        timing = "post_advantage"

        def score(self, batch, step, **ctx):
            return Score(batch.rewards, "response")

    register("scorer", "needs_entropy", NeedsEntropy)
    block = {"mechanism": "select", "scorer": {"name": "needs_entropy"}, "actuator": {"name": "topk_fraction"}}
    fields = dict(EVENT_FIELDS, on_advantage=EVENT_FIELDS["on_advantage"] - {"entropy"})
    host = ANY_HOST.replace(name="lab", fields=fields, missing={"entropy": "the lab computes none"})
    found = issues(block, host)["dataflex.scorer.name"]
    assert "requires ['entropy'], not available at on_advantage on host 'lab'" in found
    assert "the lab computes none" in found
    validate(block, host=ANY_HOST)  # a host that has it: fine


@pytest.mark.parametrize(("capability", "block", "key"), [
    ("prompt_selection", {"mechanism": "select", "scorer": {"name": "zero_variance_streak"},
                          "actuator": {"name": "greso"}}, "dataflex.scorer.name"),
    ("refill", {**BAND, "refill": {"policy": "fixed"}}, "dataflex.refill"),
    ("domain_sampling", {"mechanism": "mix", "scorer": {"name": "reward_difficulty"},
                         "actuator": {"name": "dump_ucb"}}, "dataflex.mechanism"),
    ("loss_weights", {"mechanism": "reweight", "scorer": {"name": "token_prob"},
                      "actuator": {"name": "advantage_reweight"}}, "dataflex.mechanism"),
    ("ragged_groups", {"mechanism": "allocate", "scorer": {"name": "knapsack_rate"},
                       "actuator": {"name": "knapsack"}}, "dataflex.mechanism"),
    ("replay", {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
                "actuator": {"name": "rollout_replay"}}, "dataflex.mechanism"),
    ("loss_weights", {"mechanism": "select", "scorer": {"name": "token_entropy"},
                      "actuator": {"name": "top_entropy"}}, "dataflex.actuator.name"),
    # the plan's needs, refused by the same loop
    ("prompt_ids", {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
                    "actuator": {"name": "rollout_replay"}}, "dataflex.mechanism"),
    ("prompt_ids", {"mechanism": "select", "scorer": {"name": "zero_variance_streak"},
                    "actuator": {"name": "greso"}}, "dataflex.scorer.name"),
    ("regenerates_kept_rows", BAND, "dataflex.mechanism"),
])
def test_a_capability_the_host_lacks_is_refused_naming_the_host(capability, block, key):
    host = ANY_HOST.replace(name="lab", capabilities=frozenset(CAPABILITIES) - {capability},
                            missing={capability: "not built yet"})
    found = issues(block, host)
    # one wording for every capability: what for, the host, the capability and the host's reason
    assert f", which host 'lab' cannot carry out: it lacks {capability} (not built yet)" in found[key], found
    validate(block, host=ANY_HOST)


def test_what_a_block_needs_of_its_host_comes_from_its_mechanisms_refill_and_plan():
    from dataflex_bus.validation import block_needs

    knapsack = {"mechanism": "allocate", "scorer": {"name": "knapsack_rate"}, "actuator": {"name": "knapsack"}}
    assert {(n.key, n.capability) for n in block_needs(validate(knapsack))} == {
        ("dataflex.mechanism", "ragged_groups"), ("dataflex.scorer.name", "prompt_selection"),
        # the plan's: it draws prompts by row (before generation; its scorer reads the history) and runs
        # generation again on the kept rows (an allocation)
        ("dataflex.mechanism", "prompt_ids"), ("dataflex.scorer.name", "prompt_ids"),
        ("dataflex.mechanism", "regenerates_kept_rows")}
    stack = {"methods": [{**BAND, "name": "band"}, {"name": "w", "mechanism": "reweight",
                                                    "scorer": {"name": "token_prob"},
                                                    "actuator": {"name": "advantage_reweight"}}],
             "refill": {"policy": "fixed"}}
    assert {(n.key, n.capability) for n in block_needs(validate(stack))} == {
        ("dataflex.refill", "refill"), ("dataflex.methods[1].mechanism", "loss_weights"),
        ("dataflex.refill", "prompt_ids"), ("dataflex.refill", "regenerates_kept_rows"),
        ("dataflex.methods[0].mechanism", "regenerates_kept_rows")}
    assert {(n.key, n.capability) for n in block_needs(validate(BAND))} == {
        ("dataflex.mechanism", "regenerates_kept_rows")}
    reweight = {"mechanism": "reweight", "scorer": {"name": "token_prob"}, "actuator": {"name": "advantage_reweight"}}
    assert {n.capability for n in block_needs(validate(reweight))} == {"loss_weights"}


def test_refill_policies_the_host_lacks_are_refused_with_the_ones_it_has():
    host = ANY_HOST.replace(name="lab", refill_policies=frozenset({"credit2"}),
                            exhaust_policies=frozenset({"raise"}))
    found = issues({**BAND, "refill": {"policy": "greso", "on_exhaust": "train_short"}}, host)
    assert "host 'lab'" in found["dataflex.refill.policy"] and "credit2" in found["dataflex.refill.policy"]
    assert "raise" in found["dataflex.refill.on_exhaust"]


def test_the_hosts_own_rules_run_with_validation_and_name_their_key():
    seen = []

    def check(cfg, key):
        seen.append(cfg.methods[0].resolved.event)
        return [ConfigIssue("framework.loss", "would ignore the method")]

    found = issues(BAND, ANY_HOST.replace(name="lab", check=check))
    assert seen == ["on_rollout"] and "would ignore the method" in found["framework.loss"]


def test_group_methods_on_a_host_without_groups_name_the_host():
    found = issues(BAND, ANY_HOST.replace(name="lab", group_size=1))
    assert "rollout n=1 (< 2) on host 'lab'" in found["dataflex.scorer.name"]
    found = issues(BAND, ANY_HOST.replace(name="lab", adv_estimator="gae"))
    assert "not group-based" in found["dataflex.scorer.name"]


def test_the_shim_computes_entropy_only_when_asked(register):
    from dataflex_bus.shim import run_training

    seen = {}

    class Entropy(Scorer):
        requires = ("entropy", "response_mask")
        timing = "post_advantage"

        def score(self, batch, step, **ctx):
            seen["entropy"] = batch["entropy"]
            seen["mask"] = batch.token_mask
            return Score(batch.rewards, "response")

    register("scorer", "kit_entropy", Entropy)
    block = {"mechanism": "select", "scorer": {"name": "kit_entropy"},
             "actuator": {"name": "topk_fraction", "params": {"fraction": 1.0}}}
    small = {"trainer": {"steps": 1, "prompts_per_step": 4, "group_size": 2, "eval_every": 0},
             "model": {"pretrain_steps": 0, "hidden": 8}}
    run_training({**small, "dataflex": block})
    entropy, mask = seen["entropy"], seen["mask"]
    # nats over the 11 output tokens: within [0, ln 11] on real tokens, and not all equal
    assert bool(((entropy[mask] >= 0) & (entropy[mask] <= torch.log(torch.tensor(11.0)) + 1e-5)).all())
    assert float(entropy[mask].std()) > 0
    from dataflex_bus.shim.config import prepare
    from dataflex_bus.shim.host import describe

    assert "entropy" in describe(prepare(small).resolved).fields["on_advantage"]
    assert "entropy" not in Runtime(None, host=describe(prepare(small).resolved)).fields("on_advantage")


# ---------------------------------------------------------------------------- mechanisms
def test_component_kinds_and_block_choices_come_from_the_mechanism_registry():
    assert mechanism_names() == ("select", "reweight", "mix", "replay", "allocate")
    assert component_kinds() == ("scorer", "selector", "reweighter", "mixer", "replayer", "allocator")
    with pytest.raises(KeyError, match="registered: select, reweight, mix, replay, allocate"):
        mechanism("shuffle")
    with pytest.raises(ValueError, match="already"):
        register_mechanism(mechanism("select"))


class Clipper(Actuator):
    """The actuator kind of a test mechanism: clips advantages into [-bound, bound] (a new Decision use)."""

    kind: ClassVar[str] = "clipper"
    mechanism: ClassVar[str] = "clip"
    min_timing: ClassVar[str] = "post_advantage"
    accepts: ClassVar = ("response",)

    def bound(self) -> float:
        return 0.5


class Clip(Mechanism):
    name = "clip"
    kind = "clipper"
    base = Clipper
    summary = "clip advantages"

    def event(self, scorer, actuator):
        return "on_advantage"

    def apply(self, run, batch, step, decision: Decision) -> None:
        bound = run.call("actuator", run.actuator.bound)
        decision.advantages = batch["advantages"].clamp(-bound, bound)


def test_adding_a_mechanism_is_one_class_and_its_registration(register):
    register_mechanism(Clip())
    try:
        assert "clipper" in component_kinds()
        register("clipper", "half", Clipper)  # a plugin registers components of the new kind by name
        block = {"mechanism": "clip", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "half"}}
        pipeline = build_pipeline(block)
        assert pipeline.event == "on_advantage"
        batch = make_batch(groups=3, group_size=4, seed=1)
        decision = pipeline.apply(batch, 0)
        assert float(decision.advantages.abs().max()) <= 0.5 < float(batch["advantages"].abs().max())
        with pytest.raises(ConfigError, match="did you mean 'clip'"):
            validate({**block, "mechanism": "clp"})
    finally:
        unregister_mechanism("clip")
    refused = r"'clip' is not allowed \(allowed: select, reweight, mix, replay, allocate\)"
    with pytest.raises(ConfigError, match=refused):
        validate({"mechanism": "clip", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "half"}})


# ---------------------------------------------------------------------------- the drivers and their metrics
def test_rollout_stats_over_rounds_equal_the_statistics_of_their_concatenation():
    rounds = [make_batch(groups=3, group_size=4, seed=s, domains=2) for s in (1, 2, 3)]
    stats = RolloutStats()
    for b in rounds:
        stats.add(b)
    whole = concat_rounds(rounds)
    expected = row_metrics("dataflex/rollout/", whole.valid_rows, whole.rewards, whole.lengths, whole.group_index)
    got = stats.metrics()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value), name
    assert got["dataflex/rollout/groups"] == 9 == whole.num_groups


# Round 1: 8 prompts, 2 zero-variance (dropped), 6 kept of the 7 needed; then fixed asks 8 again,
# credit2 twice the 2 dropped, greso floor(1.25 * 1 * 8 / 6) = 1, raised to its floor ceil(7 / 4) = 2.
@pytest.mark.parametrize(("policy", "rounds"), [("fixed", [8, 8]), ("credit2", [8, 4]), ("greso", [8, 2])])
def test_generation_runs_every_refill_policy_and_counts_every_rollout(policy, rounds):
    block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"},
             "refill": RefillConfig(gen_batch_size=8, policy=policy).to_dict()}
    kit = StepKit(Runtime(block))
    step = kit.begin(0)
    gen = step.generation(7)
    asked = []
    while (n := gen.request()) > 0:
        asked.append(n)
        rewards = [0.0] * 8 + [1.0, 0.0] * (2 * n - 4) if len(asked) == 1 else [1.0, 0.0] * (2 * n)
        gen.add(make_batch(groups=n, group_size=4, rewards=rewards, seed=len(asked)))
    outcome = gen.finish()
    assert asked == rounds
    kept = sum(int(k.sum()) if k is not None else 4 * n for k, n in zip(outcome.keeps, asked))
    assert kept == 28 and not outcome.skip_update  # 7 groups of 4 rows trained
    metrics = step.end(None)
    assert metrics["compute/generated_rollouts"] == 4 * sum(asked) and metrics["dataflex/refill/trained_groups"] == 7
    assert metrics["dataflex/removed_rows"] == 4 * sum(asked) - 28
    state = kit.state_dict()
    again = StepKit(Runtime(block))
    again.load_state_dict(state)
    assert again.counters.metrics() == kit.counters.metrics()


def test_a_step_that_trains_nothing_still_reports_its_trained_metrics():
    step = StepKit(Runtime(None)).begin(0)
    step.skipped()
    metrics = step.end(None)
    assert metrics["dataflex/trained/rows"] == 0 and metrics["dataflex/skipped_update"] == 1
    assert metrics["dataflex/skipped_updates"] == 1 and metrics["dataflex/kept_fraction"] == 0
