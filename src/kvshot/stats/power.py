"""Synthetic drafting chains with a known truth, for the coverage and power of `resample`.

A chain is drawn per anchor and seed: step k is accepted with probability
sigmoid(logit(alpha_k) + seed effect + anchor difficulty), and the chain stops at its first
rejection. The anchor difficulty is a conversation effect plus an anchor effect, both shared by
every seed and variant (the evaluation scores all of them on the same anchors), plus a small
variant-by-anchor term so that pairing removes most but not all of it. The seed effect is one
normal draw per (variant, seed): training variance.

The truth of a design is the population value of each statistic (expected pooled counts over
conversations, anchors and seeds), computed by Monte Carlo on a large draw (`truth`).
`power_curve` and `minimum_detectable` size an evaluation: how many anchors a claim needs to
decide a given difference in MAT or alpha_k (docs/statistics.md uses them for the paper config).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvshot.stats.resample import AnchorPanel, LEVEL, interval, intervals, statistic


@dataclass(frozen=True)
class Design:
    """The shape of one evaluation: conversations, anchors, seeds, steps, and the spreads
    (logit scale) of conversations, anchors, seeds and the variant-by-anchor term."""
    conversations: int = 100
    anchors: int = 255
    seeds: int = 3
    steps: int = 7
    conversation_sd: float = 0.8
    anchor_sd: float = 1.0
    seed_sd: float = 0.05
    variant_anchor_sd: float = 0.5
    # every held-out position an anchor: conversations hold very unequal counts (log-normal sizes of
    # this spread) and neighbouring anchors of one assistant turn share a difficulty of their own
    size_sd: float = 0.0
    turn_anchors: int = 0
    turn_sd: float = 0.0


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def draw(design: Design, alphas: list[list[float]], gen: torch.Generator) -> list[AnchorPanel]:
    """One evaluation of len(alphas) variants on the same anchors; alphas[v][k] on the logit scale
    is shifted by the random effects (so the population alpha_k is near, not equal to, alphas)."""
    d = design
    if d.size_sd:
        size = torch.exp(torch.randn(d.conversations, generator=gen, dtype=torch.float64) * d.size_sd)
        sequence = torch.sort(torch.multinomial(size, d.anchors, replacement=True, generator=gen)).values
    else:   # equal expected counts (the draws the sampled-anchor designs were tested with)
        sequence = torch.sort(torch.randint(0, d.conversations, (d.anchors,), generator=gen)).values
    sequence = torch.unique(sequence, return_inverse=True)[1]     # only conversations that hold anchors
    shared = (torch.randn(d.conversations, generator=gen, dtype=torch.float64)[sequence] * d.conversation_sd
              + torch.randn(d.anchors, generator=gen, dtype=torch.float64) * d.anchor_sd)
    if d.turn_anchors:
        first = torch.searchsorted(sequence, sequence)              # the conversation's first anchor (sorted)
        turn = torch.unique(sequence * d.anchors + (torch.arange(d.anchors) - first) // d.turn_anchors,
                            return_inverse=True)[1]
        shared = shared + torch.randn(int(turn.max()) + 1, generator=gen, dtype=torch.float64)[turn] * d.turn_sd
    panels = []
    for a in alphas:
        base = torch.tensor([_logit(x) for x in a], dtype=torch.float64)
        own = torch.randn(d.anchors, generator=gen, dtype=torch.float64) * d.variant_anchor_sd
        seed_fx = torch.randn(d.seeds, generator=gen, dtype=torch.float64) * d.seed_sd
        logits = base[None, None, :] + (shared + own)[None, :, None] + seed_fx[:, None, None]
        ok = torch.rand(logits.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(logits)
        lengths = torch.cumprod(ok.long(), dim=2).sum(2)
        panels.append(AnchorPanel(lengths, sequence, d.steps))
    return panels


def truth(design: Design, alphas: list[list[float]], names: list[str], seed: int = 12345,
          replicates: int = 400) -> dict[str, list[float]]:
    """Population values of each statistic per variant: pooled counts over many independent
    evaluations (new conversations, anchors and seeds each time)."""
    gen = torch.Generator().manual_seed(seed)
    big = replace(design, conversations=design.conversations * 10, anchors=design.anchors * 10, seeds=1)
    sums = [[torch.zeros(design.steps, dtype=torch.float64), torch.zeros(design.steps, dtype=torch.float64)]
            for _ in alphas]
    for _ in range(replicates):
        for total, p in zip(sums, draw(big, alphas, gen)):
            r, a = p.per_sequence()
            total[0] += r.sum((0, 1))
            total[1] += a.sum((0, 1))
    return {name: [float(statistic(name)(r, a)) for r, a in sums] for name in names}


def coverage(design: Design, alphas: list[list[float]], names: list[str], reps: int, samples: int = 400,
             seed: int = 0, level: float = LEVEL, truth_replicates: int = 400) -> dict[str, float]:
    """Share of `reps` synthetic evaluations whose interval holds the truth: each statistic of the
    first variant, and (with two variants) the paired difference as `<name> diff`."""
    true = truth(design, alphas, names, replicates=truth_replicates)
    gen = torch.Generator().manual_seed(seed)
    hits = {n: 0 for n in names} | ({f"{n} diff": 0 for n in names} if len(alphas) > 1 else {})
    for i in range(reps):
        panels = draw(design, alphas, gen)
        for n, one in intervals(panels[:1], names, samples, seed=i, level=level).items():
            hits[n] += one.low <= true[n][0] <= one.high
        if len(panels) > 1:
            for n, diff in intervals(panels[:2], names, samples, seed=i, level=level).items():
                hits[f"{n} diff"] += diff.low <= true[n][0] - true[n][1] <= diff.high
    return {k: v / reps for k, v in hits.items()}


def decided(design: Design, alphas: list[list[float]], name: str, reps: int, samples: int = 400, seed: int = 0,
            level: float = LEVEL) -> dict:
    """Share of synthetic evaluations in which the paired interval of variant 0 - variant 1 in
    `name` excludes zero (either direction): the power, or under no difference the error rate;
    with the mean minimum detectable effect the intervals stated."""
    gen = torch.Generator().manual_seed(seed)
    hits, mde = 0, 0.0
    for i in range(reps):
        diff = interval(draw(design, alphas, gen)[:2], name, samples, seed=i, level=level)
        hits += diff.low > 0 or diff.high < 0
        mde += diff.mde / reps
    return {"decided": hits / reps, "mde": mde}


def shifted(alphas: list[float], logit_shift: float) -> list[float]:
    """Every alpha_k moved by the same amount on the logit scale."""
    return [1 / (1 + math.exp(-(_logit(a) + logit_shift))) for a in alphas]


def coverage_by_sequences(conversations: list[int], alphas: list[float], anchors_per_conversation: int, reps: int,
                          samples: int = 200, seed: int = 0, level: float = LEVEL,
                          steps: list[int] | None = None) -> dict[int, dict]:
    """The minimum-sequences rule's evidence: one-seed evaluations of `conversations` each
    (`anchors_per_conversation` anchors per conversation), every alpha_k's interval binned by the
    distinct sequences that reach step k (`AnchorPanel.distinct_sequences`). Per count: intervals,
    coverage of the truth (a withheld interval, null because its resamples do not vary, covers
    nothing), the withheld share, and the mean width and share reaching a bound (0 or 1: clipped,
    or degenerate there) of those given. steps: only these alpha_k (default all)."""
    names = [f"alpha_{k}" for k in (range(len(alphas)) if steps is None else steps)]
    out: dict[int, dict] = {}
    for c in conversations:
        design = Design(conversations=c, anchors=anchors_per_conversation * c, steps=len(alphas), seeds=1, seed_sd=0.0)
        true = truth(design, [alphas], names, replicates=100)
        gen = torch.Generator().manual_seed(seed + c)
        for i in range(reps):
            one = draw(design, [alphas], gen)[0]
            reach = one.distinct_sequences()
            for name, iv in intervals([one], names, samples, seed=seed + i, level=level).items():
                b = out.setdefault(reach[int(name.rpartition("_")[2])],
                                   {"intervals": 0, "covered": 0, "withheld": 0, "width": 0.0, "at_bound": 0})
                b["intervals"] += 1
                b["covered"] += bool(iv.low <= true[name][0] <= iv.high)
                b["withheld"] += iv.reason is not None
                if iv.reason is None:
                    b["width"] += iv.high - iv.low
                    b["at_bound"] += iv.low <= 0.0 or iv.high >= 1.0
    for b in out.values():
        given = max(b["intervals"] - b["withheld"], 1)
        b |= {"coverage": b["covered"] / b["intervals"], "withheld_share": b["withheld"] / b["intervals"],
              "mean_width": b["width"] / given, "at_bound_share": b["at_bound"] / given}
    return dict(sorted(out.items()))
