"""Acceptance metrics as the paper defines them (docs/paper-vs-kvshot.md), and intervals that stay honest with few rounds.

alpha_k      conditional acceptance: P(step k correct | steps 0..k-1 all correct), chain drafting
cumulative_k prod_{j<=k} alpha_j = accepted_k / rounds_0 (share of rounds that accept steps 0..k)
acc_k        unconditional teacher-forced top-1 accuracy (reported, never called alpha)
MAT          1 + sum_k prod_{j<=k} alpha_j  (accepted draft tokens per round + the bonus token)
retention    alpha_{K-1} / alpha_0

Intervals (`bootstrap`): resample whole prompts (rounds within a sequence are correlated), and in
each resample draw alpha_k from its Jeffreys posterior Beta(accepted + 1/2, rejected + 1/2). A step
that no round of a resample reaches draws from the prior Beta(1/2, 1/2) and is counted, not dropped,
so an interval never collapses to a point on a handful of rounds.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

DEFAULT_MIN_ROUNDS = 30   # below this many rounds alpha_k is "insufficient data" (config eval.min_rounds)
JEFFREYS_PRIOR = 0.5


def chain_counts(correct: Tensor) -> tuple[Tensor, Tensor]:
    """correct [N, K] bool, one row per drafting round. Returns per step the rounds that
    reached step k (all earlier steps accepted) and those that also accepted step k."""
    accepted_through = torch.cumprod(correct.long(), dim=1)            # steps 0..k all correct
    reached = torch.cat([torch.ones_like(accepted_through[:, :1]), accepted_through[:, :-1]], dim=1)
    return reached.sum(0), accepted_through.sum(0)


def alpha(reached: Tensor, accepted: Tensor) -> list[float]:
    return [float(a) / float(r) if r > 0 else float("nan") for r, a in zip(reached.tolist(), accepted.tolist())]


def mat(alphas: list[float]) -> float:
    total, run = 1.0, 1.0
    for a in alphas:
        if math.isnan(a):
            break
        run *= a
        total += run
    return total


def retention(alphas: list[float]) -> float:
    return alphas[-1] / alphas[0] if alphas and alphas[0] > 0 else float("nan")


# ---------------------------------------------------------------- Beta distribution

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


def beta_quantile(q: float, a: float, b: float) -> float:
    """The x with beta_cdf(x, a, b) = q, by bisection (the CDF is monotone)."""
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def jeffreys_interval(accepted: int, rounds: int, level: float = 0.95) -> list[float]:
    """Equal-tailed Jeffreys interval for a binomial rate (pooled counts, no prompt resampling);
    the bound at an observed 0 or 1 is the boundary itself (Brown, Cai and DasGupta 2001)."""
    a, b = accepted + JEFFREYS_PRIOR, rounds - accepted + JEFFREYS_PRIOR
    tail = (1 - level) / 2
    lo = 0.0 if accepted == 0 else beta_quantile(tail, a, b)
    hi = 1.0 if accepted == rounds else beta_quantile(1 - tail, a, b)
    return [lo, hi]


# ---------------------------------------------------------------- intervals

def bootstrap(reached: Tensor, accepted: Tensor, samples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Intervals for alpha_k, cumulative_k, MAT and retention: prompt bootstrap x Jeffreys
    posterior draw (module docstring). reached/accepted: [S, K] per-sequence counts."""
    s, steps = reached.shape
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, s, (samples, s), generator=gen)
    weights = torch.zeros(samples, s, dtype=torch.float64).scatter_add_(1, idx, torch.ones(samples, s, dtype=torch.float64))
    r = weights @ reached.double()
    a = weights @ accepted.double()
    with torch.random.fork_rng(devices=[]):          # Beta sampling has no generator argument
        torch.manual_seed(seed)
        draws = torch.distributions.Beta(a + JEFFREYS_PRIOR, r - a + JEFFREYS_PRIOR).sample()
    cumulative = torch.cumprod(draws, dim=1)
    mats = 1 + cumulative.sum(1)
    rets = draws[:, -1] / draws[:, 0]
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2

    def ci(x: Tensor) -> list[float]:
        return [float(torch.quantile(x, lo)), float(torch.quantile(x, hi))]

    return {"alpha_ci": [ci(draws[:, k]) for k in range(steps)],
            "alpha_undefined_resamples": (r == 0).sum(0).tolist(),
            "cumulative_ci": [ci(cumulative[:, k]) for k in range(steps)],
            "mat_ci": ci(mats), "retention_ci": ci(rets), "bootstrap_samples": samples, "level": level,
            "interval": "prompt bootstrap x Jeffreys Beta(1/2, 1/2) posterior draw per step; a resample in which "
                        "no round reaches step k draws from the prior and is counted in alpha_undefined_resamples"}


def chain_summary(reached: Tensor, accepted: Tensor, samples: int = 1000, seed: int = 0,
                  min_rounds: int = DEFAULT_MIN_ROUNDS, level: float = 0.95) -> dict:
    """Everything stepwise.json reports from per-sequence chain counts [S, K]: counts, rates,
    cumulative acceptance, MAT, retention, intervals, and the minimum-rounds rule. A rate that
    rests on fewer than min_rounds rounds is null in `alpha`/`retention` (its raw value stays in
    `alpha_observed`/`retention_observed`) and flagged false in `*_sufficient`."""
    rounds, acc = reached.sum(0), accepted.sum(0)
    observed = alpha(rounds, acc)
    rounds_l, acc_l = [int(x) for x in rounds.tolist()], [int(x) for x in acc.tolist()]
    enough = [n >= min_rounds for n in rounds_l]
    ret_enough = enough[0] and enough[-1]
    ret = retention(observed)
    out = {
        "rounds": rounds_l,
        "accepted": acc_l,
        "min_rounds": min_rounds,
        "alpha": [x if ok else None for x, ok in zip(observed, enough)],
        "alpha_observed": observed,
        "alpha_sufficient": enough,
        "alpha_jeffreys_ci": [jeffreys_interval(x, n, level) for x, n in zip(acc_l, rounds_l)],
        "cumulative": [x / rounds_l[0] if rounds_l[0] else float("nan") for x in acc_l],
        "mat": mat(observed),
        "mat_sufficient": enough[0],
        "retention": ret if ret_enough else None,
        "retention_observed": ret,
        "retention_sufficient": ret_enough,
    }
    out.update(bootstrap(reached, accepted, samples, seed, level))
    return out


def expected_tokens(a: float, gamma: int) -> float:
    """Leviathan et al. (2023): expected tokens per round for i.i.d. acceptance a, gamma drafts."""
    return gamma + 1.0 if a >= 1 else (1 - a ** (gamma + 1)) / (1 - a)


def expected_speedup(a: float, gamma: int, cost_ratio: float) -> float:
    """Walltime speedup with draft/target cost ratio c: tokens per round / (gamma * c + 1)."""
    return expected_tokens(a, gamma) / (gamma * cost_ratio + 1)
