"""The t distribution and the paired statistics of `dataflex compare`, against reference values.

Reference values were computed offline with scipy 1.17 (`scipy.stats.t`, `scipy.special.betainc`,
`scipy.stats.ttest_rel`) and are hard-coded: scipy is not a dependency.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflex_bus.shim.stats import (
    betainc,
    mean_ci,
    paired_difference,
    significance_mark,
    t_cdf,
    t_ppf,
    t_two_sided_p,
)

# df -> (t.ppf(0.975), t.ppf(0.995), t.cdf(1.3), t.cdf(-2.1), 2 * t.sf(8.5))
T_REFERENCE = {
    1: (12.706204736174694, 63.656741162871526, 0.7912855998398473, 0.141463028121509, 0.07455374230841037),
    2: (4.302652729749462, 9.924843200918287, 0.8383764840919798, 0.08527493459498375, 0.013559949584378917),
    3: (3.1824463052837078, 5.840909309733355, 0.8577662456360515, 0.0632826012748423, 0.003419691416344476),
    4: (2.7764451051977934, 4.604094871349992, 0.868274201764388, 0.05182664315880109, 0.0010505780707892498),
    9: (2.262157162798205, 3.249835541592126, 0.8870468136634754, 0.03255914120607598, 1.3594073222356529e-05),
    29: (2.045229642132703, 2.756385903670605, 0.898080408168985, 0.022270979018145207, 2.2980332862819147e-09),
    1.5: (6.016663104427929, 17.820310514462804, 0.8209853043992096, 0.10567271776471907, 0.030099219550139677),
}
BETAINC_REFERENCE = [
    (0.5, 0.5, 0.3, 0.36901011956554536),
    (2, 3, 0.4, 0.5248),  # closed form: polynomial in x for integer a, b
    (10, 0.5, 0.95, 0.31715157546554495),
    (0.5, 20, 0.01, 0.4713699354850154),
    (50, 40, 0.55, 0.45479521086387),
    (1, 1, 0.77, 0.77),  # uniform
]


@pytest.mark.parametrize("df", sorted(T_REFERENCE))
def test_t_distribution_matches_reference_values(df):
    q975, q995, cdf_pos, cdf_neg, p_two = T_REFERENCE[df]
    assert t_ppf(0.975, df) == pytest.approx(q975, rel=1e-12)
    assert t_ppf(0.995, df) == pytest.approx(q995, rel=1e-12)
    assert t_ppf(0.025, df) == pytest.approx(-q975, rel=1e-12)
    assert t_cdf(1.3, df) == pytest.approx(cdf_pos, rel=1e-12)
    assert t_cdf(-2.1, df) == pytest.approx(cdf_neg, rel=1e-12)
    assert t_two_sided_p(8.5, df) == pytest.approx(p_two, rel=1e-10)
    assert t_two_sided_p(-8.5, df) == t_two_sided_p(8.5, df)


@pytest.mark.parametrize(("a", "b", "x", "expected"), BETAINC_REFERENCE)
def test_betainc_matches_reference_values(a, b, x, expected):
    assert betainc(a, b, x) == pytest.approx(expected, rel=1e-12)
    assert betainc(b, a, 1 - x) == pytest.approx(1 - expected, rel=1e-12, abs=1e-15)


def test_t_edges():
    assert t_cdf(0.0, 3) == 0.5 and t_ppf(0.5, 7) == 0.0
    assert t_two_sided_p(0.0, 4) == 1.0 and t_two_sided_p(math.inf, 4) == 0.0
    # df = 1 is the Cauchy distribution: quantile tan(pi (p - 1/2))
    assert t_ppf(0.9, 1) == pytest.approx(math.tan(math.pi * 0.4), rel=1e-12)
    # large df tends to the normal quantile 1.959963984540054
    assert t_ppf(0.975, 1e7) == pytest.approx(1.959963984540054, rel=1e-6)
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_ppf(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="a > 0 and b > 0"):
        betainc(0, 1, 0.5)


@settings(max_examples=200, deadline=None)
@given(p=st.floats(1e-6, 1 - 1e-6), df=st.floats(0.5, 200))
def test_quantile_inverts_the_cdf(p, df):
    assert t_cdf(t_ppf(p, df), df) == pytest.approx(p, rel=1e-9, abs=1e-12)


def test_mean_ci_is_the_hand_computed_t_interval():
    values = [0.56, 0.55, 0.52, 0.60, 0.57]
    est = mean_ci(values)
    mean = 2.80 / 5
    # squared deviations from 0.56: 0, 0.0001, 0.0016, 0.0016, 0.0001 -> 0.0034 / (n - 1)
    std = math.sqrt(0.0034 / 4)
    half = 2.7764451051977934 * std / math.sqrt(5)  # t_{0.975, 4}
    assert est.n == 5
    assert est.mean == pytest.approx(mean, abs=1e-15)
    assert est.std == pytest.approx(std, rel=1e-12)
    assert est.ci == pytest.approx((mean - half, mean + half), rel=1e-12)
    # scipy.stats.t.interval(0.95, 4, loc=mean, scale=std / sqrt(5))
    assert est.ci == pytest.approx((0.5237995847845628, 0.5962004152154371), rel=1e-12)


def test_paired_difference_is_the_hand_computed_paired_t():
    method = [0.56, 0.55, 0.52, 0.60, 0.57]
    base = [0.50, 0.52, 0.48, 0.55, 0.51]
    d = paired_difference(method, base)
    # differences 0.06, 0.03, 0.04, 0.05, 0.06: mean 0.048; squared deviations (1e-6) 144, 324, 64, 4, 144
    std = math.sqrt(680e-6 / 4)
    half = 2.7764451051977934 * std / math.sqrt(5)
    assert d.mean == pytest.approx(0.048, abs=1e-15) and d.std == pytest.approx(std, rel=1e-12)
    assert d.ci == pytest.approx((0.048 - half, 0.048 + half), rel=1e-12)
    # scipy.stats.ttest_rel(method, base): statistic 8.231932086840436, pvalue 0.0011873593006288465
    assert d.p_value == pytest.approx(0.0011873593006288465, rel=1e-10)
    # swapping the sides mirrors the interval and keeps the p-value
    r = paired_difference(base, method)
    assert r.ci == pytest.approx((-d.ci[1], -d.ci[0]), rel=1e-12) and r.p_value == pytest.approx(d.p_value)


def test_one_seed_and_constant_differences_give_no_nan():
    one = mean_ci([0.7])
    assert (one.n, one.mean, one.std, one.ci) == (1, 0.7, None, None)
    d = paired_difference([0.7], [0.6])
    assert d.mean == pytest.approx(0.1) and (d.std, d.ci, d.p_value) == (None, None, None)
    same = paired_difference([0.5, 0.6, 0.7], [0.5, 0.6, 0.7])
    assert (same.mean, same.std, same.ci, same.p_value) == (0.0, 0.0, (0.0, 0.0), 1.0)
    shifted = paired_difference([0.75, 0.5, 0.25], [0.5, 0.25, 0.0])
    assert shifted.std == 0.0 and shifted.ci == (0.25, 0.25) and shifted.p_value == 0.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-finite value nan"):
        mean_ci([1.0, math.nan])
    with pytest.raises(ValueError, match="no values"):
        mean_ci([])


def test_significance_marks():
    assert [significance_mark(p) for p in (None, 0.2, 0.05, 0.049, 0.0099, 0.0009)] == ["", "", "", "*", "**", "***"]
