"""A separate virtual environment with vLLM's `speculators` library, built once and cached.

`speculators` pins older transformers/datasets than kvshot, so it never enters the project's
environment: its own venv holds the CPU torch wheel, the pinned libraries its converter and
model code import, and `speculators` itself without its other dependencies (vLLM clients,
training extras). The first build takes a few minutes (PyPI); later runs reuse it.

Location: $KVSHOT_SPECULATORS_VENV, else ~/.cache/kvshot/speculators-<hash of the pins>.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SPECULATORS = "speculators==0.9.0"
# what speculators 0.9.0's convert/eagle and models/eagle3 import (transitively, through its
# package __init__), at versions inside its own pins; torch is the CPU wheel (an unpinned
# torch pulls a multi-GB CUDA build)
REQUIREMENTS = [
    "torch==2.13.0",
    "transformers==5.19.0",
    "datasets==5.1.0",
    "pydantic==2.14.4",
    "pydantic-settings==2.16.3",
    "loguru==0.7.3",
    "openai==3.57.0",
    "hs-connectors==0.9.0",
]
SCRIPT = Path(__file__).with_name("speculators_eagle3.py")


def venv_dir() -> Path:
    if os.environ.get("KVSHOT_SPECULATORS_VENV"):
        return Path(os.environ["KVSHOT_SPECULATORS_VENV"])
    pins = hashlib.sha256("\n".join([SPECULATORS, *REQUIREMENTS]).encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "kvshot" / f"speculators-{pins}"


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=clean_env())
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"building the speculators venv failed ({' '.join(cmd[:4])} ...); log {log}:\n"
                           + "\n".join(tail))


def clean_env() -> dict:
    """The environment without this project's paths, so the venv sees only its own packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"   # every file it reads is local
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def ensure_venv() -> Path:
    """The venv's python, building the venv first if it is not there (one builder at a time)."""
    root = venv_dir()
    python = root / "bin" / "python"
    if (root / "READY").is_file():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "READY").is_file():   # another process built it meanwhile
            return python
        shutil.rmtree(root, ignore_errors=True)   # a build cut short: start over (READY is written last)
        log = root.parent / f"{root.name}.log"
        log.write_text("")
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(root)], log)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run(pip + [REQUIREMENTS[0]], log)            # torch first: the CPU wheel
        _run(pip + REQUIREMENTS[1:], log)
        _run(pip + ["--no-deps", SPECULATORS], log)
        _run([str(python), "-c", "import speculators.convert.eagle, speculators.models.eagle3"], log)
        (root / "READY").write_text("\n".join([SPECULATORS, *REQUIREMENTS]) + "\n")
    return python


def write_inputs(batch: dict, path: Path) -> Path:
    """One sequence of a feature batch as speculators' forward takes it: kvshot's anchor t reads
    x_{t+1} at position t+1, and speculators takes that pairing as its input."""
    import torch
    from safetensors.torch import save_file

    n = batch["input_ids"].shape[1]
    save_file({"hidden_states": batch["aux_hidden"][:, : n - 1].flatten(-2).float().contiguous(),
               "input_ids": batch["input_ids"][:, 1:].long().contiguous(),
               "position_ids": torch.arange(1, n)[None].contiguous()}, str(path))
    return path


def run_script(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run tests/speculators_eagle3.py in the speculators venv."""
    python = ensure_venv()
    return subprocess.run([str(python), str(SCRIPT), *args], capture_output=True, text=True, env=clean_env(),
                          timeout=timeout)


if __name__ == "__main__":   # .ci/run builds it in the background while the install and first tests run
    print(ensure_venv())
