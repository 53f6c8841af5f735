"""A verdict on each of the paper's claims, computed from the result files only.

Step-wise comparisons use the bootstrap 95% intervals: `reproduced` when the intervals
separate in the paper's direction, `not reproduced` when they separate the other way,
`inconclusive` when they overlap. Thresholds for the diagnostics are stated with each test.
"""
from __future__ import annotations

import statistics

from .results import Variant, roles

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, MISSING = "reproduced", "not reproduced", "inconclusive", "not measured"

GATE_COLLAPSE_RATIO = 0.5      # final mean gate below half its initial value
KV_KEY_SHARE_SPARSE = 0.2      # under 20% of attended keys carry gradient to W_K/W_V
KV_GRAD_RATIO_SPARSE = 0.5     # |grad W_K,W_V| below half of |grad W_Q,W_O| (median over training)
E2E_MARGINAL = 0.05            # |tau gain| within 5%


def greater(a: float, a_ci, b: float, b_ci) -> str:
    """Is a > b, judged by the intervals (undefined numbers: inconclusive)."""
    if any(x != x for x in (a, b, *a_ci, *b_ci)):
        return INCONCLUSIVE
    if a_ci[0] > b_ci[1]:
        return REPRODUCED
    if a_ci[1] < b_ci[0]:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    if not verdicts or MISSING in verdicts:
        return MISSING
    if NOT_REPRODUCED in verdicts:
        return NOT_REPRODUCED
    return REPRODUCED if all(v == REPRODUCED for v in verdicts) else INCONCLUSIVE


def _alpha(v: Variant, k: int):
    sw = v.stepwise
    return sw["alpha"][k], sw["alpha_ci"][k]


def _mat(v: Variant):
    return v.stepwise["mat"], v.stepwise["mat_ci"]


def _fmt(x, ci=None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def claim(name: str, paper: str, test: str, numbers: dict, verdict: str) -> dict:
    return {"claim": name, "paper": paper, "test": test, "numbers": numbers, "verdict": verdict}


def evaluate_claims(variants: list[Variant]) -> list[dict]:
    r = roles(variants)
    ref, kv, hyb = r["eagle3"], r["kv"], r["hybrid"]
    out = []
    last = (ref.stepwise["steps"] - 1) if ref else 6

    # P1: long-range advantage
    if ref and kv:
        deep = kv[max(kv)]
        a, b = _alpha(deep, last), _alpha(ref, last)
        out.append(claim("P1 long-range advantage", "alpha_6: 4-layer KV-only 0.495 > EAGLE-3 0.469",
                         f"alpha_{last}({deep.name}) > alpha_{last}({ref.name}), 95% intervals",
                         {deep.name: _fmt(*a), ref.name: _fmt(*b)}, greater(a[0], a[1], b[0], b[1])))
    # P2: query-estimation (depth) bottleneck
    if ref and len(kv) >= 2:
        depths = sorted(kv)
        verdicts = [greater(*_mat(kv[depths[1]]), *_mat(kv[depths[0]]))]
        verdicts += [greater(*_mat(ref), *_mat(kv[d])) for d in depths]
        nums = {kv[d].name: _fmt(*_mat(kv[d])) for d in depths} | {ref.name: _fmt(*_mat(ref))}
        out.append(claim("P2 depth bottleneck", "MAT 1.84 (1 layer) < 2.23 (2 layers), 4 layers diminishing, "
                         "all below EAGLE-3's 2.37", f"MAT(depth {depths[1]}) > MAT(depth {depths[0]}) and "
                         f"MAT({ref.name}) > MAT of every KV-only depth", nums, combine(verdicts)))
    # P3: short-range disadvantage
    if ref and kv:
        verdicts, nums = [], {}
        for k in (0, 1):
            nums[f"alpha_{k} {ref.name}"] = _fmt(*_alpha(ref, k))
            for d, v in kv.items():
                verdicts.append(greater(*_alpha(ref, k), *_alpha(v, k)))
                nums[f"alpha_{k} {v.name}"] = _fmt(*_alpha(v, k))
        out.append(claim("P3 short-range disadvantage", "hidden-only wins at k = 0, 1",
                         f"alpha_0 and alpha_1 of {ref.name} > every KV-only variant", nums, combine(verdicts)))
    # Hybrid best step-wise, and its retention gain
    if hyb:
        others = [v for v in r["paper"] if v is not hyb]
        out.append(claim("hybrid best step-wise", "MAT 2.54 vs EAGLE-3 2.37", f"MAT({hyb.name}) > MAT of every other variant",
                         {v.name: _fmt(*_mat(v)) for v in r["paper"]},
                         combine([greater(*_mat(hyb), *_mat(v)) for v in others])))
    if hyb and ref:
        a = (hyb.stepwise["retention"], hyb.stepwise["retention_ci"])
        b = (ref.stepwise["retention"], ref.stepwise["retention_ci"])
        out.append(claim("long-range retention gain", "alpha_6/alpha_0: 73.5% (EAGLE-3) -> 77.3% (hybrid)",
                         f"retention({hyb.name}) > retention({ref.name})", {hyb.name: _fmt(*a), ref.name: _fmt(*b)},
                         greater(a[0], a[1], b[0], b[1])))
    out.append(_e2e_claim(ref, hyb))
    out.append(_gate_claim(hyb))
    out.append(_gradient_claim(kv[max(kv)] if kv else None))
    return out


def _e2e_claim(ref: Variant | None, hyb: Variant | None) -> dict:
    name, paper = "marginal E2E gain, 5-10% drafting overhead", "tau 5.01 -> 5.04; cross-attention adds 5-10% drafting latency"
    test = f"|tau(hybrid)/tau(EAGLE-3) - 1| <= {E2E_MARGINAL:.0%} (chain) and drafting time per round of hybrid > EAGLE-3's"
    if not (ref and hyb and ref.e2e and hyb.e2e):
        return claim(name, paper, test, {}, MISSING)
    a, b = hyb.e2e["modes"]["chain"], ref.e2e["modes"]["chain"]
    gain = a["tau"] / b["tau"] - 1
    overhead = a["draft_seconds_per_round"] / b["draft_seconds_per_round"] - 1
    ok = abs(gain) <= E2E_MARGINAL and overhead > 0
    return claim(name, paper, test, {"tau gain": f"{gain:+.1%}", "drafting overhead": f"{overhead:+.1%}",
                                     f"tau {ref.name}": f"{b['tau']:.3f}", f"tau {hyb.name}": f"{a['tau']:.3f}"},
                 REPRODUCED if ok else NOT_REPRODUCED)


def _gate_claim(hyb: Variant | None) -> dict:
    name, paper = "gate collapse", "the hybrid gate falls toward 0 early and stays closed"
    test = f"final mean gate < {GATE_COLLAPSE_RATIO} x its initial value (closed) ; above the initial value: not reproduced"
    gates = [r["gate"]["mean"] for r in (hyb.log if hyb else []) if "gate" in r]
    if len(gates) < 2:
        return claim(name, paper, test, {}, MISSING)
    first, final = gates[0], gates[-1]
    verdict = REPRODUCED if final < GATE_COLLAPSE_RATIO * first else NOT_REPRODUCED if final >= first else INCONCLUSIVE
    return claim(name, paper, test, {"initial gate": f"{first:.3f}", "final gate": f"{final:.3f}",
                                     "min over training": f"{min(gates):.3f}"}, verdict)


def _gradient_claim(deep: Variant | None) -> dict:
    name, paper = "sparse KV-path gradient", "drafter-side W_K/W_V see only the drafted tokens: sparse, unbalanced gradient"
    test = (f"{deep.name if deep else 'deepest KV-only'}: share of attended keys from its own W_K/W_V < "
            f"{KV_KEY_SHARE_SPARSE} and median |grad W_K,W_V| / |grad W_Q,W_O| < {KV_GRAD_RATIO_SPARSE}")
    recs = [r for r in (deep.log if deep else []) if r.get("kv_key_share") is not None]
    if not recs:
        return claim(name, paper, test, {}, MISSING)
    share = statistics.mean(r["kv_key_share"] for r in recs)
    ratio = statistics.median(r["grad_norm"]["kv_wk_wv"] / max(r["grad_norm"]["kv_query_out"], 1e-12) for r in recs)
    ok = share < KV_KEY_SHARE_SPARSE and ratio < KV_GRAD_RATIO_SPARSE
    half = share < KV_KEY_SHARE_SPARSE or ratio < KV_GRAD_RATIO_SPARSE
    return claim(name, paper, test, {"own-key share": f"{share:.3f}", "grad ratio": f"{ratio:.3f}"},
                 REPRODUCED if ok else INCONCLUSIVE if half else NOT_REPRODUCED)


def claims_markdown(claims: list[dict]) -> str:
    lines = ["# Claims verdict", "", "Computed by `kvshot report` from the result files; paper numbers are "
             "Qwen3-8B's (shared/PAPER.md), this run's are the embedded or configured scale.", "",
             "| claim | paper | test | this run | verdict |", "|---|---|---|---|---|"]
    for c in claims:
        nums = "; ".join(f"{k}: {v}" for k, v in c["numbers"].items()) or "n/a"
        lines.append(f"| {c['claim']} | {c['paper']} | {c['test']} | {nums} | **{c['verdict']}** |")
    return "\n".join(lines) + "\n"
