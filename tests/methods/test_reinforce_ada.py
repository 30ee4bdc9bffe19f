"""Reinforce-Ada (``reinforce_ada`` rounds + ``ada_downsample``) against the spec's vectors (``allocation.md``
2.9) and against a port of the official logic (``RLHFlow/Reinforce-Ada@05be605``:
``ray_trainer.py:_generate_multi_round_adaptive_downsampling`` and ``core_algos.py:compute_grpo_outcome_
advantage``) on random rewards, both driven through the bus's host kit (generation rounds, continuations,
``on_advantage`` carried out) as a host would."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.errors import ConfigError
from dataflex_bus.history import PromptTable
from dataflex_bus.host import ANY_HOST
from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import StepKit
from dataflex_bus.validation import validate


# ---------------------------------------------------------------------------- the official logic, ported
def official(rounds: dict[int, list[list[float]]], *, choice: str, n: int, max_rounds: int,
             threshold: float = 0.7, global_stat_est: bool = True, norm_by_std: bool = False,
             eps: float = 1e-6) -> dict[int, dict]:
    """The official round loop, fallback and GRPO advantage on one batch of prompts, line for line (a cached
    sample is its arrival index; ``rounds[uid][r]`` is the uid's round-``r`` rewards). Returns per uid: whether
    it exited, the rounds it was sampled in, its pool (pos, neg), the kept arrival indices and their
    advantages (torch float32, as the official code computes them)."""
    uid_arr = list(rounds)
    state = {uid: {"finished": False, "seen": 0, "pos": 0, "neg": 0, "rounds": 0} for uid in uid_arr}
    pos_cache: dict[int, list[int]] = defaultdict(list)
    neg_cache: dict[int, list[int]] = defaultdict(list)
    rewards: dict[int, list[float]] = defaultdict(list)
    selected: dict[int, list[int]] = {}
    full = {uid: {"total_pos": 0, "total_neg": 0} for uid in uid_arr}
    active = set(uid_arr)

    def downsample_cache(uid: int, target_total: int) -> list[int]:
        target_pos = min(target_total // 2, len(pos_cache[uid]))
        target_neg = min(target_total - target_pos, len(neg_cache[uid]))
        if target_pos + target_neg < target_total:
            if len(pos_cache[uid]) > target_pos:
                target_pos += min(len(pos_cache[uid]) - target_pos, target_total - (target_pos + target_neg))
            elif len(neg_cache[uid]) > target_neg:
                target_neg += min(len(neg_cache[uid]) - target_neg, target_total - (target_pos + target_neg))
        return pos_cache[uid][:target_pos] + neg_cache[uid][:target_neg]

    target_pos = target_neg = 0
    for r in range(max_rounds):
        if not active:
            break
        for uid in list(active):
            st = state[uid]
            st["rounds"] += 1
            for reward in rounds[uid][r]:
                if st["finished"]:
                    break
                st["seen"] += 1
                j = len(rewards[uid])
                rewards[uid].append(reward)
                if reward > threshold:
                    st["pos"] += 1
                    pos_cache[uid].append(j)
                    full[uid]["total_pos"] += 1
                else:
                    st["neg"] += 1
                    neg_cache[uid].append(j)
                    full[uid]["total_neg"] += 1
            if not st["finished"]:
                if choice == "balanced":
                    target_pos = n // 2
                    target_neg = n - target_pos
                    if len(pos_cache[uid]) >= target_pos and len(neg_cache[uid]) >= target_neg:
                        selected[uid] = downsample_cache(uid, n)
                        st["finished"] = True
                elif len(pos_cache[uid]) >= 1:
                    selected[uid] = downsample_cache(uid, n)
                    st["finished"] = True
        active = {u for u in active if not state[u]["finished"]}
    for uid in uid_arr:
        if state[uid]["finished"]:
            continue
        pos_num, neg_num = len(pos_cache[uid]), len(neg_cache[uid])
        n_rows = pos_num + neg_num
        take = min(n, n_rows)
        if choice == "positive_focused":
            ratio = (pos_num / n_rows) if n_rows > 0 else 0.0
            target_pos = max(min(math.ceil(ratio * n), take - 1), 1)
            target_neg = take - target_pos
        actual_pos, actual_neg = min(pos_num, target_pos), min(neg_num, target_neg)
        if actual_pos + actual_neg < take:
            if pos_num > actual_pos:
                actual_pos += min(pos_num - actual_pos, take - actual_pos - actual_neg)
            elif neg_num > actual_neg:
                actual_neg += min(neg_num - actual_neg, take - actual_pos - actual_neg)
        selected[uid] = pos_cache[uid][:actual_pos] + neg_cache[uid][:actual_neg]
    out = {}
    for uid in uid_arr:
        kept = selected[uid]
        scores = torch.tensor([rewards[uid][j] for j in kept], dtype=torch.float32)
        if global_stat_est:
            total = full[uid]["total_pos"] + full[uid]["total_neg"]
            if total <= 1:
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                pool = torch.cat([torch.ones(full[uid]["total_pos"]), torch.zeros(full[uid]["total_neg"])])
                mean, std = torch.mean(pool), torch.clamp(torch.std(pool), min=eps)
        elif len(kept) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = torch.mean(scores), torch.std(scores)
        adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
        out[uid] = {"finished": state[uid]["finished"], "rounds": state[uid]["rounds"],
                    "pool": (full[uid]["total_pos"], full[uid]["total_neg"]),
                    "kept": dict(zip(kept, adv.tolist()))}
    return out


# ---------------------------------------------------------------------------- ours, through the host kit
def block(*, choice: str = "balanced", n: int = 4, max_rounds: int = 4, threshold: float = 0.7,
          baseline: str = "pool", norm_by_std: bool = False) -> dict:
    return {"methods": [
        {"name": "rounds", "mechanism": "allocate",
         "scorer": {"name": "group_solve_rate", "params": {"success_threshold": threshold}},
         "actuator": {"name": "reinforce_ada", "params": {"final_keep": n, "choice": choice,
                                                           "max_rounds": max_rounds}}},
        {"name": "downsample", "mechanism": "select", "scorer": {"name": "reward_difficulty"},
         "actuator": {"name": "ada_downsample", "params": {"final_keep": n, "positive_threshold": threshold,
                                                            "baseline": baseline, "norm_by_std": norm_by_std}}}]}


def rows(uids: list[int], rewards: list[list[float]]) -> Batch:
    """One generation round: each uid's rewards, its rows together."""
    uid = [u for u, rs in zip(uids, rewards) for _ in rs]
    r = torch.tensor([x for rs in rewards for x in rs], dtype=torch.float32)
    return Batch.from_tensors(uid=torch.tensor(uid), prompt_index=torch.tensor(uid), rm_scores=r[:, None],
                              response_mask=torch.ones(len(uid), 1, dtype=torch.long))


def ours(rounds: dict[int, list[list[float]]], m: int, **params) -> tuple[dict[int, dict], dict[str, float]]:
    """The block run for one step on a host of group size ``m``; per uid the same summary as :func:`official`
    (arrival index = a row's rank in its group, continuation rows appended after the group's earlier ones)."""
    rt = Runtime(block(**params), host=ANY_HOST.replace(name="lab", group_size=m))
    rt.set_prompts(PromptTable.full(["d"], [max(rounds) + 1], column="row"))
    step = StepKit(rt).begin(0)
    uids = list(rounds)
    gen = step.generation(len(uids))
    assert gen.request() == len(uids)
    first = rows(uids, [rounds[u][0] for u in uids])
    gen.add(first)
    sampled = dict.fromkeys(uids, 1)
    while (more := gen.continuation()) is not None:
        assert bool((more.counts == m).all())
        again = first["prompt_index"][more.rows].tolist()  # the continued groups' prompts
        gen.extend(rows(again, [rounds[u][sampled[u]] for u in again]))
        for u in again:
            sampled[u] += 1
    outcome = gen.finish()
    assert outcome.keep([len(b) for b in gen.batches]) is None  # no group is dropped at on_rollout
    (pool,) = gen.batches
    adv = grpo_outcome_advantage(pool.rewards, pool.group_index, pool.num_groups)[:, None]
    on_adv = pool.with_fields(advantages=adv, loss_mask=pool["response_mask"].clone())
    action = step.advantage(on_adv)
    keep = action.keep if action.keep is not None else pool.valid_rows
    new_adv = action.fields["advantages"][:, 0]
    ids = pool["prompt_index"].tolist()
    arrival: dict[int, int] = defaultdict(int)
    out: dict[int, dict] = {u: {"rounds": sampled[u], "kept": {}} for u in uids}
    for row, u in enumerate(ids):
        j = arrival[u]
        arrival[u] += 1
        if bool(keep[row]):
            out[u]["kept"][j] = float(new_adv[row])
    for u in uids:
        out[u]["pool"] = (sum(r > params.get("threshold", 0.7) for rr in rounds[u][:sampled[u]] for r in rr),
                          sum(r <= params.get("threshold", 0.7) for rr in rounds[u][:sampled[u]] for r in rr))
    return out, step.end(None)


def assert_same(got: dict[int, dict], want: dict[int, dict], abs_tol: float = 1e-5) -> None:
    for uid, w in want.items():
        g = got[uid]
        assert g["rounds"] == w["rounds"], (uid, "rounds")
        assert g["pool"] == w["pool"], (uid, "pool")
        assert sorted(g["kept"]) == sorted(w["kept"]), (uid, "kept rows")
        for j, a in w["kept"].items():
            assert g["kept"][j] == pytest.approx(a, abs=abs_tol), (uid, j, "advantage")


# ---------------------------------------------------------------------------- the spec's vectors (2.9)
ONE, ZERO = [1.0] * 8, [0.0] * 8
VECTORS = {  # id: (choice, round rewards, exited, rounds, (pos, neg), kept rewards, A = r - mean, A with std)
    "R1": ("balanced", [[1, 1, 1, 1, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1, 1, 1]], True, 2, (14, 2), [1, 1, 0, 0],
           [0.125, 0.125, -0.875, -0.875], [0.365961, 0.365961, -2.56173, -2.56173]),
    "R2": ("positive_focused", [ZERO, [0, 0, 1, 0, 0, 0, 0, 0]], True, 2, (1, 15), [1, 0, 0, 0],
           [0.9375, -0.0625, -0.0625, -0.0625], [3.749985, -0.249999, -0.249999, -0.249999]),
    "R3": ("balanced", [ZERO] * 4, False, 4, (0, 32), [0, 0, 0, 0], [0.0] * 4, [0.0] * 4),
    "R4": ("balanced", [ONE] * 4, False, 4, (32, 0), [1, 1, 1, 1], [0.0] * 4, [0.0] * 4),
    "R5": ("positive_focused", [ZERO] * 4, False, 4, (0, 32), [0, 0, 0, 0], [0.0] * 4, [0.0] * 4),
    "R6": ("balanced", [[1, 0, 0, 1, 0, 0, 0, 0]], True, 1, (2, 6), [1, 1, 0, 0],
           [0.75, 0.75, -0.25, -0.25], [1.620182, 1.620182, -0.540061, -0.540061]),
}


def padded(rounds: list[list[float]]) -> list[list[float]]:
    """A vector's rounds, then rewards the rounds after its exit never read (they would change the result)."""
    return [[float(x) for x in r] for r in rounds] + [[0.5] * 8] * (4 - len(rounds))


@pytest.mark.parametrize("vid", sorted(VECTORS))
@pytest.mark.parametrize("norm_by_std", [False, True], ids=["r-mean", "std"])
def test_the_spec_vectors(vid, norm_by_std):
    choice, rounds, exited, n_rounds, pool, kept, adv, adv_std = VECTORS[vid]
    got, metrics = ours({0: padded(rounds)}, 8, choice=choice, norm_by_std=norm_by_std)
    g = got[0]
    assert (g["rounds"], g["pool"]) == (n_rounds, pool)
    arrival = [x for r in rounds for x in r]
    assert sorted(arrival[j] for j in g["kept"]) == sorted(kept)
    want = sorted(adv_std if norm_by_std else adv)
    assert sorted(g["kept"].values()) == pytest.approx(want, abs=1e-5)
    assert metrics["dataflex/rounds/reinforce_ada/exited_groups"] == float(exited)
    assert metrics["compute/generated_rollouts"] == 8 * n_rounds
    # the official port gives the same on the vector
    assert_same(got, official({0: padded(rounds)}, choice=choice, n=4, max_rounds=4, norm_by_std=norm_by_std))


def test_the_spec_batch_costs_56_rollouts_for_12_kept():
    batch = {1: padded(VECTORS["R1"][1]), 3: padded(VECTORS["R3"][1]), 6: padded(VECTORS["R6"][1])}
    got, metrics = ours(batch, 8)
    assert metrics["compute/generated_rollouts"] == 16 + 32 + 8 == metrics["dataflex/alloc/rollouts"]
    assert sum(len(g["kept"]) for g in got.values()) == 12
    assert metrics["dataflex/alloc/max"] == 32 and metrics["dataflex/alloc/min"] == 8
    assert metrics["dataflex/downsample/ada_downsample/pool_rows"] == 56


# ---------------------------------------------------------------------------- random rewards: ours vs the port
def random_rounds(rng: random.Random, prompts: int, m: int, max_rounds: int) -> dict[int, list[list[float]]]:
    """Per prompt a success rate, then ``max_rounds`` rounds of ``m`` rewards: binary, or (a third of the
    prompts) graded in {0, 0.5, 0.7, 0.71, 1} around the 0.7 threshold."""
    out = {}
    for u in range(prompts):
        p = rng.choice([0.0, 1.0, rng.random(), rng.random(), rng.random() / 8, 1 - rng.random() / 8])
        graded = rng.random() < 1 / 3
        values = [0.0, 0.5, 0.7, 0.71, 1.0]
        out[u] = [[(rng.choice(values) if graded else float(rng.random() < p)) for _ in range(m)]
                  for _ in range(max_rounds)]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_rewards_match_the_official_logic(seed):
    rng = random.Random(seed)
    m = rng.choice([2, 4, 8])
    n = rng.choice([1, 2, 3, 4, 8, 9])
    max_rounds = rng.choice([1, 2, 4, 5])
    choice = rng.choice(["balanced", "positive_focused"])
    baseline = rng.choice(["pool", "kept"])
    norm = rng.random() < 0.5
    rounds = random_rounds(rng, rng.randint(1, 12), m, max_rounds)
    got, metrics = ours(rounds, m, choice=choice, n=n, max_rounds=max_rounds, baseline=baseline, norm_by_std=norm)
    want = official(rounds, choice=choice, n=n, max_rounds=max_rounds, global_stat_est=baseline == "pool",
                    norm_by_std=norm)
    assert_same(got, want, abs_tol=1e-4 if norm else 1e-6)
    generated = sum(m * w["rounds"] for w in want.values())
    assert metrics["compute/generated_rollouts"] == generated


# ---------------------------------------------------------------------------- validation
def test_the_two_methods_must_share_n_and_the_threshold():
    validate(block())
    bad = block()
    bad["methods"][1]["actuator"]["params"]["final_keep"] = 8
    with pytest.raises(ConfigError, match=r"methods\[1\]\.actuator\.params\.final_keep.*final_keep=8 differs from "
                       r"dataflex\.methods\[0\]\.actuator\.params\.final_keep=4"):
        validate(bad)
    bad = block()
    bad["methods"][0]["scorer"]["params"]["success_threshold"] = 0.5
    with pytest.raises(ConfigError, match=r"positive_threshold=0\.7 differs from .*success_threshold=0\.5"):
        validate(bad)


def test_a_pool_beyond_max_n_is_refused_from_the_host():
    cfg = block()
    cfg["methods"][0]["actuator"]["params"]["max_n"] = 16
    with pytest.raises(ConfigError, match=r"max_rounds=4 rounds of the group size 8 .* up to 32 rollouts, above "
                       r"max_n=16"):
        validate(cfg, host=ANY_HOST.replace(name="lab", group_size=8))


def test_final_keep_above_the_round_size_is_warned():
    cfg = validate(block(n=8), host=ANY_HOST.replace(name="lab", group_size=4))
    assert any("final_keep=8 is above the round size 4" in w.message for w in cfg.warnings)


def test_the_selection_probe_leaves_out_what_follows_continuation_rounds():
    """The probe's groups are one round of the host's size; after reinforce_ada's rounds the downsampling sees
    the pools, so a probe saying it keeps every row (a pool of 8 at n = 8) would be wrong: no warning."""
    cfg = validate(block(n=8), host=ANY_HOST.replace(name="lab", group_size=8))
    assert not [w for w in cfg.warnings if "probe batch" in w.message]
    alone = validate({"mechanism": "select", "scorer": {"name": "reward_difficulty"},
                      "actuator": {"name": "ada_downsample", "params": {"final_keep": 8}}},
                     host=ANY_HOST.replace(name="lab", group_size=8))
    assert [w for w in alone.warnings if "keeps every row of a probe batch" in w.message]


@pytest.mark.parametrize("threshold", [-1.0, 1.0, 2.0, 1e300])
def test_a_positive_threshold_no_reward_in_0_1_can_straddle_is_refused(tmp_path, capsys, threshold):
    """A row is positive when its reward exceeds the threshold: below 0 every row of rewards in [0, 1] is positive,
    at 1 or above none is, and no prompt could ever exit balanced; refused naming the key and the range."""
    from pathlib import Path

    import yaml

    from dataflex_bus.cli import main

    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "reinforce_ada.yaml").read_text())
    config["dataflex"]["methods"][0]["scorer"]["params"]["success_threshold"] = threshold  # the two agree
    config["dataflex"]["methods"][1]["actuator"]["params"]["positive_threshold"] = threshold
    path = tmp_path / "ra.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "dataflex.methods[1].actuator.params.positive_threshold" in err and "[0, 1)" in err
