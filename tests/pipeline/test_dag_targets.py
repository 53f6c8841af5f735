"""Small Snakemake runs and dry runs of single targets, moved beside the DAG tests because each
starts Snakemake: a target's own jobs, the profiles, the env files, config errors before any
job, the export and shared-pass rules."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from ..conftest import REPO
from ..dag import snakemake, workdir
from ..unit.test_envs import (CPU_RULES, DEFAULT_PROFILE_KEYS, DEVICE_RULES, LOCAL_RULES, OPTIONAL_RULES, device_env,
                              rule_envs)
from ..unit.test_export import SGLANG_PARAMS, sglang_destination
from ..unit.test_reliability import _sharegpt


# from test_export.py
def snakemake_workdir(tmp_path: Path) -> Path:
    """A working directory on the repo's workflow, its Snakefile including the export rules."""
    for name in ("workflow", "config", "envs", "src"):
        (tmp_path / name).symlink_to(REPO / name)
    snakefile = (REPO / "Snakefile").read_text()
    if "workflow/rules/export.smk" not in snakefile:
        snakefile += '\ninclude: "workflow/rules/export.smk"\n'
    (tmp_path / "Snakefile").write_text(snakefile)
    return tmp_path


# from test_export.py
@pytest.mark.slow
def test_the_dag_exports_the_eagle3_variant(tmp_path, smoke_workdir):
    """`snakemake results/export/eagle3` (smoke scale): from scratch it trains eagle3 alone and
    exports it (dry run); run in the session's smoke DAG directory (conftest.py), it exports the
    eagle3 drafter trained there, or trains it first when the smoke DAG test has not run yet."""
    import subprocess

    wd = snakemake_workdir(tmp_path)
    run = lambda cwd, *a: subprocess.run(["snakemake", *a, "--cores", "2", "--configfile", "config/smoke.yaml"],
                                         cwd=cwd, capture_output=True, text=True, timeout=1200)
    dry = run(wd, "-n", "results/export/eagle3")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "export_eagle3" in dry.stdout and "kv-d1" not in dry.stdout
    assert re.search(r"^train_drafter\s+1$", dry.stdout, re.M), dry.stdout[-2000:]   # eagle3 seed0 alone
    refused = run(wd, "-n", "results/export/kv-d1")                 # KV drafters have no engine format
    assert refused.returncode != 0 and "MissingRule" in refused.stderr + refused.stdout, refused.stderr[-2000:]
    wd = smoke_workdir
    done = run(wd, "results/export/eagle3")
    assert done.returncode == 0, done.stderr[-3000:]
    out = wd / "results/export/eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]   # smoke features.aux_layers
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert {sglang_destination(n) for n in names} - {None} == SGLANG_PARAMS
    assert (wd / "logs/export_eagle3_eagle3.log").exists()
    assert json.loads((wd / "results/drafters/eagle3/seed0/variant.json").read_text())["qk_norm"] is False


# from test_paper_shapes.py
def test_every_job_gets_the_expandable_segments_allocator(tmp_path):
    """workflow/rules/common.smk's shell prefix exports PYTORCH_CUDA_ALLOC_CONF to every job
    (local, conda, SLURM alike; a value the caller set wins: `${VAR:-...}`)."""
    (tmp_path / "Snakefile").write_text(
        f'configfile: "{REPO}/config/config.yaml"\ninclude: "{REPO}/workflow/rules/common.smk"\n'
        'rule env:\n    output: "env.txt"\n    shell: "echo $PYTORCH_CUDA_ALLOC_CONF > {output}"\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "env.txt"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "env.txt").read_text().strip() == "expandable_segments:True"


# from test_shared_target_pass.py
def test_snakemake_runs_one_shared_job(tmp_path):
    """With eval.shared_target_pass the core variants' step-wise evaluation is one job
    (eval_stepwise_shared) and asking for one variant's record runs it; the block-wise variants
    keep one job each (dry run, smoke config)."""
    import re

    import yaml

    from ..dag import snakemake, workdir

    wd = workdir(tmp_path)
    (wd / "shared.yaml").write_text(yaml.safe_dump({"eval": {"shared_target_pass": True}}))
    proc = snakemake(wd, "figures/decay.pdf", "figures/blockwise.pdf", "-n", "--cores", "1",
                     "--configfile", "config/smoke.yaml", "shared.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", out[out.index("Job stats:"):], re.M)}
    assert jobs["eval_stepwise_shared"] == 1 and "eval_stepwise" not in jobs and jobs["blockwise_stepwise"] == 3
    one = snakemake(wd, "results/eval/kv-d1/stepwise_natural.json", "-n", "--cores", "1",
                    "--configfile", "config/smoke.yaml", "shared.yaml")
    assert one.returncode == 0 and "eval_stepwise_shared" in one.stdout, (one.stdout + one.stderr)[-3000:]


# from test_reliability.py
@pytest.mark.slow
def test_snakemake_rejects_before_any_job(tmp_path):
    """The dry run fails at startup, naming the overlay file that set the bad value."""
    wd = workdir(tmp_path)
    overlay = tmp_path / "bad.yaml"
    overlay.write_text(yaml.safe_dump({"drafters": {"draft_vocab_size": 100000}}))
    proc = snakemake(wd, "-n", "--cores", "1", "--configfile", "config/smoke.yaml", str(overlay))
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"{overlay}: drafters.draft_vocab_size: 100000 is larger than the target's vocabulary" in out, out[-1500:]
    assert not (wd / "results").exists()


# from test_reliability.py
@pytest.mark.slow
def test_editing_a_local_data_file_reruns_prepare_data_and_below(tmp_path):
    (tmp_path / "wd").mkdir()
    wd = workdir(tmp_path / "wd")
    _sharegpt(wd / "mine.json", 70)
    (wd / "hub.jsonl").write_text("")
    overlay = tmp_path / "local.yaml"
    overlay.write_text(yaml.safe_dump({"data": {"sources": [
        {"kind": "sharegpt_file", "path": "mine.json"}]}}))
    args = ("--cores", "1", "--configfile", "config/smoke.yaml", str(overlay))
    proc = snakemake(wd, "results/data/stats.json", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = snakemake(wd, "-n", "results/data/stats.json", *args)
    assert "Nothing to be done" in proc.stdout + proc.stderr
    _sharegpt(wd / "mine.json", 70, extra=3)   # the user edits the file (3 copies added)
    os.utime(wd / "mine.json")
    proc = snakemake(wd, "-n", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    jobs = {m.group(1): m.group(2) for m in re.finditer(r"^rule (\w+):\n(?:    .*\n)*?    reason: (.*)$", out, re.M)}
    assert jobs["prepare_data"] == "Updated input files: mine.json", out[-3000:]
    for rule in ("train_tokenizer", "target", "capture_features", "train_drafter", "eval_stepwise", "eval_e2e"):
        assert "Input files updated by another job" in jobs[rule], (rule, jobs.get(rule))
    proc = snakemake(wd, "results/data/stats.json", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads((wd / "results/data/stats.json").read_text())
    assert stats["sources"][0]["read"] == 73 and stats["duplicates_removed"] == 3
    # a hub source's local data_files are inputs too, and so are local evaluation prompts
    (wd / "prompts.jsonl").write_text(json.dumps({"prompt": ["hello"]}) + "\n")
    overlay.write_text(yaml.safe_dump({
        "data": {"sources": [{"kind": "sharegpt_file", "path": "mine.json"},
                             {"kind": "hub", "name": "json", "split": "train", "schema": "sharegpt",
                              "data_files": ["hub.jsonl"]}]},
        "eval": {"prompt_sources": [{"kind": "hub", "name": "json", "split": "train", "schema": "mtbench",
                                     "data_files": "prompts.jsonl"}]}}))
    out = snakemake(wd, "-n", "results/eval/continuations.json", *args).stdout
    assert "input: mine.json, hub.jsonl" in out, out[-2000:]
    assert "input: results/data/eval.jsonl, results/target/model, prompts.jsonl" in out, out[-2000:]


# from test_reliability.py
@pytest.mark.slow
@pytest.mark.parametrize("text,what", [("seed: [0\n", "not valid YAML (while parsing a flow sequence"),
                                       ("", "expected a mapping of config sections, found an empty file")],
                         ids=["syntax", "empty"])
def test_broken_base_config_is_named_by_snakemake(tmp_path, text, what):
    """The Snakefile's `configfile:` names the file. (--configfile overlays are parsed by
    Snakemake's CLI before the Snakefile runs; its message there names no file.)"""
    for name in ("Snakefile", "workflow", "envs", "src"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text(text)
    proc = snakemake(tmp_path, "-n", "--cores", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"config/config.yaml: {what}" in out, out[-1500:]


# from test_benchmarks.py
def test_benchmarks_null_drops_the_stage_from_the_dag(tmp_path):
    from ..dag import dry_run_jobs, workdir

    wd = workdir(tmp_path)
    (wd / "nobench.yaml").write_text("eval:\n  e2e:\n    benchmarks: null\n")
    jobs = dry_run_jobs(wd, "config/smoke.yaml", "nobench.yaml")
    assert "eval_benchmarks" not in jobs and jobs["report"] == 1
    assert dry_run_jobs(wd, "config/smoke.yaml")["eval_benchmarks"] == 6


# from test_envs.py
def test_rules_run_in_env_files_chosen_by_device(tmp_path):
    from ..dag import workdir

    wd = workdir(tmp_path)
    cpu, gpu = str((REPO / "envs/cpu.yaml").resolve()), str((REPO / "envs/gpu.yaml").resolve())
    paper = rule_envs(wd, "config/paper.yaml")
    unknown = set(paper) - DEVICE_RULES - CPU_RULES - LOCAL_RULES - {"all"}
    assert not unknown, f"rules {sorted(unknown)}: add them to DEVICE_RULES or CPU_RULES (tests/unit/test_envs.py)"
    assert (DEVICE_RULES | CPU_RULES) - OPTIONAL_RULES <= set(paper)
    assert paper.pop("all") is None
    for name in LOCAL_RULES:   # run on the submitting host (localrules)
        assert paper.pop(name) == "localrule", name
    for name, env in paper.items():
        assert env == str((REPO / "envs" / device_env(name, True)).resolve()), f"paper config: rule {name} runs in {env}"
    # the embedded default (device: auto) and a CUDA-less overlay of the paper config stay on CPU
    (wd / "cpu.yaml").write_text("device: cpu\n")
    for overlays in ((), ("config/paper.yaml", "cpu.yaml")):
        envs = rule_envs(wd, *overlays)
        for name in ("all", *LOCAL_RULES):
            envs.pop(name)
        assert envs == {n: str((REPO / "envs" / device_env(n, False)).resolve()) for n in envs}, (overlays, envs)
        assert {e for n, e in envs.items() if n != "serve_vllm"} == {cpu}, (overlays, envs)


# from test_envs.py
def test_default_profile_is_where_snakemake_finds_it_and_safe_to_merge(tmp_path):
    """profiles/default/ beside the Snakefile is Snakemake's implicit workflow profile: it is
    merged into every run (local, `--profile profiles/slurm`, the tests' own calls) and its keys
    override a --profile's, so it sets nothing a run chooses itself (cores, jobs, executor,
    resources). The named profiles sit beside it."""
    from ..dag import snakemake, workdir

    default = yaml.safe_load((REPO / "profiles/default/config.yaml").read_text())
    assert set(default) <= DEFAULT_PROFILE_KEYS and default["rerun-incomplete"] is True
    assert all((REPO / "profiles" / name / "config.yaml").is_file() for name in ("slurm", "slurm-test"))
    assert not (REPO / "workflow/profiles").exists()
    proc = snakemake(workdir(tmp_path), "-n", "--cores", "1", "--configfile", "config/smoke.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "workflow specific profile profiles/default" in proc.stderr   # found, and used


# from test_drift_report.py
def test_drift_is_its_own_snakemake_target(tmp_path):
    import re

    from ..dag import snakemake, workdir

    wd = workdir(tmp_path)
    proc = snakemake(wd, "figures/drift.pdf", "-n", "-p", "--cores", "1", "--configfile", "config/smoke.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    # the report job's own config holds every section its name check reads (drift.blocks names
    # blockwise.variants: a run without that section failed at the last job)
    import shlex

    from kvshot.checks import drift_name_problems
    from kvshot.config import read_config

    line = next(l for l in out.splitlines() if "python -m kvshot drift-report" in l)
    words = shlex.split(line)
    job_cfg = read_config([words[words.index("--config") + 1]], ("drafters", "drift", "blockwise"))
    assert job_cfg["drift"]["blocks"] and drift_name_problems(job_cfg) == []
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", out[out.index("Job stats:"):], re.M)}
    # smoke: 3 drift variants x 2 seeds; eagle3, kv-d1/2/4 and the hybrid; block-kv-d1 (drift.blocks)
    assert jobs["drift_train"] == 6 and jobs["drift_stepwise"] == 3 and jobs["drift_e2e"] == 3
    assert jobs["drift_report"] == 1 and jobs["train_drafter"] == 10 and jobs["eval_stepwise"] == 5
    assert jobs["blockwise_train"] == 2 and jobs["blockwise_stepwise"] == 1 and "report" not in jobs
    assert "results/drift/drafters/eagle3.1/seed1" in out
    proc = snakemake(wd, "-n", "--cores", "1", "--configfile", "config/smoke.yaml")   # `all`
    assert proc.returncode == 0 and "rule drift_" not in proc.stdout + proc.stderr and "results/drift/" not in proc.stdout


# from test_blockwise_report.py
def test_blockwise_is_its_own_snakemake_target(tmp_path):
    """`snakemake -n figures/blockwise.pdf` (smoke config): the block variants trained per seed,
    evaluated and decoded under results/blockwise/, the KV-only chains they are judged
    against, one report; `all` does not include them."""
    import re

    from ..dag import snakemake, workdir

    wd = workdir(tmp_path)
    proc = snakemake(wd, "figures/blockwise.pdf", "-n", "--cores", "1", "--configfile", "config/smoke.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", out[out.index("Job stats:"):], re.M)}
    # smoke: 2 block variants and 1 gate remedy x 2 seeds; the 6 drafters.variants x 2 seeds (the KV-only
    # chains and the hybrid are judged against, all of them are redrawn in blockwise_decay.pdf)
    assert jobs["blockwise_train"] == 6 and jobs["blockwise_stepwise"] == 3 and jobs["blockwise_e2e"] == 3
    assert jobs["blockwise_report"] == 1 and jobs["train_drafter"] == 12 and jobs["eval_stepwise"] == 6
    assert "figures/blockwise_decay.pdf" in out and "figures/blockwise_depth.pdf" in out
    assert "results/blockwise/drafters/block-hidden/seed1" in out and "report" not in jobs
