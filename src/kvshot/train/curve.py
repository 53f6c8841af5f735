"""The learning curve's training plan (`snakemake results/curve/curve.md`, workflow/rules/curve.smk):
how many steps a token budget buys and where the held-out points go. Plain dicts in and out,
as Snakemake holds the config."""
from __future__ import annotations

import math

# what the curve sets: a variant's own value would escape it
CURVE_SETS = ("max_steps", "eval_every", "eval_steps", "plateau", "max_minutes", "train_samples")


def unknown_variant(curve_variants, names) -> str | None:
    """`curve.variants.<i>: ...` for the first curve variant not in drafters.variants; None when all are.
    Checked where the curve is asked for (target and report), so a config that drops one needs no curve."""
    for i, name in enumerate(curve_variants):
        if name not in names:
            return f"curve.variants.{i}: {name!r} is not in drafters.variants"
    return None


def curve_seeds(seeds, drafter_seeds, seed: int) -> list[int]:
    """curve.seeds, else the first of drafters.seeds (else the global seed)."""
    return [int(s) for s in seeds] if seeds else [int((list(drafter_seeds or []) or [seed])[0])]


def curve_steps(tokens: int, batch_size: int, max_len: int) -> int:
    """Optimizer steps that train `tokens` batch tokens (batch_size x max_len a step, padding included)."""
    return max(1, math.ceil(tokens / (batch_size * max_len)))


def eval_points(max_steps: int, points: int) -> list[int]:
    """Held-out steps even on a log axis: max_steps, then halving, `points` of them at most
    (fewer when max_steps is too small to halve that often: no step is taken twice)."""
    return sorted({max(1, round(max_steps / 2 ** i)) for i in range(points)})


def curve_train(curve: dict, train: dict) -> dict:
    """drafters.train's overlay for one curve drafter; `train` is the variant's merged train settings."""
    steps = curve_steps(int(curve["tokens"]), int(train["batch_size"]), int(train["max_len"]))
    out = {"max_steps": steps, "eval_every": 0, "eval_steps": eval_points(steps, int(curve["points"])),
           "plateau": None, "train_samples": None}
    if curve.get("max_minutes"):
        out["max_minutes"] = curve["max_minutes"]
    return out
