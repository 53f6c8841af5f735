"""Every claim test driven to each of its verdicts by result files written in the real schema:
stepwise.json from per-sequence chain counts through the same `chain_summary` the evaluation
uses, e2e.json as `e2e.summarize` writes it, and the drafters' train_log.json / metrics.json."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvshot.core.io import write_json
from kvshot.evaluate.stepwise import by_context
from kvshot.report.claims import INCONCLUSIVE, MISSING, NOT_REPRODUCED, REPRODUCED, evaluate_claims
from kvshot.report.e2e_claim import OVERHEAD_BAND
from kvshot.report.results import PAPER, load_variants
from kvshot.stats.metrics import chain_summary
from kvshot.stats.resample import panel, panel_record

NAMES = ["eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone"]
SPEC = {"eagle3": ("hidden", 1), "kv-d1": ("kv", 1), "kv-d2": ("kv", 2), "kv-d4": ("kv", 4), "hybrid": ("hybrid", 1),
        "standalone": ("standalone", 2)}
# alpha_0..6 shaped like the paper's story: hidden wins early, KV decays less, hybrid on top
ALPHAS = {
    "eagle3": [0.80, 0.72, 0.65, 0.60, 0.55, 0.50, 0.47],
    "kv-d1": [0.50, 0.45, 0.42, 0.40, 0.38, 0.36, 0.35],
    "kv-d2": [0.60, 0.55, 0.52, 0.50, 0.49, 0.48, 0.47],
    "kv-d4": [0.62, 0.60, 0.59, 0.58, 0.58, 0.57, 0.57],
    "hybrid": [0.85, 0.78, 0.72, 0.68, 0.66, 0.65, 0.64],
    "standalone": [0.95, 0.94, 0.93, 0.92, 0.91, 0.90, 0.89],   # a baseline above everything: in no claim
}
MIN_ROUNDS = 30
E2E = "marginal E2E gain"


def chain_lengths(alphas: list[float], anchors: int, seeds: int = 1, draw: int = 0) -> torch.Tensor:
    """[seeds, anchors] accepted runs drawn from the chain model: step k accepted with alphas[k]."""
    gen = torch.Generator().manual_seed(1_000_003 * draw + round(sum(a * 10 ** (2 * i) for i, a in enumerate(alphas))))
    ok = torch.rand(seeds, anchors, len(alphas), generator=gen) < torch.tensor(alphas)
    return torch.cumprod(ok.long(), dim=2).sum(2)


def stepwise_record(alphas: list[float] | list[list[float]], paradigm: str, layers: int, rounds: int = 30_000,
                    seed: int = 0, protocol: str = "continuations", repetition: float = 0.10) -> dict:
    """stepwise.json for `rounds` anchors (one round each) over 300 prompts, shared by every
    variant written with the same `rounds`, chains drawn with alpha_k; alphas a list per seed:
    one row of the panel per seed. The reference tokens repeat an earlier 4-gram at `repetition`."""
    per_seed = alphas if isinstance(alphas[0], list) else [alphas]
    sequences = max(1, min(300, rounds // 100))
    lengths = torch.cat([chain_lengths(a, rounds, draw=seed * 7 + i) for i, a in enumerate(per_seed)])
    anchors = panel(lengths, torch.arange(rounds) * sequences // rounds, len(per_seed[0]),
                    keys=[(f"p{j * sequences // rounds}", j) for j in range(rounds)])
    tokens = 10_000
    # 100 anchors per context bucket; row i accepts step k while i < accepted_k (a chain)
    first = per_seed[0]
    accepted_per_bucket = [round(100 * math.prod(first[: k + 1])) for k in range(len(first))]
    correct = torch.arange(100)[:, None] < torch.tensor(accepted_per_bucket)[None]
    contexts = torch.tensor([c for c in (50, 200, 400, 700) for _ in range(100)])
    return {"by_context": by_context(contexts, correct.repeat(4, 1), [128, 256, 512]), "acc": first, "sequences": sequences,
            "steps": len(first), "paradigm": paradigm, "layers": layers,
            "protocol": protocol, "max_repetition": 0.25,
            "repetition": {"share": repetition, "repeated": round(repetition * tokens), "tokens": tokens, "ngram": 4},
            "anchors_panel": panel_record(anchors, list(range(len(per_seed)))),
            **chain_summary(anchors, samples=200, seed=seed, min_rounds=MIN_ROUNDS)}


def train_log(paradigm: str, gate_final: float, own_key_mass: float | None, grad_ratio: float,
              gate_share_final: float | None = None, closes_at: int = 10) -> list[dict]:
    """Logged every 5 steps over 100. The hybrid's gate share |g delta|/|h| starts at 0.2 and falls
    geometrically to gate_share_final by step `closes_at`, then stays (default: 0.2 (g / 0.5)^2 for
    the final g, so g 0.05 closes the branch); NaN: not logged (older logs). grad_ratio: the
    positions sending gradient into W_K,W_V per those into W_Q,W_O (and the norm ratio, as logged)."""
    log = []
    for step in range(0, 100, 5):
        rec = {"step": step, "loss": 1.0, "grad_norm": {"body": 1.0, "lm_head": 1.0}, "kv_key_share": None}
        if paradigm in ("kv", "hybrid"):
            rec["grad_norm"] |= {"kv_wk_wv": grad_ratio, "kv_query_out": 1.0}
            rec["kv_key_share"] = 0.05            # the length formula: always "sparse", decides nothing
            rec |= {"kv_grad_position_ratio": grad_ratio, "kv_grad_positions": 4 * grad_ratio,
                    "query_grad_positions": 4.0}
            if own_key_mass is not None:
                rec["kv_own_key_mass"] = own_key_mass
        if paradigm == "hybrid":
            g = 0.5 + (gate_final - 0.5) * min(step, 15) / 15
            rec["gate"] = {"mean": g, "min": g, "max": g}
            final = 0.2 * (gate_final / 0.5) ** 2 if gate_share_final is None else gate_share_final
            if final == final:
                rec["gate_share"] = [0.2 * (final / 0.2) ** (min(step, closes_at) / closes_at)]
        log.append(rec)
    return log


def e2e_record(tau: float, draft_s: float, rounds: int, spread: float = 0.1, noise_seed: int = 0) -> dict:
    """e2e.json over up to 20 prompts whose tau varies by `spread` (the same pattern for every variant
    with the same noise_seed: perfectly paired prompts), with the per-prompt counts `e2e` writes."""
    import numpy as np

    prompts = min(20, rounds)
    per = rounds // prompts
    z = np.random.default_rng(noise_seed).standard_normal(prompts)
    emitted = per * tau * (1 + spread * z)
    counts = {"emitted": emitted.tolist(), "rounds": [per] * prompts, "draft_s": [per * draft_s] * prompts,
              "tokens": emitted.round().tolist()}
    mode = {"tau": tau, "tokens_per_s": 100 * tau, "speedup": tau / 2, "draft_seconds_per_round": draft_s,
            "verify_seconds_per_round": 0.02, "rounds": rounds, "tokens": int(rounds * tau),
            "accepted_per_round": tau - 1, "lossless": True, "per_prompt": counts}
    return {"modes": {"chain": mode, "tree": mode}, "baseline": {"tokens_per_s": 200},
            "prompt_keys": [[i, 10] for i in range(prompts)]}


def write_results(root: Path, alphas: dict = ALPHAS, rounds: int | None = None, gate_final: float = 0.05,
                  tau: tuple = (3.0, 3.05), draft_s: tuple = (0.010, 0.0108), e2e_rounds: int = 400,
                  own_key_mass: float | None = 0.05, grad_ratio: float = 0.05, seeds: list[dict] | None = None,
                  gate_share_final: float | None = None, repetition: float = 0.10,
                  natural: dict | None = None, natural_repetition: float = 0.03) -> Path:
    """One study's result files, every variant scored on the same `rounds` anchors. seeds:
    per-seed overrides of the keyword arguments (each seed's records go into the `per_seed`
    lists of the same files, and its chains into the pooled record's panel). natural: alphas of
    a second, natural-text protocol (stepwise_natural.json) with its own reference repetition."""
    seeds = seeds or []
    for name in NAMES:
        paradigm, layers = SPEC[name]
        is_h = name == "hybrid"

        def records(alphas=alphas, rounds=rounds, gate_final=gate_final, tau=tau, draft_s=draft_s,
                    e2e_rounds=e2e_rounds, own_key_mass=own_key_mass, grad_ratio=grad_ratio, seed=0,
                    gate_share_final=gate_share_final):
            sw = stepwise_record(alphas[name], paradigm, layers, rounds=rounds or 30_000, seed=seed,
                                 repetition=repetition)
            e2e = e2e_record(tau[is_h], draft_s[is_h], e2e_rounds)
            return sw, e2e, train_log(paradigm, gate_final, own_key_mass, grad_ratio, gate_share_final)

        sw, e2e, log = records()
        per_seed = [records(**(s | {"seed": i + 1})) for i, s in enumerate(seeds)]
        metrics = {"eval": {"query_cosine": [0.3] * 7 if paradigm in ("kv", "hybrid") else None}}
        if per_seed:
            pooled = [(s.get("alphas") or alphas)[name] for s in seeds]
            sw = stepwise_record(pooled, paradigm, layers, rounds=rounds or 30_000, repetition=repetition)
            sw["per_seed"] = [s for s, _, _ in per_seed]
            e2e["per_seed"] = [e for _, e, _ in per_seed]
            metrics["per_seed"] = [{"train_log": lg} for _, _, lg in per_seed]
        write_json(root / "eval" / name / "stepwise.json", sw)
        if natural:
            write_json(root / "eval" / name / "stepwise_natural.json",
                       stepwise_record(natural[name], paradigm, layers, protocol="natural", repetition=natural_repetition))
        write_json(root / "eval" / name / "e2e.json", e2e)
        write_json(root / "drafters" / name / "train_log.json", log)
        write_json(root / "drafters" / name / "metrics.json", metrics)
    return root


def verdicts(root: Path) -> dict:
    return {c["claim"]: c["verdict"] for c in evaluate_claims(load_variants(root, NAMES))}


def claims(root: Path) -> dict:
    return {c["claim"]: c for c in evaluate_claims(load_variants(root, NAMES))}


def changed(**steps) -> dict:
    """ALPHAS with some variants' alpha lists replaced (or edited by index: {"kv-d4": {6: 0.4}})."""
    out = {k: list(v) for k, v in ALPHAS.items()}
    for name, new in steps.items():
        if isinstance(new, dict):
            for k, a in new.items():
                out[name][k] = a
        else:
            out[name] = list(new)
    return out


def test_paper_numbers_live_in_results():
    from kvshot.report import claims as claims_module

    assert OVERHEAD_BAND == PAPER["draft_overhead"] == (0.05, 0.10)
    source = Path(claims_module.__file__).read_text()
    for literal in ("0.495", "0.469", "1.84", "2.23", "2.37", "2.54", "73.5", "77.3", "5.01", "5.04"):
        assert literal not in source, literal


def test_paper_shaped_results_reproduce_every_claim(tmp_path):
    assert set(verdicts(write_results(tmp_path)).values()) == {REPRODUCED}


@pytest.mark.parametrize("alphas,verdict", [
    (changed(**{"kv-d4": {6: 0.40}}), NOT_REPRODUCED),                  # KV-only decays worse than EAGLE-3
    (changed(**{"kv-d4": {6: 0.475}}), INCONCLUSIVE),                   # a gap of 0.005: the interval holds 0
])
def test_p1_long_range_advantage(tmp_path, alphas, verdict):
    assert verdicts(write_results(tmp_path, alphas=alphas))["P1 long-range advantage"] == verdict


def test_p1_on_too_few_anchors_is_inconclusive_and_says_why(tmp_path):
    # eagle3 brings ~22 of 30,000 anchors to step 6 (0.3^6), below the minimum of 30, yet the gap is large
    alphas = changed(**{"kv-d4": {6: 0.95}, "eagle3": [0.3] * 6 + [0.05]})
    c = claims(write_results(tmp_path, alphas=alphas))["P1 long-range advantage"]
    assert c["verdict"] == INCONCLUSIVE
    assert "insufficient data" in c["numbers"]["eagle3"] and "alpha_6 of eagle3" in c["note"]
    # the same gap on enough anchors (0.4^6: ~120) decides
    alphas = changed(**{"kv-d4": {6: 0.95}, "eagle3": [0.4] * 6 + [0.05]})
    assert verdicts(write_results(tmp_path, alphas=alphas))["P1 long-range advantage"] == REPRODUCED


@pytest.mark.parametrize("claim,alphas,verdict", [
    ("P2 EAGLE-3 above every KV-only depth", changed(eagle3=[0.40] * 7), NOT_REPRODUCED),
    ("P2 KV-only depends on depth", changed(**{"kv-d2": ALPHAS["kv-d1"]}), INCONCLUSIVE),   # equal MATs
    ("P2 KV-only depends on depth", changed(**{"kv-d1": ALPHAS["kv-d4"]}), NOT_REPRODUCED),
    ("P2 diminishing returns with depth", changed(**{"kv-d4": [0.8] * 7}), NOT_REPRODUCED),  # 4 layers gain more
])
def test_p2_is_three_statements(tmp_path, claim, alphas, verdict):
    got = verdicts(write_results(tmp_path, alphas=alphas))
    assert got[claim] == verdict
    # each statement stands alone: changing one part of P2 leaves the others as they were
    others = {"P2 KV-only depends on depth", "P2 diminishing returns with depth",
              "P2 EAGLE-3 above every KV-only depth"} - {claim}
    if claim == "P2 EAGLE-3 above every KV-only depth":
        assert all(got[c] == REPRODUCED for c in others)


def test_comparisons_carry_difference_interval_and_detectable_effect(tmp_path):
    c = claims(write_results(tmp_path, alphas=changed(**{"kv-d4": {6: 0.475}})))["P1 long-range advantage"]
    (comp,) = c["comparisons"]
    assert comp["variants"] == ["kv-d4", "eagle3"] and comp["statistic"] == "alpha_6"
    assert comp["ci"][0] < 0 < comp["ci"][1] and comp["verdict"] == INCONCLUSIVE
    # the detectable effect is the interval's half-width scaled by (t_0.975 + t_0.8) / t_0.975
    half = (comp["ci"][1] - comp["ci"][0]) / 2
    assert comp["mde"] == pytest.approx(half * (1.96 + 0.8416) / 1.96, rel=0.01)
    from kvshot.report.claims import claims_markdown

    assert "detectable at 80% power" in claims_markdown([c])


@pytest.mark.parametrize("alphas,verdict", [
    (changed(**{"kv-d1": {0: 0.9}}), NOT_REPRODUCED),
    (changed(**{"kv-d1": {1: 0.72}}), INCONCLUSIVE),
])
def test_p3_short_range_disadvantage(tmp_path, alphas, verdict):
    assert verdicts(write_results(tmp_path, alphas=alphas))["P3 short-range disadvantage"] == verdict


@pytest.mark.parametrize("alphas,verdict", [
    (changed(hybrid=[0.5] * 7), NOT_REPRODUCED),
    (changed(hybrid=ALPHAS["eagle3"]), INCONCLUSIVE),
])
def test_hybrid_best_stepwise(tmp_path, alphas, verdict):
    assert verdicts(write_results(tmp_path, alphas=alphas))["hybrid best step-wise"] == verdict


@pytest.mark.parametrize("alphas,rounds,verdict", [
    (changed(hybrid={6: 0.30}), None, NOT_REPRODUCED),                  # retention 0.35 < eagle3's 0.59
    (changed(hybrid={6: 0.85 * 0.47 / 0.80}), 3000, INCONCLUSIVE),      # the same retention as eagle3
])
def test_retention_gain(tmp_path, alphas, rounds, verdict):
    assert verdicts(write_results(tmp_path, alphas=alphas, rounds=rounds))["long-range retention gain"] == verdict


@pytest.mark.parametrize("gate_final,verdict", [(0.05, REPRODUCED), (0.6, NOT_REPRODUCED), (0.4, NOT_REPRODUCED)])
def test_gate_collapse(tmp_path, gate_final, verdict):
    # g 0.4: the share falls from 0.2 to 0.128, never below a tenth of its start: not closed
    assert verdicts(write_results(tmp_path, gate_final=gate_final))["gate collapse"] == verdict


def test_gate_collapse_reads_the_measured_share_not_g(tmp_path):
    # g stays open at 0.5, yet the gated correction shrinks to 0.1% of |h|: the branch is closed
    c = claims(write_results(tmp_path, gate_final=0.5, gate_share_final=0.001))["gate collapse"]
    assert c["verdict"] == REPRODUCED and "effectively unused" in c["note"]
    assert c["numbers"]["g first -> last"] == "0.500 -> 0.500" and c["numbers"]["share first -> last"] == "0.2000 -> 0.0010"
    # g falls, but g * delta keeps its share of h: not reproduced
    assert verdicts(write_results(tmp_path, gate_final=0.05, gate_share_final=0.3))["gate collapse"] == NOT_REPRODUCED
    # g alone decides nothing
    c = claims(write_results(tmp_path, gate_final=0.05, gate_share_final=float("nan")))["gate collapse"]
    assert c["verdict"] == INCONCLUSIVE and "only g is logged" in c["note"]


# ---------------------------------------------------------------- evaluation protocols

def test_claims_are_judged_on_the_protocol_whose_reference_does_not_repeat(tmp_path):
    reversed_p1 = changed(**{"kv-d4": {6: 0.40}})
    # the continuations repeat themselves (58%): the natural protocol (3%) decides
    got = claims(write_results(tmp_path, repetition=0.58, natural=reversed_p1))
    assert got["P1 long-range advantage"]["verdict"] == NOT_REPRODUCED
    assert {c["protocol"] for c in got.values() if "protocol" in c} == {"natural"}
    assert got["P1 long-range advantage"]["reference_repetition"] == 0.03
    assert "protocol" not in got[E2E] and "protocol" not in got["gate collapse"]
    # a continuations reference within the limit is the paper's protocol: it decides
    got = claims(write_results(tmp_path, repetition=0.10, natural=reversed_p1))
    assert got["P1 long-range advantage"]["verdict"] == REPRODUCED and got["P1 long-range advantage"]["protocol"] == \
        "continuations"


def test_no_protocol_within_the_repetition_limit_is_said(tmp_path):
    got = claims(write_results(tmp_path, repetition=0.58, natural=ALPHAS, natural_repetition=0.40))
    p1 = got["P1 long-range advantage"]
    assert p1["protocol"] == "natural" and "least repetitive" in p1["note"]
    from kvshot.report.claims import claims_markdown

    assert "judged on the `natural` protocol" in claims_markdown(list(got.values()))


@pytest.mark.parametrize("ratio,verdict", [(0.05, REPRODUCED), (1.0, NOT_REPRODUCED)])
def test_sparse_gradient_from_the_measured_positions(tmp_path, ratio, verdict):
    # the own-key attention mass no longer decides: only where the gradient comes from does
    got = verdicts(write_results(tmp_path, own_key_mass=0.5, grad_ratio=ratio))["sparse KV-path gradient"]
    assert got == verdict


def test_missing_inputs_read_not_measured(tmp_path):
    write_results(tmp_path)
    variants = [v for v in load_variants(tmp_path, NAMES) if v.paradigm != "hybrid"]
    for v in variants:
        v.e2e = None
    got = {c["claim"]: c["verdict"] for c in evaluate_claims(variants)}
    assert got[E2E] == got["gate collapse"] == MISSING


# ---------------------------------------------------------------- per-seed results

def test_every_seed_agreeing_keeps_the_verdict(tmp_path):
    seeds = [{}, {}, {}]
    got = claims(write_results(tmp_path, seeds=seeds))
    assert {c["verdict"] for c in got.values()} == {REPRODUCED} and all(c["seeds"] == 3 for c in got.values())
    p1 = got["P1 long-range advantage"]["comparisons"][0]
    assert len(p1["per_seed_difference"]) == 3 and all(d > 0 for d in p1["per_seed_difference"])


def test_one_seed_in_the_other_direction_makes_it_inconclusive(tmp_path):
    # two seeds: kv-d4 clearly ahead at step 6; the third: behind. The seeds' spread is in the interval.
    seeds = [{}, {}, {"alphas": changed(**{"kv-d4": {6: 0.40}})}]
    got = claims(write_results(tmp_path, seeds=seeds))
    assert got["P1 long-range advantage"]["verdict"] == INCONCLUSIVE
    assert got["P3 short-range disadvantage"]["verdict"] == REPRODUCED
    # the same pooled gap without the seeds' spread decides: the width came from the seeds
    agreeing = claims(write_results(tmp_path, seeds=[{}, {}, {}]))["P1 long-range advantage"]["comparisons"][0]
    spread = got["P1 long-range advantage"]["comparisons"][0]
    assert spread["ci"][1] - spread["ci"][0] > 2 * (agreeing["ci"][1] - agreeing["ci"][0])


def test_a_reversed_claim_needs_every_seed_reversed(tmp_path):
    pooled = changed(**{"kv-d4": {6: 0.40}})
    root = write_results(tmp_path, alphas=pooled, seeds=[{"alphas": pooled}] * 3)
    assert verdicts(root)["P1 long-range advantage"] == NOT_REPRODUCED
    root = write_results(tmp_path, alphas=pooled, seeds=[{"alphas": pooled}] * 2 + [{"alphas": ALPHAS}])
    assert verdicts(root)["P1 long-range advantage"] == INCONCLUSIVE


def test_diagnostics_need_every_seed_to_agree(tmp_path):
    got = claims(write_results(tmp_path, seeds=[{}, {"gate_final": 0.6, "draft_s": (0.010, 0.013)}]))
    assert got["gate collapse"]["verdict"] == INCONCLUSIVE and "per-seed" in got["gate collapse"]["note"]


def test_decide_reads_the_paired_interval():
    from kvshot.report.claims import decide
    from kvshot.stats.resample import Interval

    at = lambda lo, hi: Interval(0.0, lo, hi, 0.1, 50, 0.3)   # noqa: E731
    assert decide(at(0.01, 0.2)) == REPRODUCED
    assert decide(at(-0.2, -0.01)) == NOT_REPRODUCED
    assert decide(at(-0.01, 0.2)) == INCONCLUSIVE
    assert decide(at(float("nan"), float("nan"))) == INCONCLUSIVE
