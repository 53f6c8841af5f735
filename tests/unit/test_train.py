"""The TTT trainer: resume after a kill is bit-identical, NaN stops cleanly, a stop before the
job's runtime checkpoints and resumes to the same weights, and 2-process DDP (accelerate,
gloo on CPU) matches one process at the same global batch."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import kvshot.train.loop as train_mod
from kvshot.train.launch import accelerate_args
from kvshot.train.loop import STOP_EXIT_CODE, StoppedForRuntime, train_variant

from ..conftest import REPO
from ..conftest import typed


def small_cfg(tiny, **train) -> dict:
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["drafters"]["variants"] = [{"name": "hyb", "paradigm": "hybrid", "layers": 1},
                                   {"name": "kv2", "paradigm": "kv", "layers": 2},
                                   {"name": "sa", "paradigm": "standalone", "layers": 1}]
    cfg["scaling"]["variants"] = ["kv2"]
    cfg["drafters"]["train"].update({"max_steps": 6, "ckpt_every": 2, "batch_size": 2, "max_len": 48,
                                     "eval_batches": 1, "eval_every": 0, "plateau": None, **train})
    return cfg


def run(tiny, feats, cfg, out, name="hyb", runtime_minutes=None):
    return train_variant(typed(cfg), tiny["rt"], name, str(feats["train"]), str(feats["eval"]), str(tiny["model"]), str(out),
                         runtime_minutes)


def untimed(curve: list[dict]) -> list[dict]:
    """A held-out curve without its wall-clock field (train_seconds), which no two runs share."""
    return [{k: v for k, v in p.items() if k != "train_seconds"} for p in curve]


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs, no cleanup beyond what the OS gives."""


def die_at_call(monkeypatch, call: int, exc: type[BaseException] = Killed) -> None:
    """Make the trainer's `step_losses` raise `exc` on its `call`-th call (undo: monkeypatch.undo)."""
    calls = {"n": 0}
    real = train_mod.step_losses

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == call:
            raise exc
        return real(*a, **kw)

    monkeypatch.setattr(train_mod, "step_losses", dying)


@pytest.mark.parametrize("name", ["hyb", "kv2", "sa"])
def test_kill_and_resume_is_bit_identical(tiny, tiny_features, tmp_path, monkeypatch, name):
    """Also: the checkpoint holds no frozen tensor (the target's token embedding, 2.5 GB in
    fp32 at Qwen3-8B); the resumed drafter takes it from the target again."""
    cfg = small_cfg(tiny)
    run(tiny, tiny_features, cfg, tmp_path / "whole", name)

    die_at_call(monkeypatch, 4)   # step 3: the checkpoint of step 2 exists, step 3 is lost
    with pytest.raises(Killed):
        run(tiny, tiny_features, cfg, tmp_path / "resumed", name)
    assert not (tmp_path / "resumed").exists()
    saved = torch.load(tmp_path / "resumed.ckpt/checkpoint.pt", weights_only=False)
    assert saved["progress"]["step"] == 2
    # neither the checkpoint nor the saved drafter holds the frozen copy of the target's embedding
    assert "embed_tokens.weight" not in saved["model"] and "embed_tokens.weight" not in weights(tmp_path / "whole")
    assert {"d2t", "t2d", "lm_head.weight"} <= set(saved["model"])
    monkeypatch.undo()
    metrics = run(tiny, tiny_features, cfg, tmp_path / "resumed", name)
    assert metrics["resumed_from"] == 2
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_a = json.loads((tmp_path / "whole/train_log.json").read_text())
    log_b = json.loads((tmp_path / "resumed/train_log.json").read_text())
    assert [r["loss"] for r in log_a] == [r["loss"] for r in log_b]


def test_heldout_point_comes_after_the_steps_checkpoint(tiny, tiny_features, tmp_path, monkeypatch):
    """At a step that is both an eval_every and a ckpt_every step the checkpoint is written
    first: a held-out evaluation that dies there (an OOM) loses no training, and the rerun
    evaluates that step before training on, ending as an uninterrupted run does."""
    cfg = small_cfg(tiny, eval_every=2)   # checkpoints and held-out points at steps 2 and 4
    whole = run(tiny, tiny_features, cfg, tmp_path / "whole")
    real, calls = train_mod.heldout_point, {"n": 0}

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:   # step 4's
            raise Killed
        return real(*a, **kw)

    monkeypatch.setattr(train_mod, "heldout_point", dying)
    with pytest.raises(Killed):
        run(tiny, tiny_features, cfg, tmp_path / "out")
    saved = torch.load(tmp_path / "out.ckpt/checkpoint.pt", weights_only=False)
    assert saved["progress"]["step"] == 4 and [p["step"] for p in saved["progress"]["heldout"]] == [2]
    monkeypatch.undo()
    m = run(tiny, tiny_features, cfg, tmp_path / "out")
    assert m["resumed_from"] == 4 and untimed(m["heldout_curve"]) == untimed(whole["heldout_curve"])
    assert [p["step"] for p in m["heldout_curve"]] == [2, 4, 6]
    # the curve's x: training tokens over the resume, as the uninterrupted run counted them
    assert [p["train_tokens"] for p in m["heldout_curve"]] == [p["train_tokens"] for p in whole["heldout_curve"]]
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_steps_add_heldout_points_with_the_tokens_trained_so_far(tiny, tiny_features, tmp_path):
    """drafters.train.eval_steps (the curve target's log-spaced points) beside eval_every: a
    point at each, counting the real (unpadded) training tokens and the steps' own seconds."""
    from kvshot.train.curve import curve_train, eval_points

    cfg = small_cfg(tiny, eval_every=4, eval_steps=[1, 3])
    m = run(tiny, tiny_features, cfg, tmp_path / "out")
    curve = m["heldout_curve"]
    assert [p["step"] for p in curve] == [1, 3, 4]
    tokens = [p["train_tokens"] for p in curve]
    assert 0 < tokens[0] < tokens[1] < tokens[2] <= 4 * 2 * 48   # batch 2 x 48 at most per step
    assert all(a["train_seconds"] < b["train_seconds"] for a, b in zip(curve, curve[1:]))
    # the curve target's plan: 8 points, halving from max_steps, on a budget of batch tokens
    assert eval_points(1024, 8) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert eval_points(5, 4) == [1, 2, 5]   # 5 / 4 and 5 / 8 both round to 1: taken once
    plan = curve_train({"tokens": 1_048_576, "points": 8, "max_minutes": 45}, {"batch_size": 4, "max_len": 256})
    assert plan == {"max_steps": 1024, "eval_every": 0, "eval_steps": [8, 16, 32, 64, 128, 256, 512, 1024],
                    "plateau": None, "train_samples": None, "max_minutes": 45}


def test_changed_config_does_not_resume(tiny, tiny_features, tmp_path, capsys):
    cfg = small_cfg(tiny, max_steps=2)
    run(tiny, tiny_features, cfg, tmp_path / "out")
    (tmp_path / "out.ckpt").mkdir(exist_ok=True)
    cfg2 = small_cfg(tiny, max_steps=4, lr=5e-4)
    torch.save({"progress": {"fingerprint": "other"}}, tmp_path / "out.ckpt/checkpoint.pt")
    m = run(tiny, tiny_features, cfg2, tmp_path / "out")
    out = capsys.readouterr().out
    assert m["resumed_from"] is None and "written for other inputs or config" in out and "set aside" in out
    assert not (tmp_path / "out.ckpt").exists()   # removed once the drafter is saved


def _killed_at_step_3(monkeypatch, train):
    """Run `train()` until it dies at step 3, after the step-2 checkpoint."""
    die_at_call(monkeypatch, 4)
    with pytest.raises(Killed):
        train()
    monkeypatch.undo()


def test_upstream_change_retrains_from_step_0(tiny, tiny_features, tmp_path, monkeypatch, capsys):
    """A retrained target and recaptured features at the same paths: the checkpoint of the
    old inputs is set aside, and training equals a clean run on the new ones."""
    import shutil

    from transformers import Qwen3ForCausalLM

    from kvshot.capture.features import capture_split
    from kvshot.core.integrity import write_manifest

    cfg = small_cfg(tiny)
    target, feats = tmp_path / "target", {s: tmp_path / "features" / s for s in ("train", "eval")}
    shutil.copytree(tiny["model"], target)
    for split, folder in feats.items():
        shutil.copytree(tiny_features[split], folder)

    def train(out):
        return train_variant(typed(cfg), tiny["rt"], "hyb", str(feats["train"]), str(feats["eval"]), str(target), str(out))

    _killed_at_step_3(monkeypatch, lambda: train(tmp_path / "out"))
    assert torch.load(tmp_path / "out.ckpt/checkpoint.pt", weights_only=False)["progress"]["step"] == 2
    model = Qwen3ForCausalLM.from_pretrained(str(target))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    model.save_pretrained(str(target))
    write_manifest(target)   # as the target stage does after writing the model
    for split, folder in feats.items():
        shutil.rmtree(folder)
        capture_split(typed(tiny["cfg"]), tiny["rt"], str(tiny[split]), str(target), str(folder))
    capsys.readouterr()
    m = train(tmp_path / "out")
    log = capsys.readouterr().out
    assert m["resumed_from"] is None and "resuming" not in log and "set aside" in log, log
    train(tmp_path / "clean")
    a, b = weights(tmp_path / "out"), weights(tmp_path / "clean")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_truncated_checkpoint_is_set_aside(tiny, tiny_features, tmp_path, monkeypatch, capsys):
    cfg = small_cfg(tiny)
    _killed_at_step_3(monkeypatch, lambda: run(tiny, tiny_features, cfg, tmp_path / "out"))
    ckpt = tmp_path / "out.ckpt/checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    m = run(tiny, tiny_features, cfg, tmp_path / "out")
    log = capsys.readouterr().out
    assert m["resumed_from"] is None and "unreadable" in log and "as checkpoint.pt.corrupt" in log, log
    run(tiny, tiny_features, cfg, tmp_path / "clean")
    a, b = weights(tmp_path / "out"), weights(tmp_path / "clean")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nan_loss_names_the_step_and_keeps_the_checkpoint(tiny, tiny_features, tmp_path, monkeypatch):
    cfg = small_cfg(tiny)
    real = train_mod.weighted_loss
    calls = {"n": 0}

    def poisoned(losses, decay):
        calls["n"] += 1
        loss = real(losses, decay)
        return loss * float("nan") if calls["n"] == 4 else loss

    monkeypatch.setattr(train_mod, "weighted_loss", poisoned)
    with pytest.raises(FloatingPointError, match="at step 3"):
        run(tiny, tiny_features, cfg, tmp_path / "out")
    saved = torch.load(tmp_path / "out.ckpt/checkpoint.pt", weights_only=False)
    assert saved["progress"]["step"] == 2
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())
    assert not (tmp_path / "out").exists()


def test_nan_before_any_checkpoint_says_so(tiny, tiny_features, tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "weighted_loss", lambda losses, decay: losses[0] * float("inf"))
    with pytest.raises(FloatingPointError, match="at step 0; no checkpoint yet"):
        run(tiny, tiny_features, small_cfg(tiny), tmp_path / "out")


def test_runtime_stop_checkpoints_and_the_rerun_ends_where_one_run_does(tiny, tiny_features, tmp_path, capsys):
    """Past the job's runtime less the margin (counted from process start: a 1e-9 minute
    runtime is over at once), training checkpoints after the step in hand, records why, and
    raises; reruns resume, and the last one ends with the weights of an uninterrupted run."""
    cfg = small_cfg(tiny, stop_margin_minutes=0)
    run(tiny, tiny_features, cfg, tmp_path / "whole")
    for stopped_at in (1, 2):
        with pytest.raises(StoppedForRuntime, match=f"stopped at step {stopped_at} of 6"):
            run(tiny, tiny_features, cfg, tmp_path / "cut", runtime_minutes=1e-9)
        saved = torch.load(tmp_path / "cut.ckpt/checkpoint.pt", weights_only=False)
        assert saved["progress"]["step"] == stopped_at and saved["progress"]["stopped_by"] == "runtime"
        assert not (tmp_path / "cut").exists()
    assert "a rerun resumes" in capsys.readouterr().out
    cfg["drafters"]["train"]["stop_margin_minutes"] = 7   # the margin is no part of what a checkpoint must match
    metrics = run(tiny, tiny_features, cfg, tmp_path / "cut", runtime_minutes=1e6)
    assert metrics["resumed_from"] == 2 and metrics["steps"] == 6 and metrics["stopped_by"] == "max_steps"
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_a = json.loads((tmp_path / "whole/train_log.json").read_text())
    log_b = json.loads((tmp_path / "cut/train_log.json").read_text())
    assert [r["loss"] for r in log_a] == [r["loss"] for r in log_b]


def test_train_drafter_exits_75_when_stopped_for_runtime(tiny, tiny_features, tmp_path):
    from kvshot.__main__ import main

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(small_cfg(tiny)))
    args = ["train-drafter", "--config", str(cfg_file), "--variant", "kv2", "--train-features",
            str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]), "--target", str(tiny["model"]),
            "--out", str(tmp_path / "out"), "--runtime-minutes", "0.5"]   # within smoke's 1 min margin: over at once
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == STOP_EXIT_CODE == 75
    assert torch.load(tmp_path / "out.ckpt/checkpoint.pt", weights_only=False)["progress"]["stopped_by"] == "runtime"


def test_max_minutes_is_a_budget_that_finishes(tiny, tiny_features, tmp_path):
    run(tiny, tiny_features, small_cfg(tiny, max_minutes=1e-9), tmp_path / "out")
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert metrics["steps"] == 1 and metrics["stopped_by"] == "max_minutes" and "eval" in metrics
    run(tiny, tiny_features, small_cfg(tiny, max_steps=1), tmp_path / "full")
    assert json.loads((tmp_path / "full/metrics.json").read_text())["stopped_by"] == "max_steps"


def test_training_lowers_the_loss_and_logs_diagnostics(tiny, tiny_features, tmp_path):
    cfg = small_cfg(tiny, max_steps=12, ckpt_every=100, lr=3e-3, log_every=1)
    run(tiny, tiny_features, cfg, tmp_path / "out")
    log = json.loads((tmp_path / "out/train_log.json").read_text())
    assert len(log) == 12 and len(log[0]["acc_k"]) == cfg["drafters"]["ttt_steps"]
    first, last = sum(r["loss"] for r in log[:3]), sum(r["loss"] for r in log[-3:])
    assert last < first
    rec = log[-1]
    assert {"kv_wk_wv", "kv_query_out", "gate", "fusion", "lm_head", "body"} <= set(rec["grad_norm"])
    assert 0 < rec["kv_key_share"] < 1 and 0 < rec["gate"]["min"] <= rec["gate"]["max"] < 1
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert len(metrics["eval"]["query_cosine"]) == cfg["drafters"]["ttt_steps"]


def test_two_process_ddp_matches_one_process(tiny, tiny_features, tmp_path):
    """The same global batches (length-grouped) on 1 and 2 processes: the same weights (the
    gradients DDP's bucket views; a hybrid-warm step holding the hidden path back), the same
    logged loss, objective, loss_k and acc_k (over every process's sequences, not rank 0's),
    the same diagnostics (the key share and the gradient positions from both processes'
    sequences, the probe batches' attention diagnostics shared out and summed), and the same
    held-out curve and final evaluation (each process evaluating its share)."""
    cfg = small_cfg(tiny, max_steps=3, batch_size=4, ckpt_every=100, log_every=1, eval_every=3, eval_batches=2,
                    length_grouping=2)
    cfg["drafters"]["variants"][0]["kv_warmup_steps"] = 1   # "hyb": step 0 trains the KV branch alone
    run(tiny, tiny_features, cfg, tmp_path / "one", "hyb")
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args(2), "-m", "kvshot", "train-drafter", "--config", str(cfg_file), "--threads", "1",
           "--variant", "hyb", "--train-features", str(tiny_features["train"]),
           "--eval-features", str(tiny_features["eval"]), "--target", str(tiny["model"]), "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "two/metrics.json").read_text())
    assert metrics["world_size"] == 2
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    log_a = json.loads((tmp_path / "one/train_log.json").read_text())
    log_b = json.loads((tmp_path / "two/train_log.json").read_text())
    assert len(log_a) == len(log_b) == 3
    for ra, rb in zip(log_a, log_b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4)
        assert rb["objective"] == pytest.approx(ra["objective"], rel=1e-4)
        assert rb["loss_k"] == pytest.approx(ra["loss_k"], rel=1e-4)
        assert rb["acc_k"] == pytest.approx(ra["acc_k"], abs=1e-9)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3)
        assert rb["kv_key_share"] == pytest.approx(ra["kv_key_share"], rel=1e-6)
        for key in ("kv_own_key_mass_k", "kv_own_key_mass", "gate_share"):   # the same probe batches, shared out
            assert rb[key] == pytest.approx(ra[key], rel=1e-3), key
        # sampled rows (each process its half of the sample): the same estimate, not the same rows
        assert rb["grad_position_rows"] == pytest.approx(ra["grad_position_rows"], rel=0.25)
        for key in ("kv_grad_positions", "query_grad_positions", "kv_grad_position_ratio", "kv_grad_on_own_keys"):
            assert rb[key] == pytest.approx(ra[key], rel=0.25), key
    one = json.loads((tmp_path / "one/metrics.json").read_text())
    (pa,), (pb,) = one["heldout_curve"], metrics["heldout_curve"]
    assert pb["heldout_loss_k"] == pytest.approx(pa["heldout_loss_k"], rel=1e-4)
    assert pb["heldout_acc_k"] == pytest.approx(pa["heldout_acc_k"], abs=1e-9)
    assert metrics["eval"]["loss"] == pytest.approx(one["eval"]["loss"], rel=1e-4)
    assert metrics["eval"]["tokens"] == one["eval"]["tokens"]
    assert metrics["eval"]["query_cosine"] == pytest.approx(one["eval"]["query_cosine"], rel=1e-4)


def test_the_epoch_order_is_built_once_per_epoch(tiny, tiny_features, tmp_path, monkeypatch):
    calls, real = [], torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda n, *a, **kw: calls.append(n) or real(n, *a, **kw))
    m = run(tiny, tiny_features, small_cfg(tiny, max_steps=21, batch_size=4, ckpt_every=100, log_every=100),
            tmp_path / "out")
    assert m["train_samples"] == 40 and calls.count(40) == 3   # 10 steps an epoch: epochs 0, 1 and 2


def test_a_step_that_logs_nothing_waits_on_the_device_once(tiny, tiny_features, tmp_path, monkeypatch):
    """The trainer's own reads of tensor values (its NaN guards, the log's numbers): one per
    step (the rest of the step's are the model's). Counted as the difference between 6 and 10
    steps that log the first and the last step only."""
    seen = {"n": 0}
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **kw):
            seen["n"] += sys._getframe(1).f_code.co_filename == train_mod.__file__
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    reads = []
    for steps in (6, 10):
        seen["n"] = 0
        run(tiny, tiny_features, small_cfg(tiny, max_steps=steps, ckpt_every=100, log_every=100),
            tmp_path / f"out{steps}", "kv2")
        reads.append(seen["n"])
    assert (reads[1] - reads[0]) / 4 == 1, reads
