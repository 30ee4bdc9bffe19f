"""Small-sample statistics for ``dataflex compare``: Student t intervals and paired t-tests.

scipy is not a dependency, so the t distribution is computed here from the regularized incomplete beta
function (continued fraction, modified Lentz). Everything is plain float arithmetic on a handful of
seeds; nothing here is on a training hot path. Undefined quantities (a standard deviation or interval
from one seed) are ``None``, never NaN, so they serialise to JSON ``null``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-15
_TINY = 1e-300
_MAX_TERMS = 500


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), converging fast for x < (a + 1) / (a + b + 2)."""
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_TERMS + 1):
        # even term d_{2m}, then odd term d_{2m+1}, each folded in with one Lentz update
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            step = c * d
            h *= step
        if abs(step - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc needs a > 0 and b > 0 (got a={a}, b={b})")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1 (got x={x})")
    if x == 0.0 or x == 1.0:
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    # The symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast-converging region.
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def _check_df(df: float) -> None:
    if not (df > 0 and math.isfinite(df)):
        raise ValueError(f"degrees of freedom must be a positive finite number (got {df})")


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    _check_df(df)
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    half_tail = 0.5 * t_two_sided_p(t, df)
    return 1.0 - half_tail if t > 0 else half_tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (the inverse of :func:`t_cdf`), by bisection on the cdf."""
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1 (got {p})")
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    if p == 0.5:
        return 0.0
    tail = 2.0 * (1.0 - p)  # the two-sided tail mass beyond the quantile
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > tail:
        lo, hi = hi, hi * 2.0
    while hi - lo > 4 * _EPS * hi:
        mid = 0.5 * (lo + hi)
        if t_two_sided_p(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class MeanEstimate:
    """Mean of ``n`` values with the sample standard deviation and a t interval (``None`` when n = 1)."""

    n: int
    mean: float
    std: float | None
    ci: tuple[float, float] | None


@dataclass(frozen=True)
class PairedDifference:
    """Mean of paired differences ``a_i - b_i`` with its t interval and two-sided paired t-test p-value."""

    n: int
    mean: float
    std: float | None
    ci: tuple[float, float] | None
    p_value: float | None


def _finite(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: no values")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: non-finite value {bad[0]}")
    return out


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> MeanEstimate:
    """Mean, sample standard deviation (n - 1) and the Student t interval of the mean."""
    xs = _finite(values, "mean_ci")
    n = len(xs)
    mean = math.fsum(xs) / n
    if n < 2:
        return MeanEstimate(n, mean, None, None)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_ppf(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
    return MeanEstimate(n, mean, std, (mean - half, mean + half))


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedDifference:
    """The paired t analysis of ``a - b`` (same seeds in the same order): interval and two-sided p.

    When every difference is identical (standard deviation 0) the interval collapses to that value and
    the p-value is 1 if it is 0, else 0 (the limit of the t statistic).
    """
    xa, xb = _finite(a, "paired_difference"), _finite(b, "paired_difference")
    if len(xa) != len(xb):
        raise ValueError(f"paired_difference: {len(xa)} values against {len(xb)}; pairs need equal lengths")
    est = mean_ci([x - y for x, y in zip(xa, xb)], confidence)
    if est.std is None:
        return PairedDifference(est.n, est.mean, None, None, None)
    if est.std == 0.0:
        return PairedDifference(est.n, est.mean, 0.0, est.ci, 1.0 if est.mean == 0.0 else 0.0)
    t = est.mean / (est.std / math.sqrt(est.n))
    return PairedDifference(est.n, est.mean, est.std, est.ci, t_two_sided_p(t, est.n - 1))


def one_sided_p(mean: float, std: float | None, n: int, value: float = 0.0) -> float | None:
    """P(T >= t) for ``t = (mean - value) / (std / sqrt(n))``, ``n - 1`` df: the one-sided t-test that the mean
    exceeds ``value`` (``None`` with one value; a zero std gives 0 above ``value``, else 1)."""
    if std is None or n < 2:
        return None
    if std == 0.0:
        return 0.0 if mean > value else 1.0
    return 1.0 - t_cdf((mean - value) / (std / math.sqrt(n)), n - 1)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest of ``m`` is multiplied by
    ``m - i + 1`` (i from 1), then made non-decreasing along that order and capped at 1."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def significance_mark(p_value: float | None) -> str:
    """``***`` p < 0.001, ``**`` p < 0.01, ``*`` p < 0.05, ``""`` otherwise (or without a p-value)."""
    if p_value is None:
        return ""
    for limit, mark in ((0.001, "***"), (0.01, "**"), (0.05, "*")):
        if p_value < limit:
            return mark
    return ""


__all__ = ["MeanEstimate", "PairedDifference", "betainc", "holm", "mean_ci", "one_sided_p", "paired_difference",
           "significance_mark", "t_cdf", "t_ppf", "t_two_sided_p"]
