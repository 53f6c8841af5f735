"""The Snakemake DAG: smoke run end to end, paper dry-run, lint, and failures that
leave no half-written outputs."""
from __future__ import annotations

import json
import re

import pytest

from ..conftest import REPO
from ..dag import dry_run_jobs, job_counts, numerics_lines, snakemake, without_numerics, workdir

@pytest.mark.slow
def test_smoke_dag_end_to_end(smoke_workdir):
    wd = smoke_workdir   # shared with the SLURM test's comparison and the export rule's test (conftest.py)
    # `all` with the block-wise, drift and learning-curve targets on top, in one run (one DAG, both
    # cores busy to the end)
    # the shared workdir may already hold drafters another test of its group asked for (the export
    # rule's eagle3, seed 0): Snakemake plans only the rest
    present = [p for p in (wd / "results/drafters").glob("*/seed*") if (p / "metrics.json").exists()]
    # started without the portable numerics' variables (conftest sets them for the session's own
    # processes): every job must get them from the workflow's shell prefix
    proc = snakemake(wd, "all", "figures/blockwise.pdf", "figures/drift.pdf", "results/curve/curve.md", "--cores", "2",
                     "--configfile", "config/smoke.yaml", env=without_numerics())
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((wd / "logs").glob("*.log"))
    assert len(logs) > 40
    for log in logs:
        lines = numerics_lines(log)
        assert lines and all(x.endswith("; from the job's environment)") and "MKL_CBWR=AVX2,STRICT" in x
                             for x in lines), (log.name, lines)
    prints = json.loads((wd / "results/fingerprints.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{16}", prints["run"]) and prints["machine"]["numerics"] == "portable"
    assert prints["machine"]["kernels"] == "AVX2" and prints["stages"].keys() >= {"data", "tokenizer", "target",
                                                                                    "features", "claims"}
    planned = job_counts(proc.stdout + proc.stderr)
    planned["train_drafter"] = planned.get("train_drafter", 0) + len(present)
    # the block-wise target reuses the default run's drafters and trains only its own (3 variants x 2
    # seeds); the drift target reuses those chains and the block variant, training only its 3 variants
    assert (planned["train_drafter"], planned["blockwise_train"], planned["drift_train"]) == (12, 6, 6), planned
    # the learning curve: its own 16 captured train samples, each curve variant trained alone (seed 0)
    # for 1,024 batch tokens (8 steps of 2 x 64) with held-out points at steps 1, 2, 4, 8
    assert (planned["curve_capture"], planned["curve_train"], planned["curve_report"]) == (1, 2, 1), planned
    assert json.loads((wd / "results/curve/features/train/index.json").read_text())["num_samples"] == 16
    for name in ("eagle3", "kv-d1"):
        curve = json.loads((wd / f"results/curve/drafters/{name}/seed0/metrics.json").read_text())["heldout_curve"]
        assert [p["step"] for p in curve] == [1, 2, 4, 8] and 0 < curve[0]["train_tokens"] < curve[-1]["train_tokens"]
        assert f"- {name}/seed0: acc_0" in (wd / "results/curve/curve.md").read_text()
    assert (wd / "figures/curve.pdf").read_bytes()[:4] == b"%PDF"
    stats = json.loads((wd / "results/data/stats.json").read_text())
    src = stats["sources"][0]
    assert src["read"] == src["kept"] + sum(src["skipped"].values()) and src["skipped"]["truncated"] == 1
    assert (stats["train"], stats["eval"], stats["val"]) == (48, 8, 8)
    metrics = json.loads((wd / "results/target/metrics.json").read_text())
    assert metrics["heldout_loss"] < metrics["initial_heldout_loss"]
    for split, n in (("train", 48), ("eval", 8), ("val", 8)):
        index = json.loads((wd / f"results/features/{split}/index.json").read_text())
        assert index["mode"] == "offline" and index["num_samples"] == n
        assert index["bytes_per_token"] == sum(index["bytes_per_token_by_tensor"].values())
    variants = ("eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone")
    for name in variants:
        for seed in (0, 1):   # smoke.yaml: drafters.seeds [0, 1], one training job each
            folder = wd / f"results/drafters/{name}/seed{seed}"
            metrics = json.loads((folder / "metrics.json").read_text())
            log = json.loads((folder / "train_log.json").read_text())
            assert metrics["seed"] == seed and metrics["steps"] == 4 and len(metrics["eval"]["acc"]) == 7
            assert [p["step"] for p in metrics["heldout_curve"]] == [2, 4]   # eval_every 2
            assert metrics["heldout_split"] == "val"   # the curve reads the validation split, not eval
            assert all(len(r["acc_k"]) == 7 and len(r["loss_k"]) == 7 for r in log)
            assert len((folder / "train_log.jsonl").read_text().splitlines()) == len(log) + 2
            assert (folder / "model.safetensors").exists() and not (folder.parent / f"seed{seed}.ckpt").exists()
        stepwise = json.loads((wd / f"results/eval/{name}/stepwise.json").read_text())
        assert len(stepwise["alpha"]) == 7 and stepwise["rounds"][0] > 0 and stepwise["mat"] >= 1
        assert [s["seed"] for s in stepwise["per_seed"]] == [0, 1]      # pooled: the seeds' counts summed
        assert stepwise["rounds"] == [a + b for a, b in zip(*(s["rounds"] for s in stepwise["per_seed"]))]
        natural = json.loads((wd / f"results/eval/{name}/stepwise_natural.json").read_text())
        assert natural["protocol"] == "natural" and all(0 < s["rounds"][0] <= 24 for s in natural["per_seed"])
        assert natural["rounds"][0] == sum(s["rounds"][0] for s in natural["per_seed"])   # one round per anchor and seed
        for sw in (stepwise, natural):
            assert 0 <= sw["repetition"]["share"] <= 1 and sum(sw["by_context"]["anchors"]) == sw["rounds"][0]
            # the guards for thin evidence (issue 38): intervals inside [0, 1] and never a point; a rate on
            # fewer than min_sequences (3) prompts or conversations reads insufficient
            assert sw["min_sequences"] == 3 and len(sw["distinct_sequences"]) == 7 and "interval_guard" in sw
            for k, (lo, hi) in enumerate(sw["alpha_ci"] + sw["cumulative_ci"]):
                assert (lo is None and hi is None) or 0 <= lo < hi <= 1, (name, k, lo, hi)
            for k, n in enumerate(sw["distinct_sequences"]):
                assert sw["alpha_sufficient"][k] == (sw["alpha_reason"][k] is None)
                if n < 3:
                    assert sw["alpha"][k] is None and sw["alpha_reason"][k].startswith("insufficient")
        if name.startswith("kv") or name == "hybrid":   # measured diagnostics (a batch with a scored row)
            measured = [r for r in log if r.get("kv_own_key_mass") is not None]
            assert measured and all(len(r["kv_own_key_mass_k"]) == 7 and 0 < r["kv_own_key_mass"] < 1 for r in measured)
        assert any("gate_share" in r for r in log) == (name == "hybrid")
        e2e = json.loads((wd / f"results/eval/{name}/e2e.json").read_text())
        assert e2e["lossless"] is True and set(e2e["modes"]) == {"chain", "tree"}
        assert [s["seed"] for s in e2e["per_seed"]] == [0, 1]
        assert e2e["modes"]["chain"]["rounds"] == sum(s["modes"]["chain"]["rounds"] for s in e2e["per_seed"])
        assert e2e["protocol"] == "natural" and len(e2e["per_seed"][0]["modes"]["chain"]["per_prompt"]["rounds"]) == 3
    timing = json.loads((wd / "results/eval/e2e_timing.json").read_text())
    assert [s["seed"] for s in timing["variants"]["hybrid"]["per_seed"]] == [0, 1] and timing["prompts"] == 3
    for fig in ("decay", "depth", "gate", "gradients", "query_error", "e2e", "context"):
        assert (wd / f"figures/{fig}.pdf").read_bytes()[:4] == b"%PDF"
    claims = json.loads((wd / "results/claims.json").read_text())
    assert len(claims) == 10 and all(c["verdict"] for c in claims)
    assert {c["protocol"] for c in claims if "protocol" in c} <= {"continuations", "natural"}
    natural = json.loads((wd / "results/eval/natural.json").read_text())
    convs = {c["conversation"]: c for c in natural["conversations"]}
    assert sum(len(c["anchors"]) for c in convs.values()) == 24   # eval.natural.anchors: a cap on the candidates
    # E2E: one prompt per conversation that holds anchors, cut at one of its anchors, its branch the reference
    assert len(natural["items"]) == sum(bool(c["anchors"]) for c in convs.values())
    for it in natural["items"]:
        conv = convs[it["conversation"]]
        assert it["anchors"][0] in conv["anchors"] and it["prompt"] == conv["ids"][: it["anchors"][0] + 1]
    assert all(c.get("seeds") == 2 for c in claims if c.get("seeds") is not None)
    assert any(c.get("seeds") == 2 for c in claims)
    for table in ("stepwise", "steps", "context", "depth", "e2e", "paper", "training", "benchmarks"):
        assert (wd / f"results/tables/{table}.csv").exists()
    # the benchmarks axis: held-out ShareGPT and HumanEval columns, T = 0 and T = 1 row groups, every variant
    bench = (wd / "results/tables/benchmarks.md").read_text()
    assert bench.startswith("| variant | mode | sharegpt tau | sharegpt speedup | humaneval tau | humaneval speedup |")
    assert "| **T = 0** |" in bench and "| **T = 1** |" in bench
    assert all(bench.count(f"| {name} | chain |") == 2 for name in variants)
    assert (wd / "figures/benchmarks.pdf").read_bytes()[:4] == b"%PDF"
    rules = ["prepare_data", "train_tokenizer", "target", "capture_features_train", "capture_features_eval",
             "capture_features_val", "target_continuations", "e2e_timing", "report"]
    per_variant = [f"{r}_{name}" for r in ("eval_stepwise", "eval_e2e", "eval_benchmarks") for name in variants]
    per_variant += [f"train_drafter_{name}_seed{seed}" for name in variants for seed in (0, 1)]
    for rule in rules + per_variant:
        assert (wd / f"logs/{rule}.log").exists()
        assert (wd / f"results/benchmarks/rules/{rule}.tsv").exists()
    proc = snakemake(wd, "--configfile", "config/smoke.yaml", "--report", "report.html")
    assert proc.returncode == 0, proc.stderr[-2000:]
    html = (wd / "report.html").read_text(errors="replace")
    assert all(name in html for name in ("decay.pdf", "claims.md", "stepwise.csv"))
    # everything is up to date afterwards; a config change reruns only what depends on it
    assert "Nothing to be done" in (snakemake(wd, "-n", "--configfile", "config/smoke.yaml").stdout)
    (wd / "more.yaml").write_text("features:\n  kv_layers: [0, 1, 2, 3]\n")   # every variant's layers (checks.py)
    jobs = dry_run_jobs(wd, "config/smoke.yaml", "more.yaml")
    downstream = {"train_drafter": 12, "eval_stepwise": 6, "eval_e2e": 6, "eval_benchmarks": 6, "e2e_timing": 1,
                  "report": 1, "all": 1}
    assert jobs == {"capture_features": 3, **downstream}
    (wd / "more.yaml").write_text("drafters:\n  train:\n    lr: 0.002\n")
    assert dry_run_jobs(wd, "config/smoke.yaml", "more.yaml") == downstream

    # the block-wise target: real verdicts, lossless decoding
    for name in ("block-kv-d1", "block-hidden", "hybrid-warm"):
        e2e = json.loads((wd / f"results/blockwise/eval/{name}/e2e.json").read_text())
        assert e2e["lossless"] is True and [s["seed"] for s in e2e["per_seed"]] == [0, 1]
        assert set(e2e["modes"]) == ({"chain"} if name.startswith("block") else {"chain", "tree"})
        stepwise = json.loads((wd / f"results/blockwise/eval/{name}/stepwise.json").read_text())
        assert len(stepwise["alpha"]) == 7 and stepwise["rounds"][0] > 0
    block_claims = {c["claim"]: c for c in json.loads((wd / "results/blockwise/claims.json").read_text())}
    assert {"block-wise training rescues long-range KV drafting", "block-wise KV context vs block-wise hidden context",
            "block-wise training densifies the KV-path gradient", "gate remedy hybrid-warm"} <= set(block_claims)
    assert all(c["verdict"] and c.get("seeds") == 2 for c in block_claims.values())
    for fig in ("blockwise", "blockwise_decay", "blockwise_depth"):
        assert (wd / f"figures/{fig}.pdf").read_bytes()[:4] == b"%PDF"

    # the drift target: EAGLE-3.1 and its ablations train, evaluate step-wise and decode
    # losslessly; the report reuses the chains and the block variant and judges retention
    for name in ("eagle3.1", "eagle3-fcnorm", "eagle3-postnorm"):
        switches = json.loads((wd / f"results/drift/drafters/{name}/seed0/config.json").read_text())
        assert switches["fc_norm"] == (name != "eagle3-postnorm") and switches["norm_output"] == (name != "eagle3-fcnorm")
        assert json.loads((wd / f"results/drift/eval/{name}/e2e.json").read_text())["lossless"] is True
        stepwise = json.loads((wd / f"results/drift/eval/{name}/stepwise_natural.json").read_text())
        assert len(stepwise["alpha"]) == 7 and [s["seed"] for s in stepwise["per_seed"]] == [0, 1]
    drift_claims = {c["claim"]: c for c in json.loads((wd / "results/drift/claims.json").read_text())}
    assert {"EAGLE-3.1 retains more than EAGLE-3 at long range",
            "KV-only at depth 4 retains more than EAGLE-3.1"} <= set(drift_claims)
    assert all(c["verdict"] for c in drift_claims.values())
    assert (wd / "figures/drift.pdf").read_bytes()[:4] == b"%PDF"


def test_paper_dag_dry_runs_with_the_default_rule_graph(tmp_path):
    wd = workdir(tmp_path)
    default = dry_run_jobs(wd)
    paper = dry_run_jobs(wd, "config/paper.yaml")
    smoke = dry_run_jobs(wd, "config/smoke.yaml")
    shared = {"prepare_data": 1, "train_tokenizer": 1, "target": 1, "capture_features": 3,
              "target_continuations": 1, "eval_stepwise": 6, "eval_e2e": 6, "eval_benchmarks": 6, "e2e_timing": 1,
              "report": 1, "all": 1}
    # one training job per variant and seed (drafters.seeds: default 3, smoke 2, paper 1)
    assert default == shared | {"train_drafter": 18}
    assert smoke == shared | {"train_drafter": 12}
    # config/paper.yaml's drafters.group_training: kv-d4 alone, [eagle3, kv-d1, kv-d2] and [hybrid, standalone]
    # side by side, each member then linked to results/drafters/<variant>/seed0
    assert paper == shared | {"train_drafter": 1, "train_drafter_group": 2, "drafter_from_group": 5}


def test_scaling_sweep_is_its_own_target(tmp_path):
    wd = workdir(tmp_path)
    proc = snakemake(wd, "figures/scaling.pdf", "-n", "--cores", "1", "--configfile", "config/paper.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", out[out.index("Job stats:"):], re.M)}
    # 3 sizes (70k, 140k, 280k) x 5 paradigms, each trained and evaluated, then one figure; trained:
    # kv-d4 and hybrid alone, [eagle3, kv-d1, kv-d2] side by side (drafters.group_training)
    assert (jobs["scaling_train"], jobs["scaling_train_group"], jobs["scaling_drafter_from_group"]) == (6, 3, 9)
    assert jobs["scaling_stepwise"] == 15 and jobs["scaling_report"] == 1
    assert "results/scaling/n70000/drafters/kv-d4" in out


def test_paper_dag_through_the_slurm_profile_dry_runs_with_gpu_resources(tmp_path):
    wd = workdir(tmp_path)
    proc = snakemake(wd, "-n", "-p", "--profile", "profiles/slurm", "--configfile", "config/paper.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    blocks = [b for b in re.split(r"\n(?=\[)", out) if re.search(r"rule train_drafter(_group)?:", b)]
    assert len(blocks) == 3 and all("gpu=8" in b and "slurm_partition=gpu" in b for b in blocks)   # kv-d4, 2 groups
    assert out.count("accelerate launch --multi_gpu --num_processes 8") == 3   # DDP over the job's 8 GPUs


def test_lint_is_clean(tmp_path):
    proc = snakemake(workdir(tmp_path), "--lint")
    assert proc.returncode == 0 and "Congratulations" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_every_rule_has_log_benchmark_and_conda():
    for smk in (REPO / "workflow/rules").glob("*.smk"):
        text = smk.read_text()
        for rule in re.split(r"^rule ", text, flags=re.M)[1:]:
            name = rule.split(":")[0]
            for directive in ("log:", "benchmark:", "conda:", "threads:", "resources:"):
                assert directive in rule, f"{smk.name}: rule {name} lacks {directive}"


def test_bad_config_fails_before_any_job(tmp_path):
    wd = workdir(tmp_path)
    (wd / "bad.yaml").write_text("features:\n  batch_tokens: many\n")
    proc = snakemake(wd, "--cores", "1", "--configfile", "bad.yaml")
    assert proc.returncode != 0
    assert "bad.yaml: features.batch_tokens: 'many' is not of type 'integer'" in proc.stderr
    assert not (wd / "results").exists()


def test_corrupt_data_file_fails_in_one_line_and_writes_nothing(tmp_path):
    wd = workdir(tmp_path)
    (wd / "corrupt.json").write_text('{"id": "x", "conversations": []}')  # not a JSON array
    (wd / "bad_data.yaml").write_text(f"data:\n  sources:\n    - kind: sharegpt_file\n      path: {wd / 'corrupt.json'}\n")
    proc = snakemake(wd, "results/data/stats.json", "--cores", "1", "--configfile", "config/smoke.yaml", "bad_data.yaml")
    assert proc.returncode != 0
    log = (wd / "logs/prepare_data.log").read_text().strip().splitlines()
    assert log[-1].startswith("kvshot prepare-data: error: ") and "corrupt.json" in log[-1]
    assert not (wd / "results/data").exists() or not any((wd / "results/data").iterdir())
