"""The predictors and the actuators they feed, on random inputs, against ports of the authors' code:
DPS (``maoyixiu/DPS`` at 5654d528415e2c40026d5d37447342d1119c6c5b, ``recipe/dps/task_sampler.py``) and CurES
(``ZexuSun/CurES`` at eccf2983feb62ac977e309ea0f5566d892d1b721, ``epic/epic_sampler.py``); VIP published no code
(``HieuNT91/VIP`` at 3604dd42fdfe63e76eda9afa7027e3f9b1db6cf2 holds a README), so its GP and its allocation are
held to their equations with hand-checked vectors and a per-prompt NumPy solve."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dataflex_plugins.methods.predictors import Cures, Dps, Vip
from dataflex_plugins.methods.rules2026 import variance_counts

from dataflex_bus.predictor import Observation


# ---------------------------------------------------------------------------- DPS: the authors' sampler, ported
class DpsPort:
    """``BayesianHMMSampler`` as the authors wrote it (dict per prompt, one prompt at a time): get_alpha_pi,
    predict_next_state, update_transition_params, train (observed and unobserved prompts), sample_batch's topk."""

    def __init__(self, prior_alpha: np.ndarray, prior_pi: np.ndarray, decay: float) -> None:
        self.prior_alpha, self.prior_pi, self.decay = prior_alpha, prior_pi, decay
        self.alphas: dict[str, np.ndarray] = {}
        self.pis: dict[str, np.ndarray] = {}
        self.pis_before: dict[str, np.ndarray] = {}

    def get(self, index):
        index = str(index)
        self.alphas.setdefault(index, self.prior_alpha)
        self.pis.setdefault(index, self.prior_pi)
        self.pis_before.setdefault(index, self.prior_pi)
        return self.alphas[index], self.pis[index], self.pis_before[index]

    @staticmethod
    def predict_next_state(alpha, pi):
        p = alpha / alpha.sum(axis=0, keepdims=True)
        nxt = np.dot(p, pi)
        return nxt / nxt.sum()

    def update(self, alpha, pi, pi_next, lr):
        p = alpha / alpha.sum(axis=0, keepdims=True)
        numerator = np.outer(pi_next, pi) * p
        # the one deliberate difference: a transition the prior forbids adds no count (the authors: 0 / 0 = NaN)
        update = numerator / numerator.sum() * lr if numerator.sum() > 0 else 0.0 * numerator
        return alpha * self.decay + self.prior_alpha * (1 - self.decay) + update

    def sample_scores(self, candidates):
        return np.array([self.get(i)[1] for i in candidates])

    def train(self, indices, y):
        for idx, s in zip(indices, y):
            alpha, pi, before = self.get(idx)
            state = 0 if s == 0.0 else 2 if s == 1.0 else 1
            new = np.zeros_like(pi)
            new[state] = 1.0
            alpha_new = self.update(alpha, before, new, 1.0)
            self.alphas[str(idx)], self.pis_before[str(idx)] = alpha_new, new
            self.pis[str(idx)] = self.predict_next_state(alpha_new, new)
        seen = {str(i) for i in indices}
        for idx in list(self.alphas):
            if idx not in seen:
                alpha, pi, before = self.get(idx)
                alpha_new = self.update(alpha, before, pi, 0.0)
                self.alphas[idx], self.pis_before[idx] = alpha_new, pi
                self.pis[idx] = self.predict_next_state(alpha_new, pi)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prior", ["uniform", "progress", "stability", "local"])
def test_dps_matches_the_authors_sampler_on_random_steps(seed, prior):
    rng = np.random.default_rng(seed)
    n, group = 40, 4
    prior_pi = ["uniform", "1", "2", "3"][seed % 4]
    decay = float(rng.choice([0.7, 1.0, 0.5]))
    ours = Dps(prior=prior, prior_value=1.0, prior_pi=prior_pi, decay=decay)
    ours.bind(n)
    port = DpsPort(ours.prior_matrix.numpy(), ours.pi[0].numpy().copy(), decay)
    for step in range(12):
        candidates = rng.choice(n, size=16, replace=False)
        pred = ours.predict(torch.as_tensor(candidates), step)
        want = port.sample_scores(candidates)
        np.testing.assert_allclose(pred.columns["partial"].numpy(), want[:, 1], rtol=1e-12, atol=1e-12)
        # DPS's topk: the candidates with the highest P(partial), the same set
        k = 6  # the same top-k values (which of several tied candidates is taken is unspecified: argsort)
        mine = torch.sort(pred.columns["partial"], descending=True, stable=True).values[:k].numpy()
        np.testing.assert_allclose(mine, np.sort(want[:, 1])[::-1][:k], rtol=1e-12)
        visited = candidates[:8]
        successes = rng.integers(0, group + 1, size=visited.size)
        ours.observe(Observation(torch.as_tensor(visited), torch.full((visited.size,), group),
                                 torch.as_tensor(successes), step))
        ours.end_step(step)
        port.train(visited, successes / group)
        for idx, alpha in port.alphas.items():
            i = int(idx)
            np.testing.assert_allclose(ours.alpha[i].numpy(), alpha, rtol=1e-12)
            np.testing.assert_allclose(ours.pi[i].numpy(), port.pis[idx], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(ours.pi_before[i].numpy(), port.pis_before[idx], rtol=1e-12, atol=1e-15)
    # prompts the authors never touched keep the prior, as in ours
    untouched = [i for i in range(n) if str(i) not in port.alphas]
    assert all(torch.equal(ours.alpha[i], ours.prior_matrix) for i in untouched)


# ---------------------------------------------------------------------------- CurES
class CuresPort:
    """``EpicSampler``: counters, ``update_difficulty`` (the Beta(alpha + 1, beta + 1) mean) and ``__iter__``'s
    sampling probabilities."""

    def __init__(self, n: int) -> None:
        self.counter = [{"Accepted": 0, "All": 0} for _ in range(n)]

    def add(self, index: int, accepted: int, size: int) -> None:
        self.counter[index]["Accepted"] += accepted
        self.counter[index]["All"] += size

    def difficulties(self) -> np.ndarray:
        return np.array([(c["Accepted"] + 1) / (c["All"] + 2) for c in self.counter])

    def probs(self) -> np.ndarray:
        w = self.difficulties()
        alpha = np.array([c["Accepted"] for c in self.counter], dtype=np.float64)
        t = (alpha + 1) / 1e-2
        scores = np.exp(np.sqrt(w * (1 - w)) / t)
        return scores / scores.sum()


@pytest.mark.parametrize("seed", range(5))
def test_cures_posterior_and_sampling_law_match_the_authors(seed):
    from dataflex_plugins.methods.predictors import Predicted

    from dataflex_bus.batch import Batch

    rng = np.random.default_rng(seed)
    n = 30
    ours, port = Cures(), CuresPort(n)
    ours.bind(n)
    for step in range(8):
        at = rng.choice(n, size=10, replace=False)
        size = rng.integers(1, 9, size=at.size)
        acc = rng.integers(0, size + 1)
        ours.observe(Observation(torch.as_tensor(at), torch.as_tensor(size), torch.as_tensor(acc), step))
        for i, s, a in zip(at, size, acc):
            port.add(int(i), int(a), int(s))
    everyone = torch.arange(n)
    pred = ours.predict(everyone, 0)
    np.testing.assert_allclose(pred.p.numpy(), port.difficulties(), rtol=1e-12)
    # the scorer's `cures` transform is the log of the authors' sampling score: softmax of it = their law
    batch = Batch.from_tensors(uid=everyone, is_padding=torch.zeros(n, dtype=torch.bool), prompt_index=everyone,
                               predicted_p=pred.p, predicted_accepted=pred.columns["accepted"])
    score = Predicted(transform="cures").score(batch, 0)
    np.testing.assert_allclose(torch.softmax(score.values, 0).numpy(), port.probs(), rtol=1e-10)


def test_weighted_draw_samples_without_replacement_by_exp_score():
    """Gumbel-top-1 picks candidate i with probability softmax(score)_i (the law of np.random.choice)."""
    from dataflex_plugins.methods.rules2026 import WeightedDraw

    from dataflex_bus.batch import Batch
    from dataflex_bus.components import Score

    n = 4
    values = torch.tensor([0.0, math.log(2.0), math.log(3.0), math.log(4.0)], dtype=torch.float64)
    batch = Batch.from_tensors(uid=torch.arange(n), is_padding=torch.zeros(n, dtype=torch.bool),
                               prompt_index=torch.arange(n), budget_prompts=torch.tensor(1))
    draw = WeightedDraw(seed=1)
    picks = torch.stack([draw.select(batch, Score(values, "prompt"), 0).keep for _ in range(20_000)])
    freq = picks.to(torch.float64).mean(0)
    assert freq.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.012)


# ---------------------------------------------------------------------------- the variance allocation
@pytest.mark.parametrize("seed", range(8))
def test_variance_counts_solve_the_convex_split(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 40))
    min_n, max_n = 2, int(rng.integers(6, 40))
    total = int(rng.integers(k * min_n, k * max_n + 1))
    p = torch.as_tensor(rng.uniform(0, 1, size=k))
    n = variance_counts(p, total, min_n, max_n)
    assert int(n.sum()) == total and int(n.min()) >= min_n and int(n.max()) <= max_n
    # the integer optimum of sum p(1-p)/n (separable, convex: greedy on marginal gains is exact)
    var = (p * (1 - p)).numpy()
    best = np.full(k, min_n)
    for _ in range(total - k * min_n):
        gain = np.where(best < max_n, var / best - var / (best + 1), -1.0)
        best[int(np.argmax(gain))] += 1
    objective = float((var / n.numpy()).sum())
    optimum = float((var / best).sum())
    assert objective <= optimum * (1 + 1e-2) + 1e-12


def test_variance_counts_hand_vector():
    # p(1-p) = 0.25, 0.09, 0 -> sqrt 0.5, 0.3, 0; budget 20 within [2, 16]: the zero-variance prompt keeps 2,
    # the other 18 go 0.5 : 0.3 -> 11.25, 6.75 -> floors 11, 6, the last one to the larger remainder (6.75)
    n = variance_counts(torch.tensor([0.5, 0.1, 1.0], dtype=torch.float64), 20, 2, 16)
    assert n.tolist() == [11, 7, 2]


# ---------------------------------------------------------------------------- VIP's GP
def test_vip_gp_hand_vectors():
    vip = Vip(window=4, lengthscale=20.0, amplitude=0.05, noise=0.02)
    vip.bind(3)
    # never seen: the prior mean (0.5 before any step's mean), the prior std
    pred = vip.predict(torch.tensor([0]), 0)
    assert pred.p.tolist() == [0.5] and pred.columns["std"].tolist() == pytest.approx([math.sqrt(0.05)])
    vip.observe(Observation(torch.tensor([1]), torch.tensor([4]), torch.tensor([4]), 0))
    # one observation y = 1 at the step predicted: m + a / (a + s) (y - m) = 0.5 + 0.05 / 0.07 * 0.5
    pred = vip.predict(torch.tensor([1]), 0)
    assert pred.p.item() == pytest.approx(0.5 + 0.05 / 0.07 * 0.5)
    assert pred.columns["std"].item() == pytest.approx(math.sqrt(0.05 - 0.05**2 / 0.07))
    vip.end_step(0)  # the step's mean (1.0) is the next prior mean
    assert vip.predict(torch.tensor([2]), 1).p.tolist() == [1.0]


@pytest.mark.parametrize("seed", range(4))
def test_vip_batched_gp_equals_a_per_prompt_numpy_solve(seed):
    rng = np.random.default_rng(seed)
    n, w = 12, 3
    vip = Vip(window=w, lengthscale=7.0, amplitude=0.08, noise=0.03)
    vip.bind(n)
    for step in range(9):
        at = rng.choice(n, size=5, replace=False)
        size = np.full(at.size, 4)
        vip.observe(Observation(torch.as_tensor(at), torch.as_tensor(size),
                                torch.as_tensor(rng.integers(0, 5, size=at.size)), step))
        vip.end_step(step)
    t_now = 9
    got = vip.predict(torch.arange(n), t_now)
    m = float(vip.mean[0])
    for i in range(n):
        have = vip.steps[i].numpy() >= 0
        t, y = vip.steps[i].numpy()[have], vip.rates[i].numpy()[have]
        if t.size == 0:
            mean = m
        else:
            k = 0.08 * np.exp(-0.5 * ((t[:, None] - t[None, :]) / 7.0) ** 2) + 0.03 * np.eye(t.size)
            ks = 0.08 * np.exp(-0.5 * ((t - t_now) / 7.0) ** 2)
            mean = m + ks @ np.linalg.solve(k, y - m)
        assert got.p[i].item() == pytest.approx(min(max(mean, 0.0), 1.0), abs=1e-8)
