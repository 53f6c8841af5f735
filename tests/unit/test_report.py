"""Tables, figures and verdicts are computed from the result files: change a number, the
verdict follows. The result files are written by tests/unit/test_claims.py's `write_results`."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvshot.report import run_report
from kvshot.report.claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from kvshot.report.results import load_variants

from .test_claims import ALPHAS, E2E, NAMES, changed, write_results


def report(root: Path) -> dict:
    return run_report(str(root), NAMES, str(root / "tables"), str(root / "figures"), str(root / "claims.md"),
                      str(root / "claims.json"))


def rows(root: Path, table: str) -> list[dict]:
    return list(csv.DictReader(open(root / "tables" / f"{table}.csv")))


def test_paper_shaped_results_reproduce_every_claim(tmp_path):
    write_results(tmp_path)
    verdicts = report(tmp_path)
    assert set(verdicts.values()) == {REPRODUCED}, verdicts
    for fig in ("decay", "depth", "gate", "gradients", "query_error", "e2e", "context"):
        assert (tmp_path / "figures" / f"{fig}.pdf").read_bytes()[:4] == b"%PDF"
    stepwise = rows(tmp_path, "stepwise")
    sw = load_variants(tmp_path, NAMES)[0].stepwise
    assert [r["variant"] for r in stepwise] == NAMES and float(stepwise[0]["alpha_6"]) == pytest.approx(sw["alpha_observed"][6])
    assert sw["alpha_observed"][6] == pytest.approx(0.47, abs=0.04)        # drawn with alpha_6 = 0.47 (~1,850 anchors)
    # distinct anchors beside every rate, not only the first step
    assert [int(stepwise[0][f"n_{k}"]) for k in range(7)] == sw["distinct_anchors"] and sw["rounds"][6] < sw["rounds"][0]
    assert float(stepwise[0]["MAT"]) == pytest.approx(sw["mat"])
    for name in ("stepwise", "steps", "context", "depth", "e2e", "paper"):
        assert (tmp_path / f"tables/{name}.md").exists() and "tabular" in (tmp_path / f"tables/{name}.tex").read_text()
    steps = [r for r in rows(tmp_path, "steps") if r["variant"] == "eagle3"]
    assert [int(r["accepted"]) for r in steps] == sw["accepted"]
    assert float(steps[2]["cumulative"]) == pytest.approx(sw["cumulative"][2])
    paper = rows(tmp_path, "paper")
    row = next(r for r in paper if r["metric"] == "alpha_6" and r["drafter"] == "kv-d4")
    kv_d4 = load_variants(tmp_path, NAMES)[3].stepwise
    assert float(row["paper (Qwen3-8B)"]) == 0.495 and float(row["this run"]) == pytest.approx(kv_d4["alpha_observed"][6])
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert "**reproduced**" in (tmp_path / "claims.md").read_text() and len(claims) == 10
    # the standalone draft LM is a baseline row in the tables, never part of a claim
    assert not any("standalone" in json.dumps(c) for c in claims)
    e2e = rows(tmp_path, "e2e")
    assert [r["mode"] for r in e2e if r["variant"] == "standalone"] == ["chain", "tree"]
    chain = next(r for r in e2e if r["variant"] == "eagle3" and r["mode"] == "chain")
    assert float(chain["tau - MAT"]) == pytest.approx(3.0 - sw["mat"])
    assert float(chain["draft overhead vs EAGLE-3"]) == 0.0
    assert "standalone" not in (tmp_path / "tables/depth.md").read_text()


def test_rates_on_too_few_rounds_read_insufficient_data(tmp_path):
    write_results(tmp_path, alphas=changed(eagle3=[0.3] * 6 + [0.5]))   # about 22 anchors reach step 6 (minimum 30)
    verdicts = report(tmp_path)
    assert verdicts["P1 long-range advantage"] == INCONCLUSIVE
    eagle3 = rows(tmp_path, "stepwise")[0]
    assert eagle3["alpha_6"] == "insufficient data" and 0 < int(eagle3["n_6"]) < 30
    assert eagle3["alpha_0"] != "insufficient data" and eagle3["retention"] == "insufficient data"
    steps = [r for r in rows(tmp_path, "steps") if r["variant"] == "eagle3"]
    lo, hi = json.loads(steps[6]["alpha_k 95% CI"])
    assert hi - lo > 0.1                                       # a wide interval, not a point
    md = (tmp_path / "claims.md").read_text()
    assert "insufficient data (" in md and "alpha_6 of eagle3" in md
    stepwise = json.loads((tmp_path / "eval/eagle3/stepwise.json").read_text())
    assert stepwise["alpha"][6] is None and stepwise["alpha_sufficient"][6] is False
    assert (tmp_path / "figures/decay.pdf").read_bytes()[:4] == b"%PDF"


def test_verdicts_follow_the_numbers(tmp_path):
    alphas = changed(**{"kv-d4": {6: 0.40}, "kv-d2": ALPHAS["kv-d1"]})
    write_results(tmp_path, alphas=alphas, gate_final=0.6, tau=(3.0, 3.6))
    v = report(tmp_path)
    assert v["P1 long-range advantage"] == NOT_REPRODUCED
    assert v["P2 KV-only depends on depth"] == INCONCLUSIVE     # equal MATs: the paired interval holds 0
    assert v["gate collapse"] == NOT_REPRODUCED
    assert v[E2E] == NOT_REPRODUCED
    kv_d4 = next(r for r in rows(tmp_path, "stepwise") if r["variant"] == "kv-d4")
    assert float(kv_d4["alpha_6"]) == pytest.approx(0.40, abs=0.04)


def test_readme_block_is_regenerated_from_results(tmp_path):
    from kvshot.report import update_readme

    write_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- results:start -->\nstale\n<!-- results:end -->\nafter\n")
    update_readme(str(tmp_path), NAMES, str(readme), str(tmp_path / "docs/decay.png"))
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| P1 long-range advantage |" in text and "**reproduced**" in text
    assert "| n_6 |" in text and "| MAT 95% CI |" in text and "detectable" not in text.split("| P1")[0]
    header = next(l for l in text.splitlines() if l.startswith("| variant |")).split(" | ")
    eagle3 = dict(zip(header, next(l for l in text.splitlines() if l.startswith("| eagle3 |")).split(" | ")))
    chain = json.loads((tmp_path / "eval/eagle3/e2e.json").read_text())["modes"]["chain"]   # E2E beside step-wise
    assert eagle3["chain tau"] == f"{chain['tau']:.3f}" and eagle3["chain speedup"] == f"{chain['speedup']:.2f}x"
    full = (tmp_path / "docs/results.md").read_text()          # every table and the claims in full
    assert "tau - MAT" in full and "## Claims" in full and "| alpha_3 |" in full
    assert (tmp_path / "docs/decay.png").read_bytes()[:4] == b"\x89PNG"
    update_readme(str(tmp_path), NAMES, str(readme), str(tmp_path / "docs/decay.png"))
    assert readme.read_text() == text


def test_readme_block_prints_the_fingerprint_and_marks_verdicts_that_rounding_flips(tmp_path):
    """The run fingerprint and the machine beside it; a claim whose verdict differs in the same run
    under native numerics reads fragile, the others as before."""
    import shutil

    from kvshot.report import update_readme
    from kvshot.report.fingerprint import write_fingerprints

    run = tmp_path / "portable"
    write_results(run)
    verdicts = report(run)
    machine = {"numerics": "portable", "kernels": "AVX2", "cpu": "AMD EPYC", "cpu_id": "AuthenticAMD family 25",
               "cores": 2, "avx2": True, "avx512f": True, "versions": {"torch": "2.13.0+cpu"}}
    digest = write_fingerprints(run, run / "fingerprints.json", machine)
    native = tmp_path / "native"
    shutil.copytree(run, native)
    claims = json.loads((native / "claims.json").read_text())
    flipped = claims[0]["claim"]
    claims[0]["verdict"] = "inconclusive"
    (native / "claims.json").write_text(json.dumps(claims))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:start -->\nstale\n<!-- results:end -->\n")
    update_readme(str(run), NAMES, str(readme), str(tmp_path / "docs/decay.png"), rounding=str(native))
    text = readme.read_text()
    assert (f"Run fingerprint **`{digest}`**: numerics portable (AVX2 kernels) on AMD EPYC (AuthenticAMD family "
            f"25; 2 cores, AVX-512), torch 2.13.0+cpu") in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {flipped} |"))
    assert f"**{verdicts[flipped]}**" in row and "; **fragile**: inconclusive in native numerics |" in row
    assert text.count("**fragile**") == 1


def test_a_named_block_is_regenerated_and_the_default_block_left_alone(tmp_path):
    """--block smollm2: the real target's run fills its own block and full file; the default
    run's block and docs/results.md stay as they were."""
    from kvshot.report import update_readme

    write_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:start -->\ndefault\n<!-- results:end -->\n<!-- smollm2:start -->\nstale\n"
                      "<!-- smollm2:end -->\n")
    update_readme(str(tmp_path), NAMES, str(readme), str(tmp_path / "docs/decay-smollm2.png"),
                  str(tmp_path / "docs/smollm2-results.md"), "smollm2")
    text = readme.read_text()
    assert "<!-- results:start -->\ndefault\n<!-- results:end -->" in text and "stale" not in text
    assert "| n_6 |" in text.split("<!-- smollm2:start -->")[1] and "| P1 long-range advantage |" in text
    full = (tmp_path / "docs/smollm2-results.md").read_text()
    assert full.startswith("# Results of the smollm2 run") and "--block smollm2" in full
    assert not (tmp_path / "docs/results.md").exists()


def test_both_protocols_in_tables_figures_and_readme(tmp_path):
    from kvshot.report import update_readme

    natural = changed(**{"kv-d4": {6: 0.40}})
    write_results(tmp_path, repetition=0.58, natural=natural)
    verdicts = report(tmp_path)
    assert verdicts["P1 long-range advantage"] == NOT_REPRODUCED          # judged on the natural protocol
    stepwise = rows(tmp_path, "stepwise")
    assert [(r["protocol"], r["variant"]) for r in stepwise] == [(p, n) for p in ("continuations", "natural") for n in NAMES]
    assert {r["protocol"]: float(r["repetition"]) for r in stepwise} == {"continuations": 0.58, "natural": 0.03}
    kv_d4 = {r["protocol"]: float(r["alpha_6"]) for r in stepwise if r["variant"] == "kv-d4"}
    assert kv_d4["natural"] == pytest.approx(0.40, abs=0.04) and kv_d4["continuations"] == pytest.approx(0.57, abs=0.04)
    assert {r["protocol"] for r in rows(tmp_path, "steps")} == {"continuations", "natural"}
    context = rows(tmp_path, "context")
    assert len(context) == 2 * len(NAMES) * 4 and {r["context"] for r in context} == {"<128", "128-256", "256-512", ">=512"}
    assert int(context[0]["n_0"]) == 100 and float(context[0]["alpha_0"]) == pytest.approx(0.80)
    assert {r["protocol"] for r in rows(tmp_path, "depth")} == {"natural"}
    assert (tmp_path / "figures/context.pdf").read_bytes()[:4] == b"%PDF"
    assert "judged on the `natural` protocol" in (tmp_path / "claims.md").read_text()
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")
    update_readme(str(tmp_path), NAMES, str(readme), str(tmp_path / "decay.png"))
    text = readme.read_text()
    full = (tmp_path / "results.md").read_text()                 # both protocols in the full tables
    assert "| natural | 0.030 | eagle3 |" in full and "| continuations | 0.580 | eagle3 |" in full
    assert "| natural |" in text and "| continuations |" not in text    # the README: the judged protocol only
