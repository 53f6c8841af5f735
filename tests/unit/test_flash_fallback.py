"""flash-attn is optional: the target's "auto" attention tries to import it and falls back to
SDPA, with one warning line, when it is missing or broken; the GPU env's post-deploy script
never fails on it and says which attention the target will use."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshot.capture import target

from ..conftest import REPO

SCRIPT = REPO / "envs/gpu.post-deploy.sh"


@pytest.fixture
def fresh_probe(monkeypatch):
    """A process that has not tried flash-attn yet, and no flash_attn module left behind."""
    def reset():
        target.flash_attn_problem.cache_clear()
        target._warned.clear()
        sys.modules.pop("flash_attn", None)
    reset()
    yield
    reset()


def fake_flash_attn(root: Path, body: str) -> Path:
    (root / "flash_attn").mkdir(parents=True)
    (root / "flash_attn/__init__.py").write_text(body)
    return root


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_missing_flash_attn_falls_back_to_sdpa_with_one_warning(fresh_probe, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_attn", None)   # not importable, whatever is installed
    assert [target.attn_implementation("auto", "cuda") for _ in range(3)] == ["sdpa"] * 3
    (line,) = warnings_in(capsys.readouterr().err)
    assert "flash-attn is not installed" in line and "SDPA" in line
    # what the config names explicitly, and any CPU run, is taken as is: no probe, no warning
    assert target.attn_implementation("eager", "cuda") == "eager"
    assert target.attn_implementation("flash_attention_2", "cuda") == "flash_attention_2"
    assert target.attn_implementation("auto", "cpu") == "sdpa"
    assert not warnings_in(capsys.readouterr().err)


@pytest.mark.parametrize("error", [
    'ImportError("/env/lib/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDevice")',
    'RuntimeError("CUDA driver version is insufficient")',
])
def test_flash_attn_that_raises_on_import_falls_back_to_sdpa(fresh_probe, monkeypatch, tmp_path, capsys, error):
    monkeypatch.syspath_prepend(str(fake_flash_attn(tmp_path, f"raise {error}\n")))
    assert target.attn_implementation("auto", "cuda") == "sdpa"
    assert target.attn_implementation("auto", "cuda") == "sdpa"   # tried once per process
    (line,) = warnings_in(capsys.readouterr().err)
    kind, message = error.split("(", 1)
    assert f"fails to import ({kind}: {message[1:30]}" in line and "SDPA" in line, line


def test_a_working_flash_attn_is_used_on_cuda_only(fresh_probe, monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(fake_flash_attn(tmp_path, '__version__ = "2.8.3"\n')))
    assert target.attn_implementation("auto", "cuda") == "flash_attention_2"
    assert target.attn_implementation("auto", "cpu") == "sdpa"
    assert not warnings_in(capsys.readouterr().err)


# ------------------------------------------------------------------ envs/gpu.post-deploy.sh

SHIM = """#!/usr/bin/env bash
# `python` for the post-deploy script: records its calls; pip exits SHIM_WHEEL_RC for a wheel,
# SHIM_PIP_RC otherwise; the torch CUDA query answers SHIM_TORCH_CUDA; anything else runs the
# real interpreter
echo "$*" >> "$SHIM_LOG"
if [ "$1" = -m ] && [ "$2" = pip ] && [[ "$*" == *.whl ]]; then exit "${SHIM_WHEEL_RC:-1}"; fi
if [ "$1" = -m ] && [ "$2" = pip ]; then exit "${SHIM_PIP_RC:-1}"; fi
if [ "$1" = -c ] && [[ "$2" == *torch.version.cuda* ]]; then echo "${SHIM_TORCH_CUDA:-none}"; exit 0; fi
exec %s "$@"
"""


def post_deploy(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script with a recording `python` first on PATH, no nvcc, no CUDA_HOME."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(SHIM % sys.executable)
    (bin_dir / "python").chmod(0o755)
    log = tmp_path / "python-calls.log"
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "PYTHONPATH", "KVSHOT_SKIP_FLASH_ATTN")}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**base, "PATH": f"{bin_dir}:/usr/bin:/bin", "SHIM_LOG": str(log), **env})
    return proc, log.read_text().splitlines() if log.exists() else []


def fake_cuda_home(root: Path, release: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include/cuda_runtime.h").write_text("")
    nvcc = root / "bin/nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "Cuda compilation tools, release {release}, V{release}.1"\n')
    nvcc.chmod(0o755)
    return root


def test_post_deploy_without_wheel_or_nvcc_builds_the_env_on_sdpa(tmp_path):
    proc, calls = post_deploy(tmp_path)   # a CPU torch here: no CUDA wheel is guessed
    assert proc.returncode == 0, proc.stderr
    assert "no nvcc/CUDA_HOME to build flash-attn from source: skipped" in proc.stdout
    assert not [c for c in calls if c.startswith("-m pip")]
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "gpu.post-deploy.sh: target attention (target.attn_implementation: auto): sdpa (flash-attn does not import")


def test_post_deploy_survives_a_failed_wheel_and_a_mismatched_nvcc(tmp_path):
    cuda = fake_cuda_home(tmp_path / "cuda", "13.0")
    proc, calls = post_deploy(tmp_path, KVSHOT_FLASH_ATTN_WHEEL="https://example.invalid/flash_attn.whl",
                              CUDA_HOME=str(cuda), SHIM_TORCH_CUDA="12")
    assert proc.returncode == 0, proc.stderr
    assert [c for c in calls if c.startswith("-m pip")] == [
        "-m pip install --no-deps --retries 1 --timeout 30 https://example.invalid/flash_attn.whl"]
    assert "no prebuilt flash-attn wheel" in proc.stdout
    assert "is CUDA 13, torch is built for CUDA 12: flash-attn not built" in proc.stdout
    assert "): sdpa (" in proc.stdout.strip().splitlines()[-1]


def test_post_deploy_removes_a_build_that_does_not_import(tmp_path):
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8")
    proc, calls = post_deploy(tmp_path, KVSHOT_FLASH_ATTN_WHEEL="flash_attn.whl", CUDA_HOME=str(cuda),
                              SHIM_TORCH_CUDA="12", SHIM_PIP_RC="0", MAX_JOBS="2")
    assert proc.returncode == 0, proc.stderr
    pips = [c for c in calls if c.startswith("-m pip")]
    assert pips == ["-m pip install --no-deps --retries 1 --timeout 30 flash_attn.whl",
                    "-m pip install --no-build-isolation --no-deps flash-attn==2.8.3.post2",
                    "-m pip uninstall -y flash-attn"]
    assert f"building flash-attn==2.8.3.post2 with {cuda}/bin/nvcc (MAX_JOBS=2)" in proc.stdout
    assert "installed but does not import: removing it" in proc.stdout
    assert "): sdpa (" in proc.stdout.strip().splitlines()[-1]


def test_post_deploy_reports_flash_attn_when_it_imports(tmp_path):
    fake_flash_attn(tmp_path / "site", '__version__ = "2.8.3"\n')
    proc, _ = post_deploy(tmp_path, KVSHOT_FLASH_ATTN_WHEEL="flash_attn.whl", SHIM_WHEEL_RC="0",
                          PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].endswith("): flash_attention_2 (flash-attn 2.8.3)")
