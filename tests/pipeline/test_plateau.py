"""Training to plateau is its own Snakemake target (results/plateau/claims.md, dry run): the
drafters.variants retrained with plateau.max_steps and plateau.rule, evaluated on the default
run's anchors, one report; and the validation split steers training only, never evaluation."""
from __future__ import annotations

import json
import re
import shlex

from kvshot.config import read_config

from ..conftest import REPO
from ..dag import snakemake, workdir
from .test_slurm import parse_dry_run

VARIANTS = ("eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone")


def dry_run(wd, *targets: str, config: str | None = None) -> tuple[dict[str, int], list[dict], str]:
    extra = ["--configfile", config] if config else []
    proc = snakemake(wd, *targets, "-n", "-p", "--cores", "1", *extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    table = out[out.index("Job stats:"):]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}
    return counts, parse_dry_run(out), out


def overlay_of(job: dict) -> dict:
    """The last inline --config of a training job (the overlay the rule adds)."""
    return [json.loads(w) for w in shlex.split(job["shell"].split(" > ")[0]) if w.startswith("{")][-1]


def test_plateau_is_its_own_snakemake_target(tmp_path):
    """`snakemake -n results/plateau/claims.md`: smoke trains every variant per seed with the
    plateau overlay, evaluates and decodes them on the default run's anchors, one report under
    results/plateau/; the default run's drafters are not part of it, nor is it part of `all`."""
    wd = workdir(tmp_path)
    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/smoke.yaml")])
    counts, jobs, out = dry_run(wd, "results/plateau/claims.md", config="config/smoke.yaml")
    # smoke: 6 variants x 2 seeds (drafters.seeds), the data, target and features they stand on
    assert counts == {"prepare_data": 1, "train_tokenizer": 1, "target": 1, "capture_features": 3,
                      "target_continuations": 1, "plateau_train": 12, "plateau_stepwise": 6, "plateau_e2e": 6,
                      "plateau_e2e_timing": 1, "plateau_report": 1}
    train = [j for j in jobs if j["rule"] == "plateau_train"]
    assert {(j["wildcards"]["variant"], j["wildcards"]["seed"]) for j in train} == {
        (v, s) for v in VARIANTS for s in ("0", "1")}
    for job in train:
        assert overlay_of(job) == {"drafters": {"train": {"max_steps": cfg["plateau"]["max_steps"],
                                                          "eval_every": cfg["plateau"]["eval_every"],
                                                          "plateau": cfg["plateau"]["rule"]}}}
        assert " --val-features results/features/val " in job["shell"]
        assert f"--out results/plateau/drafters/{job['wildcards']['variant']}/seed{job['wildcards']['seed']}" in job["shell"]
    for job in (j for j in jobs if j["rule"] == "plateau_stepwise"):   # the default run's anchors
        assert "--continuations results/eval/continuations.json" in job["shell"]
        assert "--natural results/eval/natural.json" in job["shell"]
        assert "--drafter results/plateau/drafters/" in job["shell"]
    for job in (j for j in jobs if j["rule"] in ("plateau_e2e", "plateau_e2e_timing")):   # and E2E prompts
        assert "--prompts results/eval/natural.json" in job["shell"] and "results/plateau/drafters/" in job["shell"]
    report = next(j for j in jobs if j["rule"] == "plateau_report")
    assert "--results results/plateau " in report["shell"] and "--figures results/plateau/figures " in report["shell"]
    assert "results/plateau/figures/decay.pdf" in out
    # the default and paper configs dry-run it too (one training job per variant and seed)
    assert dry_run(wd, "results/plateau/claims.md")[0]["plateau_train"] == 18
    paper, paper_jobs, _ = dry_run(wd, "results/plateau/claims.md", config="config/paper.yaml")
    # drafters.group_training: kv-d4 alone, [eagle3, kv-d1, kv-d2] and [hybrid, standalone] side by side
    assert (paper["plateau_train"], paper["plateau_train_group"], paper["plateau_report"]) == (1, 2, 1)
    assert all(overlay_of(j)["drafters"]["train"]["max_steps"] == 120000
               for j in paper_jobs if j["rule"] in ("plateau_train", "plateau_train_group"))
    # not part of the default run
    assert not any(rule.startswith("plateau") for rule in dry_run(wd, config="config/smoke.yaml")[0])


def test_validation_split_steers_training_and_nothing_evaluates_on_it(tmp_path):
    """The default DAG (smoke): prepare_data writes val.jsonl, its features are captured, every
    drafter's held-out curve reads them; no evaluation job (continuations, natural anchors,
    step-wise, E2E, report) reads the validation split."""
    wd = workdir(tmp_path)
    _, jobs, _ = dry_run(wd, config="config/smoke.yaml")
    assert any("--split results/data/val.jsonl" in j["shell"] for j in jobs if j["rule"] == "capture_features")
    train = [j for j in jobs if j["rule"] == "train_drafter"]
    assert len(train) == 12 and all(" --val-features results/features/val " in j["shell"] for j in train)
    for job in jobs:
        if job["rule"] not in ("prepare_data", "capture_features", "train_drafter"):
            assert not re.search(r"data/val\.jsonl|features/val\b", job["shell"]), job["rule"]
    target_continuations = next(j for j in jobs if j["rule"] == "target_continuations")
    assert "--eval results/data/eval.jsonl" in target_continuations["shell"]   # the anchors: the eval split
