"""scripts/slurm_local.sh is safe to name (issue 49): without KVSHOT_LOCAL_SLURM=1 it refuses in
one line, exit status 2, before it runs any command (every command it could run is a stub on PATH
that logs its call); an unknown action is refused the same way with the variable set. `up` and
`down` themselves act as root on the machine and are run only by CI (.ci/run)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ..conftest import REPO

SCRIPT = REPO / "scripts" / "slurm_local.sh"
COMMANDS = ("apt-get", "awk", "cat", "chmod", "chown", "cp", "dd", "grep", "hostname", "kill", "mkdir", "munged",
            "mv", "nproc", "pgrep", "pkill", "rm", "runuser", "scancel", "seq", "sinfo", "sleep", "slurmctld",
            "slurmd")


def run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    stubs, log = tmp_path / "bin", tmp_path / "calls.log"
    stubs.mkdir(exist_ok=True)
    for name in COMMANDS:
        stub = stubs / name
        stub.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {log}\n")
        stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k != "KVSHOT_LOCAL_SLURM"}
    proc = subprocess.run(["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                          env={**clean, "PATH": str(stubs), **env})
    return proc, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("action", ["up", "down", ""])
@pytest.mark.parametrize("ci", [None, "true"])
def test_refuses_without_the_variable_and_runs_nothing(tmp_path, action, ci):
    proc, calls = run(tmp_path, *([action] if action else []), **({"CI": ci} if ci else {}))
    assert proc.returncode == 2, proc
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "KVSHOT_LOCAL_SLURM=1" in proc.stderr
    assert calls == "", calls


def test_an_unknown_action_is_refused_before_anything_runs(tmp_path):
    proc, calls = run(tmp_path, "restart", KVSHOT_LOCAL_SLURM="1")
    assert proc.returncode == 2 and "usage" in proc.stderr, proc
    assert calls == "", calls


def test_the_first_comment_line_names_the_variable():
    first_comment = next(line for line in SCRIPT.read_text().splitlines() if line.startswith("# "))
    assert "KVSHOT_LOCAL_SLURM=1" in first_comment, first_comment
