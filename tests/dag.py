"""Running Snakemake in a scratch directory that sees the repo's workflow (both tiers use it)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from .conftest import REPO

LINKED = ("Snakefile", "workflow", "profiles", "config", "envs", "src")


def workdir(tmp_path: Path) -> Path:
    """A fresh working directory that sees the repo's workflow but writes its own results/."""
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def snakemake(cwd: Path, *args: str, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["snakemake", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def dry_run_jobs(cwd: Path, *configfiles: str) -> dict[str, int]:
    extra = ["--configfile", *configfiles] if configfiles else []
    proc = snakemake(cwd, "-n", "--cores", "1", *extra)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    out = proc.stdout + proc.stderr
    assert "warning" not in out.lower(), out
    return job_counts(out)


def job_counts(out: str) -> dict[str, int]:
    """{rule: jobs} of the first "Job stats:" table Snakemake printed (a dry run's or a run's plan)."""
    table = out[out.index("Job stats:"):]
    table = table[: table.index("total") + 5] if "total" in table else table
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def without_numerics() -> dict:
    """This environment without the portable numerics' variables (tests/conftest.py sets them for
    the session's own processes): a Snakemake run started with it shows what its jobs get from the
    workflow's shell prefix alone."""
    from kvshot.core.numerics import PORTABLE_ENV

    return {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}


def numerics_lines(log: Path) -> list[str]:
    """A job log's `numerics: ...` lines (each kvshot stage opens with one)."""
    return [x for x in log.read_text().splitlines() if x.startswith("numerics: ")]
