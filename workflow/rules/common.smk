# Helpers shared by every rule file. All stage logic lives in the kvshot package.
import json
import sys
from pathlib import Path

SRC = str(Path(workflow.basedir) / "src")
sys.path.insert(0, SRC)

from kvshot.config import ConfigError, stage_config, validate_config  # noqa: E402

SPLITS = ["train", "eval"]
VARIANTS = [v["name"] for v in config["drafters"]["variants"]]
CPU_ENV = "../../envs/cpu.yaml"


def _config_files():
    """Config files in merge order: the Snakefile's `configfile:`, then --configfile overlays."""
    overlays = [str(f) for f in getattr(workflow, "overwrite_configfiles", None) or []]
    base = [str(f) for f in getattr(workflow, "configfiles", []) if str(f) not in overlays]
    return base + overlays


try:
    validate_config(config, _config_files())
except ConfigError as exc:
    raise WorkflowError(f"invalid config: {exc}") from None


# The package runs from this checkout in every job, local, conda or SLURM alike.
shell.prefix(f"export PYTHONPATH={SRC}:$PYTHONPATH; ")


def stage_params(*sections):
    """The config a stage depends on, as JSON: changing it reruns that stage only."""
    return json.dumps(stage_config(config, *sections), sort_keys=True)


def variant_params(*sections):
    """stage_params for a job of one drafter variant: drafters.variants holds only that
    variant's entry, so adding or editing a variant reruns its own jobs alone."""

    def params(wildcards):
        cfg = stage_config(config, *sections)
        own = [v for v in config["drafters"]["variants"] if v["name"] == wildcards.variant]
        cfg["drafters"] = {**cfg["drafters"], "variants": own}
        return json.dumps(cfg, sort_keys=True)

    return params


def log_path(rule_name, suffix=""):
    return f"logs/{rule_name}{suffix}.log"


def bench_path(rule_name, suffix=""):
    return f"results/benchmarks/rules/{rule_name}{suffix}.tsv"


def train_launcher():
    """One process, or DDP over `drafters.train.num_processes` through accelerate."""
    from kvshot.train import launcher_args

    n = config["drafters"]["train"]["num_processes"]
    if n == 1:
        return "python -m kvshot"
    return " ".join(["accelerate launch", *launcher_args(n), "-m kvshot"])


def scaling_overlay(wildcards):
    """The data-scaling sweep's one change: train on the first N captured samples."""
    return json.dumps({"drafters": {"train": {"train_samples": int(wildcards.n)}}})
