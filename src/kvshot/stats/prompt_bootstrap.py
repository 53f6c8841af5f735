"""Prompt-bootstrap intervals for end-to-end decoding: tau and drafting time per round.

Decoding is counted per (seed, prompt) cell: every training seed's drafter decodes the same
prompts, so seeds and prompts are crossed factors. One resample draws the seeds with replacement
(when there are several) and, independently, the prompts with replacement: Owen's (2007)
pigeonhole bootstrap for crossed factors, which keeps both the prompt and the training variance.
Every variant in a comparison gets the same draws (paired on prompts and seeds). A statistic is a
ratio of sums over the drawn cells (tau = emitted tokens / rounds), so a prompt weighs by its
rounds, as in the pooled estimate. Percentile interval; nothing is resampled twice.

(metrics.py holds the step-wise bootstrap; this one is separate because decoding counts are
ratios of per-prompt sums, not chain tallies.)
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable

import numpy as np

from kvshot.stats.resample import LEVEL, POWER  # one confidence level and power for every verdict



@dataclass(frozen=True)
class Interval:
    value: float              # the statistic on every cell (the pooled estimate)
    ci: tuple[float, float]   # percentile interval at `level`
    sd: float                 # the bootstrap standard error
    level: float = LEVEL

    def mde(self, power: float = POWER) -> float:
        """The smallest true difference a two-sided test at `level` detects with `power`,
        from this interval's standard error (normal approximation)."""
        z = NormalDist().inv_cdf
        return (z((1 + self.level) / 2) + z(power)) * self.sd

    def as_dict(self) -> dict:
        return {"value": self.value, "ci": list(self.ci), "sd": self.sd, "level": self.level,
                f"mde_power_{POWER:g}": self.mde()}


def crossed_bootstrap(tables: dict[str, np.ndarray], statistic: Callable[[dict], np.ndarray],
                      samples: int = 2000, seed: int = 0, level: float = LEVEL) -> Interval:
    """The interval of statistic(sums), where sums holds each table's total over a resample of
    its [seeds, prompts] cells; every table is resampled with the same draws (paired)."""
    arrays = {k: np.asarray(t, dtype=float) for k, t in tables.items()}
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"crossed_bootstrap: tables must share one [seeds, prompts] shape, got {shapes}")
    n_seeds, n_prompts = shapes.pop()
    rng = np.random.default_rng(seed)
    seed_w = (rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=samples) if n_seeds > 1
              else np.ones((samples, 1)))
    prompt_w = rng.multinomial(n_prompts, np.full(n_prompts, 1 / n_prompts), size=samples)
    value = float(statistic({k: a.sum() for k, a in arrays.items()}))
    with np.errstate(divide="ignore", invalid="ignore"):
        draws = np.asarray(statistic({k: np.einsum("bs,sp,bp->b", seed_w, a, prompt_w) for k, a in arrays.items()}))
    draws = draws[np.isfinite(draws)]
    if draws.size < 2:
        return Interval(value, (float("nan"), float("nan")), float("nan"), level)
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return Interval(value, (float(lo), float(hi)), float(draws.std(ddof=1)), level)


def ratio(num: np.ndarray, den: np.ndarray, samples: int = 2000, seed: int = 0, level: float = LEVEL) -> Interval:
    """sum(num) / sum(den), e.g. tau from emitted tokens and rounds per (seed, prompt)."""
    return crossed_bootstrap({"num": num, "den": den}, lambda s: s["num"] / s["den"], samples, seed, level)


def paired_ratio_change(num_a: np.ndarray, den_a: np.ndarray, num_b: np.ndarray, den_b: np.ndarray,
                        samples: int = 2000, seed: int = 0, level: float = LEVEL) -> Interval:
    """(sum(num_b) / sum(den_b)) / (sum(num_a) / sum(den_a)) - 1, both variants on the same
    resampled prompts and seeds: b's relative change over a."""
    def change(s: dict) -> np.ndarray:
        return (s["nb"] / s["db"]) / (s["na"] / s["da"]) - 1
    return crossed_bootstrap({"na": num_a, "da": den_a, "nb": num_b, "db": den_b}, change, samples, seed, level)
