"""Intervals and paired tests for the step-wise metrics, from per-anchor chain lengths.

Every variant and seed is scored on the same anchors (the evaluation's seeded anchor draw), so
a record is an `AnchorPanel`: for each training seed and anchor, how many leading draft steps
were accepted (0..K), and the sequence (conversation or prompt) each anchor belongs to.
alpha_k, MAT and retention are ratios of pooled counts (`metrics` defines them).

The variance of a statistic, or of a paired contrast between variants on the shared anchors,
has two parts, each counted once:
- prompts: one bootstrap that resamples whole sequences (anchors of one conversation share
  their difficulty), every seed's counts kept, the same sequences for every variant of a
  contrast. It holds the sequence effect and the seed-by-sequence noise.
- training seeds: what a new seed would change, net of that noise: a crossed two-way ANOVA of
  the (seed, sequence) cells' first-order contributions, n S max(0, MS_seed - MS_residual).
Resampling three seeds instead would keep (n-1)/n of their variance in ten distinct draws and
count the seed-by-sequence noise a second time.
The interval is estimate +- sqrt(sum_c t_c^2 V_c), each component with its own t quantile
(S - 1 and n - 1 degrees of freedom; Graybill and Wang's rule for a sum of components), so three
seeds widen only the seed part. The minimum detectable effect replaces t_c by t_c + t_power.
tests/unit/test_coverage.py measures coverage and power on clustered synthetic chains with a known
truth (`power`); docs/statistics.md states the choices.

Two guards for thin evidence (`guard_bounds`, `record_guards`; tests/unit/test_interval_guards.py):
- an interval is clipped to the values its statistic can take (`statistic_range`,
  `contrast_range`): the truth lies in that range, so clipping never drops it and the measured
  coverage is unchanged, while a t interval on few sequences can reach far outside it;
- a resample distribution without spread (every resample equal: one sequence, or sequences that
  all agree) gives no interval: null bounds and the reason "insufficient", never a point.
A rate also reads "insufficient" when it rests on fewer than min_rounds distinct anchors or on
fewer than min_sequences distinct sequences: the bootstrap resamples sequences, and with few of
them its intervals under-cover (docs/statistics.md, "Minimum sequences").
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from kvshot.stats.beta import beta_cdf

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

    @functools.cached_property
    def counts(self) -> tuple[Tensor, Tensor]:
        """`per_sequence`, computed once."""
        return self.per_sequence()

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

    def distinct_sequences(self) -> list[int]:
        """Per step, the distinct sequences holding an anchor that some seed brings to step k: the
        clusters the bootstrap resamples for alpha_k, what the minimum-sequences rule counts."""
        best = self.lengths.max(0).values
        return [int(self.sequence[best >= k].unique().numel()) for k in range(self.steps)]


def panel(lengths: list[list[int]] | Tensor, sequence: list[int] | Tensor, steps: int, keys=()) -> AnchorPanel:
    return AnchorPanel(torch.as_tensor(lengths, dtype=torch.long), torch.as_tensor(sequence, dtype=torch.long),
                       steps, tuple(keys))


def panel_record(anchors: AnchorPanel, seeds: list) -> dict:
    """stepwise.json's `anchors_panel`: per anchor its sequence and position, per seed its accepted run
    length (0..K): what paired comparisons between variants resample (report/claims.py)."""
    sequences = list(dict.fromkeys(str(g) for g, _ in anchors.keys))
    return {"seeds": seeds, "sequences": sequences, "sequence": anchors.sequence.tolist(),
            "position": [t for _, t in anchors.keys], "accepted_len": anchors.lengths.tolist()}


def read_panel(record: dict, steps: int) -> AnchorPanel:
    """An AnchorPanel back from stepwise.json's `anchors_panel` (keys: sequence name and position)."""
    names = record["sequences"]
    keys = tuple((names[j], t) for j, t in zip(record["sequence"], record["position"]))
    return panel(record["accepted_len"], record["sequence"], steps, keys=keys)


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

def sequence_weights(n_sequences: int, samples: int, seed: int) -> Tensor:
    """Multinomial resampling counts [B, S]: each resample draws S sequences with replacement."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_sequences, (samples, n_sequences), generator=gen)
    return torch.zeros(samples, n_sequences, dtype=torch.float64).scatter_add_(
        1, idx, torch.ones(samples, n_sequences, dtype=torch.float64))


def pooled_counts(per_seq: tuple[Tensor, Tensor], seqs: Tensor) -> tuple[Tensor, Tensor]:
    """Counts [B, K] of each resample (seeds summed) from per-sequence counts [n, S, K]."""
    r, a = per_seq
    return seqs @ r.sum(0), seqs @ a.sum(0)


@functools.lru_cache(maxsize=256)
def _t_quantile(p: float, df: float) -> float:
    """Student t quantile (Hill 1970's series, exact for df -> inf); df >= 1."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(p, dtype=torch.float64)).item()
    if math.isinf(df) or df > 1e6:
        return z
    if df < 1:
        df = 1.0
    # invert the t CDF by bisection on the regularized incomplete beta function
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
    reason: str | None = None     # "insufficient: <why>" where the interval is withheld (`guard_bounds`)

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "ci": [self.low, self.high], "se": self.se, "df": self.df,
                "mde": self.mde, "level": self.level, "undefined_resamples": self.undefined_resamples,
                "reason": self.reason}


def interval(panels: list[AnchorPanel], name: str, samples: int = DEFAULT_SAMPLES, seed: int = 0,
             level: float = LEVEL, power: float = POWER, coefs: tuple[float, ...] | None = None) -> Interval:
    """The interval of statistic `name` for one panel, of the paired difference
    panels[0] - panels[1], or of a contrast sum_i coefs[i] * statistic(panels[i]) (module
    docstring). The panels must score the same anchors (`same_anchors`)."""
    return intervals(panels, [name], samples, seed, level, power, coefs)[name]


def intervals(panels: list[AnchorPanel], names: list[str], samples: int = DEFAULT_SAMPLES, seed: int = 0,
              level: float = LEVEL, power: float = POWER, coefs: tuple[float, ...] | None = None) -> dict[str, Interval]:
    """`interval` of several statistics on the same resamples. Undefined resamples (no round
    reaches a step) are dropped from the variance and counted."""
    coefs = coefs or ((1.0,) if len(panels) == 1 else (1.0, -1.0))
    if len(coefs) != len(panels):
        raise ValueError(f"{len(panels)} panels, {len(coefs)} coefficients")
    seqs = sequence_weights(panels[0].n_sequences, samples, seed)
    resampled = [pooled_counts(p.counts, seqs) for p in panels]
    totals = [tuple(x.sum((0, 1)) for x in p.counts) for p in panels]
    out = {}
    for name in names:
        stat = statistic(name)
        estimate = sum(c * stat(*tot).item() for c, tot in zip(coefs, totals))
        by_seq = sum(c * stat(*rs) for c, rs in zip(coefs, resampled))
        undefined = int((~torch.isfinite(by_seq)).sum())
        var_seq, df_seq = _var(by_seq), max(panels[0].n_sequences - 1, 1)
        var_seed = seed_component(panels, coefs, stat) if panels[0].seeds > 1 else 0.0
        raw = _t_interval(estimate, [(var_seq, df_seq), (var_seed, panels[0].seeds - 1)], level, power, undefined)
        low, high, why = guard_bounds(raw.estimate, raw.low, raw.high, contrast_range(name, panels[0].steps, coefs))
        out[name] = dataclasses.replace(raw, low=low, high=high, reason=insufficient(why),
                                        mde=float("nan") if why else raw.mde)
    return out


def _t_interval(estimate: float, parts: list[tuple[float, int]], level: float, power: float,
                undefined: int) -> Interval:
    """estimate +- sqrt(sum_c t_c^2 V_c) over variance components (V_c, df_c): each with its own t
    quantile (Graybill and Wang's modified large-sample rule for a sum of components), so the few
    degrees of freedom of the seeds widen only their part."""
    parts = [(v, df) for v, df in parts if v > 0 or v != v]
    var = sum(v for v, _ in parts)
    se = math.sqrt(var) if var == var else float("nan")
    df = var ** 2 / sum(v ** 2 / d for v, d in parts) if parts and var > 0 else float("nan")
    if not math.isfinite(estimate) or not math.isfinite(se):
        return Interval(estimate, float("nan"), float("nan"), se, df, float("nan"), level, undefined)
    two = 1 - (1 - level) / 2
    half = math.sqrt(sum(_t_quantile(two, d) ** 2 * v for v, d in parts))
    mde = math.sqrt(sum((_t_quantile(two, d) + _t_quantile(power, d)) ** 2 * v for v, d in parts))
    return Interval(estimate, estimate - half, estimate + half, se, df, mde, level, undefined)


def cell_influence(panels: list[AnchorPanel], coefs: tuple[float, ...], stat: Callable) -> Tensor:
    """[n_seeds, S]: each (seed, sequence) cell's first-order contribution to the contrast
    sum_i coefs[i] * statistic(panels[i]): the gradient at the pooled counts times the cell's counts."""
    out = None
    for sign, p in zip(coefs, panels):
        r, a = p.counts
        tr, ta = r.sum((0, 1)).requires_grad_(), a.sum((0, 1)).requires_grad_()
        gr, ga = torch.autograd.grad(stat(tr, ta), (tr, ta))
        z = sign * ((r * gr).sum(-1) + (a * ga).sum(-1))
        out = z if out is None else out + z
    return out


def seed_component(panels: list[AnchorPanel], coefs: tuple[float, ...], stat: Callable) -> float:
    """The training-seed share of the statistic's variance, net of the seed-by-sequence noise that
    the sequence bootstrap already counts: crossed-design ANOVA on the cell influences,
    n S max(0, MS_seed - MS_residual) (the expected mean squares of a two-way random layout)."""
    z = cell_influence(panels, coefs, stat).double()
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


def same_anchors(a: AnchorPanel, b: AnchorPanel) -> bool:
    """Two panels can be compared paired when they score the same anchors in the same order with
    as many seeds (seed i of one is paired with seed i of the other)."""
    return (a.keys == b.keys and a.lengths.shape[1] == b.lengths.shape[1] and a.seeds == b.seeds
            and bool((a.sequence == b.sequence).all()))


# ---------------------------------------------------------------- guards for thin evidence

INSUFFICIENT = "insufficient"
NO_SPREAD = "the resamples do not vary"
UNDEFINED = "too few defined resamples"
ZERO_WIDTH = 1e-9   # relative: an interval narrower than this has no spread
NO_ESTIMATE = "no estimate (a step no anchor reaches, or a zero denominator)"
INTERVAL_GUARD = ("intervals clipped to the statistic's range (rates [0, 1], MAT [1, K + 1], retention >= 0, a "
                  "contrast to the range of its coefficients: the truth lies there, so coverage is unchanged); a "
                  "resample distribution without spread gives no interval (null, 'insufficient'); a rate on fewer "
                  "than min_rounds distinct anchors or min_sequences distinct sequences reads 'insufficient' "
                  "(resample.py, docs/statistics.md)")


def statistic_range(name: str, steps: int) -> tuple[float, float]:
    """The values statistic `name` can take with K = steps: a rate (alpha_k, cumulative_k) [0, 1];
    MAT, 1 + the sum of K cumulative rates, [1, K + 1]; retention alpha_{K-1} / alpha_0, a ratio of
    two rates, [0, inf) (it exceeds 1 when the last step is accepted more often than the first)."""
    if name == "mat":
        return 1.0, steps + 1.0
    if name == "retention":
        return 0.0, math.inf
    if name.rpartition("_")[0] in ("alpha", "cumulative"):
        return 0.0, 1.0
    raise KeyError(f"unknown statistic {name!r}")


def contrast_range(name: str, steps: int, coefs: tuple[float, ...]) -> tuple[float, float]:
    """The range of sum_i coefs[i] * statistic_i, each statistic in `statistic_range` (a difference
    of two rates: [-1, 1]; of two MATs: [-K, K])."""
    lo, hi = statistic_range(name, steps)
    ends = [(c * lo, c * hi) if c > 0 else (c * hi, c * lo) for c in coefs if c != 0]
    return sum(a for a, _ in ends), sum(b for _, b in ends)


def guard_bounds(estimate: float, low: float, high: float, bounds: tuple[float, float]) -> tuple[float, float, str]:
    """An interval's bounds after both guards, and why it was withheld ('' when it stands): a
    zero-width interval of a defined estimate (the resamples do not vary) and an undefined one
    become null (NaN); the rest is clipped to `bounds`."""
    if not math.isfinite(estimate):
        return float("nan"), float("nan"), NO_ESTIMATE
    if not (math.isfinite(low) and math.isfinite(high)):
        return float("nan"), float("nan"), UNDEFINED
    if high - low <= ZERO_WIDTH * max(1.0, abs(estimate)):   # rounding leaves ~1e-16 of one sequence's ratio
        return float("nan"), float("nan"), NO_SPREAD
    return max(low, bounds[0]), min(high, bounds[1]), ""


def insufficient(*why: str) -> str | None:
    """The reason a number reads insufficient ("insufficient: a; b"), None when nothing is wrong."""
    parts = [w for w in why if w]
    return f"{INSUFFICIENT}: {'; '.join(parts)}" if parts else None


def count_why(anchors: int, sequences: int | None, min_rounds: int, min_sequences: int) -> str:
    """What the minimum-counts rule finds short: distinct anchors and distinct sequences."""
    short = [f"{anchors} anchors < min_rounds {min_rounds}"] if anchors < min_rounds else []
    if sequences is not None and sequences < min_sequences:
        short.append(f"{sequences} sequence{'s' if sequences != 1 else ''} < min_sequences {min_sequences}")
    return "; ".join(short)


def reason_why(reason: str | None) -> str:
    """The text after "insufficient: " of a reason ('' for None)."""
    return (reason or "").partition(": ")[2] if reason else ""


def record_guards(record: dict, anchors: int, sequences: int | None, min_rounds: int, min_sequences: int) -> dict:
    """An interval record (`Interval.as_dict`) annotated with what it rests on (`anchors`,
    `sequences`) and the guards' verdict: `reason` "insufficient: <why>" when the counts are
    below the minimums or the interval was withheld, else None; `sufficient` accordingly."""
    reason = insufficient(count_why(anchors, sequences, min_rounds, min_sequences), reason_why(record.get("reason")))
    return record | {"anchors": anchors, "sequences": sequences, "reason": reason, "sufficient": reason is None}
