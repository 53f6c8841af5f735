"""The Beta distribution's CDF and quantile (Jeffreys intervals, Student t quantiles), in plain
Python: no SciPy dependency."""
from __future__ import annotations

import functools
import math


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz),
    convergent for x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1)          # the first term, d_1 = -(a + b) x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 1000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),          # even term d_2m
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # odd term d_2m+1
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return f


def beta_cdf(x: float, a: float, b: float) -> float:
    """P(X <= x) for X ~ Beta(a, b): the regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def beta_pdf(x: float, a: float, b: float) -> float:
    if x <= 0.0 or x >= 1.0:
        return 0.0
    return math.exp((a - 1) * math.log(x) + (b - 1) * math.log1p(-x)
                    + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b))


def beta_quantile_bisection(q: float, a: float, b: float) -> float:
    """The x with beta_cdf(x, a, b) = q, by bisection (the CDF is monotone): the reference
    beta_quantile is tested equal to."""
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@functools.lru_cache(maxsize=65536)
def beta_quantile(q: float, a: float, b: float) -> float:
    """beta_quantile_bisection's x in ~6 CDF evaluations instead of 80: Newton steps on the
    CDF, kept inside the bisection bracket (a step that leaves it bisects instead). Cached:
    a report asks for the same (successes, trials) interval many times."""
    lo, hi, x = 0.0, 1.0, a / (a + b)
    for _ in range(200):
        f = beta_cdf(x, a, b) - q
        if f == 0.0:
            return x
        lo, hi = (x, hi) if f < 0 else (lo, x)
        pdf = beta_pdf(x, a, b)
        step = x - f / pdf if pdf > 0.0 else -1.0
        nxt = step if lo < step < hi else (lo + hi) / 2
        if abs(nxt - x) <= 4e-16 * max(x, 1e-300) or hi - lo <= 4e-16 * hi:
            return nxt
        x = nxt
    return x
