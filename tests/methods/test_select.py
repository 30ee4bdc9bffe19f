"""Selectors: band boundaries on integer counts, DAPO, top-k rounding and ties, PODS max-variance."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dataflex_bus.components import Score
from dataflex_bus.errors import BatchFieldError, ConfigError

from .helpers import batch_of, component, row_score


def _gsr(b, threshold=0.5):
    return component("scorer", "group_solve_rate", success_threshold=threshold).score(b, 0)


def _groups_with_k(group_size, ks):
    rewards, uid = [], []
    for g, k in enumerate(ks):
        rewards += [1.0] * k + [0.0] * (group_size - k)
        uid += [f"g{g}"] * group_size
    return batch_of(rewards, uid)


# ------------------------------------------------------------------ threshold_band
def test_band_g5_inclusive_keeps_k1_to_k4():
    b = _groups_with_k(5, [0, 1, 2, 3, 4, 5])
    sel = component("actuator", "threshold_band", low=0.2, high=0.8).select(b, _gsr(b), 0)
    kept_k = sorted({int(k) for k in _gsr(b).counts[sel.keep].tolist()})
    assert kept_k == [1, 2, 3, 4]
    # whole groups only
    assert sel.keep.view(6, 5).all(1).tolist() == [False, True, True, True, True, False]


def test_band_g5_strict_keeps_k2_k3():
    b = _groups_with_k(5, [0, 1, 2, 3, 4, 5])
    sel = component("actuator", "threshold_band", low=0.2, high=0.8, inclusive=False).select(b, _gsr(b), 0)
    assert sel.keep.view(6, 5).all(1).tolist() == [False, False, True, True, False, False]


def test_band_float32_seven_tenths_boundary_decided_on_counts():
    b = _groups_with_k(10, [6, 7])
    s = _gsr(b)
    assert float(s.values[10]) < 0.7  # the float32 trap: 7/10 is stored below 0.7
    sel = component("actuator", "threshold_band", low=0.7, high=1.0).select(b, s, 0)
    assert sel.keep.view(2, 10).all(1).tolist() == [False, True]
    # without the counts the float comparison would have dropped k=7
    floats = Score(values=s.values, granularity="prompt")
    sel2 = component("actuator", "threshold_band", low=0.7, high=1.0).select(b, floats, 0)
    assert not bool(sel2.keep.any())


def test_band_on_raw_scores_compares_floats_and_drops_padding():
    b = batch_of([0, 0, 0, 0, 0], ["a", "b", "c", "d", "e"], padding=[False] * 4 + [True])
    s = row_score([-1.0, 0.5, 2.0, 2.5, 1.0])
    inc = component("actuator", "threshold_band", low=0.5, high=2.0).select(b, s, 0)
    assert inc.keep.tolist() == [False, True, True, False, False]
    strict = component("actuator", "threshold_band", low=0.5, high=2.0, inclusive=False).select(b, s, 0)
    assert strict.keep.tolist() == [False, False, False, False, False]
    assert inc.metrics["band/below_rows"] == pytest.approx(0.25)
    assert inc.metrics["band/above_rows"] == pytest.approx(0.25)


def test_band_low_above_high_is_a_config_error():
    with pytest.raises(ConfigError, match="low"):
        component("actuator", "threshold_band", low=0.9, high=0.1)


def test_band_nan_score_names_the_selector():
    b = batch_of([0, 0], ["a", "b"])
    with pytest.raises(BatchFieldError, match=r"threshold_band.*score"):
        component("actuator", "threshold_band", low=0, high=1).select(b, row_score([0.1, float("nan")]), 0)


def test_band_mixed_group_sizes_and_singletons():
    # sizes 5 (k=1), 1 (k=1: rate 1.0), 3 (k=2: 0.667), 2 (k=1: 0.5)
    rewards = [1, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0]
    uid = ["a"] * 5 + ["s"] + ["c"] * 3 + ["d"] * 2
    b = batch_of(rewards, uid)
    sel = component("actuator", "threshold_band", low=0.2, high=0.8).select(b, _gsr(b), 0)
    assert sel.keep.tolist() == [True] * 5 + [False] + [True] * 3 + [True] * 2


# ------------------------------------------------------------------ dapo
def test_dapo_drops_uniform_groups_keeps_singletons_and_ignores_padding():
    rewards = [1, 1, 1, 0, 1, 0, 0.5, 0.5, 3.0, 0.5]
    uid = ["all1"] * 3 + ["mixed"] * 3 + ["same"] * 2 + ["single", "same"]
    pad = [False] * 9 + [True]  # the padding row's reward would make "same" look varied
    b = batch_of(rewards, uid, padding=pad)
    sel = component("actuator", "dapo").select(b, row_score([0.0] * 10), 0)
    assert sel.keep.tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True, False]
    assert sel.metrics["dapo/uniform_groups"] == 2.0


def test_dapo_metric_score_uses_the_scorer_values():
    b = batch_of([1, 1, 0, 0], ["a", "a", "b", "b"])
    sel = component("actuator", "dapo", metric="score").select(b, row_score([0.1, 0.2, 0.3, 0.3]), 0)
    assert sel.keep.tolist() == [True, True, False, False]


# ------------------------------------------------------------------ topk_fraction
@pytest.mark.parametrize(("fraction", "n", "k"), [(0.5, 5, 3), (0.5, 3, 2), (0.5, 1, 1), (0.1, 4, 1),
                                                  (1.0, 4, 4), (0.3, 5, 2), (0.7, 5, 4)])
def test_topk_rounds_half_up(fraction, n, k):
    b = batch_of([0] * n, [f"g{i}" for i in range(n)])
    sel = component("actuator", "topk_fraction", fraction=fraction).select(b, row_score(list(range(n))), 0)
    assert int(sel.keep.sum()) == k == math.floor(fraction * n + 0.5) or k == 1
    assert sel.keep.tolist() == [i >= n - k for i in range(n)]


def test_topk_ties_go_to_the_earlier_row_in_both_directions():
    b = batch_of([0] * 6, list("abcdef"))
    s = row_score([1.0, 2.0, 2.0, 1.0, 2.0, 1.0])
    top = component("actuator", "topk_fraction", fraction=0.5).select(b, s, 0)
    assert top.keep.tolist() == [False, True, True, False, True, False]
    top2 = component("actuator", "topk_fraction", fraction=0.3).select(b, s, 0)  # k = 2
    assert top2.keep.tolist() == [False, True, True, False, False, False]
    low2 = component("actuator", "topk_fraction", fraction=0.3, largest=False).select(b, s, 0)
    assert low2.keep.tolist() == [True, False, False, True, False, False]


def test_topk_counts_real_rows_only_and_never_keeps_padding():
    b = batch_of([0] * 5, list("abcde"), padding=[True, False, False, True, False])
    s = row_score([100.0, 1.0, 2.0, 100.0, 3.0])
    sel = component("actuator", "topk_fraction", fraction=0.5).select(b, s, 0)  # N=3 -> k=2
    assert sel.keep.tolist() == [False, False, True, False, True]
    low = component("actuator", "topk_fraction", fraction=1.0, largest=False).select(b, s, 0)
    assert low.keep.tolist() == [False, True, True, False, True]


def test_topk_nan_is_an_error_and_fraction_range_is_checked():
    b = batch_of([0, 0], ["a", "b"])
    with pytest.raises(BatchFieldError, match="topk_fraction"):
        component("actuator", "topk_fraction").select(b, row_score([float("nan"), 1.0]), 0)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="fraction"):
            component("actuator", "topk_fraction", fraction=bad)


def test_topk_all_padding_keeps_nothing():
    b = batch_of([0, 0], ["a", "b"], padding=[True, True])
    sel = component("actuator", "topk_fraction").select(b, row_score([1.0, 2.0]), 0)
    assert not bool(sel.keep.any())


# ------------------------------------------------------------------ max_variance (PODS)
def _mv(b, frac=0.5, eps=1e-4, score=None):
    s = score or component("scorer", "reward_difficulty").score(b, 0)
    return component("actuator", "max_variance", keep_fraction=frac, eps=eps).select(b, s, 0)


def test_max_variance_hand_case_and_subset_advantages():
    # G=4, m=2: rewards [0, 1, 1, 0] -> best is one low + one high: rows 0 (first 0) and 2 (last 1).
    b = batch_of([0, 1, 1, 0], ["a"] * 4, lengths=[6, 4, 2, 5])
    sel = _mv(b)
    assert sel.keep.tolist() == [True, False, True, False]
    std = math.sqrt(0.5)  # unbiased std of {0, 1}
    a = 0.5 / (std + 1e-4)
    expected_rows = torch.tensor([-a, 0.0, a, 0.0])
    assert torch.allclose(sel.advantages[:, 0], expected_rows, atol=1e-6)
    # broadcast over valid tokens only
    assert sel.advantages[2].tolist()[:2] == pytest.approx([a, a]) and sel.advantages[2, 2:].abs().sum() == 0
    assert sel.advantages[0, :6].tolist() == pytest.approx([-a] * 6)


def test_max_variance_official_tie_order_prefers_a_zero():
    # All-equal rewards: every subset has variance 0, so a=0 (the m highest, last in stable order) wins.
    b = batch_of([1, 1, 1, 1], ["a"] * 4)
    sel = _mv(b)
    assert sel.keep.tolist() == [False, False, True, True]
    assert sel.advantages.abs().sum() == 0  # (r - mean) = 0 exactly


def test_max_variance_tie_between_a_values_follows_scan_order():
    # rewards sorted [0, 1, 2, 3], m=2: a=2 -> {0,1} var .5; a=0 -> {2,3} var .5; a=1 -> {0,3} var 4.5
    b = batch_of([3, 0, 2, 1], ["a"] * 4)
    assert _mv(b).keep.tolist() == [True, True, False, False]
    # m=3 on [0, 0, 1, 1, 1]: a=0 {1,1,1} 0; a=3 {0,0,1} 1/3; a=2 {0,0,1} 1/3 (tie, not strictly better);
    # a=1 {0,1,1} 1/3. First maximum in the order 0,3,2,1 is a=3: the two zeros + the lowest one.
    b = batch_of([1, 0, 1, 0, 1], ["a"] * 5)
    assert _mv(b, frac=0.6).keep.tolist() == [True, True, False, True, False]


def test_max_variance_singletons_mixed_sizes_and_padding():
    rewards = [2.0, 0, 1, 1, 0, 1, 0, 5.0, 9.0]
    uid = ["s", "a", "a", "a", "b", "b", "b", "b", "p"]  # "b" has 4 rows, padding row last
    b = batch_of(rewards, uid, padding=[False] * 8 + [True])
    sel = _mv(b)
    keep = sel.keep.tolist()
    assert keep[0] is True  # singleton: m = 1, verl convention mean 0 std 1 -> A = r / (1 + eps)
    assert sel.advantages[0, 0].item() == pytest.approx(2.0 / (1 + 1e-4))
    assert sum(keep[1:4]) == 2 and sum(keep[4:8]) == 2 and keep[8] is False  # m = floor(1.5+.5)=2, 2
    assert keep[4:8] == [True, False, False, True]  # 0 (lowest) and 5.0 (highest)
    assert sel.advantages[8].abs().sum() == 0


def test_max_variance_uses_the_score_for_selection_and_rewards_for_advantages():
    b = batch_of([0, 1, 0, 1], ["a"] * 4)
    sel = _mv(b, score=row_score([10.0, 0.0, 0.0, 0.0]))
    # variance of the score: the 10 plus one 0. a=0 (the two highest in (score, row) order: rows 3, 0)
    # comes first in the scan; a=1 (rows 1, 0) ties and is not a strict improvement.
    assert sel.keep.tolist() == [True, False, False, True]
    # advantages from the rewards of the kept rows {0, 1}
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert sel.advantages[:, 0].tolist() == pytest.approx([-a, 0, 0, a])


def test_max_variance_declares_post_advantage_and_groups():
    from dataflex_plugins.methods.select import MaxVariance

    assert MaxVariance.min_timing == "post_advantage" and MaxVariance.needs_groups


def _brute_force_best(values, m):
    best = -1.0
    for subset in itertools.combinations(range(len(values)), m):
        v = torch.tensor([values[i] for i in subset], dtype=torch.float64)
        var = float(v.var()) if m > 1 else 0.0
        best = max(best, var)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_max_variance_matches_brute_force_on_small_groups(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 8, (5,), generator=g).tolist()
    rewards = (torch.randint(0, 4, (sum(sizes),), generator=g).float() / 2).tolist()
    if seed % 2:
        rewards = torch.randn(sum(sizes), generator=g).tolist()
    uid = [f"g{i}" for i, n in enumerate(sizes) for _ in range(n)]
    b = batch_of(rewards, uid)
    frac = [0.3, 0.5, 0.75][seed % 3]
    sel = _mv(b, frac=frac)
    start = 0
    for n in sizes:
        m = min(max(math.floor(frac * n + 0.5), 1), n)
        kept = sel.keep[start:start + n]
        assert int(kept.sum()) == m
        vals = [b.rewards[start + i].item() for i in range(n)]
        got = [vals[i] for i in range(n) if kept[i]]
        got_var = float(torch.tensor(got, dtype=torch.float64).var()) if m > 1 else 0.0
        assert got_var == pytest.approx(_brute_force_best(vals, m), rel=1e-9, abs=1e-12)
        adv = sel.advantages[start:start + n, 0][kept]
        if m > 1:
            assert float(adv.double().sum()) == pytest.approx(0.0, abs=1e-5)
        start += n
