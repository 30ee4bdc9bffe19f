"""The host contract: every host carries out the same decisions the same way.

Each case runs a block for a few steps on every host (``-m hosts``; each test id names its host) over the
scripted world (``world.py``): the same prompts give the same rollouts everywhere, so the rows each update
trains on, their advantages, weights and loss tokens, whether the update is skipped, the kit's metrics
(names and values), the refill rounds and the domain probabilities published must all be the same. The
shim, the reference host, is held to each case's expectations in closed form; every other host to the
shim's records. A host that cannot carry out a method must refuse it at validation, naming itself.

Adding a host: give it a driver module like ``shim_host.py`` (``run`` and ``description``) and name it in the
host's registration (:mod:`dataflex_bus.hosts`, ``Contract``); ``conftest.py`` makes a parameter of every one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import contract_components  # noqa: F401  (registers contract_token_score, the same on every host)
import pytest
from world import DOMAINS, StepRecord, World

pytestmark = pytest.mark.hosts

A_COPY = 0.866025  # rewards [1, 0, 1, 0]: (r - 0.5) / (std 0.57735 + 1e-6)
A_COPY8 = 0.935414  # a group of 8 continuing [1, 0, 1, 0]: (r - 0.5) / (std 0.534522 + 1e-6)
A_SORT_RIGHT, A_SORT_WRONG = 1.5, -0.5  # [1, 0, 0, 0]: mean 0.25, std 0.5
#: Relative tolerance of advantage-derived values on the host under test (``Host.rel``, set per test; the shim
#: and verl divide by std + 1e-6, TRL by std + 1e-4).
REL = 0.0


@dataclass
class Case:
    block: dict[str, Any] | None
    expect: Callable[[list[StepRecord]], None]
    steps: int = 1
    batch: int = 6
    world: World = field(default_factory=World)
    #: Per host, the framework settings the case needs there (verl overrides).
    settings: dict[str, list[str]] = field(default_factory=dict)
    #: The weights are verl's token-level truncated IS ``min(exp(old - mu), cap)``: each host's old log-probs
    #: come from its own policy, so the weights are held to that formula, not to the reference's values.
    is_cap: float | None = None


def trained_domains(record: StepRecord) -> dict[str, int]:
    out: dict[str, int] = {}
    for domain, *_ in record.trained:
        out[domain] = out.get(domain, 0) + 1
    return out


def _plain(records: list[StepRecord]) -> None:
    (r,) = records
    assert trained_domains(r) == {"copy": 8, "sort": 8, "reverse": 8} and not r.skipped
    assert all(abs(x.advantages[0]) == pytest.approx(A_COPY, abs=1e-4, rel=REL) for k, x in r.trained.items()
               if k[0] == "copy")
    assert all(x.weights is None for x in r.trained.values())
    m = r.metrics
    assert m["dataflex/rollout/rows"] == 24 and m["dataflex/rollout/zero_signal_groups"] == pytest.approx(2 / 6)
    assert m["compute/generated_rollouts"] == m["compute/trained_rows"] == 24 and m["dataflex/kept_fraction"] == 1


def _band(records: list[StepRecord]) -> None:
    (r,) = records
    assert trained_domains(r) == {"copy": 8}
    assert r.metrics["dataflex/removed_rows"] == 16 and r.metrics["compute/dropped_rows"] == 16


def _empty(records: list[StepRecord]) -> None:
    (r,) = records
    assert r.skipped and not r.trained
    assert r.metrics["dataflex/skipped_update"] == 1 and r.metrics["dataflex/empty_selection"] == 1


def _topk(records: list[StepRecord]) -> None:
    (r,) = records
    # |A|: sort's right answers 1.5 (2 rows), copy 0.866 (8): exactly the top 10, no tie at the cut
    assert trained_domains(r) == {"copy": 8, "sort": 2}
    assert all(x.advantages[0] == pytest.approx(A_SORT_RIGHT, abs=1e-4, rel=REL) for k, x in r.trained.items()
               if k[0] == "sort")


def _subset(records: list[StepRecord]) -> None:
    (r,) = records
    # PODS keeps 2 of 4 per group, the max-variance pair: one right, one wrong where there is one
    assert trained_domains(r) == {"copy": 4, "sort": 4, "reverse": 4}
    signal = [abs(x.advantages[0]) for k, x in r.trained.items() if k[0] != "reverse"]
    assert signal == pytest.approx([0.7071] * 8, abs=1e-4)


def _reweight(records: list[StepRecord]) -> None:
    (r,) = records
    assert len(r.trained) == 24
    weights = {k: x.weights for k, x in r.trained.items()}
    assert all(w is not None for w in weights.values()) and r.metrics["dataflex/weight_max"] > 1


def _mix(records: list[StepRecord]) -> None:
    (r,) = records
    assert r.domain_probs is not None and set(r.domain_probs) == set(DOMAINS)
    assert sum(r.domain_probs.values()) == pytest.approx(1.0)


def _refill(rounds: int, generated: int, trained: int) -> Callable[[list[StepRecord]], None]:
    def expect(records: list[StepRecord]) -> None:
        (r,) = records
        assert len(r.trained) == 4 * trained and "reverse" not in trained_domains(r)
        m = r.metrics
        assert (m["dataflex/refill/rounds"], m["dataflex/refill/generated_groups"]) == (rounds, generated)
        assert m["dataflex/refill/trained_groups"] == trained and m["compute/generated_rollouts"] == 4 * generated

    return expect


def _replay_dots(records: list[StepRecord]) -> None:
    first, *later = records
    assert len(first.trained) == 24 and first.metrics["dataflex/replay/empty"] == 1
    for r in later:
        m = r.metrics
        assert m["dataflex/replay/fresh_prompts"] == 3 and m["dataflex/replay/rows"] == 12 and len(r.trained) == 24
    m = records[-1].metrics
    assert m["compute/generated_rollouts"] == 24 + 2 * 12 and m["compute/replayed_rows"] == 2 * 12
    # The replayed rows are weighted by min(pi_old / mu, is_cap) on every host; a fresh row's weight is exactly 1
    # (so none recorded) where its behaviour log-probs are its old ones (TRL without vLLM).
    assert all(sum(x.weights is not None for x in r.trained.values()) >= 12 for r in later)


def _replay_repo(records: list[StepRecord]) -> None:
    *early, last = records
    assert all(r.metrics["dataflex/replay/rows"] == 0 for r in early)
    assert last.metrics["dataflex/replay/rows"] == 24 and len(last.trained) == 48
    again = [x for k, x in last.trained.items() if k[3] >= 1]  # rows trained a second (third) time
    assert len(again) == 24 and all(x.old == x.mu and x.weights is None for x in again)
    assert last.metrics["compute/generated_rollouts"] == 3 * 24 and last.metrics["compute/replayed_rows"] == 24
    # highest_k on binary rewards: copy's best 4 are all right, reverse's all wrong: 4 of 6 groups carry no signal
    assert last.metrics["dataflex/replay/zero_signal_groups"] == pytest.approx(4 / 6)


def _replay_mixed(records: list[StepRecord]) -> None:
    last = records[-1]
    assert last.metrics["dataflex/replay/rows"] == 24 and last.metrics["dataflex/replay/groups"] == 6
    # a sort prompt's 8 rows (4 fresh [1, 0, 0, 0], its stored best 4 [1, 1, 0, 0]) normalised together: 3 of 8
    # right in each of its two prompts
    sort = sorted(round(x.advantages[0], 3) for k, x in last.trained.items() if k[0] == "sort")
    assert len(sort) == 16 and sort.count(sort[-1]) == 6 and sort[-1] > 0 > sort[0]


def _tokens(masked: bool) -> Callable[[list[StepRecord]], None]:
    """The 80/20 block on ``contract_token_score``: 25 of the world's 84 valid tokens score at or above the 0.7
    quantile (0.67). Through the weights every row trains (KL and the denominator keep its tokens), the kept
    tokens weighted N / K for selected_tokens; under mask_kl only the kept tokens are in the loss masks, the 10
    rows left without one are dropped, and all_tokens weights the kept ones K / N."""

    def expect(records: list[StepRecord]) -> None:
        (r,) = records
        m = r.metrics
        assert (m["dataflex/kept_tokens"], m["dataflex/kept_token_fraction"]) == (25, pytest.approx(25 / 84))
        assert m["dataflex/top_entropy/threshold"] == pytest.approx(0.67)
        if masked:
            assert len(r.trained) == 14 and sum(x.tokens for x in r.trained.values()) == 25
            assert {w for x in r.trained.values() for w in x.weights} == {round(25 / 84, 5)}
        else:
            assert len(r.trained) == 24 and sum(x.tokens for x in r.trained.values()) == 84
            weights = [w for x in r.trained.values() for w in (x.weights or (1.0,) * x.tokens)]
            assert sorted(set(weights)) == [0.0, round(84 / 25, 5)] and weights.count(round(84 / 25, 5)) == 25

    return expect


def _greso(records: list[StepRecord]) -> None:
    assert len(records) == 3
    assert all(r.metrics["dataflex/prompts_generated"] == 4 for r in records)
    assert records[-1].metrics["dataflex/prompts_considered"] >= 4


def _knapsack(records: list[StepRecord]) -> None:
    first, second = records
    # step 0: every prompt new, the group size each; step 1: rates copy 1/2, sort 1/4, reverse 0 -> floors of 2
    # and the 12 rollouts left to the four effective prompts by Value(n, p)
    assert trained_domains(first) == {"copy": 8, "sort": 8, "reverse": 8}
    assert first.metrics["dataflex/alloc/max"] == first.metrics["dataflex/alloc/min"] == 4
    m = second.metrics
    assert m["dataflex/knapsack/effective"] == 4 and m["dataflex/knapsack/never_solved"] == 2
    assert m["dataflex/alloc/min"] == 2 and m["dataflex/alloc/max"] > 4 and m["dataflex/alloc/rollouts"] == 24
    assert trained_domains(second)["reverse"] == 4 and len(second.trained) == 24
    assert m["compute/generated_rollouts"] == 48


def _knapsack_skip(records: list[StepRecord]) -> None:
    # negative_n=0: the never-solved prompts (reverse) get no rollout at step 1, so verl dispatches 4 prompts,
    # not train_batch_size, and the step still ends; the budget goes to copy and sort
    second = records[1]
    assert "reverse" not in trained_domains(second) and len(second.trained) == 24
    assert second.metrics["dataflex/alloc/skipped"] == 2 and second.metrics["dataflex/alloc/covered"] == 4
    assert second.metrics["dataflex/prompts_generated"] == 4


def _speed(records: list[StepRecord]) -> None:
    (r,) = records
    # copy [1,0,1,0] and sort [1,0,0,0] qualify and get 4 more rollouts each (groups of 8), reverse is dropped
    assert trained_domains(r) == {"copy": 16, "sort": 16}
    assert all(abs(x.advantages[0]) == pytest.approx(A_COPY8, abs=1e-4, rel=REL) for k, x in r.trained.items()
               if k[0] == "copy")
    m = r.metrics
    assert m["compute/generated_rollouts"] == 24 + 16 and m["dataflex/alloc/continued"] == 4
    assert m["dataflex/speed/qualified_groups"] == 4 and m["dataflex/alloc/max"] == 8


def _pilot_commit(records: list[StepRecord]) -> None:
    # pilots of 4: copy 1/2 and sort 1/4 lie in the band [0.125, 0.75] and get 4 more rollouts each (groups of
    # 8, pilot rows trained with them); reverse (0) is too hard and dropped; nobody solved everything, so the
    # second step draws the same prompts
    for r in records:
        assert trained_domains(r) == {"copy": 16, "sort": 16}
        assert all(abs(x.advantages[0]) == pytest.approx(A_COPY8, abs=1e-4, rel=REL)
                   for k, x in r.trained.items() if k[0] == "copy")
        m = r.metrics
        assert m["dataflex/alloc/rollouts"] == 24 + 16 and m["dataflex/alloc/continued"] == 4
        assert m["dataflex/pc/pilot_commit/committed_groups"] == 4
        assert m["dataflex/pc/pilot_commit/too_hard_groups"] == 2
        assert m["dataflex/alloc/max"] == 8 and m["dataflex/prompts_skipped"] == 0
    assert records[-1].metrics["compute/generated_rollouts"] == 2 * (24 + 16)


def _reinforce_ada(records: list[StepRecord]) -> None:
    (r,) = records
    # rounds of 4 until 2 positives and 2 negatives: copy [1,0,1,0] exits after one round, sort [1,0,0,0] after
    # two (session 0 of each round right: a continuation's sessions start again at 0), reverse never (4 rounds,
    # 16 wrong); each keeps 4 rows, the first positives and negatives in arrival order, with
    # A = r - pos / (pos + neg) over its whole pool
    assert trained_domains(r) == {"copy": 8, "sort": 8, "reverse": 8}
    assert {k[2:] for k in r.trained if k[0] == "sort"} == {(0, 0), (0, 1), (1, 0), (2, 0)}
    assert {k[2:] for k in r.trained if k[0] == "reverse"} == {(0, 0), (1, 0), (2, 0), (3, 0)}
    adv = {k[0]: set() for k in r.trained}
    for k, x in r.trained.items():
        adv[k[0]].add(round(x.advantages[0], 4))
    assert adv == {"copy": {0.5, -0.5}, "sort": {0.75, -0.25}, "reverse": {0.0}}
    m = r.metrics
    assert m["compute/generated_rollouts"] == 2 * (4 + 8 + 16) and m["dataflex/alloc/max"] == 16
    assert m["dataflex/rounds/reinforce_ada/round"] == 4 and m["dataflex/rounds/reinforce_ada/exited_groups"] == 4


def _mopps(records: list[StepRecord]) -> None:
    assert all(r.metrics["dataflex/prompts_considered"] == 6 and r.metrics["dataflex/prompts_generated"] == 3
               for r in records)
    assert all(len(r.trained) == 12 for r in records)


def _dps(records: list[StepRecord]) -> None:
    _mopps(records)  # 6 candidates, the 3 the HMM predicts most likely partially solved generated
    assert all(r.metrics["dataflex/predictor/brier"] >= 0 for r in records)
    # step 0 predicts 1/3 * 0.5 + 1/3 = 0.5 for everyone (uniform prior) against rates 1/2, 1/4, 0 of its picks
    assert "dataflex/predictor/spearman" not in records[0].metrics


def _learnability_cures(records: list[StepRecord]) -> None:
    _mopps(records)  # 6 candidates, the 3 of highest predicted p(1-p) generated (the same ones on every host)
    assert all(r.metrics["dataflex/predictor/brier"] >= 0 for r in records)


def _vip(records: list[StepRecord]) -> None:
    for r in records:  # every prompt generated, the 24 rollouts of plain GRPO split by the predicted p(1-p)
        assert r.metrics["dataflex/alloc/rollouts"] == 24 and len(r.trained) == 24
    # step 1: prior mean 1/4 (step 0's rates 1/2, 1/4, 0), the GP pulls each prompt 5/7 of the way to its rate:
    # p ~ 0.43, 0.25, 0.07 -> sqrt(p(1-p)) 0.495, 0.433, 0.257 -> relaxed 5.0, 4.4, 2.6 -> 5, 4, 3 per prompt
    assert trained_domains(records[0]) == {"copy": 8, "sort": 8, "reverse": 8}
    assert trained_domains(records[1]) == {"copy": 10, "sort": 8, "reverse": 6}


def _snr(records: list[StepRecord]) -> None:
    (r,) = records  # variances 0.25 (copy), 0.1875 (sort), 0 (reverse): 0.9 of the mass needs copy and sort
    assert trained_domains(r) == {"copy": 8, "sort": 8}
    assert r.metrics["dataflex/snr_filter/groups_kept"] == 4


def _learnability(records: list[StepRecord]) -> None:
    (r,) = records  # p(1-p) 0.25 (copy), 0.1875 (sort), 0 (reverse): half of the 6 groups, copy's first
    assert trained_domains(r) == {"copy": 8, "sort": 4}


def _no_positive_resampling(records: list[StepRecord]) -> None:
    # no prompt of the world reaches a pass rate of 0.9: nothing is dropped
    assert all(r.metrics["dataflex/no_positive_resampling/dropped"] == 0 for r in records)
    assert all(len(r.trained) == 24 for r in records)


ALLOCATE_KNAPSACK = {"mechanism": "allocate", "scorer": {"name": "knapsack_rate", "params": {"min_buffer_length": 4}},
                     "actuator": {"name": "knapsack"}}
REFILL_WORLD = World((("reverse", 5), ("copy", 4), ("sort", 3)))
REPLAY = {"mechanism": "replay", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "rollout_replay"}}
REPO = {"unit": "prompt", "priority": "highest", "advantage": "split", "correction": "behaviour", "per_prompt": 8,
        "min_to_replay": 8, "replays": 4, "capacity": 1024}
CASES: dict[str, Case] = {
    "plain": Case(None, _plain),
    "select-rollout-band": Case({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                                 "actuator": {"name": "threshold_band", "params": {"low": 0.4, "high": 0.6}}}, _band),
    "select-rollout-empty": Case({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                                  "actuator": {"name": "threshold_band", "params": {"low": 1.5, "high": 2.0}}},
                                 _empty),
    "select-advantage-topk": Case({"mechanism": "select", "scorer": {"name": "advantage_magnitude"},
                                   "actuator": {"name": "topk_fraction", "params": {"fraction": 0.4167}}}, _topk),
    "select-subset-pods": Case({"mechanism": "select", "scorer": {"name": "reward_difficulty"},
                                "actuator": {"name": "max_variance", "params": {"keep_fraction": 0.5}}}, _subset),
    "reweight": Case({"mechanism": "reweight", "scorer": {"name": "advantage_magnitude"},
                      "actuator": {"name": "per_advantage"}}, _reweight),
    "mix": Case({"mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
                 "actuator": {"name": "dump_ucb", "params": {"c": 1.0, "window": 10, "temperature": 0.5}}}, _mix),
    # round 1 is the whole dataset (12 prompts: 5 reverse dropped, 7 kept), 1 group short; then fixed asks
    # 12 more, credit2 2 x 5 = 10, greso floor(1.25 * 1 * 12 / 7) = 2, announced as its last round: both are
    # reverse prompts, so GRESO trains short (on_exhaust=train_short)
    **{f"refill-{policy}": Case({"mechanism": "select", "scorer": {"name": "reward_difficulty"},
                                 "actuator": {"name": "dapo"},
                                 "refill": {"gen_batch_size": 12, "policy": policy, "max_rounds": 5,
                                            "on_exhaust": "train_short"}},
                                _refill(*expected), batch=8, world=REFILL_WORLD)
       for policy, expected in (("fixed", (2, 24, 8)), ("credit2", (2, 22, 8)), ("greso", (2, 14, 7)))},
    # DOTS: 6 groups, then 3 fresh + 3 drawn from the stored 6 (verl's TIS weights every row, decoupled PPO)
    "replay-dots": Case({**REPLAY, "actuator": {"name": "rollout_replay", "params": {
        "fresh_fraction": 0.5, "capacity": 24, "dedup": True, "max_age_steps": 2, "is_cap": 2.0}}}, _replay_dots,
        steps=3, settings={"verl": ["algorithm.rollout_correction.rollout_is=token"]}, is_cap=2.0),
    # RePO: at the third visit each prompt has 8 rows stored, its best 4 train again in a group of their own
    "replay-repo": Case({**REPLAY, "actuator": {"name": "rollout_replay", "params": REPO}}, _replay_repo, steps=3),
    "replay-mixed": Case({**REPLAY, "actuator": {"name": "rollout_replay", "params": {**REPO, "advantage": "mixed"}}},
                         _replay_mixed, steps=3),
    # the 80/20 block (quantile form: ties at the threshold are kept or dropped together, whatever the row order)
    **{f"select-tokens-{route}": Case({"mechanism": "select", "scorer": {"name": "contract_token_score"},
                                       "actuator": {"name": "top_entropy", "params": {
                                           "rho": 0.3, "form": "quantile", **params}}}, _tokens(route == "masks"))
       for route, params in (("weights", {"normalize": "selected_tokens"}), ("masks", {"mask_kl": True}))},
    "prompts-greso": Case({"methods": [
        {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
         "actuator": {"name": "greso", "params": {"p_easy_init": 0.5, "p_hard_init": 0.5, "adapt_from_epoch": 0}}},
        {"name": "dapo", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
         "actuator": {"name": "dapo"}}]},
        _greso, steps=3, batch=4, world=World((("reverse", 4), ("copy", 4), ("sort", 4)))),
    "allocate-knapsack": Case(ALLOCATE_KNAPSACK, _knapsack, steps=2),
    "allocate-knapsack-skip": Case({**ALLOCATE_KNAPSACK, "actuator": {"name": "knapsack",
                                                                       "params": {"negative_n": 0}}},
                                   _knapsack_skip, steps=2),
    "allocate-speed": Case({"mechanism": "allocate", "scorer": {"name": "group_solve_rate"},
                            "actuator": {"name": "speed", "params": {"n_continue": 4}}}, _speed),
    "allocate-pilot-commit": Case({"methods": [
        {"name": "evict", "mechanism": "select", "scorer": {"name": "max_solve_rate"},
         "actuator": {"name": "exclude_solved"}},
        {"name": "pc", "mechanism": "allocate", "scorer": {"name": "group_solve_rate"},
         "actuator": {"name": "pilot_commit", "params": {"n_commit": 4}}}]}, _pilot_commit, steps=2),
    "allocate-reinforce-ada": Case({"methods": [
        {"name": "rounds", "mechanism": "allocate",
         "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.7}},
         "actuator": {"name": "reinforce_ada", "params": {"final_keep": 4}}},
        {"name": "downsample", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
         "actuator": {"name": "ada_downsample", "params": {"final_keep": 4}}}]}, _reinforce_ada),
    "prompts-mopps": Case({"mechanism": "select", "scorer": {"name": "mopps", "params": {"seed": 3}},
                           "actuator": {"name": "top_b", "params": {"pool": 2}}}, _mopps, steps=2, batch=3),
    # the 2026 methods (#47): a predictor the block names, read by a pre-rollout selector or an allocator
    "prompts-dps": Case({"predictor": {"name": "dps"}, "mechanism": "select",
                         "scorer": {"name": "predicted", "params": {"column": "partial"}},
                         "actuator": {"name": "top_b", "params": {"pool": 2}}}, _dps, steps=2, batch=3),
    "prompts-learnability-cures": Case({"predictor": {"name": "cures"}, "mechanism": "select",
                                        "scorer": {"name": "predicted"},
                                        "actuator": {"name": "learnability", "params": {"pool": 2}}},
                                       _learnability_cures, steps=2, batch=3),
    "allocate-vip": Case({"predictor": {"name": "vip"}, "mechanism": "allocate", "scorer": {"name": "predicted"},
                          "actuator": {"name": "variance_split", "params": {"min_n": 2, "max_n": 8}}}, _vip, steps=2),
    "select-snr": Case({"mechanism": "select", "scorer": {"name": "reward_variance"},
                        "actuator": {"name": "snr_filter", "params": {"rho": 0.9}}}, _snr),
    "select-learnability": Case({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                                 "actuator": {"name": "learnability", "params": {"fraction": 0.5}}}, _learnability),
    "prompts-no-positive-resampling": Case({"mechanism": "select", "scorer": {"name": "max_solve_rate"},
                                            "actuator": {"name": "no_positive_resampling"}},
                                           _no_positive_resampling, steps=2),
    "mix-sec": Case({"mechanism": "mix", "scorer": {"name": "advantage_magnitude", "params": {"agg": "mean"}},
                     "actuator": {"name": "sec"}}, _mix),
}


def needs(block: dict[str, Any] | None) -> set[str]:
    """The capabilities a case's block needs of its host: its mechanisms' needs and ``dataflex.refill``'s, as
    validation derives them (no map of the suite's own)."""
    from dataflex_bus.validation import block_needs, validate

    return set() if block is None else {n.capability for n in block_needs(validate(block))}


def skipped(description: Any) -> dict[str, list[str]]:
    """The cases a host of ``description`` skips, each with the capabilities it lacks for them."""
    out = {}
    for name, case in CASES.items():
        lacking = sorted(needs(case.block) - description.capabilities)
        if lacking:
            out[name] = lacking
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[str], list[StepRecord]]:
    """The shim's records of a case, computed once."""
    import shim_host

    cache: dict[str, list[StepRecord]] = {}

    def get(name: str) -> list[StepRecord]:
        if name not in cache:
            case = CASES[name]
            cache[name] = shim_host.run(case.block, case.world, batch=case.batch, steps=case.steps,
                                        tmp_path=tmp_path_factory.mktemp(name))
        return cache[name]

    return get


#: compute/generated_tokens: prompt + response tokens of every generated rollout.
PROMPT_AND_RESPONSE = "compute/generated_tokens"


def assert_same(records: list[StepRecord], reference: list[StepRecord], host: str, is_cap: float | None = None,
                rel: float = 0.0, behaviour_is_old: bool = False) -> None:
    assert len(records) == len(reference)
    for i, (got, want) in enumerate(zip(records, reference)):
        where = f"{host}, step {i}"
        assert got.skipped == want.skipped, where
        assert sorted(got.trained) == sorted(want.trained), where
        for key, row in want.trained.items():
            mine = got.trained[key]
            assert mine.tokens == row.tokens, (where, key)
            assert mine.advantages == pytest.approx(row.advantages, abs=1e-4, rel=rel), (where, key, "advantages")
            if behaviour_is_old and mine.weights is None:
                # Its behaviour log-probs are its old ones (a vLLM sampler's to its kernels' rounding):
                # min(pi_old / mu, cap) is 1, so no weight.
                assert mine.mu is None or mine.mu == pytest.approx(mine.old, abs=1e-5), (where, key, "behaviour")
                continue
            if mine.mu is not None and row.mu is not None and not behaviour_is_old:
                assert mine.mu == pytest.approx(row.mu, abs=1e-5), (where, key, "behaviour log-probs")
            assert (mine.weights is None) == (row.weights is None), (where, key, "weights")
            if is_cap is not None:
                for r in (mine, row):  # each host's old log-probs are its own policy's
                    assert r.weights is not None and r.old is not None and r.mu is not None
                    truncated = [min(math.exp(o - m), is_cap) for o, m in zip(r.old, r.mu)]
                    assert r.weights == pytest.approx(truncated, rel=1e-3), (where, key, "weights")
            elif row.weights is not None:
                assert mine.weights == pytest.approx(row.weights, abs=1e-4, rel=rel), (where, key, "weights")
        assert sorted(got.metrics) == sorted(want.metrics), (where, set(got.metrics) ^ set(want.metrics))
        for name, value in want.metrics.items():
            if name == PROMPT_AND_RESPONSE:
                continue  # its prompt part is each host's own tokenization of the prompt
            assert got.metrics[name] == pytest.approx(value, abs=1e-5, rel=rel), (where, name)
        for m in (got.metrics, want.metrics):  # every host gives its prompts' lengths: at least a token each
            prompt = m[PROMPT_AND_RESPONSE] - m["compute/generated_response_tokens"]
            assert prompt >= m["compute/generated_rollouts"], (where, "prompt tokens")
        # the reference's prompts are the world's 4 tokens
        assert want.metrics[PROMPT_AND_RESPONSE] == pytest.approx(
            want.metrics["compute/generated_response_tokens"] + 4 * want.metrics["compute/generated_rollouts"]), where
        if want.domain_probs is None:
            assert got.domain_probs is None, where
        else:
            assert got.domain_probs == pytest.approx(want.domain_probs, rel=max(rel, 1e-6)), where


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_decisions_are_carried_out_the_same_way(host, case, reference, tmp_path, monkeypatch):
    c = CASES[case]
    lacking = sorted(needs(c.block) - host.description().capabilities)
    if lacking:  # its refusal: test_every_capability_the_host_lacks_is_refused_naming_the_host
        pytest.skip(f"host {host.name!r} lacks {lacking}")
    want = reference(case)
    if host.name == "shim":
        c.expect(want)
        return
    got = host.run(c.block, c.world, batch=c.batch, steps=c.steps, tmp_path=tmp_path,
                   settings=c.settings.get(host.name, []))
    monkeypatch.setattr(sys.modules[__name__], "REL", host.rel)
    c.expect(got)
    assert_same(got, want, host.name, c.is_cap, rel=host.rel, behaviour_is_old=host.behaviour_is_old)


def test_a_field_the_host_lacks_is_refused_naming_the_host(host, register):
    from dataflex_bus import Score, Scorer
    from dataflex_bus.errors import ConfigError
    from dataflex_bus.host import EVENT_FIELDS
    from dataflex_bus.validation import validate

    description = host.description()
    lacking = sorted(EVENT_FIELDS["on_advantage"] - description.fields["on_advantage"])
    if not lacking:
        pytest.skip(f"host {description.name!r} provides every field")

    class Needs(Scorer):
        requires = (lacking[0],)
        timing = "post_advantage"

        def score(self, batch, step, **ctx):
            return Score(batch.rewards, "response")

    register("scorer", "contract_needs", Needs)
    block = {"mechanism": "select", "scorer": {"name": "contract_needs"}, "actuator": {"name": "topk_fraction"}}
    with pytest.raises(ConfigError) as err:
        validate(block, host=description)
    message = str(err.value)
    assert f"host {description.name!r}" in message and lacking[0] in message


def test_every_capability_the_host_lacks_is_refused_naming_the_host(host):
    from dataflex_bus.errors import ConfigError
    from dataflex_bus.validation import validate

    refused = set()
    for description in host.descriptions():
        for case, lacking in skipped(description).items():
            with pytest.raises(ConfigError) as err:
                validate(CASES[case].block, host=description)
            message = str(err.value)
            for capability in lacking:
                assert f"host {description.name!r} cannot carry out: it lacks {capability}" in message, case
            refused.update(lacking)
    if not refused:
        pytest.skip(f"host {host.name!r} has every capability")


def test_every_capability_is_needed_by_a_case():
    """So a host lacking any capability has a case whose refusal is tested."""
    from dataflex_bus.host import CAPABILITIES

    assert set().union(*(needs(c.block) for c in CASES.values())) == set(CAPABILITIES)


class FourthHost:
    """A host the suite has never seen: every capability but ``lacks``; running a case records it."""

    rel = 0.0

    def __init__(self, lacks: set[str]) -> None:
        from dataflex_bus.host import ANY_HOST

        self.name = "fourth"
        self._description = ANY_HOST.replace(name="fourth", capabilities=ANY_HOST.capabilities - lacks)
        self.ran: list[dict[str, Any] | None] = []

    def description(self) -> Any:
        return self._description

    def run(self, block: dict[str, Any] | None, *args: Any, **kwargs: Any) -> list[StepRecord]:
        self.ran.append(block)
        raise RuntimeError("ran")


def test_a_host_lacking_a_capability_skips_the_cases_that_need_it_and_runs_the_rest(monkeypatch):
    host = FourthHost({"domain_sampling"})
    assert skipped(host.description()) == {"mix": ["domain_sampling"], "mix-sec": ["domain_sampling"]}
    with pytest.raises(pytest.skip.Exception, match=r"host 'fourth' lacks \['domain_sampling'\]"):
        test_the_same_decisions_are_carried_out_the_same_way(host, "mix", None, None, monkeypatch)
    with pytest.raises(RuntimeError, match="ran"):  # a case it can carry out runs
        test_the_same_decisions_are_carried_out_the_same_way(host, "reweight", lambda case: [], None, monkeypatch)
    assert host.ran == [CASES["reweight"].block]
    # prompt selection: the on_prompts selections and allocations (Pilot-Commit's eviction); refill: its policies
    assert skipped(FourthHost({"prompt_selection", "refill"}).description()) == {
        "prompts-greso": ["prompt_selection"], "prompts-mopps": ["prompt_selection"],
        "prompts-dps": ["prompt_selection"], "allocate-vip": ["prompt_selection"],
        "prompts-learnability-cures": ["prompt_selection"],
        "prompts-no-positive-resampling": ["prompt_selection"],
        "allocate-knapsack": ["prompt_selection"], "allocate-knapsack-skip": ["prompt_selection"],
        "allocate-pilot-commit": ["prompt_selection"],
        "refill-fixed": ["refill"], "refill-credit2": ["refill"], "refill-greso": ["refill"]}
    assert skipped(FourthHost(set()).description()) == {}
