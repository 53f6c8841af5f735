"""The SLURM path. Without a cluster: every target of the paper DAG (`all` and the optional
ones) dry-run through profiles/slurm books what each job runs (one GPU per process it launches
on one node: 8 GPUs x 8 CPUs for DDP training, one GPU for the other device jobs; the CPU
partition and no GPU for CPU-only rules), and the sbatch options the executor plugin derives
from those resources; config/one-gpu.yaml through the same profile books one GPU per training
job, and through the workstation launcher (`--resources gpu=1`) every device job asks for the
one GPU. With the single-node cluster of scripts/slurm_local.sh (CI starts it): the smoke DAG
through `sbatch`, and a training job killed by `scancel` that resumes when resubmitted."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from kvshot.config import read_config
from kvshot.train.launch import FREE_PORT_SHELL, accelerate_args, free_port, launcher_command, scaled_steps

from ..conftest import REPO
from ..dag import numerics_lines, snakemake, without_numerics, workdir
from ..unit.test_envs import CPU_RULES, DEVICE_RULES, LOCAL_RULES, device_env, rule_envs

SLURM_SNAKEMAKE = [sys.executable, str(REPO / "tests/slurm_snakemake.py")]   # backoff capped: see there

PROFILE = ("--profile", "profiles/slurm-test")
PAPER_PROFILE = REPO / "profiles/slurm/config.yaml"
TRAIN_RULES = {"train_drafter", "scaling_train", "plateau_train", "blockwise_train", "drift_train", "curve_train",   # DDP: 8 GPUs
               "train_drafter_group", "scaling_train_group", "plateau_train_group", "blockwise_train_group",
               "drift_train_group"}


def cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mixed", "allocated"))


needs_cluster = pytest.mark.skipif(not cluster_up() and os.environ.get("CI") != "true",
                                   reason="no SLURM cluster: run `bash scripts/slurm_local.sh up` first")


# ---------------------------------------------------------------- paper DAG, dry run


def parse_dry_run(out: str) -> list[dict]:
    """The jobs of `snakemake -n -p`: rule, wildcards, resources and shell command each."""
    jobs = []
    for block in re.split(r"\n(?=\[)", out):
        rule = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if rule is None or rule.group(1) == "all":
            continue
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        wc = re.search(r"^\s+wildcards: (.*)$", block, re.M)
        shell = re.search(r"^Shell command: (.*)$", block, re.M)
        jobs.append({
            "rule": rule.group(1),
            "resources": dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {},
            "wildcards": dict(kv.split("=", 1) for kv in wc.group(1).split(", ")) if wc else {},
            "shell": shell.group(1) if shell else "",
        })
    return jobs


# Every target of the workflow, through the paper profile: `all` and the ones not behind it.
# One dry run per group (a dry run of the paper DAG takes ~10 s); regenerate_data exists only
# with data.regenerate.enabled, an overlay of its own.
PAPER_TARGETS = ("all", "figures/scaling.pdf", "figures/blockwise.pdf", "results/export/eagle3", "results/serve/vllm.json",
                 "results/plateau/claims.md", "results/published/table.md", "figures/drift.pdf", "results/curve/curve.md")
# the rules only an option runs: data.regenerate (regenerate_data), eval.shared_target_pass (eval_stepwise_shared)
# drafters.group_training off: drift_train (config/paper.yaml trains every drift variant in one group)
REGENERATE_TARGETS = ("regenerate_data", "results/eval/kv-d1/stepwise.json", "results/drift/drafters/eagle3.1/seed0")
REGENERATE_OVERLAY = ("data:\n  regenerate:\n    enabled: true\neval:\n  shared_target_pass: true\n"
                      "drafters:\n  group_training: false\n")
OPTION_RULES = {"regenerate_data", "eval_stepwise_shared", "drift_train"}
GPU_PARTITION, CPU_PARTITION, CPUS_PER_GPU = "gpu", "cpu", 8


def slurm_dry_run(wd, targets, *overlays, config="config/paper.yaml") -> list[dict]:
    proc = snakemake(wd, *targets, "-n", "-p", "--profile", "profiles/slurm",
                     "--configfile", config, *overlays, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    return parse_dry_run(out)


@pytest.fixture(scope="module")
def paper_dry_run(tmp_path_factory):
    wd = workdir(tmp_path_factory.mktemp("paper_slurm"))
    return wd, slurm_dry_run(wd, PAPER_TARGETS)


@pytest.fixture(scope="module")
def regenerate_dry_run(tmp_path_factory):
    wd = workdir(tmp_path_factory.mktemp("paper_slurm_regenerate"))
    (wd / "regenerate.yaml").write_text(REGENERATE_OVERLAY)
    return wd, slurm_dry_run(wd, REGENERATE_TARGETS, "regenerate.yaml")


@pytest.fixture(scope="module")
def paper_envs(paper_dry_run):
    """{rule: env file} of every rule under the paper config (the env depends on `device` only)."""
    return rule_envs(paper_dry_run[0], "config/paper.yaml")


class _Resources(dict):
    """A job's resources as the executor plugin reads them (attribute access and .get)."""

    def __getattr__(self, name):
        return self[name]


class _Job:
    def __init__(self, job: dict):
        self.name = job["rule"]
        self.threads = 1
        self.resources = _Resources({k: int(v) if v.isdigit() else v for k, v in job["resources"].items()})


def sbatch_options(job: dict) -> str:
    """The sbatch call the SLURM executor plugin builds for a dry-run job."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    fake = _Job(job)
    params = {"run_uuid": "uuid", "slurm_logfile": "log", "comment_str": f"rule_{job['rule']}",
              "account": f"-A {fake.resources['slurm_account']}",
              "partition": f"-p {fake.resources['slurm_partition']}", "workdir": "."}
    return get_submit_command(fake, params) + set_gres_string(fake)


def sbatch_flags(sbatch: str) -> dict[str, str | None]:
    """{flag: value} of an sbatch call: `--key=value`, `--key value`, `-k value`, bare flags None."""
    words, flags, i = shlex.split(sbatch)[1:], {}, 0
    while i < len(words):
        word = words[i]
        if "=" in word:
            key, value = word.split("=", 1)
        elif i + 1 < len(words) and not words[i + 1].startswith("-"):
            key, value = word, words[i + 1]
            i += 1
        else:
            key, value = word, None
        assert key not in flags, f"{key} twice in {sbatch}"
        flags[key] = value
        i += 1
    return flags


def launched_processes(shell: str) -> int:
    """How many processes a job's command starts: `accelerate launch --num_processes N` (DDP), else 1."""
    if not shell.startswith("accelerate launch "):
        return 1
    return int(re.search(r" --num_processes (\d+) ", shell).group(1))


def online_capture(job: dict) -> bool:
    """A capture_features (or curve_capture) job of features.mode online (its --config): it tokenizes and indexes
    only (the trainer runs the target), so it books no GPU, though it runs in the device env."""
    if job["rule"] not in ("capture_features", "curve_capture"):
        return False
    cfg = next(json.loads(w) for w in shlex.split(job["shell"].split(" > ")[0]) if w.startswith("{"))
    return cfg["features"]["mode"] == "online"


def assert_booked(job: dict, envs: dict[str, str | None]) -> None:
    """A job books what its command uses: a device job (it loads the target or a drafter: on
    CUDA in the paper config) one GPU per process it launches, on one node, in the GPU
    partition and the GPU env; a CPU job no GPU, the CPU partition and the CPU env; online
    capture_features no GPU and the CPU partition, in the GPU env (offline it is a device job)."""
    rule, res = job["rule"], job["resources"]
    if rule in LOCAL_RULES:   # hard links on the submitting host (localrules: tests/unit/test_envs.py)
        assert "link_tree" in job["shell"] and launched_processes(job["shell"]) == 1, job
        return
    assert rule in DEVICE_RULES | CPU_RULES, f"rule {rule}: add it to DEVICE_RULES or CPU_RULES (tests/unit/test_envs.py)"
    assert "cpus_per_task" not in res, f"{rule}: cpus_per_task would override cpus_per_gpu"
    assert int(res["runtime"]) > 0 and int(res["mem_mb"]) > 0, job
    flags = sbatch_flags(sbatch_options(job))
    assert "--cpus-per-task" not in flags or "--cpus-per-gpu" not in flags, flags
    if online_capture(job):
        assert envs[rule].endswith("/envs/gpu.yaml"), (rule, envs[rule])
        assert res.get("slurm_partition") == CPU_PARTITION and res.get("gpu") == "0" and \
            not {"gres", "cpus_per_gpu"} & set(res), f"online {rule} tokenizes only: {res}"
        assert flags["-p"] == CPU_PARTITION and not {"--gpus", "--gres", "--cpus-per-gpu"} & set(flags), \
            (rule, flags)
        assert flags.get("--cpus-per-task") == "1" and flags.get("--ntasks") == "1", (rule, flags)
    elif rule in DEVICE_RULES:
        gpus = launched_processes(job["shell"])
        assert envs[rule].endswith(f"/envs/{device_env(rule, True)}"), (rule, envs[rule])
        assert (res.get("slurm_partition"), res.get("gpu"), res.get("nodes")) == (GPU_PARTITION, str(gpus), "1"), \
            f"{rule} launches {gpus} process(es) on CUDA: {res}"
        assert (flags["-p"], flags.get("--gpus"), flags.get("--nodes")) == (GPU_PARTITION, str(gpus), "1"), (rule, flags)
        assert flags.get("--cpus-per-gpu") == str(CPUS_PER_GPU) and "--cpus-per-task" not in flags, (rule, flags)
    else:
        assert launched_processes(job["shell"]) == 1, job["shell"]
        assert envs[rule].endswith("/envs/cpu.yaml"), (rule, envs[rule])
        assert res.get("slurm_partition") == CPU_PARTITION and not {"gpu", "gres", "cpus_per_gpu"} & set(res), \
            f"{rule} runs on CPU: {res}"
        assert flags["-p"] == CPU_PARTITION and not {"--gpus", "--gres", "--cpus-per-gpu"} & set(flags), (rule, flags)
        assert flags.get("--cpus-per-task") == "1" and flags.get("--ntasks") == "1", (rule, flags)


def test_every_job_of_every_target_books_its_device(paper_dry_run, regenerate_dry_run, paper_envs):
    """Every target through profiles/slurm: each job's resources and the sbatch options the
    executor plugin derives from them match what its command launches, and between the two
    dry runs every rule of the workflow is booked."""
    booked: dict[str, set[str]] = {}
    for name, (_, jobs) in (("paper", paper_dry_run), ("regenerate", regenerate_dry_run)):
        for job in jobs:
            assert_booked(job, paper_envs)
        booked[name] = {j["rule"] for j in jobs}
    every = set(paper_envs) - {"all"}
    assert every == DEVICE_RULES | CPU_RULES | LOCAL_RULES
    assert booked["paper"] == every - OPTION_RULES, every - booked["paper"]
    assert OPTION_RULES <= booked["regenerate"], OPTION_RULES - booked["regenerate"]
    ddp = {j["rule"] for j in paper_dry_run[1] if launched_processes(j["shell"]) > 1}
    assert ddp == TRAIN_RULES - OPTION_RULES, ddp
    ddp = {j["rule"] for j in regenerate_dry_run[1] if launched_processes(j["shell"]) > 1}
    assert TRAIN_RULES & OPTION_RULES <= ddp, ddp   # drift_train: with group_training off
    capture = [j for j in paper_dry_run[1] if j["rule"] == "capture_features"]
    assert len(capture) == 3 and all(map(online_capture, capture))   # config/paper.yaml: online, no GPU booked


def test_paper_dry_run_job_counts(paper_dry_run):
    _, jobs = paper_dry_run
    count: dict[str, int] = {}
    for job in jobs:
        count[job["rule"]] = count.get(job["rule"], 0) + 1
    # drafters.group_training (config/paper.yaml): [eagle3, kv-d1, kv-d2], [hybrid, standalone], kv-d4 alone;
    # the scaling sweep's five: the first group, kv-d4 and hybrid alone, at 3 sizes
    assert (count["train_drafter"], count["train_drafter_group"], count["drafter_from_group"]) == (1, 2, 5)
    assert (count["scaling_train"], count["scaling_train_group"], count["scaling_drafter_from_group"]) == (6, 3, 9)
    assert (count["plateau_train"], count["plateau_train_group"], count["plateau_drafter_from_group"]) == (1, 2, 5)
    # 7 block + 2 remedies: two groups of three, block-kv-d4, block-kv-d2-refine and block-dflash alone
    assert (count["blockwise_train"], count["blockwise_train_group"], count["blockwise_drafter_from_group"]) == (3, 2, 6)
    assert (count["blockwise_stepwise"], count["blockwise_e2e"]) == (9, 9)
    assert count["export_eagle3"] == 1 and count["export_dflash"] == 1 and count["eval_benchmarks"] == 6
    assert (count["drift_train_group"], count["drift_drafter_from_group"]) == (1, 3) and "drift_train" not in count
    assert (count["drift_stepwise"], count["drift_e2e"], count["drift_report"]) == (3, 3, 1)
    # the published heads (paper config published.heads): imported, then the same evaluation
    assert (count["import_published"], count["published_stepwise"], count["published_e2e"],
            count["published_benchmarks"], count["published_table"]) == (2, 2, 2, 2, 1)
    cpu_job = sbatch_options(next(j for j in jobs if j["rule"] == "prepare_data"))
    assert "-p cpu" in cpu_job and "--gpus" not in cpu_job and "--cpus-per-task=1" in cpu_job


def test_paper_training_jobs_launch_ddp_on_a_run_time_port_with_their_runtime(paper_dry_run):
    _, jobs = paper_dry_run
    profile = yaml.safe_load(PAPER_PROFILE.read_text())
    assert profile["retries"] >= 1   # the graceful stop exits non-zero: the retry resumes
    train = [j for j in jobs if j["rule"] in TRAIN_RULES]
    for job in train:
        words = job["shell"]
        assert words.startswith(launcher_command(8) + " train-drafter ")
        assert f"--main_process_port {FREE_PORT_SHELL}" in words and "--mixed_precision no" in words
        assert f"--runtime-minutes {job['resources']['runtime']} " in words
        assert " --threads 8 " in words   # config `threads` per rank = the job's cpus_per_gpu


def test_scaling_points_see_the_epochs_of_the_largest(paper_dry_run):
    _, jobs = paper_dry_run
    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])
    batch, max_steps = cfg["drafters"]["train"]["batch_size"], cfg["drafters"]["train"]["max_steps"]
    sizes = cfg["scaling"]["train_samples"]
    steps = {}
    for job in (j for j in jobs if j["rule"] in ("scaling_train", "scaling_train_group")):
        configs = [json.loads(w) for w in shlex.split(job["shell"].split(" > ")[0]) if w.startswith("{")]
        overlay = configs[-1]["drafters"]["train"]
        n = int(job["wildcards"]["n"])
        assert overlay["train_samples"] == n
        steps[n] = overlay["max_steps"]
    assert sorted(steps) == sorted(sizes) and steps[max(sizes)] == max_steps
    epochs = {n: s * batch / n for n, s in steps.items()}
    assert max(epochs.values()) - min(epochs.values()) < batch / min(sizes)   # equal up to one step's rounding
    assert steps == {70000: 15000, 140000: 30000, 280000: 60000}


# ---------------------------------------------------------------- one GPU (config/one-gpu.yaml)
ONE_GPU = "config/one-gpu.yaml"


@pytest.fixture(scope="module")
def one_gpu_dry_run(tmp_path_factory):
    wd = workdir(tmp_path_factory.mktemp("one_gpu_slurm"))
    return wd, slurm_dry_run(wd, PAPER_TARGETS, config=ONE_GPU)


def test_one_gpu_config_books_one_gpu_per_job_through_the_profile(one_gpu_dry_run):
    """The same profile with config/one-gpu.yaml: num_processes 1, so every training job
    launches one process (no accelerate) and books 1 GPU and 40 GB, every job as assert_booked."""
    wd, jobs = one_gpu_dry_run
    envs = rule_envs(wd, ONE_GPU)
    for job in jobs:
        assert_booked(job, envs)
    train = [j for j in jobs if j["rule"] in TRAIN_RULES]
    # config/one-gpu.yaml trains every drafter alone (no drafters.group_training: not sized at its shapes)
    assert {j["rule"] for j in train} == {r for r in TRAIN_RULES if not r.endswith("_group")}
    for job in train:
        assert job["shell"].startswith(launcher_command(1) + " train-drafter "), job["shell"][:120]
        assert (job["resources"]["gpu"], job["resources"]["mem_mb"]) == ("1", "40000"), job["resources"]
    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / ONE_GPU)])
    seeds, variants = cfg["drafters"]["seeds"], cfg["drafters"]["variants"]
    assert sum(j["rule"] == "train_drafter" for j in jobs) == len(seeds) * len(variants) == 18


def test_one_gpu_config_on_a_workstation_serializes_the_gpu_jobs(tmp_path):
    """`snakemake --cores all --resources gpu=1 --configfile config/one-gpu.yaml` (dry run): every
    device job asks for gpu=1, so the scheduler runs them one at a time on the one GPU; CPU
    jobs ask for none and run beside them."""
    wd = workdir(tmp_path)
    proc = snakemake(wd, "all", "-n", "-p", "--cores", "all", "--resources", "gpu=1",
                     "--configfile", ONE_GPU, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "warning" not in out.lower(), out[-3000:]
    jobs = parse_dry_run(out)
    rules = {j["rule"] for j in jobs}
    assert {"train_drafter", "eval_stepwise", "eval_e2e", "target", "capture_features"} <= rules
    for job in jobs:
        want = "0" if online_capture(job) else "1" if job["rule"] in DEVICE_RULES else None
        assert job["resources"].get("gpu") == want, (job["rule"], job["resources"])
        if job["rule"] in TRAIN_RULES:
            assert launched_processes(job["shell"]) == 1, job["shell"][:120]


def test_launcher_words_and_a_free_port():
    assert launcher_command(1) == "python -m kvshot"
    assert accelerate_args(2)[:2] == ["--multi_gpu", "--num_processes"]
    with pytest.raises(ValueError):
        launcher_command(0)
    assert scaled_steps(60000, 70000, 280000) == 15000 and scaled_steps(4, 1, 1000) == 1
    port = int(subprocess.run([sys.executable, "-m", "kvshot.train.launch", "free-port"], capture_output=True,
                              text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")}).stdout)
    assert 1024 <= port <= 65535
    with socket.socket() as s:   # free now: it can be bound
        s.bind(("127.0.0.1", free_port()))


def test_predownload_fetches_every_hub_repo_at_its_pinned_revision():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/predownload_hub.py")], capture_output=True,
                          text=True, check=True)
    commands = [shlex.split(line) for line in proc.stdout.splitlines()]
    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])
    repos = {cfg["target"]["name"]: cfg["target"]["revision"]}
    repos |= {s["name"]: s.get("revision", "main") for s in cfg["data"]["sources"] + cfg["eval"]["prompt_sources"]}
    repos |= {h["repo"]: h["revision"] for h in cfg["published"]["heads"]}   # pinned commits
    repos |= {b["dataset"]: b.get("revision", "main") for b in cfg["eval"]["e2e"]["benchmarks"]["sets"]
              if b["kind"] == "hub"}
    got = {c[c.index("download") + 1] if c[2] != "--repo-type" else c[4]: c[c.index("--revision") + 1]
           for c in commands}
    assert got == repos
    sharegpt = next(c for c in commands if "Aeala/ShareGPT_Vicuna_unfiltered" in c)
    assert "ShareGPT_V4.3_unfiltered_cleaned_split.json" in sharegpt and "dataset" in sharegpt
    # the target's revision is a commit, not a branch
    assert re.fullmatch(r"[0-9a-f]{40}", cfg["target"]["revision"])


# ---------------------------------------------------------------- smoke DAG through a real cluster


# Every rule of `all` goes through sbatch, but with 2 of the 6 variants and one seed: each sbatch
# job pays a Snakemake start inside it, and the whole smoke DAG this way took 709 s of CI. The
# paradigms left out run the same rules (the local smoke DAG test runs all six, two seeds).
SBATCH_VARIANTS = ("eagle3", "hybrid")   # e2e_timing's pair; eagle3 is also the one the scancel test retrains


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory):
    assert cluster_up(), "CI must start the test cluster (scripts/slurm_local.sh up)"
    wd = workdir(tmp_path_factory.mktemp("slurm"))
    full = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/smoke.yaml")])["drafters"]
    (wd / "sbatch.yaml").write_text(yaml.safe_dump({"drafters": {
        "seeds": [0], "variants": [v for v in full["variants"] if v["name"] in SBATCH_VARIANTS]},
        "scaling": {"variants": ["eagle3"]}}))   # the sweep may name only variants the config keeps
    proc = slurm_snakemake(wd, *PROFILE, "--configfile", "config/smoke.yaml", "sbatch.yaml", timeout=1500)
    return wd, proc


def slurm_snakemake(cwd, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`snakemake` through the test cluster (tests/slurm_snakemake.py: the status checks every 2 s),
    submitted without the portable numerics' variables (conftest sets them for the session's own
    processes; sbatch would carry them): the jobs must get them from the workflow's shell prefix."""
    return subprocess.run([*SLURM_SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=without_numerics())


@pytest.mark.slow
@needs_cluster
def test_smoke_dag_goes_through_sbatch(slurm_run, smoke_workdir):
    wd, proc = slurm_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", proc.stdout + proc.stderr)
    drafters = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/smoke.yaml"),
                            str(wd / "sbatch.yaml")])["drafters"]
    variants = [v["name"] for v in drafters["variants"]]
    assert tuple(variants) == SBATCH_VARIANTS and drafters["seeds"] == [0]
    # data, tokenizer, target, 3 captures (train, val, eval), continuations, e2e_timing, report;
    # per variant: one training job per seed, 3 evals (step-wise, e2e, benchmarks)
    jobs = 9 + (3 + len(drafters["seeds"])) * len(variants)
    assert len(ids) == jobs and len(set(ids)) == jobs       # every job but `all`, each its own sbatch
    for name in variants:
        assert json.loads((wd / f"results/eval/{name}/e2e.json").read_text())["lossless"] is True
    assert (wd / "figures/decay.pdf").exists() and (wd / "results/claims.json").exists()
    # the same outputs as a local run of the same stages: the session's smoke DAG working directory
    # (tests/pipeline/test_pipeline.py's run; when that test has not run, these three stages run here)
    local = smoke_workdir
    done = snakemake(local, "results/target/metrics.json", "--cores", "2", "--configfile", "config/smoke.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    for path in ("results/data/stats.json", "results/data/train.jsonl", "results/target/metrics.json"):
        a, b = (wd / path).read_text(), (local / path).read_text()
        if path.endswith("metrics.json"):   # timings differ; the numbers must not
            a, b = ({k: v for k, v in json.loads(x).items() if "seconds" not in k} for x in (a, b))
        assert a == b, path
    # the target's weights bit for bit, and every SLURM job in portable numerics from its environment
    weights = "results/target/model/model.safetensors"
    assert (wd / weights).read_bytes() == (local / weights).read_bytes()
    for log in sorted((wd / "logs").glob("*.log")):
        lines = numerics_lines(log)
        assert lines and all(x.endswith("; from the job's environment)") for x in lines), (log.name, lines)


@pytest.mark.slow
@needs_cluster
def test_scancel_mid_training_then_resubmit_resumes(slurm_run):
    wd, _ = slurm_run
    # no plateau stop and no held-out curve: the run must still be training when it is cancelled
    (wd / "long.yaml").write_text("drafters:\n  train:\n    max_steps: 400\n    ckpt_every: 20\n"
                                  "    plateau: null\n    eval_every: 0\n")
    args = ["results/drafters/eagle3/seed0", *PROFILE, "--configfile", "config/smoke.yaml", "sbatch.yaml", "long.yaml"]
    ckpt = wd / "results/drafters/eagle3/seed0.ckpt/checkpoint.pt"
    run = subprocess.Popen([*SLURM_SNAKEMAKE, *args], cwd=wd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
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
    assert not (wd / "results/drafters/eagle3/seed0/metrics.json").exists() or \
        json.loads((wd / "results/drafters/eagle3/seed0/metrics.json").read_text())["steps"] != 400
    again = slurm_snakemake(wd, *args, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = json.loads((wd / "results/drafters/eagle3/seed0/metrics.json").read_text())
    assert metrics["steps"] == 400 and metrics["resumed_from"] is not None and metrics["resumed_from"] >= 20
