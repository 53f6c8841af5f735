"""The job environments: the pins in envs/*.yaml agree with pyproject.toml, every rule runs in
one of those env files, and rules that run the target or a drafter get the GPU env when the
config asks for CUDA (the rule -> env mapping is read from Snakemake's own workflow object)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from ..conftest import REPO

# the rules whose jobs load the target or a drafter: GPU jobs at paper scale
DEVICE_RULES = {"target", "capture_features", "target_continuations", "train_drafter", "eval_stepwise",
                "eval_stepwise_shared",
                "eval_e2e", "e2e_timing", "scaling_train", "scaling_stepwise", "regenerate_data", "blockwise_train",
                "blockwise_stepwise", "blockwise_e2e", "plateau_train", "plateau_stepwise", "plateau_e2e",
                "plateau_e2e_timing", "published_stepwise", "published_e2e", "published_benchmarks", "eval_benchmarks", "drift_train",
                "drift_stepwise", "drift_e2e", "train_drafter_group", "scaling_train_group", "plateau_train_group",
                "blockwise_train_group", "drift_train_group", "curve_capture", "curve_train", "serve_vllm"}   # *_group: drafters.group_training
# a grouped drafter's folder, hard links into its group's (drafters.group_training): a `run:` rule on the
# submitting host (localrules), no SLURM job
LOCAL_RULES = {"drafter_from_group", "scaling_drafter_from_group", "plateau_drafter_from_group",
               "blockwise_drafter_from_group", "drift_drafter_from_group"}
OPTIONAL_RULES = {"regenerate_data", "export_eagle3", "export_dflash", "eval_stepwise_shared", "blockwise_train", "blockwise_stepwise", "blockwise_e2e",
                  "blockwise_report", "plateau_train", "plateau_stepwise", "plateau_e2e", "plateau_e2e_timing",
                  "plateau_report", "import_published", "published_stepwise", "published_e2e",
                  "published_benchmarks", "published_table", "drift_train", "drift_stepwise", "drift_e2e", "drift_report",
                  "plateau_train_group", "blockwise_train_group", "drift_train_group", "curve_capture", "curve_train",
                  "curve_report", "serve_vllm"}   # not behind `all`: asked for by config or by target
CPU_RULES = {"prepare_data", "train_tokenizer", "report", "scaling_report", "export_eagle3", "export_dflash", "blockwise_report",
             "plateau_report", "import_published", "published_table", "drift_report", "curve_report"}

# rules that run in a serving engine's own environment (its pins differ from the project's): the
# env files on CUDA and on CPU, in place of gpu.yaml and cpu.yaml
ENGINE_ENVS = {"serve_vllm": ("vllm-cuda.yaml", "vllm-cpu.yaml")}
ENGINE_ENV_FILES = {f for pair in ENGINE_ENVS.values() for f in pair}


def device_env(rule: str, cuda: bool) -> str:
    """The env file name a rule runs in, with the config's device on CUDA or on CPU."""
    if rule in ENGINE_ENVS:
        return ENGINE_ENVS[rule][0 if cuda else 1]
    return "gpu.yaml" if cuda and rule in DEVICE_RULES else "cpu.yaml"


RULE_ENVS = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings
with SnakemakeApi(OutputSettings()) as api:
    wf = api.workflow(resource_settings=ResourceSettings(),
                      config_settings=ConfigSettings(configfiles=[Path(a) for a in sys.argv[1:]]),
                      snakefile=Path("Snakefile"), workdir=Path.cwd())._workflow
    envs = {r.name: "localrule" if r.name in wf._localrules else
            r.conda_env and str((Path(r.snakefile).parent / r.conda_env).resolve()) for r in wf.rules}
print("RULE_ENVS " + json.dumps(envs))
"""


def _pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(==|>=)\s*([^\s;#]+)", line)
        if m:
            out[m.group(1).lower()] = m.group(2) + m.group(3)
    return out


def _pip(env: Path) -> list[str]:
    deps = yaml.safe_load(env.read_text())["dependencies"]
    return next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)


def rule_envs(cwd: Path, *configfiles: str) -> dict[str, str | None]:
    """{rule: absolute env file} as the workflow loaded with these config overlays sees it."""
    proc = subprocess.run([sys.executable, "-c", RULE_ENVS, *configfiles], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RULE_ENVS "))
    return json.loads(line.removeprefix("RULE_ENVS "))


def test_env_pins_match_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = _pins(project["dependencies"])
    for orchestrator in ("snakemake", "snakemake-executor-plugin-slurm"):   # runs outside the job envs
        wanted.pop(orchestrator)
    for env in sorted((REPO / "envs").glob("*.yaml")):
        if env.name in ENGINE_ENV_FILES:   # vLLM's pins: tests/unit/test_serve.py checks the ones shared
            continue
        pins = _pins(_pip(env))
        for name, pin in wanted.items():
            assert pins.get(name) == pin, f"{env.name}: {name} pinned {pins.get(name)}, pyproject says {pin}"


def test_every_env_entry_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ranges = {k: v for k, v in _pins(project["dependencies"]).items() if v.startswith(">=")}
    for env in sorted((REPO / "envs").glob("*.yaml")):
        for line in _pip(env):
            if env.name in ENGINE_ENV_FILES and (line.startswith("--extra-index-url ")
                                                 or line.split()[0].split(">=")[0] in ("torchaudio", "torchvision",
                                                                                       "torchcodec")):
                continue   # vllm-cpu.yaml: PyTorch's CPU index, and the three builds pip matches to its torch there
            pins = _pins([line])
            assert pins, f"{env.name}: {line!r} has no version"
            ((name, pin),) = pins.items()
            assert pin.startswith("==") or ranges.get(name) == pin, f"{env.name}: {line!r} is not pinned exactly"


def test_gpu_env_builds_flash_attn_after_torch(tmp_path):
    # in the pip section flash-attn's isolated build cannot import torch: it must not be there,
    # and the post-deploy script Snakemake runs in the new env installs the pyproject pin
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    flash = _pins(extra)["flash-attn"]
    assert "flash-attn" not in _pins(_pip(REPO / "envs/gpu.yaml"))
    script = REPO / "envs/gpu.post-deploy.sh"
    text = script.read_text()
    assert f'"flash-attn{flash}"' in text and "--no-build-isolation" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    skip = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "KVSHOT_SKIP_FLASH_ATTN": "1"})
    assert skip.returncode == 0 and "no flash-attn" in skip.stdout


# what the implicit workflow profile may set: right for every run it merges into
DEFAULT_PROFILE_KEYS = {"rerun-incomplete"}


