"""Pilot-Commit (``pilot_commit``, ``max_solve_rate`` x ``exclude_solved``) against a port of the authors'
selection logic (``databricks/pilot-commit@6def20e``, ``recipe/pc/``: ``pc_ray_trainer.py:filter_batch`` and
``exclude_batch``, ``replay_buffer.py:ReplayBuffer.add/sample/_sample_by_variance``), on fixed vectors and on
random pilots, ours driven through the bus's host kit (pilot round, commit round, on_prompts) as a host would.

The port commits from its buffer the round's passed pilots (the one-step variant: the buffer holds this
round's passed prompts only); its ``random.sample`` is replaced by "the first ``size`` in insertion order",
since the draw of prompts is itself random (the spec stubs MoPPS's ``np.random.beta`` the same way)."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import Budget
from dataflex_bus.errors import BatchFieldError, ConfigError
from dataflex_bus.history import PromptTable
from dataflex_bus.host import ANY_HOST
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import Candidates, StepKit
from dataflex_bus.validation import validate
from dataflex_bus.visits import Visits


# ---------------------------------------------------------------------------- the authors' logic, ported
def official_filter_batch(batch_indices, batch_metric_values, upper, lower, expected_num_prompts):
    """``RayPCTrainer.filter_batch``."""
    aggregated = defaultdict(list)
    for idx, value in zip(batch_indices, batch_metric_values):
        aggregated[idx].append(value)
    assert len(aggregated) == expected_num_prompts
    passed, too_correct, too_incorrect = [], [], []
    for idx, values in aggregated.items():
        mean = np.mean(values)
        if mean >= lower and mean <= (1 - upper):
            passed.append(idx)
        elif mean > (1 - upper):
            too_correct.append(idx)
        else:
            too_incorrect.append(idx)
    return passed, {"pass_count": len(passed), "too_correct_count": len(too_correct),
                    "too_incorrect_count": len(too_incorrect)}


def official_exclude_batch(batch_indices, batch_metric_values, exclude_threshold_upper):
    """``RayPCTrainer.exclude_batch``."""
    if exclude_threshold_upper is None:
        return []
    aggregated = defaultdict(list)
    for idx, value in zip(batch_indices, batch_metric_values):
        aggregated[idx].append(value)
    return [idx for idx, values in aggregated.items() if np.mean(values) >= exclude_threshold_upper]


class OfficialBuffer:
    """``ReplayBuffer``'s add and sample (prompt selection only: the responses are not resampled at the
    official default ``n_explore_effective = n_explore``)."""

    def __init__(self) -> None:
        self.buffer: dict[int, dict] = {}

    def add(self, groups: list[tuple[int, list[float]]], step: int) -> None:
        for prompt_id, values in groups:
            self.buffer[prompt_id] = {"step": step, "metric_stats": {"std": float(np.std(values))}}

    def sample(self, size: int, strategy: str) -> list[int]:
        available = list(self.buffer)
        if len(available) <= size:
            return available
        if strategy == "random":
            chosen = available[:size]  # random.sample, stubbed: see the module doc
        else:
            ranked = [(uid, self.buffer[uid]["metric_stats"]["std"], self.buffer[uid]["step"]) for uid in available]
            ranked.sort(key=lambda x: (x[1], x[2]), reverse=True)
            chosen = [uid for uid, _, _ in ranked[:size]]
        return chosen


def official_round(pilots: dict[int, list[float]], needed: int, *, lower: float, upper: float,
                   strategy: str) -> tuple[list[int], dict]:
    """One generation round's selection (``fit``): filter the pilots, buffer the passed ones, commit up to the
    prompts still needed."""
    indices = [i for i, values in pilots.items() for _ in values]
    metrics = [v for values in pilots.values() for v in values]
    passed, stats = official_filter_batch(indices, metrics, upper, lower, len(pilots))
    buffer = OfficialBuffer()
    buffer.add([(i, pilots[i]) for i in passed], step=1)
    return buffer.sample(min(needed, len(buffer.buffer)), strategy), stats


# ---------------------------------------------------------------------------- ours, through the host kit
def pc_block(**params) -> dict:
    return {"mechanism": "allocate", "scorer": {"name": "group_solve_rate"},
            "actuator": {"name": "pilot_commit", "params": {"n_commit": 6, **params}}}


def rows(uids: list[int], rewards: list[list[float]]) -> Batch:
    uid = [u for u, rs in zip(uids, rewards) for _ in rs]
    r = torch.tensor([x for rs in rewards for x in rs], dtype=torch.float32)
    return Batch.from_tensors(uid=torch.tensor(uid), prompt_index=torch.tensor(uid), rm_scores=r[:, None],
                              response_mask=torch.ones(len(uid), 1, dtype=torch.long))


def ours_round(pilots: dict[int, list[float]], needed: int, *, pilot: int, **params) -> tuple[list[int], dict]:
    """One pilot round and its commit round on a host of group size ``pilot``, ``needed`` groups wanted: the
    prompts committed (sorted: one commit round extends them all at once) and the step's metrics."""
    rt = Runtime(pc_block(**params), host=ANY_HOST.replace(name="lab", group_size=pilot))
    rt.set_prompts(PromptTable.full(["d"], [max(pilots) + 1], column="row"))
    step = StepKit(rt).begin(0)
    gen = step.generation(needed)
    gen.request()
    uids = list(pilots)
    first = rows(uids, [pilots[u] for u in uids])
    gen.add(first)
    committed: list[int] = []
    more = gen.continuation()
    if more is not None:
        assert bool((more.counts == params.get("n_commit", 6)).all())
        committed = first["prompt_index"][more.rows].tolist()
        gen.extend(rows(committed, [[1.0] * int(c) for c in more.counts]))
        assert gen.continuation() is None
    outcome = gen.finish()
    (merged,) = gen.batches
    keep = outcome.keep([len(merged)])
    trained = merged.valid_rows if keep is None else keep & merged.valid_rows
    assert sorted(set(merged["prompt_index"][trained].tolist())) == sorted(committed) or outcome.skip_update
    return sorted(committed), step.end(None)


# ---------------------------------------------------------------------------- fixed vectors
P = [  # pilots of 4: mean 0, 1/4, 1/2, 3/4, 1, 1/2, 1/4
    [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1]]
PILOTS = {i: [float(x) for x in p] for i, p in enumerate(P)}


@pytest.mark.parametrize(("needed", "params", "committed", "stats"), [
    # the scripts' band [0.125, 0.75]: 1/4, 1/2, 3/4 pass; 0 is too hard, 1 too easy
    (8, {}, [1, 2, 3, 5, 6], (5, 1, 1)),
    (3, {}, [1, 2, 3], (5, 1, 1)),
    # the 1.5B script's max_variance: std 1/2 (2, 5) before std 0.433 (1, 3, 6), then arrival
    (3, {"commit_order": "max_variance"}, [2, 5, 1], (5, 1, 1)),
    # the recipe yaml's band [0.25, 0.75] (lower 0.25): the same; [0.5, 0.5]: the two halves only
    (8, {"diversity_threshold_lower": 0.5, "diversity_threshold_upper": 0.5}, [2, 5], (2, 2, 3)),
    (8, {"diversity_threshold_lower": 0.8, "diversity_threshold_upper": 0.0}, [4], (1, 0, 6)),
])
def test_fixed_vectors(needed, params, committed, stats):
    lower = params.get("diversity_threshold_lower", 0.125)
    upper = params.get("diversity_threshold_upper", 0.25)
    strategy = "max_variance" if params.get("commit_order") == "max_variance" else "random"
    want, official_stats = official_round(PILOTS, needed, lower=lower, upper=upper, strategy=strategy)
    got, metrics = ours_round(PILOTS, needed, pilot=4, **params)
    assert got == sorted(committed) == sorted(want)
    p = "dataflex/pilot_commit/"
    assert (metrics[f"{p}passed_groups"], metrics[f"{p}too_easy_groups"], metrics[f"{p}too_hard_groups"]) == stats
    assert stats == (official_stats["pass_count"], official_stats["too_correct_count"],
                     official_stats["too_incorrect_count"])
    assert metrics[f"{p}committed_groups"] == len(committed)
    assert metrics["compute/generated_rollouts"] == 28 + 6 * len(committed)


def test_a_pilot_of_two_passes_only_when_its_two_rollouts_disagree():
    pilots = {0: [1.0, 0.0], 1: [0.0, 0.0], 2: [1.0, 1.0], 3: [0.0, 1.0]}
    got, metrics = ours_round(pilots, 64, pilot=2)
    assert got == [0, 3] == sorted(official_round(pilots, 64, lower=0.125, upper=0.25, strategy="random")[0])
    assert metrics["dataflex/trained/rows"] == 0 and metrics["dataflex/alloc/max"] == 8


# ---------------------------------------------------------------------------- random pilots: ours vs the port
@pytest.mark.parametrize("seed", range(16))
def test_random_pilots_match_the_official_selection(seed):
    rng = random.Random(seed)
    pilot = rng.choice([2, 4, 8, 16])  # the shim's 2, the scripts' 16 (and 32: same code path)
    lower = rng.choice([0.0, 0.125, 0.25, rng.random() / 2])
    upper = rng.choice([0.0, 0.25, rng.random() / 2])
    order = rng.choice(["arrival", "max_variance"])
    prompts = rng.randint(1, 40)
    ids = rng.sample(range(200), prompts)
    pilots = {}
    for i in ids:
        p = rng.choice([0.0, 1.0, rng.random(), rng.random()])
        pilots[i] = [float(rng.random() < p) for _ in range(pilot)]
    needed = rng.randint(1, prompts + 3)
    got, metrics = ours_round(pilots, needed, pilot=pilot, diversity_threshold_lower=lower,
                              diversity_threshold_upper=upper, commit_order=order)
    want, stats = official_round(pilots, needed, lower=lower, upper=upper,
                                 strategy="random" if order == "arrival" else "max_variance")
    assert got == sorted(want)
    assert metrics["dataflex/pilot_commit/passed_groups"] == stats["pass_count"]
    assert metrics["dataflex/pilot_commit/too_easy_groups"] == stats["too_correct_count"]


# ---------------------------------------------------------------------------- eviction of solved prompts
def test_random_visits_evict_what_the_official_exclusion_evicts():
    """Over random visits (pilots, some committed with commit rollouts after them) the prompts
    ``exclude_solved`` drops at the official threshold 1.0 are exactly those ``exclude_batch`` marked; at a
    threshold below 1 a committed visit counts its commit rollouts too (documented difference)."""
    from dataflex_plugins.methods.pilot_commit import ExcludeSolved, MaxSolveRate

    from dataflex_bus.components import Score

    rng = random.Random(7)
    scorer, selector = MaxSolveRate(), ExcludeSolved(exclude_threshold=1.0)
    state = torch.zeros(30, 1, dtype=torch.float64)
    excluded: set[int] = set()
    for step in range(40):
        prompts = rng.sample(range(30), 6)
        sizes, successes = [], []
        for i in prompts:
            p = rng.choice([0.0, 1.0, rng.random()])
            pilot = [float(rng.random() < p) for _ in range(4)]
            excluded.update(official_exclude_batch([i] * 4, pilot, 1.0))
            passed, _ = official_filter_batch([i] * 4, pilot, 0.25, 0.125, 1)
            commit = [float(rng.random() < 0.9) for _ in range(12)] if passed else []
            sizes.append(len(pilot) + len(commit))
            successes.append(int(sum(pilot) + sum(commit)))
        visits = Visits(prompt=torch.tensor(prompts), size=torch.tensor(sizes), successes=torch.tensor(successes),
                        step=step)
        state[visits.prompt] = scorer.update_prompt_state(state[visits.prompt], visits)
        candidates = Batch.from_tensors(uid=torch.arange(30), prompt_index=torch.arange(30),
                                        history_max_solve_rate=state.clone())
        score = scorer.score(candidates, step)
        keep = selector.select(candidates, Score(score.values, "prompt"), step).keep
        assert set(torch.nonzero(~keep).flatten().tolist()) == excluded, step
    assert excluded  # the run evicts some


def test_a_committed_visit_counts_its_commit_rollouts_below_threshold_one():
    from dataflex_plugins.methods.pilot_commit import MaxSolveRate

    pilot = [1.0, 0.0]  # pilot mean 0.5: committed; its 6 commit rollouts all right make the visit 7/8
    assert official_exclude_batch([0, 0], pilot, 0.8) == []
    visits = Visits(prompt=torch.tensor([0]), size=torch.tensor([8]), successes=torch.tensor([7]), step=0)
    state = MaxSolveRate().update_prompt_state(torch.zeros(1, 1, dtype=torch.float64), visits)
    assert float(state) == 7 / 8  # >= 0.8: exclude_solved(exclude_threshold=0.8) would evict it


EVICT_BLOCK = {"methods": [
    {"name": "evict", "mechanism": "select", "scorer": {"name": "max_solve_rate"},
     "actuator": {"name": "exclude_solved", "params": {"exclude_threshold": 1.0}}},
    {"name": "pc", **pc_block(n_commit=2)}]}


def test_a_prompt_whose_pilot_solved_everything_is_never_generated_again():
    """Through the host kit: step 0 pilots prompts 0..3 (0 all right, 1 all wrong, 2 and 3 mixed); from step 1
    the candidates 0..3 are drawn again and prompt 0 is skipped before generation, the never-solved prompt 1
    is drawn again (deferred, not evicted)."""
    rt = Runtime(EVICT_BLOCK, host=ANY_HOST.replace(name="lab", group_size=2))
    rt.set_prompts(PromptTable.full(["d"], [8], column="row"))
    kit = StepKit(rt)
    rewards = {0: [1.0, 1.0], 1: [0.0, 0.0], 2: [1.0, 0.0], 3: [0.0, 1.0], 4: [1.0, 0.0], 5: [0.0, 0.0]}
    order = iter([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7])
    generated = []
    for s in range(2):
        step = kit.begin(s)

        def draw(n):
            got = torch.tensor([next(order) for _ in range(n)])
            return Candidates(got, torch.zeros(n, dtype=torch.long), got)

        gen = step.generation(4)
        chosen = step.prompts(gen.request(), draw)
        ids = torch.cat(chosen.draws)[chosen.index].tolist()
        generated.append(ids)
        first = rows(ids, [rewards.get(i, [1.0, 0.0]) for i in ids])
        gen.add(first)
        more = gen.continuation()
        assert more is not None
        again = first["prompt_index"][more.rows].tolist()
        gen.extend(rows(again, [[1.0, 0.0]] * len(again)))
        gen.finish()
        m = step.end(None)
    assert generated[0] == [0, 1, 2, 3]
    assert 0 not in generated[1] and 1 in generated[1] and len(generated[1]) == 4
    assert m["dataflex/prompts_skipped"] == 1 and m["dataflex/prompts_generated"] == 4


# ---------------------------------------------------------------------------- checks
def test_a_band_no_pilot_can_pass_is_refused():
    with pytest.raises(ConfigError, match=r"diversity_threshold_lower=0\.8 is above 1 - diversity_threshold_upper"):
        validate(pc_block(diversity_threshold_lower=0.8, diversity_threshold_upper=0.25))


def test_the_commit_round_needs_the_host_group_size():
    from dataflex_plugins.methods.pilot_commit import PilotCommit
    from dataflex_plugins.methods.scorers import GroupSolveRate

    batch = rows([0], [[1.0, 0.0]])
    with pytest.raises(BatchFieldError, match="budget_group_size"):
        PilotCommit(n_commit=2).allocate(batch, GroupSolveRate().score(batch, 0), 0, Budget(0, 1, 0, round=1))
    with pytest.raises(BatchFieldError, match=r"score\.counts"):
        from dataflex_bus.components import Score

        PilotCommit(n_commit=2).allocate(batch, Score(torch.zeros(2), "prompt"), 0, Budget(0, 1, 2))


def _example_with(tmp_path, evict: dict | None = None, commit: dict | None = None):
    """examples/pilot_commit.yaml with parameters of its eviction (methods[0]) or its commit (methods[1]) changed."""
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "pilot_commit.yaml").read_text())
    config["dataflex"]["methods"][0]["actuator"]["params"].update(evict or {})
    config["dataflex"]["methods"][1]["actuator"]["params"].update(commit or {})
    path = tmp_path / "pc.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("threshold", [0, -1, 0.0, 1.5])
def test_exclude_threshold_outside_a_solve_rate_is_refused_naming_the_key(tmp_path, capsys, threshold):
    """A solve rate lies in [0, 1]: at 0 or below every prompt counts as evicted (a never-rolled-out one scores 0),
    above 1 none ever is; both are refused at validation, naming the key and the allowed range."""
    from dataflex_bus.cli import main

    assert main(["validate", _example_with(tmp_path, evict={"exclude_threshold": threshold})]) == 2
    err = capsys.readouterr().err
    assert "dataflex.methods[0].actuator.params.exclude_threshold" in err and "(0, 1]" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("n_commit", "culprit"), [
    (200, "n_commit=200"), (127, "n_commit=127 gives a committed prompt 129 rollouts")])
def test_n_commit_above_max_n_is_refused_at_validation(tmp_path, capsys, n_commit, culprit):
    """max_n must hold the pilot (the group size, 2 in the example) plus n_commit: refused by `validate`, not at
    step 0 of a run."""
    from dataflex_bus.cli import main

    assert main(["validate", _example_with(tmp_path, commit={"n_commit": n_commit, "max_n": 128})]) == 2
    err = capsys.readouterr().err
    assert "dataflex.methods[1].actuator.params" in err and culprit in err and "max_n=128" in err


def test_a_pilot_plus_commit_that_max_n_holds_still_validates(tmp_path, capsys):
    from dataflex_bus.cli import main

    assert main(["validate", _example_with(tmp_path, commit={"n_commit": 126, "max_n": 128})]) == 0
