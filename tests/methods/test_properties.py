"""Property tests over random batches: shapes, mixed group sizes, singletons, padding, ties."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflex_bus.components import Score

from .helpers import batch_of, component

NAMES = ["a", "b", "c"]
SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def batches(draw, max_groups=6, max_size=6, tokens=5, ties=None):
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    discrete = draw(st.booleans()) if ties is None else ties
    reward = st.sampled_from([0.0, 0.5, 1.0]) if discrete else st.floats(-3, 3, allow_nan=False, width=32)
    rows = []
    for g, n in enumerate(sizes):
        for _ in range(n):
            rows.append((draw(reward), f"g{g}", False))
    for p in range(draw(st.integers(0, 3))):
        pos = draw(st.integers(0, len(rows)))
        rows.insert(pos, (draw(reward), f"pad{p}", True))
    n = len(rows)
    lengths = draw(st.lists(st.integers(0, tokens), min_size=n, max_size=n))
    doms = draw(st.lists(st.sampled_from(NAMES), min_size=n, max_size=n))
    return batch_of([r for r, _, _ in rows], [u for _, u, _ in rows], lengths=lengths, tokens=tokens,
                    padding=[p for _, _, p in rows], domains=doms, domain_names=NAMES)


def _whole_groups(b, keep):
    g = b.group_index
    for grp in range(b.num_groups):
        rows = keep[g == grp]
        if not (bool(rows.all()) or not bool(rows.any())):
            return False
    return True


@SETTINGS
@given(batches(), st.floats(0, 1), st.floats(0, 1), st.booleans())
def test_band_and_dapo_keep_whole_groups_never_padding(b, x, y, inclusive):
    low, high = min(x, y), max(x, y)
    s = component("scorer", "group_solve_rate").score(b, 0)
    band = component("actuator", "threshold_band", low=low, high=high, inclusive=inclusive).select(b, s, 0)
    dapo = component("actuator", "dapo").select(b, s, 0)
    for keep in (band.keep, dapo.keep):
        assert keep.shape == (len(b),) and not bool((keep & b.is_padding).any())
        assert _whole_groups(b, keep)
    # band decided on integers: compare with exact rational arithmetic
    for i in torch.nonzero(b.valid_rows).flatten().tolist():
        k, n = int(s.counts[i]), int(s.totals[i])
        inside = (low * n <= k <= high * n) if inclusive else (low * n < k < high * n)
        near = min(abs(k - low * n), abs(k - high * n)) < 1e-6
        if not near:
            assert bool(band.keep[i]) == inside


@SETTINGS
@given(batches(), st.floats(0.01, 1.0), st.booleans())
def test_topk_keeps_exactly_k_best_real_rows(b, fraction, largest):
    s = component("scorer", "reward_difficulty").score(b, 0)
    keep = component("actuator", "topk_fraction", fraction=fraction, largest=largest).select(b, s, 0).keep
    n = int(b.valid_rows.sum())
    k = min(max(math.floor(fraction * n + 0.5), 1), n)
    assert int(keep.sum()) == k and not bool((keep & b.is_padding).any())
    dropped = b.valid_rows & ~keep
    if bool(dropped.any()):
        if largest:
            assert float(s.values[keep].min()) >= float(s.values[dropped].max())
        else:
            assert float(s.values[keep].max()) <= float(s.values[dropped].min())


def _best_variance(values, m):
    best = 0.0
    for subset in itertools.combinations(values, m):
        if m > 1:
            best = max(best, float(torch.tensor(subset, dtype=torch.float64).var()))
    return best


@SETTINGS
@given(batches(), st.floats(0.05, 1.0))
def test_max_variance_is_optimal_and_subset_advantages_centre(b, frac):
    s = component("scorer", "reward_difficulty").score(b, 0)
    sel = component("actuator", "max_variance", keep_fraction=frac).select(b, s, 0)
    assert not bool((sel.keep & b.is_padding).any())
    assert sel.advantages.shape == b.token_mask.shape
    assert bool((sel.advantages[~b.token_mask] == 0).all())
    g = b.group_index
    for grp in range(b.num_groups):
        rows = torch.nonzero(g == grp).flatten()
        n = rows.numel()
        m = min(max(math.floor(frac * n + 0.5), 1), n)
        kept = rows[sel.keep[rows]]
        assert kept.numel() == m
        vals = s.values[rows].tolist()
        got = float(s.values[kept].double().var()) if m > 1 else 0.0
        assert math.isclose(got, _best_variance(vals, m), rel_tol=1e-9, abs_tol=1e-9)
        if m > 1:
            adv = (sel.advantages[kept].sum(-1) / b.lengths[kept].clamp_min(1)).double()
            has_tokens = b.lengths[kept] > 0
            r = b.rewards[kept].double()
            expected = (r - r.mean()) / (r.std() + 1e-4)
            assert torch.allclose(adv[has_tokens], expected[has_tokens], atol=1e-5)
            assert abs(float(expected.sum())) < 1e-6


@SETTINGS
@given(batches(ties=False), st.floats(0.05, 5.0), st.sampled_from(["row", "token"]),
       st.floats(0, 2), st.floats(0, 1))
def test_reweight_weights_finite_nonnegative_and_normalised(b, temperature, normalize, alpha, beta):
    s = component("scorer", "reward_difficulty").score(b, 0)
    valid = b.valid_rows
    n = int(valid.sum())
    w = component("actuator", "softmax", temperature=temperature, normalize=normalize).reweight(b, s, 0).weights
    assert w.shape == (len(b),) and bool(torch.isfinite(w).all()) and bool((w >= 0).all())
    wd, lengths = w.double(), b.lengths.double()
    if normalize == "row" and n:
        assert math.isclose(float(wd[valid].mean()), 1.0, rel_tol=1e-5)
    if normalize == "token" and float(lengths.sum()) > 0 and float((wd * lengths)[valid].sum()) > 0:
        assert math.isclose(float((wd * lengths)[valid].sum() / lengths.sum()), 1.0, rel_tol=1e-5)
    w = component("actuator", "per_advantage", alpha=alpha, beta=beta).reweight(b, s, 0).weights
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all())
    if n:
        assert math.isclose(float(w.double()[valid].mean()), 1.0, rel_tol=1e-5)


@SETTINGS
@given(batches(), st.floats(0, 1))
def test_advantage_reweight_bounds(b, alpha):
    s = component("scorer", "token_prob").score(b, 0)
    w = component("actuator", "advantage_reweight", alpha=alpha).reweight(b, s, 0).weights
    tm = b.token_mask
    p = torch.exp(b["old_log_probs"])
    assert torch.allclose(w[tm], (alpha * p + 1 - alpha)[tm])
    assert bool((w[tm] >= 1 - alpha - 1e-6).all()) and bool((w[tm] <= 1 + 1e-6).all())


@SETTINGS
@given(st.lists(batches(), min_size=2, max_size=5), st.floats(0.01, 2.0), st.integers(1, 6),
       st.floats(0, 0.33), st.floats(0, 0.9))
def test_mixers_probabilities_and_resume(steps, temperature, window, floor, momentum):
    split = len(steps) // 2

    def fresh():
        dump = component("actuator", "dump_ucb", window=window, temperature=temperature)
        gap = component("actuator", "reward_gap", temperature=temperature, floor=floor, momentum=momentum)
        for m in (dump, gap):
            m.set_domains(NAMES)
        return dump, gap

    def feed(mixers, batches_):
        out = []
        for i, b in enumerate(batches_):
            s = Score(values=b.rewards, granularity="response")
            for m in mixers:
                m.update(b, s, i)
                p = m.probabilities()
                assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-9)
                assert bool((p >= 0).all())
                out.append(p)
        return out

    a = fresh()
    feed(a, steps[:split])
    assert bool((a[1].probabilities() >= floor - 1e-12).all())
    b = fresh()
    for src, dst in zip(a, b):
        dst.load_state_dict(src.state_dict())
    for pa, pb in zip(feed(a, steps[split:]), feed(b, steps[split:])):
        assert torch.equal(pa, pb)
