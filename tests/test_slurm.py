"""The SLURM path for real: the smoke DAG through `sbatch` on the single-node cluster of
scripts/slurm_local.sh (CI starts it), and a training job killed by `scancel` that resumes
from its checkpoint when resubmitted."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest
import torch

from kvshot.config import read_config

from .conftest import REPO
from .test_pipeline import snakemake, workdir

PROFILE = ("--profile", "workflow/profiles/slurm-test")


def cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mixed", "allocated"))


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cluster_up() and os.environ.get("CI") != "true",
                       reason="no SLURM cluster: run `bash scripts/slurm_local.sh up` first"),
]


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory):
    assert cluster_up(), "CI must start the test cluster (scripts/slurm_local.sh up)"
    wd = workdir(tmp_path_factory.mktemp("slurm"))
    proc = snakemake(wd, *PROFILE, "--configfile", "config/smoke.yaml", timeout=1500)
    return wd, proc


def test_smoke_dag_goes_through_sbatch(slurm_run, tmp_path):
    wd, proc = slurm_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", proc.stdout + proc.stderr)
    variants = [v["name"] for v in read_config([str(REPO / "config/config.yaml"), str(REPO / "config/smoke.yaml")])
                ["drafters"]["variants"]]
    jobs = 7 + 3 * len(variants)   # data, tokenizer, target, 2 captures, continuations, report; 3 per variant
    assert len(ids) == jobs and len(set(ids)) == jobs       # every job but `all`, each its own sbatch
    for name in variants:
        assert json.loads((wd / f"results/eval/{name}/e2e.json").read_text())["lossless"] is True
    assert (wd / "figures/decay.pdf").exists() and (wd / "results/claims.json").exists()
    # the same outputs as a local run of the same stages
    local = workdir(tmp_path)
    done = snakemake(local, "results/target/metrics.json", "--cores", "2", "--configfile", "config/smoke.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    for path in ("results/data/stats.json", "results/data/train.jsonl", "results/target/metrics.json"):
        a, b = (wd / path).read_text(), (local / path).read_text()
        if path.endswith("metrics.json"):   # timings differ; the numbers must not
            a, b = ({k: v for k, v in json.loads(x).items() if "seconds" not in k} for x in (a, b))
        assert a == b, path


def test_scancel_mid_training_then_resubmit_resumes(slurm_run):
    wd, _ = slurm_run
    (wd / "long.yaml").write_text("drafters:\n  train:\n    max_steps: 400\n    ckpt_every: 20\n")
    args = ["results/drafters/kv-d1", *PROFILE, "--configfile", "config/smoke.yaml", "long.yaml"]
    ckpt = wd / "results/drafters/kv-d1.ckpt/checkpoint.pt"
    run = subprocess.Popen(["snakemake", *args], cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    step, deadline = 0, time.time() + 600
    while time.time() < deadline and run.poll() is None:
        if ckpt.exists():
            try:   # the smoke run's own checkpoint stopped at step 2: >= 20 is this run's
                step = torch.load(ckpt, weights_only=False)["progress"]["step"]
            except Exception:   # read while being replaced: try again
                step = 0
            if step >= 20:
                break
        time.sleep(0.2)
    assert run.poll() is None, "training finished before it could be killed"
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout.split("\n")
    ids = [line.split()[0] for line in jobs if line.strip()]
    assert ids, "no SLURM job to cancel"
    subprocess.run(["scancel", *ids], check=True)
    out = run.communicate(timeout=300)[0]
    assert run.returncode != 0, out[-2000:]
    assert not (wd / "results/drafters/kv-d1/metrics.json").exists() or \
        json.loads((wd / "results/drafters/kv-d1/metrics.json").read_text())["steps"] != 400
    again = snakemake(wd, *args, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = json.loads((wd / "results/drafters/kv-d1/metrics.json").read_text())
    assert metrics["steps"] == 400 and metrics["resumed_from"] is not None and metrics["resumed_from"] >= 20
