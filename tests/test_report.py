"""Tables, figures and verdicts are computed from the result files: change a number, the
verdict follows."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvshot.metrics import mat
from kvshot.report import run_report
from kvshot.report.claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED

NAMES = ["eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone"]
SPEC = {"eagle3": ("hidden", 1), "kv-d1": ("kv", 1), "kv-d2": ("kv", 2), "kv-d4": ("kv", 4), "hybrid": ("hybrid", 1),
        "standalone": ("standalone", 2)}
# alpha_0..6 shaped like the paper's story: hidden wins early, KV decays less, hybrid on top
ALPHAS = {
    "eagle3": [0.80, 0.72, 0.65, 0.60, 0.55, 0.50, 0.47],
    "kv-d1": [0.50, 0.45, 0.42, 0.40, 0.38, 0.36, 0.35],
    "kv-d2": [0.60, 0.55, 0.52, 0.50, 0.49, 0.48, 0.47],
    "kv-d4": [0.62, 0.58, 0.56, 0.54, 0.53, 0.52, 0.51],
    "hybrid": [0.85, 0.78, 0.72, 0.68, 0.66, 0.65, 0.64],
    "standalone": [0.95, 0.94, 0.93, 0.92, 0.91, 0.90, 0.89],   # a baseline above everything: in no claim
}
W = 0.01  # half-width of every interval


def write_results(root: Path, alphas=ALPHAS, gate_final=0.05, tau=(3.0, 3.05), draft_s=(0.010, 0.0108)):
    for name in NAMES:
        paradigm, layers = SPEC[name]
        a = alphas[name]
        sw = {"alpha": a, "alpha_ci": [[x - W, x + W] for x in a], "acc": a, "mat": mat(a),
              "mat_ci": [mat(a) - W, mat(a) + W], "retention": a[-1] / a[0],
              "retention_ci": [a[-1] / a[0] - W, a[-1] / a[0] + W], "rounds": [100] * 7, "steps": 7,
              "paradigm": paradigm, "layers": layers}
        (root / "eval" / name).mkdir(parents=True, exist_ok=True)
        (root / "eval" / name / "stepwise.json").write_text(json.dumps(sw))
        log = []
        for step in range(0, 20, 5):
            rec = {"step": step, "loss": 1.0, "grad_norm": {"body": 1.0, "lm_head": 1.0}, "kv_key_share": None}
            if paradigm in ("kv", "hybrid"):
                rec["grad_norm"] |= {"kv_wk_wv": 0.05, "kv_query_out": 1.0}
                rec["kv_key_share"] = 0.05
            if paradigm == "hybrid":
                g = 0.5 + (gate_final - 0.5) * step / 15
                rec["gate"] = {"mean": g, "min": g, "max": g}
            log.append(rec)
        folder = root / "drafters" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train_log.json").write_text(json.dumps(log))
        (folder / "metrics.json").write_text(json.dumps({"eval": {"query_cosine": [0.3] * 7 if paradigm in ("kv", "hybrid") else None}}))
        t = tau[1] if name == "hybrid" else tau[0]
        d = draft_s[1] if name == "hybrid" else draft_s[0]
        mode = {"tau": t, "tokens_per_s": 100 * t, "speedup": t / 2, "draft_seconds_per_round": d,
                "verify_seconds_per_round": 0.02, "lossless": True}
        (root / "eval" / name / "e2e.json").write_text(json.dumps({"modes": {"chain": mode, "tree": mode},
                                                                   "baseline": {"tokens_per_s": 200}}))


def report(root: Path) -> dict:
    return run_report(str(root), NAMES, str(root / "tables"), str(root / "figures"), str(root / "claims.md"),
                      str(root / "claims.json"))


def test_paper_shaped_results_reproduce_every_claim(tmp_path):
    write_results(tmp_path)
    verdicts = report(tmp_path)
    assert set(verdicts.values()) == {REPRODUCED}, verdicts
    for fig in ("decay", "depth", "gate", "gradients", "query_error", "e2e"):
        assert (tmp_path / "figures" / f"{fig}.pdf").read_bytes()[:4] == b"%PDF"
    rows = list(csv.DictReader(open(tmp_path / "tables/stepwise.csv")))
    assert [r["variant"] for r in rows] == NAMES and float(rows[0]["alpha_6"]) == pytest.approx(0.47)
    assert float(rows[0]["MAT"]) == pytest.approx(mat(ALPHAS["eagle3"]))
    for name in ("stepwise", "depth", "e2e", "paper"):
        assert (tmp_path / f"tables/{name}.md").exists() and "tabular" in (tmp_path / f"tables/{name}.tex").read_text()
    paper = list(csv.DictReader(open(tmp_path / "tables/paper.csv")))
    row = next(r for r in paper if r["metric"] == "alpha_6" and r["drafter"] == "kv-d4")
    assert float(row["paper (Qwen3-8B)"]) == 0.495 and float(row["this run"]) == pytest.approx(0.51)
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert "**reproduced**" in (tmp_path / "claims.md").read_text() and len(claims) == 8
    # the standalone draft LM is a baseline row in the tables, never part of a claim
    assert not any("standalone" in json.dumps(c) for c in claims)
    e2e = list(csv.DictReader(open(tmp_path / "tables/e2e.csv")))
    assert [r["mode"] for r in e2e if r["variant"] == "standalone"] == ["chain", "tree"]
    assert "standalone" not in (tmp_path / "tables/depth.md").read_text()


def test_verdicts_follow_the_numbers(tmp_path):
    alphas = {k: list(v) for k, v in ALPHAS.items()}
    alphas["kv-d4"][6] = 0.40               # KV-only now decays worse than EAGLE-3 at k = 6
    alphas["kv-d2"] = list(alphas["kv-d1"])  # and depth stops helping
    write_results(tmp_path, alphas=alphas, gate_final=0.6, tau=(3.0, 3.6))
    v = report(tmp_path)
    assert v["P1 long-range advantage"] == NOT_REPRODUCED
    assert v["P2 depth bottleneck"] == INCONCLUSIVE     # equal MATs: overlapping intervals
    assert v["gate collapse"] == NOT_REPRODUCED
    assert v["marginal E2E gain, 5-10% drafting overhead"] == NOT_REPRODUCED
    rows = list(csv.DictReader(open(tmp_path / "tables/stepwise.csv")))
    assert float(next(r for r in rows if r["variant"] == "kv-d4")["alpha_6"]) == pytest.approx(0.40)


def test_overlapping_intervals_are_inconclusive(tmp_path):
    alphas = {k: list(v) for k, v in ALPHAS.items()}
    alphas["kv-d4"][6] = alphas["eagle3"][6] + 0.005
    write_results(tmp_path, alphas=alphas)
    assert report(tmp_path)["P1 long-range advantage"] == INCONCLUSIVE


def test_readme_block_is_regenerated_from_results(tmp_path):
    from kvshot.report import update_readme

    write_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- results:start -->\nstale\n<!-- results:end -->\nafter\n")
    update_readme(str(tmp_path), NAMES, str(readme), str(tmp_path / "docs/decay.png"))
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| P1 long-range advantage |" in text and "**reproduced**" in text
    assert (tmp_path / "docs/decay.png").read_bytes()[:4] == b"\x89PNG"
    update_readme(str(tmp_path), NAMES, str(readme), str(tmp_path / "docs/decay.png"))
    assert readme.read_text() == text
