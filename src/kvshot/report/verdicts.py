"""The four verdicts, one claim's record, and how verdicts combine: shared by every module that
judges a claim (claims, e2e_claim, blockwise), so none of them imports another for these."""
from __future__ import annotations

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, MISSING = "reproduced", "not reproduced", "inconclusive", "not measured"


def combine(verdicts: list[str]) -> str:
    """A claim made of several comparisons (e.g. "better than every other variant"): reproduced
    only if all are, not reproduced if any goes against the paper."""
    if not verdicts or MISSING in verdicts:
        return MISSING
    if NOT_REPRODUCED in verdicts:
        return NOT_REPRODUCED
    return REPRODUCED if all(v == REPRODUCED for v in verdicts) else INCONCLUSIVE


def agree(pooled: str, per_seed: list[str]) -> str:
    """A diagnostic's verdict stands only if every seed that measured it gives the same one."""
    measured = [v for v in per_seed if v != MISSING]
    return pooled if pooled == MISSING or all(v == pooled for v in measured) else INCONCLUSIVE


def claim(name: str, paper: str, test: str, numbers: dict, verdict: str, note: str = "", seeds: int = 0) -> dict:
    out = {"claim": name, "paper": paper, "test": test, "numbers": numbers, "verdict": verdict}
    if note:
        out["note"] = note
    if seeds:
        out["seeds"] = seeds
    return out
