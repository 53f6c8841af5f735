"""benchmarks/pipeline.py on a run's files: wall from the log, peak memory and the training share
of CPU-seconds from the `benchmark:` files, OK only when every target holds."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import REPO

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def fake_run(root, jobs: dict[str, tuple[float, float, float]], minutes: int):
    rules = root / "results/benchmarks/rules"
    rules.mkdir(parents=True)
    for stem, (wall, rss_mb, cpu) in jobs.items():
        (rules / f"{stem}.tsv").write_text(HEADER + f"{wall}\t0:00:01\t{rss_mb}\t1\t1\t1\t1\t1\t50\t{cpu}\n")
    log = root / ".snakemake/log"
    log.mkdir(parents=True)
    (log / "2026-12-05T000000.snakemake.log").write_text(
        "[Sat Dec  5 01:00:00 2026]\nrule prepare_data:\n"
        f"[Sat Dec  5 {1 + minutes // 60:02d}:{minutes % 60:02d}:00 2026]\nFinished job 0.\n")


def run(root, *args):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/pipeline.py"), *args],
                          cwd=root, capture_output=True, text=True)
    return proc.returncode, proc.stdout.strip().splitlines()[-1], json.loads((root / "results/benchmarks/pipeline.json").read_text())


@pytest.mark.parametrize("train_cpu,share_ok", [(1500.0, True), (1400.0, False)])
def test_the_training_share_is_a_target_when_asked(tmp_path, train_cpu, share_ok):
    # 1,000 CPU-s elsewhere: 1,500 in training is 60.0%, 1,400 is 58.3%
    fake_run(tmp_path, {"capture_features_train": (400.0, 3000.0, 600.0), "eval_e2e_eagle3": (300.0, 2000.0, 400.0),
                        "train_drafter_eagle3_seed0": (800.0, 5000.0, train_cpu / 2),
                        "train_drafter_group_kv-d1+kv-d2_seed0": (800.0, 4000.0, train_cpu / 2)}, minutes=100)
    code, last, out = run(tmp_path, "--wall-minutes", "120")
    assert code == 0 and last.endswith("OK") and f"training {train_cpu:.0f} of {1000 + train_cpu:.0f} CPU-s" in last
    assert out["training_share"] == pytest.approx(train_cpu / (1000 + train_cpu)) and out["training_share_target"] is None
    code, last, out = run(tmp_path, "--wall-minutes", "120", "--train-share", "0.6")
    assert (code == 0) == share_ok and last.endswith("OK" if share_ok else "MISSED") and "/ target 60%" in last
    assert out["wall_seconds"] == 6000 and out["peak_rss_mb"] == 5000


def test_wall_and_memory_miss_on_their_own(tmp_path):
    fake_run(tmp_path, {"train_drafter_eagle3_seed0": (800.0, 7000.0, 900.0)}, minutes=100)
    code, last, _ = run(tmp_path, "--wall-minutes", "120")
    assert code == 1 and "peak 6.84 GiB / target 6 GiB" in last and last.endswith("MISSED")
    code, last, _ = run(tmp_path, "--wall-minutes", "90")
    assert code == 1 and "wall 100.0 min / target 90 min = 1.11" in last
