"""The one-GPU rung end to end on CPU: `config/one-gpu.yaml` overlaid only with sizes and
`device: cpu`, against an offline hub cache holding a tiny random Qwen3 saved under
`Qwen/Qwen3-1.7B` at the revision the config pins (tied embedding and head, as the real
1.7B), and the hub datasets at their pins. It runs the whole `all` (data from the hub, the
pinned target, capture, one-process training of the six variants, step-wise, E2E, the
benchmarks axis and the report) on one process per job, as a workstation runs it with
`--resources gpu=1`. One training seed and one variant per paradigm (kv-d1 for the KV-only
depths) keep CI time down: the seed count is a size, several seeds are run by the smoke DAG
test, and every depth by the smoke DAG and, in bf16, the paper path."""
from __future__ import annotations

import json
import math
import os

import pytest
import yaml

from kvshot.config import merge

from ..conftest import REPO
from ..dag import snakemake, workdir
from ..paper_fixture import CPU_SIZES, build_hub_cache, offline_env, pinned_revisions
from .test_paper_path import _failure


CONFIG = "config/one-gpu.yaml"
# Sizes only (and the device): everything else is one-gpu.yaml as a researcher runs it.
OVERLAY = merge(CPU_SIZES, {
    # one variant per paradigm: the KV depths 2 and 4 run the same code as kv-d1 here, and run in bf16 through
    # every rule in the paper path (DDP) and in fp32 in the smoke DAG
    "drafters": {"draft_vocab_size": 256, "seeds": [0], "variants": [
                     {"name": "eagle3", "paradigm": "hidden", "layers": 1, "qk_norm": False},
                     {"name": "kv-d1", "paradigm": "kv", "layers": 1},
                     {"name": "hybrid", "paradigm": "hybrid", "layers": 1, "gate_shape": "scalar", "gate_init": 0.5},
                     {"name": "standalone", "paradigm": "standalone", "layers": 2}],
                 "train": {"batch_size": 2, "max_len": 96, "max_steps": 3, "warmup_steps": 1, "log_every": 1,
                           "ckpt_every": 2, "eval_batches": 2, "eval_every": 2}},
    "eval": {"max_new_tokens": 12, "natural": {"anchors": 48}, "e2e": {"max_new_tokens": 10}},
    "scaling": {"train_samples": [60, 120], "variants": ["eagle3", "kv-d1", "hybrid"]},   # not run (`all` only): validated
})
VARIANTS = ("eagle3", "kv-d1", "hybrid", "standalone")


@pytest.mark.slow
def test_one_gpu_config_runs_end_to_end_on_cpu(tmp_path):
    cfg = yaml.safe_load((REPO / CONFIG).read_text())
    assert cfg["target"]["name"] == "Qwen/Qwen3-1.7B" and cfg["drafters"]["train"]["num_processes"] == 1
    pins = pinned_revisions(CONFIG)
    assert len(pins["Qwen/Qwen3-1.7B"]) == 40, pins
    (tmp_path / "run").mkdir()
    wd = workdir(tmp_path / "run")
    home = tmp_path / "hf_home"
    cache = build_hub_cache(home, config=CONFIG)
    snapshot = cache / "models--Qwen--Qwen3-1.7B" / "snapshots" / pins["Qwen/Qwen3-1.7B"]
    assert (snapshot / "config.json").exists() and not (cache / "models--Qwen--Qwen3-8B").exists()
    env = {**os.environ, **offline_env(cache, home)}
    overlay = tmp_path / "one_gpu_cpu.yaml"
    overlay.write_text(yaml.safe_dump(OVERLAY))

    proc = snakemake(wd, "all", "--cores", "2", "--resources", "gpu=1", "--configfile", CONFIG, str(overlay),
                     timeout=1800, env=env)
    logs = "".join(_failure(p) for p in sorted((wd / "logs").glob("*.log"))) if (wd / "logs").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + logs

    stats = json.loads((wd / "results/data/stats.json").read_text())
    assert [s["source"] for s in stats["sources"]] == ["hub:Aeala/ShareGPT_Vicuna_unfiltered",
                                                      "hub:HuggingFaceH4/ultrachat_200k"]
    target = json.loads((wd / "results/target/metrics.json").read_text())
    assert target["source"] == "pretrained" and target["dtype"] == "bfloat16"
    assert math.isfinite(target["heldout_loss"])
    for name in VARIANTS:
        metrics = json.loads((wd / f"results/drafters/{name}/seed0/metrics.json").read_text())
        assert metrics["world_size"] == 1 and metrics["steps"] == 3, metrics
        assert metrics["dtype"] == "bfloat16" and all(math.isfinite(x) for x in metrics["eval"]["loss"])
        stepwise = json.loads((wd / f"results/eval/{name}/stepwise.json").read_text())
        assert len(stepwise["alpha"]) == 7 and stepwise["rounds"][0] > 0
        e2e = json.loads((wd / f"results/eval/{name}/e2e.json").read_text())
        assert "tree" in e2e["modes"] and e2e["lossless"] is True
    assert all(json.loads((wd / f"results/eval/{v}/benchmarks.json").read_text()) for v in VARIANTS)
    claims = json.loads((wd / "results/claims.json").read_text())
    assert claims and (wd / "results/tables/benchmarks.md").exists() and (wd / "figures/decay.pdf").exists()
    for log in (wd / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
