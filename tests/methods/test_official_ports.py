"""Ours against compact ports of the authors' code, driven side by side with seeded random inputs (the spec's
fixed vectors are elsewhere). Each port is a re-implementation of the official logic written for this test,
naming the file and lines it follows; each test says how far the agreement goes, and the docs claim no more.

Knapsack RL: ``liziniu/KnapsackRL@ca5d5f5`` ``verl/trainer/ppo/exploration_utils.py`` and
``verl/utils/dataset/rl_dataset.py``; MoPPS: ``thu-rllab/MoPPS`` ``recipe/ours/mopps.py`` and
``recipe/ours/our_ray_trainer.py``; GRESO: ``Infini-AI-Lab/GRESO`` ``verl/trainer/ttis/presampling_selector.py``,
``verl/trainer/ppo/ray_trainer.py`` and ``verl/trainer/ppo/metric_utils.py``; SPEED: ``Zanette-Labs/speed-rl``
``verl/trainer/ppo/data_controller.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataflex_plugins.methods.allocate import Knapsack, KnapsackRate, Speed, value
from dataflex_plugins.methods.mopps import Mopps, TopB
from dataflex_plugins.methods.prompts import Greso, ZeroVarianceStreak
from dataflex_plugins.methods.scorers import GroupSolveRate

from dataflex_bus.batch import Batch
from dataflex_bus.components import Budget, Score
from dataflex_bus.history import PromptHistory, PromptTable
from dataflex_bus.visits import VisitClasses

SEEDS = range(8)  # each test runs per seed; the cases per seed keep one under the unit tier's half second


# ============================================================================ Knapsack RL: the allocation
class OfficialDeviation(Exception):
    """The official code takes a path ours deliberately does not (docs/methods.md's deliberate differences)."""


def official_dp(rates: np.ndarray, effective: list[int], min_n: int, k_max: int, budget: int) -> np.ndarray:
    """``solve_by_dp``'s pure-Python path (exploration_utils.py:256-414): strict '>' over the options in order
    (k = 0, then 1..), the gain from a float32 rate and a Python int, the largest reachable budget backtracked,
    whatever it could not place spread evenly over the effective prompts."""
    out = np.zeros(len(rates), dtype=np.int32)
    if budget <= 0:
        return out
    e = len(effective)
    dp = np.full((e + 1, budget + 1), -np.inf)
    dp[0][0] = 0.0
    choice = np.full((e + 1, budget + 1, 2), -1, dtype=int)
    for i in range(1, e + 1):
        r = rates[effective[i - 1]]
        for w in range(budget + 1):
            if dp[i - 1][w] > dp[i][w]:
                dp[i][w] = dp[i - 1][w]
                choice[i][w] = [0, 0]
            for k in range(1, min(k_max + 1, w + 1)):
                if dp[i - 1][w - k] == -np.inf:
                    continue
                gain = (1 - (r ** (k + min_n)) - ((1 - r) ** (k + min_n))) * r * ((1 - r) ** 2)
                if dp[i - 1][w - k] + gain > dp[i][w]:
                    dp[i][w] = dp[i - 1][w - k] + gain
                    choice[i][w] = [i - 1, k]
    usable = budget
    while usable > 0 and dp[e][usable] == -np.inf:
        usable -= 1
    w = usable
    for i in range(e, 0, -1):
        item, k = choice[i][w]
        if k > 0:
            out[effective[item]] += k
            w -= k
    rest = budget - usable
    if rest > 0:
        raise OfficialDeviation("budget beyond max_n: spread over the effective prompts past max_n")
    return out


def official_allocation(rates: list[float], n: int, budget: int, *, min_n: int, max_n: int, negative_n: int | None,
                        positive_n: int | None, alpha: float, cost_estimation: str,
                        allow_fallback: bool) -> tuple[list[int], bool, float]:
    """``sampling_budget_by_knapsack`` (exploration_utils.py:20-196): rate -1 is the official ``valid = 0``."""
    size = len(rates)
    negative_n = min_n if negative_n is None else negative_n
    positive_n = min_n if positive_n is None else positive_n
    counts = np.zeros(size, dtype=np.int32)
    costs = np.zeros(size, dtype=np.float32)
    success = np.zeros(size, dtype=np.float32)
    effective = []
    for i, p in enumerate(rates):
        if p >= 0:
            if 0 < p < 1:
                c = (np.log(1 - alpha) / np.log(max(p, 1 - p)) if cost_estimation == "probability"
                     else 1 / (p * (1 - p)) - 1)
                counts[i] += min_n
                effective.append(i)
            elif p == 0:
                c = float("inf")
                counts[i] += negative_n
            else:
                c = 0
                counts[i] += positive_n
            costs[i] = c
            success[i] = p
        else:
            counts[i] += n
    left = budget - int(counts.sum())
    if left < 0:
        raise OfficialDeviation("a budget below the floors (the official asserts after allocating)")
    fallback, ratio = False, 1.0
    if left > 0 and not effective:
        zero = np.where(success == 0)[0]
        if len(zero):
            base, rem = divmod(left, len(zero))
            for j, i in enumerate(zero):
                counts[i] += base + (1 if j < rem else 0)
        else:
            if budget != size * n:
                raise OfficialDeviation("no effective or rate-0 prompt: every prompt reset to n")
            counts[:] = n
    else:
        estimated = sum(int(min(max_n, costs[i])) for i in effective)
        if estimated < left and allow_fallback:
            fallback, ratio = True, estimated / left
            zero = np.where(success == 0)[0]
            takers = zero if len(zero) else [i for i in range(size) if i not in effective]
            if not len(takers):
                raise OfficialDeviation("fallback with nobody to take it (the official divides by zero)")
            base, rem = divmod(left - estimated, len(takers))
            for j, i in enumerate(takers):
                counts[i] += base + (1 if j < rem else 0)
            left = estimated
        counts = counts + official_dp(success, effective, min_n, max_n - min_n, left)
    if int(counts.sum()) != budget:
        raise OfficialDeviation("the official budget assert fails")
    return counts.tolist(), fallback, ratio


def random_knapsack_case(rng: np.random.Generator, continuous: bool) -> dict:
    size = int(rng.integers(1, 9))
    if continuous:  # distinct rates in (0, 1), as float32 holds them (the optimum is then unique)
        rates = [float(np.float32(x)) for x in rng.uniform(0.02, 0.98, size)]
        rates = [r if rng.random() > 0.25 else float(rng.choice([-1.0, 0.0, 1.0])) for r in rates]
    else:  # the history's k/16 estimates: many exact ties
        rates = [float(rng.choice([-1.0, 0.0, 1.0])) if rng.random() < 0.35 else int(rng.integers(1, 16)) / 16
                 for _ in range(size)]
    min_n = int(rng.choice([2, 3]))
    n = int(rng.choice([min_n, 4, 8]))
    max_n = int(rng.integers(max(n, min_n) + 1, 17))
    floors = (None, 0, 2, 3)
    params = dict(min_n=min_n, max_n=max_n, negative_n=floors[int(rng.integers(4))],
                  positive_n=floors[int(rng.integers(4))], alpha=float(rng.uniform(0.5, 0.99)),
                  cost_estimation=str(rng.choice(["probability", "expectation"])),
                  allow_fallback=bool(rng.random() < 0.8))
    budget = size * n if rng.random() < 0.5 else int(rng.integers(size * min_n, size * max_n + 1))
    return {"rates": rates, "n": n, "budget": budget, "params": params}


def ours(case: dict, solver: str) -> tuple[list[int], dict]:
    rates = case["rates"]
    batch = Batch.from_tensors(uid=torch.arange(len(rates)), prompt_index=torch.arange(len(rates)))
    knapsack = Knapsack(solver=solver, **case["params"])
    out = knapsack.allocate(batch, Score(torch.tensor(rates, dtype=torch.float64), "prompt"), 0,
                            Budget(case["budget"], len(rates), case["n"]))
    return out.counts.tolist(), out.metrics


def official(case: dict) -> tuple[list[int], bool, float] | None:
    try:
        return official_allocation(case["rates"], case["n"], case["budget"], **case["params"])
    except OfficialDeviation:
        return None


@pytest.mark.parametrize("seed", SEEDS)
def test_knapsack_dp_is_the_official_allocation_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    compared = 0
    for _ in range(25):
        case = random_knapsack_case(rng, continuous=bool(rng.random() < 0.3))
        want = official(case)
        if want is None:
            continue
        counts, metrics = ours(case, "dp")
        assert counts == want[0], case
        assert metrics["knapsack/fallback"] == float(want[1]) and metrics["knapsack/fallback_ratio"] == \
            pytest.approx(want[2]), case
        compared += 1
    assert compared >= 15  # the deviation paths are the exception, not what the test runs on


def tie_heavy_case(rng: np.random.Generator) -> dict:
    """Larger batches with three k/16 rates shared by most prompts and the official run's floors: the DP's
    choice among equal-rate prompts then rests on the float32 rounding of its sums."""
    size = int(rng.integers(8, 25))
    rates = rng.choice(np.arange(1, 16), size=3, replace=False) / 16
    n = int(rng.choice([8, 16]))
    return {"rates": [float(rng.choice(rates)) if rng.random() < 0.8 else float(rng.choice([-1.0, 0.0, 1.0]))
                      for _ in range(size)],
            "n": n, "budget": size * n,
            "params": dict(min_n=2, max_n=int(rng.integers(n + 1, 41)), negative_n=2, positive_n=2, alpha=0.9,
                           cost_estimation="probability", allow_fallback=True)}


@pytest.mark.parametrize("seed", range(16))
def test_knapsack_dp_breaks_the_officials_float32_ties_as_it_does(seed):
    # float64 gains (r ** ks with an int64 array) pick another of two equal-rate prompts on some of these cases
    rng = np.random.default_rng(300 + seed)
    for _ in range(4):
        case = tie_heavy_case(rng)
        want = official(case)
        if want is not None:
            assert ours(case, "dp")[0] == want[0], case


def extras_value(counts: list[int], case: dict) -> float:
    """The official objective of an allocation: sum of Value(N, p) over the effective prompts given extras."""
    min_n = case["params"]["min_n"]
    return sum(float(value(c, p)) for c, p in zip(counts, case["rates"]) if 0 < p < 1 and c > min_n)


@pytest.mark.parametrize("seed", SEEDS)
def test_knapsack_greedy_reaches_the_official_optimum_and_its_counts_where_unique(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        continuous = bool(rng.random() < 0.5)
        case = random_knapsack_case(rng, continuous)
        want = official(case)
        if want is None:
            continue
        counts, _ = ours(case, "greedy")
        effective = [0 < p < 1 for p in case["rates"]]
        # the prompts outside the optimisation get what the official gives them, always
        assert [c for c, e in zip(counts, effective) if not e] == [c for c, e in zip(want[0], effective) if not e]
        assert extras_value(counts, case) == pytest.approx(extras_value(want[0], case), rel=1e-6, abs=1e-12)
        rates = [p for p, e in zip(case["rates"], effective) if e]
        if continuous and len(set(rates)) == len(rates):
            assert counts == want[0], case


# ============================================================================ Knapsack RL: the estimate
class OfficialSampleState:
    """``update_sample_state`` / ``get_sample_state`` (rl_dataset.py:129-229) for one prompt."""

    def __init__(self, min_buffer_length: int, reward_buffer_length: int, epoch_estimation: bool, robust: bool):
        self.min_len, self.buf, self.epoch, self.robust = min_buffer_length, reward_buffer_length, epoch_estimation, \
            robust
        self.rewards: list[list[int]] = []
        self.count, self.ema = 0, 0.0

    def update(self, rewards: list[int]) -> None:
        normalized = [0 if r == -1 else r for r in rewards]
        self.count += len(normalized)
        self.rewards.append(normalized)
        if self.epoch and not (len(normalized) < self.buf and self.robust):
            self.ema = float(np.mean(normalized))
            return
        flat: list[int] = []
        for visit in reversed(self.rewards):
            flat.extend(reversed(visit))
            if len(flat) >= self.buf:
                break
        self.ema = float(np.mean(flat[: self.buf]))

    def get(self) -> tuple[int, float]:
        if self.count == 0:
            return (1 if self.min_len == 0 else 0), 0.0
        return (1 if self.count >= self.min_len else 0), self.ema


@pytest.mark.parametrize("seed", SEEDS)
def test_knapsack_rate_is_the_official_estimate_over_random_visits(seed):
    rng = np.random.default_rng(200 + seed)
    for _ in range(6):
        params = dict(reward_buffer_length=int(rng.integers(1, 17)), min_buffer_length=int(rng.integers(0, 21)),
                      epoch_estimation=bool(rng.random() < 0.7), robust_epoch_estimation=bool(rng.random() < 0.7))
        port = OfficialSampleState(params["min_buffer_length"], params["reward_buffer_length"],
                                   params["epoch_estimation"], params["robust_epoch_estimation"])
        scorer = KnapsackRate(**params)
        history = PromptHistory(PromptTable.full(["d"], [1], column="row"))
        for step in range(int(rng.integers(0, 7))):
            rewards = rng.choice([-1, 0, 1], size=int(rng.integers(1, 25))).tolist()
            port.update(rewards)
            history.record(Batch.from_tensors(uid=torch.zeros(len(rewards), dtype=torch.long),
                                              prompt_index=torch.zeros(len(rewards), dtype=torch.long),
                                              rm_scores=torch.tensor(rewards, dtype=torch.float32)[:, None],
                                              response_mask=torch.ones(len(rewards), 1, dtype=torch.long)), step)
            batch = Batch.from_tensors(uid=torch.arange(1), **history.fields(torch.tensor([0])))
            p = float(scorer.score(batch, step).values[0])
            valid, ema = port.get()
            assert (p >= 0, p if p >= 0 else ema) == (bool(valid), ema), (params, step)


# ============================================================================ MoPPS
class OfficialPosterior:
    """``PosteriorSampler`` (mopps.py:7-79) fed as the authors' trainer feeds it: a rollout succeeds iff
    ``acc >= 1`` (our_ray_trainer.py:449-451), a group's success rate is ``sum / len`` (:61-87), and the
    posterior becomes a float32 torch scalar at its first update (a float plus a float32 tensor)."""

    def __init__(self, prior_alpha: float, prior_beta: float, decay: float, n: int):
        self.prior_alpha, self.prior_beta, self.decay, self.n = prior_alpha, prior_beta, decay, n
        self.alpha: dict[str, object] = {}
        self.beta: dict[str, object] = {}

    def posterior(self, index: int) -> tuple[float, float]:  # sample_batch's defaults (:35-42)
        return float(self.alpha.get(str(index), self.prior_alpha)), float(self.beta.get(str(index), self.prior_beta))

    def train(self, indices: list[int], rewards: torch.Tensor) -> None:
        acc = (rewards >= 1).int()
        rates = torch.tensor([row.sum() / len(row) for row in acc])
        n, lam = self.n, self.decay
        for index, s in zip(indices, rates):
            i = str(index)
            a, b = self.alpha.get(i, self.prior_alpha), self.beta.get(i, self.prior_beta)
            self.alpha[i] = a * lam + self.prior_alpha * (1 - lam) + s * n if n > 1 else 8
            self.beta[i] = b * lam + self.prior_beta * (1 - lam) + (1 - s) * n if n > 1 else 8


def groups_batch(prompts: list[int], rewards: torch.Tensor) -> Batch:
    """One group per prompt (rows contiguous), rewards ``[G, n]``."""
    g, n = rewards.shape
    return Batch.from_tensors(uid=torch.arange(g).repeat_interleave(n),
                              prompt_index=torch.tensor(prompts).repeat_interleave(n),
                              rm_scores=rewards.reshape(-1, 1), response_mask=torch.ones(g * n, 1, dtype=torch.long))


@pytest.mark.parametrize("seed", SEEDS)
def test_mopps_posterior_is_the_authors_over_random_runs_with_graded_rewards(seed):
    rng = np.random.default_rng(400 + seed)
    prompts, n = 12, int(rng.integers(2, 17))
    prior = float(rng.uniform(0.5, 5)), float(rng.uniform(0.5, 5))
    decay = float(rng.choice([1.0, 0.5, rng.uniform(0.3, 1.0)]))
    port = OfficialPosterior(*prior, decay, n)
    scorer = Mopps(prior_alpha=prior[0], prior_beta=prior[1], decay=decay)
    history = PromptHistory(PromptTable.full(["d"], [prompts], column="row"))
    history.own(scorer.prompt_state(), scorer.update_prompt_state)
    for step in range(8):
        chosen = rng.choice(prompts, size=int(rng.integers(1, prompts + 1)), replace=False).tolist()
        rewards = torch.tensor(rng.choice([0.0, 0.1, 0.5, 0.75, 1.0, 1.25], size=(len(chosen), n)),
                               dtype=torch.float32)
        port.train(chosen, rewards)
        history.record(groups_batch(chosen, rewards), step)
        ours_state = history.fields(torch.arange(prompts))["history_beta_posterior"]
        # the same posterior up to the official's float32 rounding
        want = torch.tensor([port.posterior(i) for i in range(prompts)], dtype=torch.float64)
        assert torch.allclose(ours_state, want, rtol=1e-5, atol=0), (step, ours_state, want)


def official_choice(draws: np.ndarray, b: int, strategy: str, lower: float, upper: float, target: float,
                    rng: np.random.Generator) -> set[int]:
    """``sample_batch``'s choice from its draws (mopps.py:47-65)."""
    if strategy == "topk":
        return set(np.argsort((draws - target) ** 2)[:b].tolist())
    inside = np.where((draws >= lower) & (draws <= upper))[0]
    if len(inside) >= b:
        rng.shuffle(inside)
        return set(inside[:b].tolist())
    scores = np.zeros_like(draws)
    low, high = draws < lower, draws > upper
    scores[low] = lower - draws[low]
    scores[high] = draws[high] - upper
    return set(np.argsort(scores)[:b].tolist())


def recording_draws(scorer: Mopps) -> list[np.ndarray]:
    """Keep the scorer's Thompson draws (its own generator) to hand the same ones to the port."""
    seen: list[np.ndarray] = []
    draw = scorer.draw

    def record(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        seen.append(draw(alpha, beta).numpy())
        return torch.from_numpy(seen[-1])

    scorer.draw = record  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("seed", SEEDS)
def test_mopps_top_b_keeps_what_the_authors_sampler_keeps_from_the_same_draws(seed):
    rng = np.random.default_rng(500 + seed)
    for _ in range(20):
        m, strategy = int(rng.integers(2, 40)), str(rng.choice(["topk", "threshold"]))
        b = int(rng.integers(1, m + 1))
        lower = float(rng.uniform(0, 0.6))
        params = dict(strategy=strategy, lower=lower, upper=float(rng.uniform(lower, 1)),
                      target_mean=float(rng.uniform(0.2, 0.8)), seed=int(rng.integers(1000)))
        scorer = Mopps(**params)
        seen = recording_draws(scorer)
        posterior = torch.from_numpy(rng.uniform(0.5, 20, size=(m, 2)))
        batch = Batch.from_tensors(uid=torch.arange(m), prompt_index=torch.arange(m),
                                   history_beta_posterior=posterior, budget_prompts=torch.tensor(b))
        keep = TopB().select(batch, scorer.score(batch, 0), 0).keep
        kept = set(torch.nonzero(keep).flatten().tolist())
        draws = seen[0]
        want = official_choice(draws, b, strategy, params["lower"], params["upper"], params["target_mean"], rng)
        inside = set(np.where((draws >= params["lower"]) & (draws <= params["upper"]))[0].tolist())
        if strategy == "threshold" and len(inside) >= b:
            assert len(kept) == b and kept <= inside  # the official keeps a random b of them: any b is its choice
        else:
            assert kept == want


# ============================================================================ GRESO
class OfficialGreso:
    """GRESO's ``all_probabilistic`` filter and its adaptation: the reward traces (presampling_selector.py:8-15,
    ray_trainer.py:1119-1132: one float32 group mean per rolled-out group), the easy-then-hard skip tests
    (presampling_selector.py:102-147, 230-249), the end-of-step move of ``p_easy``/``p_hard`` gated on
    ``epoch > 0`` (ray_trainer.py:1112-1114, 1199-1225) with R_easy/R_hard from ``compute_reward_metrics``
    (metric_utils.py:171-212: groups of 8 whose float32 rewards all equal 1, or all equal 0.1)."""

    def __init__(self, p_easy: float = 0.5, p_hard: float = 0.5, target: float = 0.25):
        self.trace: dict[int, list[tuple[int, float]]] = {}
        self.p_easy, self.p_hard = p_easy, p_hard
        self.targeted_easy, self.targeted_hard = target / 3, target * 2 / 3
        self.easy_num = self.hard_num = self.total_num = 0.0

    def keep_probability(self, prompt: int) -> float:
        trace = self.trace.get(prompt, [])
        if not trace:
            return 1.0
        count = 0
        for _, m in reversed(trace):
            if m < 0.98:
                break
            count += 1
        skip_easy = 1 - max(self.p_easy ** count, 0.01)
        skip_hard = 0.0
        if trace[-1][1] <= 0.11:
            count = 0
            for _, m in reversed(trace):
                if m > 0.11:
                    break
                count += 1
            skip_hard = 1 - max(self.p_hard ** count, 0.01)
        return (1 - skip_easy) * (1 - skip_hard)

    def rollout(self, epoch: int, prompts: list[int], rewards: torch.Tensor) -> None:
        view = rewards.reshape(-1).view(-1, 8)
        prompt_num, batch_num = view.size(0), rewards.numel()
        hard = (torch.logical_and(view.max(-1)[0] == 0.1, view.min(-1)[0] == 0.1).sum() / prompt_num).item()
        easy = (torch.logical_and(view.max(-1)[0] == 1, view.min(-1)[0] == 1).sum() / prompt_num).item()
        self.easy_num += easy * batch_num
        self.hard_num += hard * batch_num
        self.total_num += batch_num
        for prompt, m in zip(prompts, view.mean(dim=1).tolist()):
            self.trace.setdefault(prompt, []).append((epoch, m))

    def end_step(self, epoch: int) -> None:
        hard_ratio, easy_ratio = self.hard_num / self.total_num, self.easy_num / self.total_num
        if epoch > 0:
            self.p_hard = max(self.p_hard - 0.01, 0.05) if hard_ratio >= self.targeted_hard else \
                min(self.p_hard + 0.01, 0.95)
            self.p_easy = max(self.p_easy - 0.01, 0.05) if easy_ratio >= self.targeted_easy else \
                min(self.p_easy + 0.01, 0.95)
        self.easy_num = self.hard_num = self.total_num = 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_greso_keep_probabilities_and_adaptation_are_the_authors_over_random_runs(seed):
    # GRESO's setting: n = 8, rewards 0 (format error) / 0.1 (wrong) / 1 (right); the candidates come as its
    # dataloader gives them (passes over a shuffled table, chunks of 4) and a step ends after 1 to 3 chunks, the
    # first pass's last chunk always ending one (GRESO does not adapt after that step: it ended in epoch 0)
    rng = np.random.default_rng(600 + seed)
    prompts, chunk = 16, 4
    skill = rng.choice([0.0, 0.0, 0.05, 0.5, 0.95, 1.0, 1.0], size=prompts)
    port = OfficialGreso()
    scorer, greso = ZeroVarianceStreak(mode="greso"), Greso(seed=seed)
    history = PromptHistory(PromptTable.full(["d"], [prompts], column="row"), classes=scorer.visit_classes())
    stream = np.concatenate([rng.permutation(prompts) for _ in range(4)])
    position, step, boundary_steps, seen_p = 0, 0, 0, set()
    while position + 3 * chunk <= len(stream):
        chunks = int(rng.integers(1, 4))
        if position < prompts:
            chunks = min(chunks, (prompts - position) // chunk)
        for _ in range(chunks):
            index = torch.from_numpy(stream[position:position + chunk].copy())
            epoch = position // prompts
            batch = Batch.from_tensors(uid=torch.arange(chunk), prompt_index=index, **history.fields(index))
            history.consider(chunk)
            position += chunk
            score = scorer.score(batch, step)
            keep = greso.select(batch, score, step).keep
            assert (greso.p_easy, greso.p_hard) == (port.p_easy, port.p_hard), step
            seen_p.add((port.p_easy, port.p_hard))
            want = torch.tensor([port.keep_probability(int(i)) for i in index], dtype=torch.float64)
            assert torch.allclose(greso.keep_probability(score.values), want, rtol=1e-12, atol=1e-15), step
            rolled = index[keep].tolist()
            if not rolled:
                continue
            right = rng.random((len(rolled), 8)) < skill[rolled][:, None]
            wrong = np.where(rng.random((len(rolled), 8)) < 0.9, 0.1, 0.0)
            rewards = torch.tensor(np.where(right, 1.0, wrong), dtype=torch.float32)
            port.rollout(epoch, rolled, rewards)
            history.record(groups_batch(rolled, rewards), step)
        if port.total_num:  # GRESO's step ends when its batch is complete: it has rolled something out
            port.end_step(epoch)
            boundary_steps += position % prompts == 0
        history.end_step(step)
        step += 1
    assert step > 5 and len(seen_p) > 2 and boundary_steps > 0  # it adapted, and crossed the first pass's end


def test_greso_differs_from_the_authors_only_at_float32_edges():
    # (a) the group mean: float32 in GRESO (1 + 0.1 + 8 x 0) / 10 = 0.10999999940 <= 0.11, hard; float64 here,
    # 0.11000000015, other (never at GRESO's n = 8 with 0 / 0.1 / 1 rewards)
    rewards = torch.tensor([[1.0, 0.1] + [0.0] * 8])
    port = OfficialGreso()
    port.trace[0] = [(0, rewards.mean(dim=1).item())]
    history = PromptHistory(PromptTable.full(["d"], [1], column="row"), classes=VisitClasses(mode="greso"))
    history.record(groups_batch([0], rewards), 0)
    assert port.keep_probability(0) == pytest.approx(0.5) and int(history.fields(torch.tensor([0]))["history_class"]) \
        == 0
    # (b) a step exactly at the hard target 1/6 (7 of 10 groups, then none of 32): GRESO's float32 shares sum
    # to 0.1666666638 < 1/6 and raise p_hard; the exact comparison here lowers it
    port = OfficialGreso()
    port.rollout(1, list(range(10)), torch.tensor([[0.1] * 8] * 7 + [[1.0] * 4 + [0.0] * 4] * 3))
    port.rollout(1, list(range(32)), torch.tensor([[1.0] * 4 + [0.0] * 4] * 32))
    port.end_step(1)
    greso = Greso()
    batch = Batch.from_tensors(uid=torch.arange(1), prompt_index=torch.arange(1), history_counts_epoch=torch.tensor(1),
                               history_counts_step=torch.tensor(0), history_step_groups=torch.tensor(42),
                               history_step_easy=torch.tensor(0), history_step_hard=torch.tensor(7))
    greso.select(batch, Score(torch.zeros(1), "prompt"), 1)
    assert (port.p_hard, greso.p_hard) == (0.51, 0.49)


# ============================================================================ SPEED
def official_speed(accs: list[list[float]], initial_n: int, n_continue: int, train_batch_size: int) -> list[int]:
    """The groups SPEED trains on, in order, from one screening round with an empty buffer: ``update_prompts``
    qualifies a prompt of ``initial_n`` responses iff ``np.std`` of its ``acc`` values is > 0 (data_controller.py:
    139-177), the continuation repeats each qualified prompt ``n_continue // initial_n`` times (:96-121) and
    ``get_training_data`` takes the first ``train_batch_size`` prompts holding ``initial_n + n_continue``
    responses, in buffer order (:192-220)."""
    qualified = [g for g, acc in enumerate(accs) if len(acc) == initial_n and np.std(acc) > 0]
    responses = {g: initial_n + (n_continue // initial_n) * initial_n for g in qualified}
    return [g for g in qualified if responses[g] == initial_n + n_continue][:train_batch_size]


@pytest.mark.parametrize("seed", SEEDS)
def test_speed_continues_the_groups_the_authors_controller_trains_on(seed):
    # with binary accuracies (SPEED's acc: math_dapo.py, math_verify.py) and N_cont a multiple of N_init
    rng = np.random.default_rng(700 + seed)
    for _ in range(20):
        groups, initial_n = int(rng.integers(1, 20)), int(rng.choice([2, 4, 8]))
        n_continue, needed = initial_n * int(rng.integers(1, 4)), int(rng.integers(1, 20))
        skill = rng.choice([0.0, 0.2, 0.5, 0.9, 1.0], size=groups)
        accs = (rng.random((groups, initial_n)) < skill[:, None]).astype(np.float32)
        batch = groups_batch(list(range(groups)), torch.from_numpy(accs))
        out = Speed(n_continue=n_continue, max_n=initial_n + n_continue).allocate(
            batch, GroupSolveRate().score(batch, 0), 0, Budget(0, needed, initial_n))
        continued = out.counts.view(groups, initial_n)
        trained = official_speed(accs.tolist(), initial_n, n_continue, needed)
        assert torch.nonzero(continued[:, 0]).flatten().tolist() == trained
        assert bool((continued[trained] == n_continue).all()) and bool((continued.sum(1)[trained]).all())
        assert out.keep is not None and out.keep.view(groups, initial_n).all(1).tolist() == \
            [g in trained for g in range(groups)]


def test_speed_qualifies_by_its_success_count_where_graded_accuracies_differ_from_the_std_rule():
    # the official rule is std > 0 of acc; ours is 0 < k < G successes (reward > 0.5): the same on binary
    # accuracies, not on graded ones (docs/methods.md says which)
    accs = [[0.2, 0.4], [0.75, 0.75], [0.0, 1.0]]
    batch = groups_batch([0, 1, 2], torch.tensor(accs))
    out = Speed(n_continue=2).allocate(batch, GroupSolveRate().score(batch, 0), 0, Budget(0, 3, 2))
    assert out.counts.view(3, 2)[:, 0].tolist() == [0, 0, 2]
    assert official_speed(accs, 2, 2, 3) == [0, 2]
