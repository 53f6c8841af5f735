"""A checkpoint resumes under another number of processes: its fingerprint holds what changes the
trained model (the global batch, data, schedule, model), not the process count or the logging,
checkpoint and time cadence. A run stopped under 2 gloo processes resumes under 1 from its step
and ends where an uninterrupted 1-process run does, up to float reduction order."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kvshot.train.launch import accelerate_args
from kvshot.train.loop import STOP_EXIT_CODE, train_variant

from ..conftest import REPO, typed
from kvshot.settings import Config, build
from kvshot.train.variants import Variant

VARIANT = "kv1"
# the 2-process run and the rerun differ only in what the fingerprint leaves out
RERUN = {"num_processes": 1, "log_every": 2, "ckpt_every": 3, "max_minutes": 20, "stop_margin_minutes": 2}


def world_cfg(tiny, **train) -> dict:
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["drafters"]["variants"] = [{"name": VARIANT, "paradigm": "kv", "layers": 1}]
    cfg["scaling"]["variants"] = [VARIANT]
    cfg["drafters"]["train"].update({"max_steps": 4, "batch_size": 4, "max_len": 48, "eval_batches": 1,
                                     "eval_every": 0, "plateau": None, "log_every": 1, "ckpt_every": 100,
                                     "max_minutes": 30, "num_processes": 2, "stop_margin_minutes": 1, **train})
    return cfg


def run(tiny, feats, cfg, out):
    return train_variant(typed(cfg), tiny["rt"], VARIANT, str(feats["train"]), str(feats["eval"]), str(tiny["model"]),
                         str(out))


def test_a_two_process_checkpoint_resumes_under_one_process(tiny, tiny_features, tmp_path, capsys):
    whole = run(tiny, tiny_features, world_cfg(tiny, **RERUN), tmp_path / "whole")

    # 2 processes, stopped for the job's runtime after their first step (0.5 min is within the
    # 1 min margin: over at once): both ranks exit 75 (accelerate launch itself exits 1) and
    # leave a checkpoint of step 1
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(world_cfg(tiny)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args(2), "-m", "kvshot", "train-drafter",
           "--config", str(cfg_file), "--threads", "1", "--variant", VARIANT,
           "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
           "--target", str(tiny["model"]), "--out", str(tmp_path / "cut"), "--runtime-minutes", "0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode != 0 and f"exitcode  : {STOP_EXIT_CODE}" in proc.stderr, proc.stderr[-3000:]
    saved = torch.load(tmp_path / "cut.ckpt/checkpoint.pt", weights_only=False)["progress"]
    assert saved["step"] == 1 and saved["world_size"] == 2 and saved["stopped_by"] == "runtime"

    # resubmitted on 1 process, with other logging/checkpoint cadence and time limits
    capsys.readouterr()
    metrics = run(tiny, tiny_features, world_cfg(tiny, **RERUN), tmp_path / "cut")
    out = capsys.readouterr().out
    assert "set aside" not in out and "written by 2 processes, resumed by 1" in out, out
    assert metrics["resumed_from"] == 1 and metrics["steps"] == 4 and metrics["world_size"] == 1
    assert metrics["stopped_by"] == "max_steps"

    # float reduction order (2 ranks' partial sums for step 0) is the only difference
    a, b = load_file(str(tmp_path / "whole/model.safetensors")), load_file(str(tmp_path / "cut/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4)
    assert metrics["eval"]["loss"] == pytest.approx(whole["eval"]["loss"], rel=1e-4)
    log_a = {r["step"]: r["loss"] for r in json.loads((tmp_path / "whole/train_log.json").read_text())}
    log_b = {r["step"]: r["loss"] for r in json.loads((tmp_path / "cut/train_log.json").read_text())}
    assert 0 in log_b and set(log_a) & set(log_b) == set(log_a)   # step 0 logged by the 2-process run
    for step, loss in log_a.items():
        assert log_b[step] == pytest.approx(loss, rel=1e-4), step


def test_the_fingerprint_keeps_what_changes_the_trained_model(monkeypatch, tmp_path, capsys):
    import kvshot.train.checkpoint as ck

    monkeypatch.setattr(ck, "content_digest", lambda path: f"content of {Path(path).parent}")
    monkeypatch.setattr(ck, "folder_digest", lambda path: f"content of {path}")

    class Rt:
        dtype = "float32"

    cfg = {"seed": 0, "drafters": {"ttt_steps": 7, "step_decay": 0.8, "draft_vocab_size": 1024}}
    # every drafters.train field, as the filled config holds them
    train = {"batch_size": 8, "lr": 3e-3, "max_steps": 250, "warmup_steps": 10, "min_lr_ratio": 0.1, "max_len": 256,
             "weight_decay": 0.1, "eval_batches": 4,
             "length_grouping": 0, "train_samples": None, "grad_clip": 0.5, "eval_every": 50, "plateau": None,
             "num_processes": 8, "log_every": 5, "ckpt_every": 25, "max_minutes": 30, "stop_margin_minutes": 5,
             "diagnostic_sequences": 4}

    def fp(seed=0, data="train", **changes):
        v = {"name": "kv-d1", "paradigm": "kv", "layers": 1, "train": {**train, **changes}}
        # the typed config as the trainer holds it (what the dicts leave out: None)
        return ck.fingerprint(build(Variant, v), build(Config, {**cfg, "seed": seed}), Rt, data, "eval", "target", "val")

    base = fp()
    assert fp(num_processes=4, log_every=1, ckpt_every=7, max_minutes=90, stop_margin_minutes=1,
              diagnostic_sequences=2) == base
    for changed in ({"batch_size": 16}, {"lr": 1e-3}, {"max_steps": 300}, {"warmup_steps": 0}, {"max_len": 128},
                    {"length_grouping": 64}, {"train_samples": 100}, {"eval_every": 25}, {"seed": 1},
                    {"data": "other-train"}):
        assert fp(**changed) != base, changed

    # a checkpoint written before (its fingerprint held the process count and cadence) resumes
    # under the same settings, and saves today's fingerprint from then on
    v = {"name": "kv-d1", "paradigm": "kv", "layers": 1,
         "train": {k: x for k, x in train.items() if k not in ("stop_margin_minutes", "length_grouping")}}
    legacy = ck.hashlib.sha256(ck.json.dumps(
        {"variant": v, "seed": 0, "dtype": "float32", "drafters": cfg["drafters"], "train": "content of train",
         "eval": "content of eval", "target": "content of target", "val": "content of val"},
        sort_keys=True).encode()).hexdigest()[:16]
    ckpt = tmp_path / "checkpoint.pt"
    torch.save({"progress": {"fingerprint": legacy, "step": 5, "world_size": 8}}, ckpt)
    saved = ck.load_checkpoint(ckpt, base)
    assert saved is not None and saved["progress"]["fingerprint"] == base and saved["progress"]["world_size"] == 1
    assert "written by 8 processes, resumed by 1" in capsys.readouterr().out
    torch.save({"progress": {"fingerprint": "0123456789abcdef", "step": 5}}, ckpt)
    assert ck.load_checkpoint(ckpt, base) is None and (tmp_path / "checkpoint.pt.stale").exists()
