"""A training group under DDP: `train-drafter --variant a b` launched on two processes trains the
same drafters as the group on one (tests/unit/test_group_training.py holds the in-process tests)."""
from __future__ import annotations

import json

import pytest
import torch

from ..conftest import REPO
from ..unit.test_group_training import group, losses, small_cfg, weights


def test_two_process_ddp_group_matches_one_process(tiny, tiny_features, tmp_path):
    """`train-drafter --variant kv2 sa` under `accelerate launch` on 2 processes (each member its
    own DDP wrap, every process walking the members in one order): the same drafters as the
    group on one process, each at <out>/<variant>, checkpoints under --checkpoints, then gone."""
    import subprocess
    import sys

    import yaml

    from kvshot.train.launch import accelerate_args

    cfg = small_cfg(tiny, batch_size=4)
    cfg["scaling"]["variants"] = ["kv2"]   # the config file is validated: names it holds
    group(tiny, tiny_features, cfg, tmp_path / "one", ["kv2", "sa"])
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args(2), "-m", "kvshot", "train-drafter",
           "--config", str(cfg_file), "--threads", "1", "--variant", "kv2", "sa",
           "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
           "--target", str(tiny["model"]), "--checkpoints", str(tmp_path / "ckpts"), "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in ("kv2", "sa"):
        m = json.loads((tmp_path / "two" / n / "metrics.json").read_text())
        assert m["world_size"] == 2 and m["group"] == ["kv2", "sa"] and m["steps"] == 4
        a, b = weights(tmp_path / "one" / n), weights(tmp_path / "two" / n)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
        assert losses(tmp_path / "two" / n) == pytest.approx(losses(tmp_path / "one" / n), rel=1e-4)
    assert not any((tmp_path / "ckpts").rglob("checkpoint.pt"))
