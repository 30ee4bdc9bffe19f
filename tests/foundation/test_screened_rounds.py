"""Groups decided as they arrive (``Generation.screen``): which blocks may be (``Plan.screens_on_arrival``), which
rounds (``Generation.pipelines``), that the whole round then asks for what the screening did whatever the arrival
order, and that a method declaring a per-group rule while reading the round is caught, named."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Param
from dataflex_bus.errors import DataflexError
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


def test_a_round_larger_than_the_groups_still_needed_is_not_pipelined(comps):
    gen = StepKit(Runtime(block("t_mixed"), host=HOST)).begin(0).generation(4)
    assert gen.pipelines(4) and gen.pipelines(1)
    assert not gen.pipelines(5) and not gen.pipelines(0)


@pytest.mark.parametrize("arrivals", [[["c", "a"], ["d"], ["b"]], [["d", "b", "c", "a"]], [["a"], ["b"], ["c"], ["d"]]])
def test_the_whole_round_asks_for_what_its_groups_were_screened_to_in_any_arrival_order(comps, arrivals):
    def run(screen: bool):
        step = StepKit(Runtime(block("t_mixed"), host=HOST)).begin(0)
        gen = step.generation(4)
        assert gen.request() == 4
        screened = {}
        if screen:
            for wave in arrivals:
                order = [u for u in "abcd" if u in wave]  # a read's arrivals, in dispatch order
                screened.update(zip(order, gen.screen(groups(order, REWARDS)).tolist()))
        gen.add(groups(list("abcd"), REWARDS))
        more = gen.continuation()
        return screened, (more.rows.tolist(), more.counts.tolist()), dict(step.metrics)

    screened, whole, metrics = run(True)
    assert screened == {"a": 2, "b": 0, "c": 2, "d": 0}
    plain = run(False)
    assert whole == plain[1] == ([0, 4], [2, 2])
    assert metrics == plain[2] and metrics["dataflex/mixed/groups"] == 4.0  # the whole round's, not a wave's


def test_a_declared_per_group_rule_that_reads_the_round_is_named(comps):
    step = StepKit(Runtime(block("t_whole_round"), host=HOST)).begin(0)
    gen = step.generation(4)
    gen.request()
    gen.screen(groups(["a"], REWARDS))  # 1 group in the batch: 1 more rollout
    gen.add(groups(list("abcd"), REWARDS))  # 4 groups: 4 more
    with pytest.raises(DataflexError, match=r"\['allocate:t_whole_round'\] declare a per-group rule .* group 'a' got "
                                            r"1 more rollouts decided on its own rows and 4 on the whole round"):
        gen.continuation()
