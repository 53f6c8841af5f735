"""The learning-curve report (kvshot.report.curve) on curves of known shape: the fit's gain per
doubling, where a curve flattens, and the tokens a rising one needs to reach the target."""
from __future__ import annotations

import json
import math

import pytest

from kvshot.report.curve import FIT_POINTS, flattening, run_curve_report


def points(accs: list[float], start: int = 1024) -> list[dict]:
    return [{"train_tokens": start * 2 ** i, "acc_0": a} for i, a in enumerate(accs)]


def test_a_log_linear_curve_is_rising_and_extrapolated_exactly():
    accs = [0.10 + 0.03 * i for i in range(8)]   # +0.03 per doubling from 1,024 tokens
    st = flattening(points(accs), flat_gain=0.01, target_acc=0.45)
    assert st["state"] == "rising" and st["gain_per_doubling"] == pytest.approx(0.03)
    assert st["reaches_target_at"] == pytest.approx(1024 * 2 ** (0.35 / 0.03), rel=1e-9)


def test_a_curve_that_levels_off_is_flat_from_the_first_flat_window():
    accs = [0.10, 0.16, 0.22, 0.28, 0.30, 0.302, 0.303, 0.303]   # gains 0.06 ... then ~0
    st = flattening(points(accs), flat_gain=0.01, target_acc=0.45)
    assert st["state"] == "flat" and st["gain_per_doubling"] < 0.01
    # windows of 3: (0.28, 0.30, 0.302) gains 0.011; (0.30, 0.302, 0.303) 0.0015: the first flat one
    assert st["flat_from_tokens"] == 1024 * 2 ** 4
    # a control: the same curve still rising at its end is not called flat
    assert flattening(points(accs[:5]), 0.01, 0.45)["state"] == "rising"


def test_too_few_points_and_a_reached_target_say_so():
    assert flattening(points([0.1, 0.2][:FIT_POINTS - 1]), 0.01, 0.45)["state"] == "too few points"
    st = flattening(points([0.3, 0.4, 0.5]), 0.01, 0.45)
    assert st["state"] == "rising" and st["target_reached"] and st["reaches_target_at"] is None


def write_drafter(root, name: str, seed: int, accs: list[float], tokens_per_step: int = 1000) -> None:
    folder = root / "drafters" / name / f"seed{seed}"
    folder.mkdir(parents=True)
    curve = [{"step": 2 ** i, "train_tokens": tokens_per_step * 2 ** i, "train_seconds": 0.5 * 2 ** i,
              "heldout_loss": 10 - a, "heldout_loss_k": [10 - a] * 3, "heldout_acc_k": [a, a / 2, a / 4]}
             for i, a in enumerate(accs)]
    (folder / "metrics.json").write_text(json.dumps({"heldout_curve": curve, "train_tokens_per_s": 1900.0,
                                                     "stopped_by": "max_steps"}))


def test_the_report_writes_the_table_figure_and_states(tmp_path):
    write_drafter(tmp_path, "eagle3", 0, [0.1 + 0.02 * i for i in range(6)])
    write_drafter(tmp_path, "kv-d4", 0, [0.1, 0.2, 0.25, 0.251, 0.252, 0.252])
    out = run_curve_report(str(tmp_path), ["eagle3", "kv-d4"], [0], 0.01, 0.45, str(tmp_path / "curve.pdf"),
                           str(tmp_path / "curve.md"))
    assert out == {"eagle3/seed0": {"state": "rising", "last_acc_0": 0.2}, "kv-d4/seed0": {"state": "flat", "last_acc_0": 0.252}}
    text = (tmp_path / "curve.md").read_text()
    assert "| eagle3 | 0 | 32 | 32000 |" in text and "acc_2" in text
    need = 32000 * 2 ** ((0.45 - 0.2) / 0.02)
    assert f"reaches 0.45 at ~{need:,.0f} tokens" in text and "kv-d4/seed0: acc_0 0.252" in text
    assert "flat from 4,000 tokens" in text   # (0.25, 0.251, 0.252): the first window under 0.01
    saved = json.loads((tmp_path / "curve.json").read_text())
    assert len(saved["rows"]) == 12 and math.isclose(saved["states"]["eagle3/seed0"]["gain_per_doubling"], 0.02)
    assert (tmp_path / "curve.csv").read_text().count("\n") == 13
    assert (tmp_path / "curve.pdf").stat().st_size > 1000


def test_a_drafter_trained_before_the_curve_existed_fails_in_one_line(tmp_path):
    write_drafter(tmp_path, "eagle3", 0, [0.1, 0.2, 0.3])
    path = tmp_path / "drafters/eagle3/seed0/metrics.json"
    m = json.loads(path.read_text())
    for p in m["heldout_curve"]:
        del p["train_tokens"]
    path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"seed0/metrics.json: heldout_curve step 1: no train_tokens"):
        run_curve_report(str(tmp_path), ["eagle3"], [0], 0.01, 0.45, str(tmp_path / "c.pdf"), str(tmp_path / "c.md"))
    with pytest.raises(FileNotFoundError, match="kv-d4/seed0/metrics.json: no metrics"):
        run_curve_report(str(tmp_path), ["kv-d4"], [0], 0.01, 0.45, str(tmp_path / "c.pdf"), str(tmp_path / "c.md"))
