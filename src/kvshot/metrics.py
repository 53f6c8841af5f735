"""Acceptance metrics as defined in shared/PAPER.md.

alpha_k   conditional acceptance: P(step k correct | steps 0..k-1 all correct), chain drafting
acc_k     unconditional teacher-forced top-1 accuracy (reported, never called alpha)
MAT       1 + sum_k prod_{j<=k} alpha_j  (accepted draft tokens per round + the bonus token)
retention alpha_{K-1} / alpha_0
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


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


def bootstrap(reached: Tensor, accepted: Tensor, samples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Percentile intervals for alpha_k, MAT and retention, resampling whole sequences
    (rounds within a sequence are correlated). reached/accepted: [S, K] per-sequence counts."""
    s = reached.shape[0]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, s, (samples, s), generator=gen)
    weights = torch.zeros(samples, s, dtype=torch.float64).scatter_add_(1, idx, torch.ones(samples, s, dtype=torch.float64))
    r = weights @ reached.double()
    a = weights @ accepted.double()
    alphas = torch.where(r > 0, a / r.clamp(min=1), torch.full_like(r, float("nan")))
    prods = torch.cumprod(torch.nan_to_num(alphas, nan=0.0), dim=1)
    mats = 1 + prods.sum(1)
    rets = alphas[:, -1] / alphas[:, 0]
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2

    def ci(x: Tensor) -> list[float]:
        x = x[~torch.isnan(x)]
        if x.numel() == 0:
            return [float("nan"), float("nan")]
        return [float(torch.quantile(x, lo)), float(torch.quantile(x, hi))]

    return {"alpha_ci": [ci(alphas[:, k]) for k in range(alphas.shape[1])], "mat_ci": ci(mats),
            "retention_ci": ci(rets), "bootstrap_samples": samples, "level": level}


def expected_tokens(a: float, gamma: int) -> float:
    """Leviathan et al. (2023): expected tokens per round for i.i.d. acceptance a, gamma drafts."""
    return gamma + 1.0 if a >= 1 else (1 - a ** (gamma + 1)) / (1 - a)


def expected_speedup(a: float, gamma: int, cost_ratio: float) -> float:
    """Walltime speedup with draft/target cost ratio c: tokens per round / (gamma * c + 1)."""
    return expected_tokens(a, gamma) / (gamma * cost_ratio + 1)
