"""The rules the diagnostic verdicts (gate collapse, sparse KV-path gradient, its block-wise
densification) apply to train_log trajectories, as docs/paper-vs-kvshot.md (Diagnostics)
defines them. Plain numbers in, plain numbers out: `report.claims` and `report.blockwise`
word the verdicts.

Gate collapse, the paper's "the hybrid gate falls toward 0 early and stays closed": the KV
branch's share |g delta| / |h| (mean over layers) is *closed* at a log point when it is below
GATE_CLOSED_FRACTION of its first logged value; the gate *collapsed* when it closes within the
first GATE_EARLY_FRACTION of training and is closed at every later log point.

Sparse gradient: a number per replicate (a seed; one seed: its log points), and a band of
mean +- t(0.975, n-1) x sd / sqrt(n) over the replicates; a verdict is decided only when the
band lies wholly on one side of its line.
"""
from __future__ import annotations

import math
import statistics

GATE_CLOSED_FRACTION = 0.1    # closed: the share below a tenth of its first value ("toward 0": an order of magnitude)
GATE_EARLY_FRACTION = 0.25    # early: closed within the first quarter of the logged training steps
GATE_MIN_POINTS = 4           # fewer log points cannot tell "early" from "stays closed"
GATE_SHARE = "gate_share"     # train_log field: per hybrid layer, |g * delta| / |h|
KV_POSITION_RATIO = "kv_grad_position_ratio"   # train_log field (`diagnostics.GradientPositions`)
KV_SPARSE_RATIO = 0.5         # sparse: the KV path's gradient from fewer than half the positions the query path's is

# two-sided 95% Student t quantiles by degrees of freedom (no scipy in the environment)
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df   # within 0.01 of the t quantile past 30


def band(values: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): the mean of the replicates with its 95% t band; None under 2 values."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if len(values) < 2:
        return None
    mean, half = statistics.mean(values), t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def side(b: tuple[float, float, float] | None, line: float) -> int | None:
    """+1: the band lies above `line`, -1: below, 0: it holds the line, None: no band."""
    if b is None:
        return None
    return 1 if b[1] > line else -1 if b[2] < line else 0


# ---------------------------------------------------------------- gate collapse

def share_trajectory(log: list[dict]) -> list[tuple[int, float]]:
    """(step, |g delta|/|h| averaged over the layers that measured it) at every log point."""
    out = []
    for r in log:
        layers = [x for x in r.get(GATE_SHARE) or [] if x is not None]
        if layers:
            out.append((r["step"], statistics.mean(layers)))
    return out


def gate_trajectory(log: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["gate"]["mean"]) for r in log if r.get("gate")]


def gate_collapse(trajectory: list[tuple[int, float]]) -> dict:
    """The collapse rule on one trajectory: `collapsed` True/False (None: too few log points, or
    none inside the early window after the first), `closed_at` (the step from which the share
    stays closed, or None), `early_until` (the last step that counts as early), `initial`, `final`."""
    out = {"collapsed": None, "closed_at": None, "early_until": None,
           "initial": trajectory[0][1] if trajectory else None, "final": trajectory[-1][1] if trajectory else None}
    if len(trajectory) < GATE_MIN_POINTS:
        return out
    first, last = trajectory[0][0], trajectory[-1][0]
    early_until = first + GATE_EARLY_FRACTION * (last - first)
    out["early_until"] = early_until
    closed = [share < GATE_CLOSED_FRACTION * out["initial"] for _, share in trajectory]
    stays = len(closed)   # the start of the closed run that lasts to the end
    while stays > 0 and closed[stays - 1]:
        stays -= 1
    if stays < len(closed):
        out["closed_at"] = trajectory[stays][0]
    if not any(first < step <= early_until for step, _ in trajectory):
        return out
    out["collapsed"] = out["closed_at"] is not None and out["closed_at"] <= early_until
    return out


# ---------------------------------------------------------------- where the KV path's gradient comes from

def log_values(log: list[dict], field: str = KV_POSITION_RATIO) -> list[tuple[int, float]]:
    return [(r["step"], r[field]) for r in log if r.get(field) is not None]


def replicates(logs: list[list[dict]], field: str = KV_POSITION_RATIO) -> list[float]:
    """One value per seed (the median over its log points); a single seed: its log points."""
    per_log = [[x for _, x in log_values(log, field)] for log in logs]
    per_log = [xs for xs in per_log if xs]
    if len(per_log) == 1:
        return per_log[0]
    return [statistics.median(xs) for xs in per_log]


def paired_replicates(a: list[list[dict]], b: list[list[dict]], field: str = KV_POSITION_RATIO) -> list[float]:
    """a - b per seed (medians over each seed's log points), paired by seed; with one seed each,
    per log point at the steps both logged."""
    if len(a) == len(b) and len(a) > 1:
        ra, rb = replicates(a, field), replicates(b, field)
        return [x - y for x, y in zip(ra, rb)] if len(ra) == len(rb) == len(a) else []
    va, vb = dict(log_values(a[0], field)), dict(log_values(b[0], field))
    return [va[s] - vb[s] for s in sorted(set(va) & set(vb))]
