"""The drift target (issue 31): `kvshot drift-report`'s verdicts follow the numbers (synthetic
result files in the real schemas), the best block-wise variant is the one with the highest
retention, and `figures/drift.pdf` is its own Snakemake target, not behind `all` (dry run)."""
from __future__ import annotations

import csv

import pytest

ROUNDS = 3000
DECAYING = [0.80, 0.70, 0.60, 0.50, 0.45, 0.40, 0.35]
HOLDING = [0.80, 0.78, 0.75, 0.72, 0.70, 0.68, 0.66]
FLAT = [0.85, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85]
MAIN = {"eagle3": ("hidden", 1), "kv-d1": ("kv", 1), "kv-d2": ("kv", 2), "kv-d4": ("kv", 4), "hybrid": ("hybrid", 1)}
DRIFT = {"eagle3.1": {"fc_norm": True, "norm_output": True}, "eagle3-fcnorm": {"fc_norm": True},
         "eagle3-postnorm": {"norm_output": True}}
BLOCKS = {"block-kv-d1": DECAYING, "block-kv-d4": HOLDING}


def write_results(root, alphas: dict):
    from kvshot.core.io import write_json

    from .test_claims import e2e_record, stepwise_record, train_log

    def one(base, name, paradigm, layers, config=None):
        write_json(base / "eval" / name / "stepwise.json", stepwise_record(alphas[name], paradigm, layers, rounds=ROUNDS))
        write_json(base / "eval" / name / "e2e.json", e2e_record(2.0, 0.01, 400))
        write_json(base / "drafters" / name / "train_log.json", train_log(paradigm, 0.5, 0.05, 0.1))
        write_json(base / "drafters" / name / "metrics.json", {"eval": {}})
        write_json(base / "drafters" / name / "config.json", {"paradigm": paradigm, **(config or {})})

    for name, (paradigm, layers) in MAIN.items():
        one(root, name, paradigm, layers)
    for name, switches in DRIFT.items():
        one(root / "drift", name, "hidden", 1, switches)
    for name in BLOCKS:
        one(root / "blockwise", name, "block", int(name[-1]), {"block_context": "kv"})
    return root


def report(root):
    from kvshot.report.drift import run_drift_report

    return run_drift_report(str(root), list(DRIFT), list(MAIN), list(BLOCKS), str(root / "figures/drift.pdf"),
                            str(root / "drift/drift.csv"), str(root / "drift/claims.md"), str(root / "drift/claims.json"))


def test_drift_verdicts_follow_the_numbers(tmp_path):
    from kvshot.report.claims import NOT_REPRODUCED, REPRODUCED

    up = {**BLOCKS, "eagle3": DECAYING, "kv-d1": DECAYING, "kv-d2": HOLDING, "kv-d4": FLAT, "hybrid": DECAYING,
          "eagle3.1": HOLDING, "eagle3-fcnorm": DECAYING, "eagle3-postnorm": HOLDING}
    verdicts = report(write_results(tmp_path / "up", up))
    assert verdicts["EAGLE-3.1 retains more than EAGLE-3 at long range"] == REPRODUCED, verdicts
    assert verdicts["KV-only at depth 4 retains more than EAGLE-3.1"] == REPRODUCED, verdicts
    assert verdicts["norm_output alone (eagle3-postnorm) retains more than EAGLE-3"] == REPRODUCED, verdicts
    assert verdicts["fc_norm alone (eagle3-fcnorm) retains more than EAGLE-3"] != REPRODUCED, verdicts
    assert (tmp_path / "up/figures/drift.pdf").read_bytes()[:4] == b"%PDF"
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "up/drift/drift.csv"))}
    # every paradigm side by side; the best block-wise variant by retention, the other left out
    assert set(rows) == set(MAIN) | set(DRIFT) | {"block-kv-d4"}
    assert rows["eagle3.1"]["role"] == "EAGLE-3.1" and rows["block-kv-d4"]["role"] == "best block-wise"
    assert rows["eagle3-fcnorm"]["role"] == "ablation: fc_norm" and "alpha_6" in rows["eagle3"]
    text = (tmp_path / "up/drift/claims.md").read_text()
    assert "Hidden-state drift" in text and "retention" in text and "eagle3.1 - eagle3" in text

    down = {**up, "eagle3.1": DECAYING, "eagle3": HOLDING, "kv-d4": DECAYING}
    verdicts = report(write_results(tmp_path / "down", down))
    assert verdicts["EAGLE-3.1 retains more than EAGLE-3 at long range"] == NOT_REPRODUCED, verdicts


def test_drift_config_names_must_exist():
    from kvshot.config import ConfigError, validate_config

    from ..conftest import tiny_config

    from kvshot.checks import drift_name_problems

    cfg = tiny_config()
    cfg["drift"]["compare"] = ["eagle3", "nope"]
    validate_config(cfg, "config/smoke.yaml")   # an optional target's names: checked when it runs
    assert [(".".join(p), m.split(" is ")[0]) for p, m in drift_name_problems(cfg)] == [("drift.compare.1", "'nope'")]
    cfg = tiny_config()
    cfg["drift"]["variants"][0] = {**cfg["drift"]["variants"][0], "norm_before_fc": True}
    with pytest.raises(ConfigError, match=r"drift\.variants\.0\.fc_norm: excludes norm_before_fc") as err:
        validate_config(cfg, "config/smoke.yaml")
    assert "\n" not in str(err.value)


