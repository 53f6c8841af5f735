"""benchmarks/gpu.py's smoke_dag figure, dry: the smoke DAG with `device=cuda` resolves in a
scratch directory (`snakemake -n`). The unit tier runs the rest of `gpu.py --dry` with
`--skip-dag` (tests/unit/test_attention_backends.py); this is the only check of that DAG."""
from __future__ import annotations

import importlib.util

from ..conftest import REPO


def test_gpu_benchmark_smoke_dag_resolves_with_device_cuda(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))   # its sibling modules, as when run as a script
    spec = importlib.util.spec_from_file_location("kvshot_gpu_benchmark", REPO / "benchmarks/gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    row = gpu.smoke_dag(True, 300.0)   # raises with the command and Snakemake's tail when the DAG fails
    assert row["dry_run"] is True and row["seconds"] > 0
    assert "--configfile config/smoke.yaml" in row["command"] and "device=cuda" in row["command"] and " -n" in row["command"]
