"""alpha_k, MAT, retention and the theory formulas against values worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from kvshot.stats.beta import beta_cdf, beta_quantile, beta_quantile_bisection
from kvshot.stats.metrics import (alpha, chain_counts, chain_summary, expected_speedup, expected_tokens,
                                  jeffreys_interval, mat, panel_from_counts, retention)

# four drafting rounds, K = 4; worked out by hand:
#   reached  = [4, 3, 2, 1]  (round 2 fails step 0; round 1 fails step 1; round 0 fails step 2)
#   accepted = [3, 2, 1, 0]
#   alpha = [3/4, 2/3, 1/2, 0]; MAT = 1 + 3/4 + 1/2 + 1/4 + 0 = 2.5; retention = 0
CORRECT = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def test_hand_worked_chain_example():
    reached, accepted = chain_counts(CORRECT)
    assert reached.tolist() == [4, 3, 2, 1] and accepted.tolist() == [3, 2, 1, 0]
    a = alpha(reached, accepted)
    assert a == pytest.approx([0.75, 2 / 3, 0.5, 0.0])
    assert mat(a) == pytest.approx(2.5)
    assert retention(a) == 0.0
    # the unconditional rate is a different number: step 3 is right in 3 of 4 rounds
    assert CORRECT.float().mean(0).tolist()[3] == 0.75


def test_mat_of_constant_alpha_matches_leviathan():
    a, k = 0.8, 7
    assert mat([a] * k) == pytest.approx(expected_tokens(a, k))
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert expected_tokens(1.0, 5) == 6


def test_retention_and_nan_steps():
    assert retention([0.8, 0.6, 0.4]) == pytest.approx(0.5)
    assert mat([0.5, float("nan"), 0.5]) == pytest.approx(1.5)  # no rounds reached step 1
    assert math.isnan(alpha(torch.tensor([2, 0]), torch.tensor([0, 0]))[1])


def test_interval_contains_the_estimate_and_shrinks_with_data():
    gen = torch.Generator().manual_seed(0)
    small = torch.rand(20, 7, generator=gen) < 0.7
    big = torch.rand(2000, 7, generator=gen) < 0.7
    widths = []
    for correct, seqs in ((small, 4), (big, 40)):
        r, a = per_sequence(correct, seqs)
        point = alpha(r.sum(0), a.sum(0))
        s = chain_summary(panel_from_counts(r, a), samples=400, seed=1)
        assert s["alpha_ci"][0][0] <= point[0] <= s["alpha_ci"][0][1]
        assert s["mat_ci"][0] <= mat(point) <= s["mat_ci"][1]
        widths.append(s["alpha_ci"][0][1] - s["alpha_ci"][0][0])
    assert widths[1] < widths[0]
    r, a = per_sequence(big, 40)
    assert chain_summary(panel_from_counts(r, a), samples=50, seed=3) == chain_summary(panel_from_counts(r, a),
                                                                                          samples=50, seed=3)


def test_panel_from_counts_is_lossless():
    gen = torch.Generator().manual_seed(4)
    r, a = per_sequence(torch.rand(60, 5, generator=gen) < 0.6, 6)
    p = panel_from_counts(r, a)
    back_r, back_a = p.per_sequence()
    assert back_r[0].long().tolist() == r.tolist() and back_a[0].long().tolist() == a.tolist()


def per_sequence(correct: torch.Tensor, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = [chain_counts(rows) for rows in correct.view(seqs, -1, correct.shape[1])]
    return torch.stack([c[0] for c in counts]), torch.stack([c[1] for c in counts])


def test_beta_cdf_and_quantile_against_closed_forms():
    for x in (1e-4, 0.1, 0.37, 0.5, 0.9, 0.9999):
        # Beta(1/2, 1/2) is the arcsine law; Beta(a, 1) has CDF x^a
        assert beta_cdf(x, 0.5, 0.5) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)), abs=1e-12)
        assert beta_cdf(x, 3.2, 1.0) == pytest.approx(x ** 3.2, rel=1e-10)
        assert beta_cdf(x, 7.5, 2.5) + beta_cdf(1 - x, 2.5, 7.5) == pytest.approx(1.0, abs=1e-12)
    assert beta_quantile(0.5, 40.5, 40.5) == pytest.approx(0.5, abs=1e-12)
    assert beta_quantile(0.9, 3.2, 1.0) == pytest.approx(0.9 ** (1 / 3.2), abs=1e-12)


def test_newton_quantile_equals_the_bisection_reference():
    """beta_quantile (safeguarded Newton, cached) against the plain bisection on Jeffreys
    posteriors from 1 to 100,000 trials and every tail the intervals ask for: within a few
    ulps of x, and the CDF residual no worse than the bisection's at the same digits."""
    import random

    rng, worst = random.Random(0), 0.0
    for _ in range(600):
        n = rng.choice([1, 2, 3, 5, 10, 30, 100, 1000, 10000, 100000])
        k = rng.randint(0, n)
        q, a, b = rng.choice([0.025, 0.975, 0.005, 0.995, 0.5, rng.random()]), k + 0.5, n - k + 0.5
        ref, fast = beta_quantile_bisection(q, a, b), beta_quantile(q, a, b)
        worst = max(worst, abs(ref - fast))
        assert abs(beta_cdf(fast, a, b) - q) < 1e-10, (q, a, b)
    assert worst < 1e-12
    # the control: a quantile one part in 1e9 off is caught by both checks
    q, a, b = 0.975, 12.5, 30.5
    off = beta_quantile_bisection(q, a, b) * (1 + 1e-9)
    assert abs(off - beta_quantile_bisection(q, a, b)) > 1e-12 and abs(beta_cdf(off, a, b) - q) > 1e-10


def test_jeffreys_interval_matches_published_values():
    # Brown, Cai & DasGupta (2001): 0 of 10 -> [0, 0.217]; the interval never has zero width
    assert jeffreys_interval(0, 10) == pytest.approx([0.0, 0.2172], abs=1e-4)
    assert jeffreys_interval(10, 10) == pytest.approx([0.7828, 1.0], abs=1e-4)
    lo, hi = jeffreys_interval(5, 10)
    assert lo == pytest.approx(1 - hi) and 0.2 < lo < 0.25
    assert jeffreys_interval(0, 0) == [0.0, 1.0]
    # large counts: the normal approximation
    lo, hi = jeffreys_interval(470_000, 1_000_000)
    assert (hi - lo) / 2 == pytest.approx(1.96 * math.sqrt(0.47 * 0.53 / 1e6), rel=1e-3)


def test_few_rounds_read_insufficient_and_keep_a_wide_pooled_interval():
    # two prompts, three rounds each, every draft accepted through step 2, never at step 3:
    # no spread to resample, so the rule on rounds and the pooled Jeffreys interval carry the doubt
    correct = torch.tensor([[1, 1, 1, 0]] * 6, dtype=torch.bool)
    r, a = per_sequence(correct, 2)
    s = chain_summary(panel_from_counts(r, a), samples=300, seed=0, min_rounds=30)
    for lo, hi in s["alpha_jeffreys_ci"]:
        assert hi - lo > 0.05, (lo, hi)
    assert s["alpha_observed"][0] == 1.0 and s["distinct_anchors"] == [6, 6, 6, 6]
    assert s["alpha"] == [None] * 4 and s["alpha_sufficient"] == [False] * 4 and s["retention"] is None


def test_undefined_resamples_are_counted():
    # step 1 is reached only in the first of four prompts (resamples without it leave alpha_1
    # undefined), step 2 in none
    correct = torch.tensor([[1, 0, 0], [1, 0, 1], [0, 0, 0], [0, 1, 1]] + [[0, 0, 0]] * 4, dtype=torch.bool)
    r, a = per_sequence(correct, 4)
    assert r[:, 1].tolist() == [2, 0, 0, 0]
    s = chain_summary(panel_from_counts(r, a), samples=400, seed=0)
    undefined = s["alpha_undefined_resamples"]
    assert undefined[0] == 0 and 0.2 * 400 < undefined[1] < 0.5 * 400     # (3/4)^4 = 32% of resamples
    # a step no anchor reaches has no estimate and no interval
    assert math.isnan(s["alpha_observed"][2]) and all(math.isnan(x) for x in s["alpha_ci"][2])


def test_chain_summary_minimum_rounds_cumulative_and_mat():
    gen = torch.Generator().manual_seed(0)
    correct = torch.rand(600, 5, generator=gen) < 0.5
    r, a = per_sequence(correct, 20)
    s = chain_summary(panel_from_counts(r, a), samples=200, seed=2, min_rounds=50)
    rounds, acc = r.sum(0).tolist(), a.sum(0).tolist()
    assert s["rounds"] == rounds and s["accepted"] == acc
    observed = [x / n for x, n in zip(acc, rounds)]
    assert s["alpha_observed"] == pytest.approx(observed)
    assert s["alpha_sufficient"] == [n >= 50 for n in rounds] and False in s["alpha_sufficient"]
    assert s["alpha"] == [x if n >= 50 else None for x, n in zip(observed, rounds)]
    assert s["cumulative"] == pytest.approx([math.prod(observed[: k + 1]) for k in range(5)])
    assert s["mat"] == pytest.approx(1 + sum(s["cumulative"]))
    for k, (lo, hi) in enumerate(s["alpha_ci"]):
        assert lo < hi and (lo <= observed[k] <= hi or rounds[k] < 50)
    assert chain_summary(panel_from_counts(r, a), samples=200, seed=2, min_rounds=50) == s   # deterministic
