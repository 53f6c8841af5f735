"""Intervals and paired tests for the step-wise metrics, from per-anchor chain lengths.

Every variant and seed is scored on the same anchors (the evaluation's seeded anchor draw), so
a record is an `AnchorPanel`: for each training seed and anchor, how many leading draft steps
were accepted (0..K), and the sequence (conversation or prompt) each anchor belongs to.
From that, alpha_k, MAT and retention are pooled ratios of counts (`metrics` defines them).

One resampling, two levels (`hierarchical_weights`): whole sequences with replacement (anchors in
one conversation share their difficulty), and, where there are several, training seeds with
replacement (the drafter a new seed would give). A comparison between two variants draws the
same sequences and the same seed indices for both (paired on the shared anchors), so the
anchors' shared difficulty cancels in the difference.

With few seeds the seed level of a plain bootstrap is too narrow (resampling n values has
(n - 1)/n of their variance and only a handful of distinct draws), so the interval is a
t interval on the bootstrap's variance components: the sequence-level variance (seeds held
fixed) plus the seed-level variance (sequences held fixed, scaled by n/(n - 1)), with
Welch-Satterthwaite degrees of freedom. With one seed it is the sequence bootstrap's own
standard error with S - 1 degrees of freedom. tests/test_coverage.py measures the coverage of
these intervals on clustered synthetic chains with a known truth, and the power of the test.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

LEVEL = 0.95          # two-sided; each directional claim errs at most 2.5% of the time under no difference
POWER = 0.80          # the minimum detectable effect is the difference decided this often
DEFAULT_SAMPLES = 1000


@dataclass(frozen=True)
class AnchorPanel:
    """lengths [n_seeds, N]: accepted leading steps per seed and anchor (0..steps);
    sequence [N]: each anchor's sequence index 0..S-1; keys: one id per anchor (for pairing)."""
    lengths: Tensor
    sequence: Tensor
    steps: int
    keys: tuple = ()

    @property
    def seeds(self) -> int:
        return self.lengths.shape[0]

    @property
    def n_sequences(self) -> int:
        return int(self.sequence.max()) + 1 if self.sequence.numel() else 0

    def per_sequence(self) -> tuple[Tensor, Tensor]:
        """reached, accepted [n_seeds, S, K] float64: rounds reaching step k and accepting it."""
        k = torch.arange(self.steps)
        reached = (self.lengths[..., None] >= k).double()            # [n, N, K]
        accepted = (self.lengths[..., None] >= k + 1).double()
        s = self.n_sequences
        out_r = torch.zeros(self.seeds, s, self.steps, dtype=torch.float64)
        out_a = torch.zeros_like(out_r)
        idx = self.sequence[None, :, None].expand_as(reached)
        return out_r.scatter_add_(1, idx, reached), out_a.scatter_add_(1, idx, accepted)

    def distinct_reached(self) -> list[int]:
        """Per step, the distinct anchors that at least one seed brings to step k (seed copies of
        one anchor count once): what the minimum-rounds rule counts."""
        best = self.lengths.max(0).values
        return [int((best >= k).sum()) for k in range(self.steps)]


def panel(lengths: list[list[int]] | Tensor, sequence: list[int] | Tensor, steps: int, keys=()) -> AnchorPanel:
    return AnchorPanel(torch.as_tensor(lengths, dtype=torch.long), torch.as_tensor(sequence, dtype=torch.long),
                       steps, tuple(keys))


# ---------------------------------------------------------------- statistics of pooled counts

def alpha_of(reached: Tensor, accepted: Tensor) -> Tensor:
    """[..., K] pooled conditional acceptance; NaN where no round reaches step k."""
    return torch.where(reached > 0, accepted / reached.clamp(min=1e-300), torch.full_like(reached, float("nan")))


STATISTICS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mat": lambda r, a: 1 + (a / r[..., :1]).sum(-1),                  # 1 + sum_k accepted_k / rounds
    "retention": lambda r, a: alpha_of(r, a)[..., -1] / alpha_of(r, a)[..., 0],
}


def statistic(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """'mat', 'retention', 'alpha_<k>' or 'cumulative_<k>' of pooled counts [..., K]."""
    if name in STATISTICS:
        return STATISTICS[name]
    kind, _, k = name.rpartition("_")
    if kind == "alpha":
        return lambda r, a: alpha_of(r, a)[..., int(k)]
    if kind == "cumulative":
        return lambda r, a: a[..., int(k)] / r[..., 0]
    raise KeyError(f"unknown statistic {name!r}")


# ---------------------------------------------------------------- resampling

def hierarchical_weights(n_seeds: int, n_sequences: int, samples: int, seed: int, level: str = "both") -> tuple[Tensor, Tensor]:
    """Multinomial resampling counts: seeds [B, n] and sequences [B, S]. level 'sequences' holds
    the seeds fixed (all ones), 'seeds' the sequences; 'both' resamples the two independently."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> Tensor:
        idx = torch.randint(0, n, (samples, n), generator=gen)
        return torch.zeros(samples, n, dtype=torch.float64).scatter_add_(1, idx, torch.ones(samples, n, dtype=torch.float64))

    seqs = draw(n_sequences) if level in ("both", "sequences") else torch.ones(samples, n_sequences, dtype=torch.float64)
    if level in ("both", "seeds") and n_seeds > 1:
        seeds = draw(n_seeds)
    else:
        seeds = torch.ones(samples, n_seeds, dtype=torch.float64)
    return seeds, seqs


def pooled_counts(per_seq: tuple[Tensor, Tensor], seeds: Tensor, seqs: Tensor) -> tuple[Tensor, Tensor]:
    """Counts [B, K] of each resample from per-sequence counts [n, S, K]."""
    r, a = per_seq
    return torch.einsum("bn,bs,nsk->bk", seeds, seqs, r), torch.einsum("bn,bs,nsk->bk", seeds, seqs, a)


def _replicates(panels: list[AnchorPanel], stat: Callable, samples: int, seed: int, level: str) -> Tensor:
    """The statistic of panels[0] minus that of panels[1] (or of panels[0] alone) per resample."""
    first = panels[0]
    seeds, seqs = hierarchical_weights(first.seeds, first.n_sequences, samples, seed, level)
    values = [stat(*pooled_counts(p.per_sequence(), seeds, seqs)) for p in panels]
    return values[0] if len(values) == 1 else values[0] - values[1]


@functools.lru_cache(maxsize=256)
def _t_quantile(p: float, df: float) -> float:
    """Student t quantile (Hill 1970's series, exact for df -> inf); df >= 1."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(p, dtype=torch.float64)).item()
    if math.isinf(df) or df > 1e6:
        return z
    if df < 1:
        df = 1.0
    # invert the t CDF by bisection on the regularized incomplete beta function
    from .metrics import beta_cdf

    def cdf(t: float) -> float:
        x = df / (df + t * t)
        tail = 0.5 * beta_cdf(x, df / 2, 0.5)
        return 1 - tail if t > 0 else tail

    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """An estimate, its interval and what it rests on. se: standard error; df: degrees of
    freedom of the t interval; mde: the smallest true difference this design decides with
    probability POWER (two-sided test at `level`)."""
    estimate: float
    low: float
    high: float
    se: float
    df: float
    mde: float
    level: float = LEVEL
    undefined_resamples: int = 0

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "ci": [self.low, self.high], "se": self.se, "df": self.df,
                "mde": self.mde, "level": self.level, "undefined_resamples": self.undefined_resamples}


def interval(panels: list[AnchorPanel], name: str, samples: int = DEFAULT_SAMPLES, seed: int = 0,
             level: float = LEVEL, power: float = POWER) -> Interval:
    """The interval of statistic `name` for one panel, or of the paired difference
    panels[0] - panels[1] (module docstring). Undefined resamples (no round reaches a step)
    are dropped from the variance and counted."""
    stat = statistic(name)
    point = [stat(*[x.sum((0, 1)) for x in p.per_sequence()]).item() for p in panels]
    estimate = point[0] if len(point) == 1 else point[0] - point[1]
    n_seeds, n_seq = panels[0].seeds, panels[0].n_sequences
    by_seq = _replicates(panels, stat, samples, seed, "sequences")
    undefined = int((~torch.isfinite(by_seq)).sum())
    var_seq, df_seq = _var(by_seq), max(n_seq - 1, 1)
    var_seed = seed_component(panels, stat) if n_seeds > 1 else 0.0
    var = var_seq + var_seed
    se = math.sqrt(var) if var == var else float("nan")
    if not math.isfinite(estimate) or not math.isfinite(se):
        return Interval(estimate, float("nan"), float("nan"), se, float(df_seq), float("nan"), level, undefined)
    # each variance component with its own t quantile (Graybill and Wang's modified large-sample
    # rule for a sum of components): the seed part's few degrees of freedom widen only that part
    crit = lambda p, df: _t_quantile(p, df)   # noqa: E731
    two = 1 - (1 - level) / 2
    parts = [(var_seq, df_seq)] + ([(var_seed, n_seeds - 1)] if var_seed > 0 else [])
    half = math.sqrt(sum(crit(two, df) ** 2 * v for v, df in parts))
    mde = math.sqrt(sum((crit(two, df) + crit(power, df)) ** 2 * v for v, df in parts))
    t = half / se if se > 0 else crit(two, df_seq)
    df = float(df_seq) if var_seed <= 0 else var ** 2 / sum(v ** 2 / df for v, df in parts)
    return Interval(estimate, estimate - t * se, estimate + t * se, se, df, mde, level, undefined)


def cell_influence(panels: list[AnchorPanel], stat: Callable) -> Tensor:
    """[n_seeds, S]: each (seed, sequence) cell's first-order contribution to the statistic
    (of panels[0], or of panels[0] - panels[1]): the gradient at the pooled counts times the
    cell's counts."""
    out = None
    for sign, p in zip((1.0, -1.0), panels):
        r, a = p.per_sequence()
        tr, ta = r.sum((0, 1)).requires_grad_(), a.sum((0, 1)).requires_grad_()
        gr, ga = torch.autograd.grad(stat(tr, ta), (tr, ta))
        z = sign * ((r * gr).sum(-1) + (a * ga).sum(-1))
        out = z if out is None else out + z
    return out


def seed_component(panels: list[AnchorPanel], stat: Callable) -> float:
    """The training-seed share of the statistic's variance, net of the seed-by-sequence noise that
    the sequence bootstrap already counts: crossed-design ANOVA on the cell influences,
    n S max(0, MS_seed - MS_residual) (the expected mean squares of a two-way random layout)."""
    z = cell_influence(panels, stat).double()
    n, s = z.shape
    if n < 2 or s < 2 or not bool(torch.isfinite(z).all()):
        return 0.0
    row, col, grand = z.mean(1, keepdim=True), z.mean(0, keepdim=True), z.mean()
    ms_seed = s * float(((row - grand) ** 2).sum()) / (n - 1)
    ms_resid = float(((z - row - col + grand) ** 2).sum()) / ((n - 1) * (s - 1))
    return n * s * max(0.0, ms_seed - ms_resid)


def _var(x: Tensor) -> float:
    ok = x[torch.isfinite(x)]
    return float(ok.var(unbiased=True)) if ok.numel() > 1 else float("nan")


def paired_keys_match(a: AnchorPanel, b: AnchorPanel) -> bool:
    """Two panels can be compared paired when they score the same anchors in the same order."""
    return (a.keys == b.keys and a.lengths.shape[1] == b.lengths.shape[1] and bool((a.sequence == b.sequence).all())
            and a.seeds == b.seeds)
