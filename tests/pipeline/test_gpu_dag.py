"""benchmarks/gpu.py's smoke_dag figure, dry: the smoke DAG with `device=cuda` resolves in a
scratch directory (`snakemake -n`). The unit tier runs the rest of `gpu.py --dry` with
`--skip-dag` (tests/unit/test_attention_backends.py); this is the only check of that DAG."""
from __future__ import annotations

import json
import subprocess
import sys

from ..conftest import REPO

# in a fresh interpreter: gpu.py registers flop formulas that another module of this worker may
# already have registered (torch refuses a second registration)
SMOKE_DAG = ("import json, sys; sys.path[:0] = ['benchmarks']; import gpu; "
             "print(json.dumps(gpu.smoke_dag(True, 300.0)))")


def test_gpu_benchmark_smoke_dag_resolves_with_device_cuda():
    proc = subprocess.run([sys.executable, "-c", SMOKE_DAG], cwd=REPO, capture_output=True, text=True, timeout=600)
    # smoke_dag raises with the command and Snakemake's tail when the DAG fails
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["dry_run"] is True and row["seconds"] > 0
    assert "--configfile config/smoke.yaml" in row["command"] and "device=cuda" in row["command"] and " -n" in row["command"]
