# Helpers shared by every rule file. All stage logic lives in the kvshot package.
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

SRC = str(Path(workflow.basedir) / "src")
sys.path.insert(0, SRC)

from kvshot.checks import all_variants  # noqa: E402
from kvshot.train.curve import curve_seeds, unknown_variant  # noqa: E402
from kvshot.config import ConfigError, fill_defaults, stage_config, validate_config  # noqa: E402
from kvshot.core.numerics import shell_exports  # noqa: E402

SPLITS = ["train", "eval", "val"]   # val: the drafters' held-out curve and plateau stop (disjoint from eval)
VARIANTS = [v["name"] for v in config["drafters"]["variants"]]
# Every variant is trained once per seed (drafter init and data order); evaluation pools them
# and keeps each seed's record, so the verdicts carry the training variance.
SEEDS = [int(s) for s in config["drafters"].get("seeds") or [config["seed"]]]
# eval.shared_target_pass: the core variants' step-wise evaluation is one job (eval_stepwise_shared)
SHARED_STEPWISE = VARIANTS if config["eval"].get("shared_target_pass") else []
SOLO_STEPWISE = [v for v in VARIANTS if v not in SHARED_STEPWISE]
NO_MATCH = "(?!)"   # a wildcard constraint no name matches
SCALING_SEEDS = [int(s) for s in config["scaling"].get("seeds") or SEEDS[:1]]
CPU_ENV = "../../envs/cpu.yaml"
GPU_ENV = "../../envs/gpu.yaml"
# Rules that run the target or a drafter get the CUDA environment (CUDA torch, flash-attn)
# when the config asks for CUDA; data, tokenizer and report rules always run on CPU.
DEVICE_ENV = GPU_ENV if config["device"] == "cuda" else CPU_ENV


def _config_files():
    """Config files in merge order: the Snakefile's `configfile:`, then --configfile overlays."""
    overlays = [str(f) for f in getattr(workflow, "overwrite_configfiles", None) or []]
    base = [str(f) for f in getattr(workflow, "configfiles", []) if str(f) not in overlays]
    return base + overlays


try:
    validate_config(config, _config_files())
except ConfigError as exc:
    raise WorkflowError(f"invalid config: {exc}") from None
fill_defaults(config)   # what an omitted optional field means: the schema's `default`


# The package runs from this checkout in every job, local, conda or SLURM alike; Snakemake's
# own strict prefix stays first (a failing command in a pipe or an unset variable fails the job).
# CUDA's caching allocator grows segments instead of caching odd-sized blocks, which packed
# shapes that change every step would fragment (docs/paper-scale.md: the memory allowance);
# a value the caller set wins. A profile cannot set a job's environment (the SLURM plugin
# forbids --export in slurm_extra; `envvars` only forwards the submitting shell's values).
# (the prefix is formatted like a shell command: its literal braces are doubled once more)
# `numerics: portable` (kvshot.core.numerics): AVX2 kernels in ATen, MKL and oneDNN, exported here
# so that every job and every process it starts (accelerate's ranks) reads them before torch.
shell.prefix(f"set -euo pipefail; export PYTHONPATH={SRC}${{{{PYTHONPATH:+:$PYTHONPATH}}}}; "
             "export PYTORCH_CUDA_ALLOC_CONF=${{PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}; "
             + shell_exports(config["numerics"]))


def stage_params(*sections):
    """The config a stage depends on, as JSON: changing it reruns that stage only."""
    return json.dumps(stage_config(config, *sections), sort_keys=True)


def variant_params(*sections):
    """stage_params for a job of one drafter variant: drafters.variants holds only that
    variant's entry, so adding or editing a variant reruns its own jobs alone. A block variant
    or gate remedy (blockwise.variants / remedies, blockwise.smk) is looked up there."""

    return lambda wildcards: _variants_params(sections, [wildcards.variant])


def _variants_params(sections, names):
    """stage_params with drafters.variants holding only the entries of `names`."""
    cfg = stage_config(config, *sections)
    own = [v for _, v in all_variants(config) if v["name"] in names]
    cfg["drafters"] = {**cfg["drafters"], "variants": own}   # (stage_config leaves group_training out)
    return json.dumps(cfg, sort_keys=True)


class TrainGroups:
    """drafters.group_training for one set of variants (kvshot.checks.training_groups): the groups
    that train side by side (a train_drafter_group job each, under <root>/.groups/<group>/seed<N>,
    members joined by '+'), and the variants that train alone (train_drafter)."""

    def __init__(self, names, among=None):
        """among: group only these of names (the scaling sweep's variants); the rest train alone."""
        from kvshot.checks import training_groups

        self.groups = training_groups(config["drafters"].get("group_training"), [v for v in names if among is None or v in among])
        self.of = {v: "+".join(g) for g in self.groups for v in g}
        self.alone = [v for v in names if v not in self.of]

    def alone_pattern(self):
        return "|".join(re.escape(v) for v in self.alone) or NO_MATCH

    def grouped_pattern(self):
        return "|".join(re.escape(v) for v in self.of) or NO_MATCH

    def group_pattern(self):
        return "|".join(re.escape("+".join(g)) for g in self.groups) or NO_MATCH

    def folder(self, root):
        """The input function of a grouped variant's drafter: its group's job folder under root."""

        def folder(wildcards):
            return f"{root.format(**wildcards)}/.groups/{self.of[wildcards.variant]}/seed{wildcards.seed}"

        return folder


def group_params(*sections):
    """variant_params for a group job: drafters.variants holds its members' entries."""

    return lambda wildcards: _variants_params(sections, wildcards.group.split("+"))


def group_checkpoints(wildcards, output):
    """Where a group job keeps each member's checkpoint, <root>/<variant>/seed<N>.ckpt: where a job
    of that drafter alone keeps it (its output is <root>/.groups/<group>/seed<N>)."""
    return str(Path(output[0]).parents[2])


def group_variants(wildcards):
    return " ".join(wildcards.group.split("+"))


def split_jsonl(wildcards):
    """The split file a features job reads: for train, the target's own answers when
    data.regenerate.enabled; the prepared split otherwise."""
    if wildcards.split == "train" and config["data"].get("regenerate", {}).get("enabled", False):
        return "results/data/regenerated/train.jsonl"
    return f"results/data/{wildcards.split}.jsonl"


# published heads (published.smk, config `published.heads`; none in the default config)
PUBLISHED = {h["name"]: h for h in (config.get("published") or {}).get("heads", [])}
PUBLISHED_NAMES = "|".join(PUBLISHED) or "(?!)"   # (?!): none configured (the default config)


def published_params(*sections):
    """stage_params for one published head: its variant alone and its publisher's decoding."""
    from kvshot.interop.head_stage import head_stage_config

    def params(wildcards):
        return json.dumps(head_stage_config(stage_config(config, *sections), PUBLISHED[wildcards.variant]),
                          sort_keys=True)

    return params


def log_path(rule_name, suffix=""):
    return f"logs/{rule_name}{suffix}.log"


def bench_path(rule_name, suffix=""):
    return f"results/benchmarks/rules/{rule_name}{suffix}.tsv"


def train_launcher():
    """`python -m kvshot`, or DDP over `drafters.train.num_processes` through accelerate on a
    port the job picks when it runs (kvshot.train.launch)."""
    from kvshot.train.launch import launcher_command

    return launcher_command(config["drafters"]["train"]["num_processes"])


def torch_threads():
    """The torch threads of a job that runs the config's `threads` (the target): under portable
    numerics that count whatever cores Snakemake has (a reduction's digits depend on the thread
    count: fewer cores run slower, not differently); native: at most --cores, as `threads:` is.
    A value, not a params function of `threads`, which the SLURM profile's dry run cannot size."""
    if config["numerics"] == "portable":
        return config["threads"]
    return min(config["threads"], workflow.cores or config["threads"])


def train_rank_threads():
    """torch threads per training process (kvshot.train.launch.rank_threads)."""
    from kvshot.train.launch import rank_threads

    return rank_threads(config["device"], config["threads"])


def gpus(processes=1):
    """GPUs a job uses: one per process it launches with `device: cuda`, else none (`auto` may
    fall back to the CPU). A workstation run with `--resources gpu=1` then runs the GPU jobs
    one at a time; the SLURM executor books them (`--gpus`)."""
    return processes if config["device"] == "cuda" else 0


def capture_gpus():
    """Offline: the target's forwards, one GPU on CUDA (`gpus`). Online: tokenizing and indexing
    only (the trainer runs the target; this stage reads its config), so no GPU."""
    return gpus() if config["features"]["mode"] == "offline" else 0


def train_gpus():
    """A training job's GPUs: one per DDP process (drafters.train.num_processes) on CUDA."""
    return gpus(config["drafters"]["train"]["num_processes"])


def train_mem_mb():
    """A training job's host memory: ~40 GB per CUDA process (each stages the target, plus
    data: docs/paper-scale.md); 6 GB on CPU."""
    return 40000 * train_gpus() if train_gpus() else 6000


def train_threads():
    """A training job's threads: every process's own; the SLURM profile books them as
    cpus_per_gpu instead (its cpus per GPU = the config's `threads`)."""
    return config["drafters"]["train"]["num_processes"] * train_rank_threads()


def job_variants(wildcards):
    """The drafters.variants entries a training job trains: its variant, or its group's members."""
    group = getattr(wildcards, "group", None)
    names = group.split("+") if group else [wildcards.variant]
    return [v for v in config["drafters"]["variants"] if v["name"] in names]


def scaling_overlay(wildcards):
    """The data-scaling sweep's change, as `--config` words: train on the first N captured
    samples, for the steps that give every N the epochs the largest N gets at
    drafters.train.max_steps (kvshot.train.launch.scaled_steps)."""
    import shlex

    from kvshot.train.launch import scaled_steps

    for own in job_variants(wildcards):
        if "max_steps" in own.get("train", {}):
            raise WorkflowError(f"config: drafters.variants.{own['name']}.train.max_steps: the scaling sweep "
                                "scales drafters.train.max_steps; a variant's own max_steps would escape it")
    n = int(wildcards.n)
    steps = scaled_steps(config["drafters"]["train"]["max_steps"], n, max(config["scaling"]["train_samples"]))
    overlay = {"drafters": {"train": {"train_samples": n, "max_steps": steps}}}
    return f" --config {shlex.quote(json.dumps(overlay, sort_keys=True))}"


def refuse_own_train(wildcards, keys, target):
    """A target that sets drafters.train.<key> for its jobs refuses a variant's own value of it."""
    for own in job_variants(wildcards):
        for key in keys:
            if key in own.get("train", {}):
                raise WorkflowError(f"config: drafters.variants.{own['name']}.train.{key}: the {target} target sets "
                                    f"drafters.train.{key}; a variant's own would escape it")


def plateau_overlay(wildcards):
    """The change against train_drafter, as `--config` words: more steps at most, a validation
    point every plateau.eval_every steps, and plateau.rule as drafters.train.plateau."""
    import shlex

    plateau = config.get("plateau") or {}
    if not plateau:
        raise WorkflowError("config: plateau: missing (max_steps, eval_every, rule): the plateau target needs it")
    refuse_own_train(wildcards, ("max_steps", "eval_every", "plateau"), "plateau")
    train = {"max_steps": plateau["max_steps"], "eval_every": plateau["eval_every"], "plateau": plateau["rule"]}
    return f" --config {shlex.quote(json.dumps({'drafters': {'train': train}}, sort_keys=True))}"


# the learning curve (curve.smk, config `curve`; not part of `all`)
CURVE = config.get("curve") or {}
CURVE_VARIANTS = list(CURVE.get("variants") or [])
CURVE_SEEDS = curve_seeds(CURVE.get("seeds"), config["drafters"].get("seeds"), config["seed"])


def curve_section():
    if not CURVE:
        raise WorkflowError("config: curve: missing (variants, tokens, points): the curve target needs it")
    problem = unknown_variant(CURVE_VARIANTS, VARIANTS)
    if problem:
        raise WorkflowError(f"config: {problem}")
    return CURVE


def curve_capture_overlay(wildcards):
    """The curve's train features: curve.train_samples captured samples (null: features.max_samples)."""
    import shlex

    n = curve_section().get("train_samples")
    return f" --config {shlex.quote(json.dumps({'features': {'max_samples': n}}))}" if n else ""


def curve_overlay(wildcards):
    """drafters.train's change for one curve drafter, as `--config` words (kvshot.train.curve)."""
    import shlex

    from kvshot.train.curve import CURVE_SETS, curve_train

    curve = curve_section()
    refuse_own_train(wildcards, CURVE_SETS, "curve")
    (own,) = job_variants(wildcards)
    train = curve_train(curve, {**config["drafters"]["train"], **own.get("train", {})})
    return f" --config {shlex.quote(json.dumps({'drafters': {'train': train}}, sort_keys=True))}"


def local_data_files(sources):
    """The local files a list of data sources reads (`sharegpt_file` paths, and a hub entry's
    `data_files` when they all exist here, as kvshot.data.sources loads them). Made inputs, editing one
    reruns the job that reads it and everything below. Hub names and packaged data are not
    files here."""
    files = []
    for src in sources:
        if src.get("kind") == "sharegpt_file":
            files.append(src["path"])
        elif src.get("kind") == "hub" and src.get("data_files") is not None:
            listed = [src["data_files"]] if isinstance(src["data_files"], str) else list(src["data_files"])
            if all(Path(f).exists() for f in listed):
                files.extend(listed)
    return files


def drafter_seeds(root, seeds):
    """The input function for a variant's drafter folders, one per training seed, under root."""

    def folders(wildcards):
        return [f"{root.format(**wildcards)}/seed{seed}" for seed in seeds]

    return folders


def stepwise_inputs(drafters):
    """eval_stepwise's inputs (and its `use rule` copies'): `drafters` (a folder pattern, or
    drafter_seeds(...)), then the target, the reference chains and the features index it reads."""
    return dict(drafters=drafters, target="results/target/model", continuations="results/eval/continuations.json",
                natural="results/eval/natural.json", features="results/features/eval")


def decode_inputs(**drafters):
    """eval_e2e's and e2e_timing's inputs: the drafters (by their input names), then the target,
    the natural-protocol prefixes they decode from and the features index."""
    return drafters | dict(target="results/target/model", prompts="results/eval/natural.json",
                           features="results/features/eval")


def _timed_variant(paradigm):
    """The variant the claims give this role (report.results.roles): the shallowest hidden-only
    drafter (EAGLE-3), the first hybrid."""
    found = [v for v in config["drafters"]["variants"] if v["paradigm"] == paradigm]
    return min(found, key=lambda v: v.get("layers", 1))["name"] if found else None


# EAGLE-3 and the hybrid, timed in one job for the E2E claim's drafting overhead (none: no such pair)
E2E_TIMED = [n for n in (_timed_variant("hidden"), _timed_variant("hybrid")) if n]
E2E_TIMED = E2E_TIMED if len(E2E_TIMED) == 2 else []


def e2e_timing_params(wildcards):
    """stage_params with drafters.variants cut to the two timed variants: editing another variant
    does not rerun this job."""
    cfg = stage_config(config, "target", "drafters", "eval")
    cfg["drafters"] = {**cfg["drafters"], "variants": [v for v in cfg["drafters"]["variants"] if v["name"] in E2E_TIMED]}
    return json.dumps(cfg, sort_keys=True)
