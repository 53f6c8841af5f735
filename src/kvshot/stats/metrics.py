"""Acceptance metrics as the paper defines them (docs/paper-vs-kvshot.md), and intervals that stay honest with few rounds.

alpha_k      conditional acceptance: P(step k correct | steps 0..k-1 all correct), chain drafting
cumulative_k prod_{j<=k} alpha_j = accepted_k / rounds_0 (share of rounds that accept steps 0..k)
acc_k        unconditional teacher-forced top-1 accuracy (reported, never called alpha)
MAT          1 + sum_k prod_{j<=k} alpha_j  (accepted draft tokens per round + the bonus token)
retention    alpha_{K-1} / alpha_0

Intervals (`chain_summary`): from per-anchor chain lengths (`resample.AnchorPanel`), resampling
whole sequences once and taking the training seeds' share of the variance from their spread
(`resample.interval`); the pooled Jeffreys interval of each rate is reported beside it for
reference. tests/unit/test_coverage.py measures their coverage on synthetic data with a known truth.
Thin evidence (few anchors, few sequences, resamples that do not vary) reads "insufficient",
and every interval stays inside its statistic's range (`resample.record_guards`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kvshot.stats.beta import beta_quantile
from kvshot.stats.resample import AnchorPanel, INTERVAL_GUARD, LEVEL, intervals, panel, reason_why, record_guards

DEFAULT_MIN_ROUNDS = 30   # below this many rounds alpha_k is "insufficient data" (config eval.min_rounds)
DEFAULT_MIN_SEQUENCES = 10   # below this many distinct sequences too (eval.min_sequences; docs/statistics.md)
JEFFREYS_PRIOR = 0.5   # the pooled-count interval shown beside the resampled one


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


def jeffreys_interval(accepted: int, rounds: int, level: float = 0.95) -> list[float]:
    """Equal-tailed Jeffreys interval for a binomial rate (pooled counts, no prompt resampling);
    the bound at an observed 0 or 1 is the boundary itself (Brown, Cai and DasGupta 2001)."""
    a, b = accepted + JEFFREYS_PRIOR, rounds - accepted + JEFFREYS_PRIOR
    tail = (1 - level) / 2
    lo = 0.0 if accepted == 0 else beta_quantile(tail, a, b)
    hi = 1.0 if accepted == rounds else beta_quantile(1 - tail, a, b)
    return [lo, hi]


# ---------------------------------------------------------------- intervals

def panel_from_counts(reached: Tensor, accepted: Tensor) -> AnchorPanel:
    """One seed's anchors from per-sequence chain counts [S, K] (lossless: in a sequence, the
    anchors that accept exactly L steps are reached_L - reached_{L+1}, with accepted_{K-1} last)."""
    lengths, sequence = [], []
    for j, (r, a) in enumerate(zip(reached.long().tolist(), accepted.long().tolist())):
        through = r + [a[-1]]                      # anchors accepting at least L steps, L = 0..K
        for length in range(len(r) + 1):
            count = through[length] - (through[length + 1] if length + 1 < len(through) else 0)
            lengths += [length] * count
            sequence += [j] * count
    return panel([lengths], sequence, reached.shape[1])


def chain_summary(anchors: AnchorPanel, samples: int = 1000, seed: int = 0, min_rounds: int = DEFAULT_MIN_ROUNDS,
                  level: float = LEVEL, min_sequences: int = DEFAULT_MIN_SEQUENCES) -> dict:
    """Everything stepwise.json reports from per-anchor chain lengths: counts, rates, cumulative
    acceptance, MAT, retention, intervals (`resample.interval`: sequences resampled, seeds as a
    variance component) and the guards for thin evidence (`resample.record_guards`). A rate is
    insufficient when it rests on fewer than min_rounds distinct anchors (an anchor that several
    seeds bring to step k counts once) or fewer than min_sequences distinct sequences, or when its
    resamples do not vary (its interval is then null, never a point): it is null in
    `alpha`/`retention` (the raw value stays in `alpha_observed` / `retention_observed`), flagged
    false in `*_sufficient`, and `*_reason` says why. Intervals are clipped to the statistic's range."""
    reached_s, accepted_s = anchors.per_sequence()
    rounds, acc = reached_s.sum((0, 1)), accepted_s.sum((0, 1))
    observed = alpha(rounds, acc)
    rounds_l, acc_l = [int(x) for x in rounds.tolist()], [int(x) for x in acc.tolist()]
    distinct, seqs = anchors.distinct_reached(), anchors.distinct_sequences()
    steps = anchors.steps
    ci = intervals([anchors], ["mat", "retention"] + [f"alpha_{k}" for k in range(steps)]
                   + [f"cumulative_{k}" for k in range(steps)], samples, seed, level)

    def guarded(name: str, k: int) -> dict:   # the record of `name`, resting on the anchors that reach step k
        return record_guards(ci[name].as_dict(), distinct[k], seqs[k], min_rounds, min_sequences)

    rates = [guarded(f"alpha_{k}", k) for k in range(steps)]
    cum = [guarded(f"cumulative_{k}", 0) for k in range(steps)]
    mat_g = guarded("mat", 0)
    ret_g = guarded("retention", steps - 1)   # the fewer anchors of its two steps
    enough = [g["sufficient"] for g in rates]
    ret_enough = enough[0] and enough[-1] and ret_g["sufficient"]
    ret_reason = ret_g["reason"] or (None if ret_enough else "insufficient: " + "; ".join(
        f"alpha_{k} {reason_why(rates[k]['reason'])}" for k in sorted({0, steps - 1}) if rates[k]["reason"]))
    ret = retention(observed)
    return {
        "rounds": rounds_l,
        "accepted": acc_l,
        "distinct_anchors": distinct,
        "distinct_sequences": seqs,
        "seeds": anchors.seeds,
        "min_rounds": min_rounds,
        "min_sequences": min_sequences,
        "alpha": [x if ok else None for x, ok in zip(observed, enough)],
        "alpha_observed": observed,
        "alpha_sufficient": enough,
        "alpha_reason": [g["reason"] for g in rates],
        "alpha_jeffreys_ci": [jeffreys_interval(x, n, level) for x, n in zip(acc_l, rounds_l)],
        "cumulative": [x / rounds_l[0] if rounds_l[0] else float("nan") for x in acc_l],
        "cumulative_reason": [g["reason"] for g in cum],
        "mat": mat(observed),
        "mat_sufficient": mat_g["sufficient"],
        "mat_reason": mat_g["reason"],
        "retention": ret if ret_enough else None,
        "retention_observed": ret,
        "retention_sufficient": ret_enough,
        "retention_reason": ret_reason,
        "alpha_ci": [g["ci"] for g in rates],
        "alpha_undefined_resamples": [ci[f"alpha_{k}"].undefined_resamples for k in range(steps)],
        "cumulative_ci": [g["ci"] for g in cum],
        "mat_ci": mat_g["ci"], "retention_ci": ret_g["ci"],
        "mat_se": ci["mat"].se, "mat_mde": ci["mat"].mde,
        "bootstrap_samples": samples, "level": level,
        "interval": INTERVAL_NOTE,
        "interval_guard": INTERVAL_GUARD,
    }


INTERVAL_NOTE = ("t interval on the variance of the sequence bootstrap (seeds held fixed) plus, with several seeds, "
                 "the seed component of a crossed ANOVA; one t quantile per component (resample.py)")


def expected_tokens(a: float, gamma: int) -> float:
    """Leviathan et al. (2023): expected tokens per round for i.i.d. acceptance a, gamma drafts."""
    return gamma + 1.0 if a >= 1 else (1 - a ** (gamma + 1)) / (1 - a)


def expected_speedup(a: float, gamma: int, cost_ratio: float) -> float:
    """Walltime speedup with draft/target cost ratio c: tokens per round / (gamma * c + 1)."""
    return expected_tokens(a, gamma) / (gamma * cost_ratio + 1)
