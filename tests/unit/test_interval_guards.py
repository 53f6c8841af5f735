"""The two guards for thin evidence (issue 38): a rate needs enough distinct sequences as well as
anchors, and an interval stays inside its statistic's range and is never a point. On a panel
shaped like the smoke run's (config/smoke.yaml: 4 prompts, 2 seeds, 9 anchors a prompt, one
prompt that repeats itself carrying every deep step), and on synthetic data."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from kvshot.report.claims import INCONCLUSIVE, Judge, alpha_at, comparison_text, mat_of, retention_of
from kvshot.report.results import Variant, stepwise_view
from kvshot.report.tables import _stepwise_rows
from kvshot.stats.metrics import chain_summary
from kvshot.stats.power import coverage_by_sequences
from kvshot.stats.resample import (NO_SPREAD, contrast_range, interval, panel, panel_record, record_guards,
                                   statistic_range)

K = 7
SMOKE = yaml.safe_load((Path(__file__).parents[2] / "config/smoke.yaml").read_text())["eval"]
# per seed, 4 prompts x 9 anchors: prompts 0-2 rarely pass step 0, prompt 3 repeats itself and
# carries every anchor past step 1; seed 1 accepts far less at step 0 than seed 0 (two seeds:
# the seed component's t quantile has 1 degree of freedom, 12.7)
SMOKE_LENGTHS = [
    [1, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 7, 7, 7, 7, 2, 7, 7, 7, 3],
    [0] * 27 + [7, 7, 6, 7, 1, 7, 7, 7, 2],
]
SEQUENCE = [j for j in range(4) for _ in range(9)]


def smoke_panel(lengths=SMOKE_LENGTHS):
    return panel(lengths, SEQUENCE, K, keys=[(f"prompt {j}", 16 + t % 9) for t, j in enumerate(SEQUENCE)])


def smoke_summary(**kw) -> dict:
    kw = {"min_rounds": SMOKE["min_rounds"], "min_sequences": SMOKE["min_sequences"]} | kw
    return chain_summary(smoke_panel(), samples=SMOKE["bootstrap_samples"], seed=0, **kw)


def intervals_of(s: dict) -> list[tuple[str, list]]:
    return ([(f"alpha_{k}", c) for k, c in enumerate(s["alpha_ci"])]
            + [(f"cumulative_{k}", c) for k, c in enumerate(s["cumulative_ci"])]
            + [("mat", s["mat_ci"]), ("retention", s["retention_ci"])])


def assert_guarded(s: dict) -> None:
    """Every interval inside its range, none a point: null bounds or a positive width."""
    for name, (lo, hi) in intervals_of(s):
        low, high = statistic_range(name, K)
        if lo is None or math.isnan(lo):
            assert hi is None or math.isnan(hi), (name, lo, hi)
            continue
        assert low <= lo < hi <= high, (name, lo, hi)


def test_smoke_shaped_panel_fails_the_unguarded_way_and_passes_guarded():
    # what the smoke run showed: alpha_0's interval far outside [0, 1], alpha_2..6 points on one prompt
    p = smoke_panel()
    assert p.distinct_sequences() == [4, 4, 1, 1, 1, 1, 1]
    assert p.distinct_reached()[2:] == [9, 8, 7, 7, 7]          # >= smoke's min_rounds 5: enough anchors alone
    s = chain_summary(p, samples=SMOKE["bootstrap_samples"], seed=0, min_rounds=SMOKE["min_rounds"])
    assert_guarded(s)
    # the defaults (min_sequences 10): nothing on 4 prompts is sufficient
    assert s["alpha"] == [None] * K and not any(s["alpha_sufficient"]) and s["retention"] is None
    assert not s["mat_sufficient"]


def test_smoke_alpha_0_interval_is_clipped_to_the_rate_range():
    s = smoke_summary()
    assert s["min_sequences"] == SMOKE["min_sequences"] == 3 and s["distinct_sequences"][:2] == [4, 4]
    lo, hi = s["alpha_ci"][0]
    assert (lo, hi) == (0.0, 1.0)          # the t interval with the 2-seed component runs past both ends
    assert s["alpha_sufficient"][0] and s["alpha"][0] == pytest.approx(s["alpha_observed"][0])
    assert s["alpha_reason"][0] is None
    assert s["mat_ci"][0] == 1.0 and s["mat_ci"][1] <= K + 1 and s["retention_ci"][0] == 0.0
    assert_guarded(s)
    assert "clipped" in s["interval_guard"]


def test_smoke_deep_steps_on_one_prompt_read_insufficient_never_a_point():
    s = smoke_summary()
    for k in range(2, K):
        assert s["distinct_sequences"][k] == 1 and s["distinct_anchors"][k] >= SMOKE["min_rounds"]
        assert s["alpha"][k] is None and s["alpha_sufficient"][k] is False
        reason = s["alpha_reason"][k]
        assert reason.startswith("insufficient") and "1 sequence < min_sequences 3" in reason
        lo, hi = s["alpha_ci"][k]
        assert math.isnan(lo) and math.isnan(hi)       # one prompt: every resample is the same ratio
        assert NO_SPREAD in s["alpha_reason"][k]
    assert s["retention"] is None and s["retention_reason"].startswith("insufficient")
    assert_guarded(s)


def test_zero_variance_reads_insufficient_even_with_enough_anchors_and_sequences():
    # 40 anchors in 20 prompts, every chain accepted to the end: alpha_k = 1 in every resample
    p = panel([[K] * 40], [j // 2 for j in range(40)], K)
    s = chain_summary(p, samples=100, seed=0, min_rounds=30, min_sequences=10)
    assert s["distinct_sequences"] == [20] * K and s["distinct_anchors"] == [40] * K
    assert s["alpha_observed"] == [1.0] * K
    assert all(math.isnan(lo) and math.isnan(hi) for lo, hi in s["alpha_ci"])
    assert s["alpha"] == [None] * K and all(r == f"insufficient: {NO_SPREAD}" for r in s["alpha_reason"])
    assert_guarded(s)
    # the same for a paired difference that never varies: no interval, no verdict
    diff = interval([p, p], "alpha_3", samples=100)
    assert diff.estimate == 0.0 and math.isnan(diff.low) and math.isnan(diff.high) and diff.reason


def test_minimum_sequences_counts_clusters_not_anchors():
    gen = torch.Generator().manual_seed(3)
    lengths = (torch.rand(1, 120, K, generator=gen) < 0.6).long().cumprod(2).sum(2)
    few = chain_summary(panel(lengths, [j // 30 for j in range(120)], K), samples=100, min_rounds=30,
                        min_sequences=10)
    many = chain_summary(panel(lengths, [j // 10 for j in range(120)], K), samples=100, min_rounds=30,
                         min_sequences=10)
    assert few["distinct_anchors"] == many["distinct_anchors"] and few["distinct_anchors"][0] == 120
    assert few["distinct_sequences"][0] == 4 and not few["alpha_sufficient"][0]
    assert "4 sequences < min_sequences 10" in few["alpha_reason"][0]
    assert many["distinct_sequences"][0] == 12 and many["alpha_sufficient"][0] and many["alpha_reason"][0] is None
    assert_guarded(few)
    assert_guarded(many)


def test_ranges_of_statistics_and_contrasts():
    assert statistic_range("alpha_3", K) == (0.0, 1.0) == statistic_range("cumulative_6", K)
    assert statistic_range("mat", K) == (1.0, 8.0)
    assert statistic_range("retention", K) == (0.0, math.inf)   # alpha_6 / alpha_0 exceeds 1 when alpha_6 is larger
    assert contrast_range("alpha_0", K, (1.0, -1.0)) == (-1.0, 1.0)
    assert contrast_range("mat", K, (1.0, -1.0)) == (-7.0, 7.0)
    assert contrast_range("mat", K, (2.0, -1.0, -1.0)) == (-14.0, 14.0)
    # a paired difference on the smoke panel stays inside [-1, 1]
    worse = smoke_panel([[0] * 36, [0] * 27 + [7, 7, 6, 7, 1, 7, 7, 7, 2]])
    diff = interval([smoke_panel(), worse], "alpha_0", samples=50)
    assert -1.0 <= diff.low < diff.high <= 1.0


def test_record_guards_annotates_an_interval_record():
    p = smoke_panel()
    rec = record_guards(interval([p], "alpha_2", samples=50).as_dict(), 9, 1, 5, 3)
    assert rec["anchors"] == 9 and rec["sequences"] == 1 and rec["sufficient"] is False
    assert rec["reason"] == f"insufficient: 1 sequence < min_sequences 3; {NO_SPREAD}"
    ok = record_guards(interval([p], "alpha_0", samples=50).as_dict(), 36, 4, 5, 3)
    assert ok["reason"] is None and ok["sufficient"] and ok["ci"] == [0.0, 1.0]


def smoke_variant(name: str, record: dict) -> Variant:
    return Variant(name=name, paradigm="hidden", layers=1, stepwise=stepwise_view(record), train={})


def old_smoke_record() -> dict:
    """stepwise.json as the code before the guards wrote it for the smoke run: intervals outside
    [0, 1] and points, no sequence counts, min_rounds only."""
    s = smoke_summary()
    old = {k: v for k, v in s.items() if not k.endswith("_reason") and k not in ("distinct_sequences", "min_sequences")}
    old |= {"alpha_ci": [[-1.91, 2.31], [-1.2, 2.4], [0.875, 0.875]] + [[1.0, 1.0]] * 4,
            "mat_ci": [-2.0, 7.2], "retention_ci": [-3.3, 8.0], "min_rounds": 5, "sequences": 4,
            "alpha_sufficient": [True] * K, "alpha": s["alpha_observed"], "retention": s["retention_observed"]}
    return old | {"steps": K, "anchors_panel": panel_record(smoke_panel(), [0, 1]), "paradigm": "hidden", "layers": 1}


def test_the_report_view_applies_both_guards_to_records_written_before_them():
    sw = stepwise_view(old_smoke_record() | {"min_sequences": 3})
    assert sw["distinct_sequences"] == [4, 4, 1, 1, 1, 1, 1]     # from the anchor panel
    assert sw["alpha_ci"][0] == [0.0, 1.0] and sw["mat_ci"][0] == 1.0 and sw["retention_ci"][0] == 0.0
    assert sw["alpha_sufficient"] == [True, True] + [False] * 5 and not sw["retention_sufficient"]
    for k in range(2, K):
        assert all(math.isnan(x) for x in sw["alpha_ci"][k]) and math.isnan(sw["alpha"][k])
        assert "1 sequence < min_sequences 3" in sw["alpha_reason"][k]
    # no min_sequences recorded: the default (10) applies, as min_rounds' does
    assert not any(stepwise_view(old_smoke_record())["alpha_sufficient"])


def test_tables_and_claims_read_insufficient_where_the_record_says_so():
    ours = smoke_variant("eagle3", smoke_summary() | {"steps": K, "paradigm": "hidden", "layers": 1,
                                                      "anchors_panel": panel_record(smoke_panel(), [0, 1])})
    row = _stepwise_rows([ours])[0]
    assert row["alpha_0"] != "insufficient data" and row["min sequences"] == 3
    assert [row[f"alpha_{k}"] for k in range(2, K)] == ["insufficient data"] * 5
    assert row["retention"] == "insufficient data"
    e = alpha_at(6)(ours)
    assert not e.enough and e.sequences == 1 and "1 sequence < min_sequences 3" in e.text()
    assert mat_of(ours).enough and not retention_of(ours).enough
    # a paired comparison on the insufficient step says why it decides nothing
    other = smoke_variant("kv-d4", smoke_summary() | {"steps": K, "paradigm": "kv", "layers": 4, "anchors_panel":
                                                      panel_record(smoke_panel(), [0, 1])})
    judge = Judge([], samples=50)
    assert judge.greater(other, ours, alpha_at(6)) == INCONCLUSIVE
    c = judge.take_comparisons()[0]
    assert "insufficient" in c and "1 sequence < min_sequences 3" in c["insufficient"]
    assert "not decided" in comparison_text(c) and c["sequences"] == 1 and c["min_sequences"] == 3
    assert "alpha_6 of eagle3: insufficient data" in judge.take_notes()
    # a step no anchor reaches has no difference at all: it reads "no estimate", not "+nan"
    undefined = c | {"difference": float("nan")}
    assert "nan" not in comparison_text(undefined) and ": no estimate, not decided:" in comparison_text(undefined)


def test_few_sequences_under_cover_and_ten_do_not():
    # the minimum's evidence (docs/statistics.md, benchmarks/min_sequences.py), at a smaller scale
    got = coverage_by_sequences([2, 3, 20], [0.62, 0.78, 0.80, 0.80, 0.80, 0.80, 0.80], 6, reps=40, samples=100)
    thin = [b for s, b in got.items() if 2 <= s <= 4]
    thick = [b for s, b in got.items() if s >= 10]
    share = lambda bs: sum(b["covered"] for b in bs) / sum(b["intervals"] for b in bs)   # noqa: E731
    assert share(thin) < 0.8 < share(thick), (share(thin), share(thick))
