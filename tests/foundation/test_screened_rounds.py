"""Groups decided as they arrive (``Generation.screen``): which blocks may be (``Plan.screens_on_arrival``), which
groups a capped rule releases early (never one a later arrival could turn away), that the whole round then asks
for what the screening released whatever the arrival order, and that a method declaring a per-group rule while
reading the round is caught, named."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Param
from dataflex_bus.errors import DataflexError
from dataflex_bus.hookspecs import hookimpl
from dataflex_bus.host import ANY_HOST
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import StepKit

HOST = ANY_HOST.replace(name="lab", group_size=2)


class Mixed(Allocator):
    """At on_rollout: ``extra`` more rollouts for each group whose rewards differ (its own rows only)."""

    accepts: ClassVar = ("response", "prompt")
    min_timing: ClassVar = "post_reward"
    rounds: ClassVar = 2
    per_group_rule: ClassVar = True
    params: ClassVar = {**ALLOCATION_PARAMS, "extra": Param(int, 2)}

    def allocate(self, batch, score, step, budget):
        from dataflex_bus.ops import segment_max, segment_min

        r, gi, g = batch.rewards, batch.group_index, batch.num_groups
        mixed = (segment_max(r, gi, g) != segment_min(r, gi, g))[gi.clamp_min(0)] & batch.valid_rows
        return Allocation(torch.where(mixed & (budget.round == 0), self.extra, 0), keep=mixed,
                          metrics={"mixed/groups": float(g)})


    def continuation_cap(self):
        return "none"


class Capped(Mixed):
    """SPEED's cap: at most the groups still needed go on, the first mixed ones in dispatch order."""

    def allocate(self, batch, score, step, budget):
        out = Mixed.allocate(self, batch, score, step, budget)
        gi = batch.group_index.clamp_min(0)
        go = torch.zeros(batch.num_groups, dtype=torch.bool)
        go[gi[out.keep]] = True
        go &= torch.cumsum(go.long(), 0) <= budget.prompts
        keep = out.keep & go[gi]
        return Allocation(torch.where(keep, out.counts, 0), keep=keep)

    def continuation_cap(self):
        return "dispatch"


class AnyOrder(Capped):
    def continuation_cap(self):
        return "any"


class WholeRound(Mixed):
    """Declares a per-group rule but gives more rollouts the more groups the batch holds: reads the round."""

    def allocate(self, batch, score, step, budget):
        out = Mixed.allocate(self, batch, score, step, budget)
        return Allocation(torch.where(out.counts > 0, batch.num_groups, 0), keep=out.keep)


class Undeclared(Mixed):
    per_group_rule: ClassVar = False


@pytest.fixture
def comps(register):
    register("allocator", "t_mixed", Mixed)
    register("allocator", "t_whole_round", WholeRound)
    register("allocator", "t_undeclared", Undeclared)
    register("allocator", "t_capped", Capped)
    register("allocator", "t_any_order", AnyOrder)


def block(actuator: str) -> dict:
    return {"mechanism": "allocate", "scorer": {"name": "group_solve_rate"}, "actuator": {"name": actuator}}


def groups(labels: list[str], rewards: dict[str, list[float]]) -> Batch:
    """The rows of the groups ``labels`` (in that order), each with its rewards."""
    uid = [u for u in labels for _ in rewards[u]]
    r = torch.tensor([x for u in labels for x in rewards[u]], dtype=torch.float32)
    return Batch.from_tensors(uid=uid, rm_scores=r[:, None], response_mask=torch.ones(len(uid), 1, dtype=torch.long))


REWARDS = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 1.0], "d": [0.0, 0.0]}


def test_the_plan_screens_on_arrival_only_where_every_rule_at_on_rollout_is_per_group(comps):
    assert Runtime(block("t_mixed"), host=HOST).plan.screens_on_arrival
    assert not Runtime(block("t_undeclared"), host=HOST).plan.screens_on_arrival
    with_selection = {"methods": [{"name": "more", **block("t_mixed")},
                                  {"name": "band", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
                                   "actuator": {"name": "dapo"}}]}
    plan = Runtime(with_selection, host=HOST).plan
    assert not plan.screens_on_arrival and plan.reads_whole_round == ("dataflex.methods[1].actuator.name",)
    from dataflex_plugins.methods.allocate import Knapsack, Speed
    from dataflex_plugins.methods.pilot_commit import PilotCommit
    from dataflex_plugins.methods.reinforce_ada import ReinforceAda

    assert Speed.per_group_rule and PilotCommit.per_group_rule and ReinforceAda.per_group_rule
    assert not Knapsack.per_group_rule  # one budget over every prompt: its rule reads them all


def run_round(actuator: str, target: int, arrivals: list[list[str]] | None):
    """One round of a, b, c, d (in dispatch order) for ``target`` groups, screened in ``arrivals`` (``None``:
    not screened): the continuations released on arrival, the whole round's continuation and the metrics."""
    step = StepKit(Runtime(block(actuator), host=HOST)).begin(0)
    gen = step.generation(target)
    gen.request()
    released: dict[str, int] = {}
    if arrivals is not None:
        assert gen.begin_screening(list("abcd"))
        for wave in arrivals:
            order = [u for u in "abcd" if u in wave]  # a read's arrivals, in dispatch order
            got = gen.screen(groups(order, REWARDS))
            assert not set(got) & set(released)  # each released once
            released.update(got)
    gen.add(groups(list("abcd"), REWARDS))
    more = gen.continuation()
    whole = None if more is None else (more.rows.tolist(), more.counts.tolist())
    return released, whole, dict(step.metrics)


@pytest.mark.parametrize("arrivals", [[["c", "a"], ["d"], ["b"]], [["d", "b", "c", "a"]], [["a"], ["b"], ["c"], ["d"]]])
def test_the_whole_round_asks_for_what_its_groups_were_screened_to_in_any_arrival_order(comps, arrivals):
    released, whole, metrics = run_round("t_mixed", 4, arrivals)
    assert released == {"a": 2, "c": 2}  # no cap: every mixed group as it arrives
    _, plain, plain_metrics = run_round("t_mixed", 4, None)
    assert whole == plain == ([0, 4], [2, 2])
    assert metrics == plain_metrics and metrics["dataflex/mixed/groups"] == 4.0  # the whole round's, not a wave's


REWARDS_CAPPED = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 0.0], "d": [0.0, 0.0]}


@pytest.mark.parametrize(("actuator", "arrivals", "released"), [
    # c passes first but a and b, before it, may still pass: held; a is sure at once, b once it is back
    ("t_capped", [["c"], ["a"], ["d"], ["b"]], [{}, {"a": 2}, {}, {"b": 2}]),
    ("t_capped", [["a", "b"], ["c", "d"]], [{"a": 2, "b": 2}, {}]),
    # another order: nothing is sure while the round may hold more passing groups than the 2 needed
    ("t_any_order", [["a"], ["d"], ["b"], ["c"]], [{}, {}, {}, {}]),
])
def test_a_capped_rule_releases_a_group_only_once_no_later_arrival_can_turn_it_away(comps, monkeypatch, actuator,
                                                                                   arrivals, released):
    monkeypatch.setitem(REWARDS, "b", REWARDS_CAPPED["b"])
    step = StepKit(Runtime(block(actuator), host=HOST)).begin(0)
    gen = step.generation(2)  # the round of 4 is larger than the 2 groups still needed: the cap binds
    gen.request()
    assert gen.begin_screening(list("abcd"))
    got = [gen.screen(groups([u for u in "abcd" if u in wave], REWARDS)) for wave in arrivals]
    assert got == released
    gen.add(groups(list("abcd"), REWARDS))
    more = gen.continuation()
    assert (more.rows.tolist(), more.counts.tolist()) == ([0, 2], [2, 2])  # a and b: the first 2 mixed groups


def test_a_round_is_screened_only_where_every_rule_is_per_group(comps):
    assert not StepKit(Runtime(block("t_undeclared"), host=HOST)).begin(0).generation(4).begin_screening(list("ab"))
    gen = StepKit(Runtime(block("t_capped"), host=HOST)).begin(0).generation(4)
    assert gen.cap_order == "dispatch" and not gen.begin_screening([])
    with pytest.raises(ValueError, match="not of this round"):
        gen.begin_screening(["a"])
        gen.screen(groups(["b"], REWARDS))


def test_a_declared_per_group_rule_that_reads_the_round_is_named(comps):
    step = StepKit(Runtime(block("t_whole_round"), host=HOST)).begin(0)
    gen = step.generation(4)
    gen.request()
    gen.begin_screening(list("abcd"))
    gen.screen(groups(["a"], REWARDS))  # 1 group in the batch: 1 more rollout
    gen.add(groups(list("abcd"), REWARDS))  # 4 groups: 4 more
    with pytest.raises(DataflexError, match=r"\['allocate:t_whole_round'\] declare a per-group rule .* group 'a' got "
                                            r"1 more rollouts decided on its own rows and 4 on the whole round"):
        gen.continuation()


class RolloutListener:
    """An observer (a logger plugin, say): the on_rollout batches it hears, by their group labels."""

    def __init__(self) -> None:
        self.heard: list[list[str]] = []

    @hookimpl
    def on_rollout(self, batch):
        self.heard.append(batch.num_groups)


def test_observers_hear_the_whole_round_once_not_its_screened_groups(comps):
    runtime = Runtime(block("t_mixed"), host=HOST)
    listener = RolloutListener()
    runtime.bus.add_observer(listener, "listener")
    gen = StepKit(runtime).begin(0).generation(4)
    gen.request()
    assert gen.begin_screening(list("abcd"))
    assert gen.screen(groups(["c", "a"], REWARDS)) == {"a": 2, "c": 2}  # the participants decided
    gen.screen(groups(["b", "d"], REWARDS))
    assert listener.heard == []
    gen.add(groups(list("abcd"), REWARDS))
    assert listener.heard == [4]
