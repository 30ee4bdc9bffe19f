"""The shim as a host of pre-rollout selection (draw -> on_prompts -> generate) and of dynamic sampling
with refill: events, compute counters that add up, exact resume, and runs that cannot stall."""

from __future__ import annotations

import itertools

import pytest
import torch

from dataflex_bus import Score, Scorer, Selection, Selector
from dataflex_bus.errors import ConfigError, DataflexError
from dataflex_bus.registry import register_local, unregister_local
from dataflex_bus.shim import run_training

from .conftest import tiny, without_times

GRESO = {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
         "actuator": {"name": "greso", "params": {"adapt_from_epoch": 0, "p_easy_init": 0.3, "p_hard_init": 0.3}}}
DAPO = {"name": "dapo", "mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}
#: Small enough for unit tests, and prompts revisit often (100 prompts per domain, random is all-wrong).
SMALL = {"trainer": {"prompts_per_step": 8, "group_size": 4, "save_every": 4},
         "data": {"domains": ["copy", "random"]}}


def greso_block(**refill):
    return {"methods": [GRESO, DAPO], "refill": {"policy": "greso", "on_exhaust": "train_short", **refill}}


def run(block, steps, **kw):
    return run_training(tiny(block, **SMALL), steps=steps, **kw)


def deltas(metrics, key):
    values = [0.0] + [m[key] for m in metrics]
    return [b - a for a, b in itertools.pairwise(values)]


class PromptIndexScore(Scorer):
    requires = ("prompt_index",)
    timing = "pre_rollout"
    granularity = "prompt"

    def score(self, batch, step, **ctx):
        return Score(batch["prompt_index"].float(), "prompt")


class SkipAll(Selector):
    def select(self, batch, score, step):
        return Selection(torch.zeros(len(batch), dtype=torch.bool))


@pytest.fixture
def skip_all():
    register_local("scorer", "t_prompt_index", PromptIndexScore)
    register_local("selector", "t_skip_all", SkipAll)
    yield {"mechanism": "select", "scorer": {"name": "t_prompt_index"}, "actuator": {"name": "t_skip_all"},
           "max_oversample": 3}
    unregister_local("scorer", "t_prompt_index")
    unregister_local("selector", "t_skip_all")


def test_on_prompts_comes_before_generation(recorder):
    run(greso_block(), 2)
    names = [e[0] for e in recorder.events if e[1] == 0]
    assert names[0] == "on_prompts" and "on_rollout" in names
    first_rollout = names.index("on_rollout")
    assert all(n == "on_prompts" for n in names[:first_rollout])
    prompts = recorder.events[0][2]
    assert {"prompt_index", "history_streak", "history_visits", "history_means"} <= set(prompts.fields)
    assert "rm_scores" not in prompts.fields and prompts.num_groups == len(prompts)


@pytest.mark.integration
def test_greso_run_counts_every_candidate_and_rollout():
    m = run(greso_block(), 14).metrics
    n = 4  # group_size
    # a prompt never rolled out is always generated (later rounds of a step already see the earlier ones)
    assert all(x["dataflex/prompts_skip_rate/new"] == 0.0 for x in m if "dataflex/prompts_skip_rate/new" in x)
    assert m[0]["dataflex/prompts_skip_rate/new"] == 0.0
    assert sum(x["dataflex/prompts_skipped"] for x in m) > 0  # revisited all-wrong/all-right prompts are skipped
    for x in m:
        assert x["compute/generated_rollouts"] == x["compute/trained_rows"] + x["compute/dropped_rows"]
        assert x["compute/generated_rollouts"] == n * x["compute/generated_groups"]
        assert x["dataflex/prompts_considered"] == (x["dataflex/prompts_generated"] + x["dataflex/prompts_skipped"]
                                                    + x["dataflex/prompts_trimmed"] + x["dataflex/prompts_duplicate"])
    assert deltas(m, "compute/generated_groups") == [x["dataflex/prompts_generated"] for x in m]
    assert deltas(m, "compute/generated_groups") == [x["dataflex/refill/generated_groups"] for x in m]
    assert deltas(m, "compute/considered_prompts") == [x["dataflex/prompts_considered"] for x in m]
    trained = deltas(m, "compute/trained_groups")
    assert trained == [0.0 if x["dataflex/skipped_update"] else x["dataflex/refill/trained_groups"] for x in m]
    assert all(t <= 8 for t in trained)


@pytest.mark.integration
def test_dynamic_sampling_refills_until_the_batch_is_full():
    block = {**{k: v for k, v in DAPO.items() if k != "name"}, "refill": {"gen_batch_size": 8, "max_rounds": 0}}
    m = run(block, 6).metrics
    for x in m:
        assert x["dataflex/refill/trained_groups"] == 8  # unbounded rounds: always a full batch
        assert x["dataflex/refill/generated_groups"] == 8 * x["dataflex/refill/rounds"]
        assert x["dataflex/refill/discarded_groups"] == x["dataflex/refill/kept_groups"] - 8
        assert x["compute/generated_rollouts"] == x["compute/trained_rows"] + x["compute/dropped_rows"]
    assert deltas(m, "compute/generated_groups") == [x["dataflex/refill/generated_groups"] for x in m]
    assert deltas(m, "compute/trained_rows") == [32.0] * 6
    assert max(x["dataflex/refill/rounds"] for x in m) > 1  # random is all-wrong: rounds were refilled


@pytest.mark.integration
def test_resume_keeps_history_probabilities_and_counters(tmp_path):
    block = greso_block()
    full = without_times(run(block, 8, out=tmp_path / "full").metrics)
    run(block, 4, out=tmp_path / "half")
    resumed = run(block, 8, out=tmp_path / "half", resume=True)
    assert without_times(resumed.metrics) == full
    assert resumed.record["counters"] == run(block, 8).record["counters"]


def test_selector_skipping_everything_cannot_stall_the_run(skip_all):
    m = run(skip_all, 3).metrics
    for x in m:
        assert x["dataflex/prompts_forced"] == 8 and x["dataflex/prompts_considered"] == 24  # 3 x 8, then filled
        assert x["dataflex/prompts_generated"] == 8
    assert m[-1]["compute/generated_groups"] == 24


def test_skipping_everything_under_on_empty_error_stops_with_a_clear_error(skip_all):
    with pytest.raises(DataflexError, match=r"skipped all 24 candidate prompts.*on_empty=error"):
        run({**skip_all, "on_empty": "error"}, 1)


def test_refill_that_never_fills_raises_by_default_or_trains_short():
    # the random domain is all-wrong: dapo drops every group, no round can fill the batch
    block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"},
             "refill": {"max_rounds": 2}}
    cfg = tiny(block, trainer={"prompts_per_step": 4, "group_size": 4}, data={"domains": ["random"]})
    with pytest.raises(DataflexError, match=r"after 2 generation round\(s\) \(8 groups\).*kept 0 of the 4"):
        run_training(cfg, steps=1)
    cfg["dataflex"]["refill"]["on_exhaust"] = "train_short"
    m = run_training(cfg, steps=2).metrics
    assert all(x["dataflex/skipped_update"] == 1.0 and x["dataflex/refill/short_groups"] == 4 for x in m)
    assert m[-1]["compute/generated_rollouts"] == 2 * 2 * 4 * 4 == m[-1]["compute/dropped_rows"]


def test_refill_without_an_on_rollout_selection_is_refused_before_training():
    block = {"methods": [GRESO], "refill": {}}
    with pytest.raises(ConfigError, match="no method of this block selects at on_rollout"):
        run(block, 1)
