"""The host kit under an allocation (mechanism ``allocate``): counts carried out per candidate, the bus's
invariants on them (budget, min_n, max_n, no group of one), on_empty, continuation rounds appended to their
groups, the ``dataflex/alloc/*`` metrics, and the refusal of a host that cannot generate ragged groups."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Param, Score, Scorer
from dataflex_bus.errors import BatchFieldError, ConfigError, DataflexError, PluginRuntimeError
from dataflex_bus.history import PromptTable
from dataflex_bus.host import ANY_HOST, CAPABILITIES
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import Candidates, StepKit
from dataflex_bus.validation import validate

HOST = ANY_HOST.replace(name="lab", group_size=4)


class IndexScore(Scorer):
    requires = ("prompt_index",)
    timing = "pre_rollout"
    granularity = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch["prompt_index"].double(), "prompt")


class Fixed(Allocator):
    """Allocates the counts it is given (one per candidate, in order)."""

    params: ClassVar = {**ALLOCATION_PARAMS, "counts": Param(list, [], item=int)}
    seen: ClassVar[list] = []

    def allocate(self, batch, score, step, budget):
        Fixed.seen.append(budget)
        return Allocation(torch.tensor(self.counts[: len(batch)], dtype=torch.long), metrics={"fixed/n": 1.0})


class More(Allocator):
    """At on_rollout: ``extra`` more rollouts for groups whose rewards are mixed, dropping the others."""

    accepts: ClassVar = ("response", "prompt")
    min_timing: ClassVar = "post_reward"
    rounds: ClassVar = 2
    params: ClassVar = {**ALLOCATION_PARAMS, "extra": Param(int, 2), "again": Param(bool, False)}

    def allocate(self, batch, score, step, budget):
        from dataflex_bus.ops import segment_max, segment_min

        r, gi, g = batch.rewards, batch.group_index, batch.num_groups
        mixed = (segment_max(r, gi, g) != segment_min(r, gi, g))[gi.clamp_min(0)] & batch.valid_rows
        ask = budget.round == 0 or self.again
        return Allocation(torch.where(mixed & ask, self.extra, 0), keep=mixed)


@pytest.fixture
def comps(register):
    register("scorer", "t_index", IndexScore)
    register("allocator", "t_fixed", Fixed)
    register("allocator", "t_more", More)
    Fixed.seen.clear()


def block(counts, **params):
    return {"mechanism": "allocate", "scorer": {"name": "t_index"},
            "actuator": {"name": "t_fixed", "params": {"counts": counts, **params}}}


def runtime(dataflex, host=HOST):
    rt = Runtime(dataflex, host=host)
    rt.set_prompts(PromptTable.full(["d"], [10], column="row"))
    return rt


def draw(n):
    rows = torch.arange(n)
    return Candidates(rows, torch.zeros(n, dtype=torch.long), rows)


def rollouts(rows, counts, rewards, uid=None):
    """Rows of each prompt in a block, rewards cycling through ``rewards``."""
    n = counts.sum()
    uid = torch.repeat_interleave(rows if uid is None else uid, counts)
    r = torch.tensor([rewards[i % len(rewards)] for i in range(int(n))], dtype=torch.float32)
    return Batch.from_tensors(uid=uid, prompt_index=torch.repeat_interleave(rows, counts),
                              rm_scores=r[:, None], response_mask=torch.ones(int(n), 1, dtype=torch.long))


def test_counts_are_carried_out_per_candidate_with_the_budget(comps):
    kit = StepKit(runtime(block([4, 0, 6, 6])))
    step = kit.begin(0)
    chosen = step.prompts(4, draw)
    assert chosen.index.tolist() == [0, 2, 3] and chosen.counts.tolist() == [4, 6, 6]
    budget = Fixed.seen[0]
    assert (budget.rollouts, budget.prompts, budget.group_size) == (16, 4, 4)
    gen = step.generation(4)
    assert gen.request() == 4
    gen.add(rollouts(chosen.index, chosen.counts, [1.0, 0.0]))
    gen.finish()
    m = step.end(None)
    assert (m["dataflex/alloc/min"], m["dataflex/alloc/max"], m["dataflex/alloc/covered"]) == (4, 6, 3)
    assert m["dataflex/alloc/skipped"] == 1 and m["dataflex/prompts_skipped"] == 1 and m["dataflex/fixed/n"] == 1
    assert m["compute/generated_rollouts"] == 16 == m["dataflex/alloc/rollouts"]


@pytest.mark.parametrize(("counts", "params", "message"), [
    ([4, 4, 4, 5], {}, r"allocated 17 rollouts; the budget is exactly 16 \(allocate:t_fixed: actuator.params.budget"),
    ([4, 4, 4, 3], {"exact_budget": False}, None),
    ([4, 4, 4, 5], {"exact_budget": False}, "at most 16"),
    ([2, 2, 2, 10], {"max_n": 8}, r"counts \[10\] on rows \[3\] break max_n=8"),
    ([1, 5, 5, 5], {"min_n": 1, "singletons": True}, None),
    ([3, 3, 3, 7], {"min_n": 4}, r"counts \[3, 3, 3\] on rows \[0, 1, 2\] break min_n=4"),
    ([4, -4, 8, 8], {}, "negative counts on rows"),
])
def test_the_bus_checks_every_allocation(comps, counts, params, message):
    step = StepKit(runtime(block(counts, **params))).begin(0)
    if message is None:
        step.prompts(4, draw)
        return
    with pytest.raises(PluginRuntimeError, match=message) as err:
        step.prompts(4, draw)
    assert "allocator 't_fixed'" in str(err.value)


def test_a_group_of_one_must_be_asked_for(comps):
    with pytest.raises(ConfigError, match="groups of one rollout"):
        validate(block([1, 5, 5, 5], min_n=1))


@pytest.mark.parametrize("policy", ["skip", "keep_all", "error"])
def test_an_allocation_of_nothing_follows_on_empty(comps, policy):
    step = StepKit(runtime({**block([0, 0, 0, 0]), "on_empty": policy})).begin(0)
    if policy == "error":
        with pytest.raises(DataflexError, match="kept no row"):
            step.prompts(4, draw)
        return
    chosen = step.prompts(4, draw)
    if policy == "skip":  # one candidate goes through the forward passes; the update is skipped
        assert chosen.counts.tolist() == [4] and step.skip_at_prompts
    else:  # the host's group size for every candidate
        assert chosen.counts.tolist() == [4, 4, 4, 4] and not step.skip_at_prompts


def test_a_host_without_ragged_groups_refuses_allocation_by_name_with_the_alternative(comps):
    host = ANY_HOST.replace(name="trl", capabilities=frozenset(CAPABILITIES) - {"ragged_groups"},
                            missing={"ragged_groups": "its sampler repeats every prompt num_generations times"})
    with pytest.raises(ConfigError) as err:
        validate(block([4, 4, 4, 4]), host=host)
    message = str(err.value)
    assert "host 'trl'" in message and "ragged_groups" in message and "num_generations" in message
    assert "pre_rollout selector" in message and "mopps" in message


def test_a_continuation_round_appends_rollouts_to_their_groups(comps):
    dataflex = {"mechanism": "allocate", "scorer": {"name": "reward_difficulty"},
                "actuator": {"name": "t_more", "params": {"extra": 3}}}
    rt = runtime(dataflex)
    step = StepKit(rt).begin(0)
    gen = step.generation(3)
    rows = torch.arange(3)
    first = rollouts(rows, torch.tensor([2, 2, 2]), [1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # mixed, all 0, all 1
    gen.add(first)
    more = gen.continuation()
    assert more is not None and more.rows.tolist() == [0] and more.counts.tolist() == [3]
    gen.extend(rollouts(rows[:1], more.counts, [0.0, 1.0, 1.0]))
    assert gen.continuation() is None
    outcome = gen.finish()
    (merged,) = gen.batches
    assert len(merged) == 9 and merged.group_sizes.tolist() == [5, 2, 2]
    assert outcome.keep([9]).tolist() == [True, True] + [False] * 4 + [True] * 3
    m = step.end(None)
    assert m["compute/generated_rollouts"] == 9 and m["compute/generated_groups"] == 3
    assert m["dataflex/alloc/continued"] == 1 and m["dataflex/alloc/max"] == 5
    assert m["dataflex/rollout/groups"] == 3 and m["dataflex/rollout/rows"] == 9


def test_a_continuation_beyond_the_allocators_rounds_is_refused(comps):
    dataflex = {"mechanism": "allocate", "scorer": {"name": "reward_difficulty"},
                "actuator": {"name": "t_more", "params": {"again": True}}}
    gen = StepKit(runtime(dataflex)).begin(0).generation(1)
    gen.add(rollouts(torch.arange(1), torch.tensor([2]), [1.0, 0.0]))
    more = gen.continuation()
    assert more is not None
    with pytest.raises(PluginRuntimeError, match="declares rounds=2"):
        gen.extend(rollouts(torch.arange(1), more.counts, [1.0]))


def test_continuation_rows_must_belong_to_a_group_of_the_round(comps):
    dataflex = {"mechanism": "allocate", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "t_more"}}
    gen = StepKit(runtime(dataflex)).begin(0).generation(1)
    gen.add(rollouts(torch.arange(1), torch.tensor([2]), [1.0, 0.0]))
    assert gen.continuation() is not None
    with pytest.raises(BatchFieldError, match="uid of a group"):
        gen.extend(rollouts(torch.arange(1), torch.tensor([2]), [1.0], uid=torch.tensor([7])))
