"""Drafters trained side by side (`kvshot.train.group`, drafters.group_training) are the drafters
trained alone: same seed, same batches, same weights, logs and held-out curves; with online
features the group runs the target once per batch; a member that stops early leaves the group;
a kill or the runtime stop resumes every member where it was, one that had finished included."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import kvshot.train.loop as loop
from kvshot.train.group import train_group
from kvshot.train.loop import StoppedForRuntime, train_variant

from .test_train import Killed, die_at_call
from ..conftest import typed

NAMES = ["hyb", "kv2", "sa"]   # three paradigms: hybrid, KV-only, the standalone LM


def small_cfg(tiny, **train) -> dict:
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["drafters"]["variants"] = [{"name": "hyb", "paradigm": "hybrid", "layers": 1},
                                   {"name": "kv2", "paradigm": "kv", "layers": 2},
                                   {"name": "sa", "paradigm": "standalone", "layers": 1}]
    cfg["drafters"]["train"].update({"max_steps": 4, "ckpt_every": 2, "batch_size": 2, "max_len": 48, "log_every": 1,
                                     "eval_batches": 1, "eval_every": 2, "plateau": None, **train})
    return cfg


def alone(tiny, feats, cfg, name, out):
    return train_variant(typed(cfg), tiny["rt"], name, str(feats["train"]), str(feats["eval"]), str(tiny["model"]), str(out))


def group(tiny, feats, cfg, out, names=NAMES, runtime_minutes=None, rt=None):
    return train_group(typed(cfg), rt or tiny["rt"], names, str(feats["train"]), str(feats["eval"]), str(tiny["model"]),
                       [str(out / n) for n in names], runtime_minutes)


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def same(a, b) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def losses(folder):
    return [r["loss"] for r in json.loads((folder / "train_log.json").read_text())]


@pytest.fixture(scope="module")
def alone_runs(tiny, tiny_features, tmp_path_factory):
    """Each variant trained alone (train_drafter's path), 4 steps with held-out points at 2 and 4."""
    root = tmp_path_factory.mktemp("alone")
    cfg = small_cfg(tiny)
    return root, {n: alone(tiny, tiny_features, cfg, n, root / n) for n in NAMES}


def untimed(curve: list[dict]) -> list[dict]:
    """A held-out curve without its wall-clock field (train_seconds), which no two runs share."""
    return [{k: v for k, v in p.items() if k != "train_seconds"} for p in curve]


def test_grouped_drafters_equal_the_drafters_trained_alone(tiny, tiny_features, tmp_path, alone_runs):
    """Bit-identical on CPU: weights, every logged loss, the held-out curve and the final
    evaluation; the control (the same group at another seed: other inits and batch order)
    differs, so the comparison can fail."""
    root, solo = alone_runs
    got = group(tiny, tiny_features, small_cfg(tiny), tmp_path / "group")
    for n in NAMES:
        assert same(root / n, tmp_path / "group" / n), n
        assert losses(root / n) == losses(tmp_path / "group" / n), n
        assert untimed(got[n]["heldout_curve"]) == untimed(solo[n]["heldout_curve"]), n   # train_tokens too
        assert got[n]["eval"]["loss"] == solo[n]["eval"]["loss"], n
        assert got[n]["group"] == NAMES and "group" not in solo[n]
        assert not (tmp_path / "group" / f"{n}.ckpt").exists()   # every member saved: checkpoints gone
    other = small_cfg(tiny)
    other["seed"] += 1
    rt = dataclasses.replace(tiny["rt"], seed=tiny["rt"].seed + 1)
    group(tiny, tiny_features, other, tmp_path / "control", rt=rt)
    assert not any(same(root / n, tmp_path / "control" / n) for n in NAMES)


@pytest.fixture(scope="module")
def tiny_online(tiny, tmp_path_factory):
    """The tiny splits captured in online mode: tokens only, the trainer runs the target."""
    from kvshot.capture.features import capture_split

    cfg = copy.deepcopy(tiny["cfg"])
    cfg["features"]["mode"] = "online"
    root = tmp_path_factory.mktemp("online")
    for split in ("train", "eval"):
        capture_split(typed(cfg), tiny["rt"], str(tiny[split]), str(tiny["model"]), str(root / split))
    return {"train": root / "train", "eval": root / "eval"}


def test_online_group_runs_the_target_once_per_batch(tiny, tiny_online, tmp_path, monkeypatch):
    """Online features: the group reads each step's batch once for all its drafters, so it runs
    the target once per batch (alone: once per batch per drafter), and trains the same drafters."""
    import kvshot.capture.features as features
    import kvshot.train.group as group_mod

    forwards, real = [0], features.target_forward

    def counted(*a, **kw):
        forwards[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(features, "target_forward", counted)
    reads = _counting(loop.fetch_batch)
    monkeypatch.setattr(loop, "fetch_batch", reads)
    monkeypatch.setattr(group_mod, "fetch_batch", reads)
    cfg = small_cfg(tiny, eval_every=0)
    names, steps = ["kv2", "sa"], cfg["drafters"]["train"]["max_steps"]
    for n in names:
        alone(tiny, tiny_online, cfg, n, tmp_path / "alone" / n)
    alone_reads, alone_forwards = reads.calls, forwards[0]
    reads.calls, forwards[0] = 0, 0
    group(tiny, tiny_online, cfg, tmp_path / "group", names)
    assert (alone_reads, reads.calls) == (len(names) * steps, steps)
    assert alone_forwards - forwards[0] >= (len(names) - 1) * steps   # at least one target forward saved a step
    for n in names:
        assert same(tmp_path / "alone" / n, tmp_path / "group" / n), n


def _counting(fn):
    def wrapped(*a, **kw):
        wrapped.calls += 1
        return fn(*a, **kw)

    wrapped.calls = 0
    return wrapped


def test_a_member_that_plateaus_leaves_and_the_others_train_on(tiny, tiny_features, tmp_path, alone_runs):
    """kv2 alone stops at its second held-out point (a plateau rule no curve can pass); in the
    group it stops there too, saved as alone, while hyb and sa train their 4 steps unchanged."""
    root, _ = alone_runs
    cfg = small_cfg(tiny, eval_every=1)
    cfg["drafters"]["variants"][1]["train"] = {"plateau": {"patience": 1, "min_delta": 1e9, "min_acc_delta": 1e9}}
    kv2 = alone(tiny, tiny_features, cfg, "kv2", tmp_path / "alone_kv2")
    assert kv2["stopped_by"] == "plateau" and kv2["steps"] == 2
    cfg["drafters"]["train"]["eval_every"] = 2   # hyb and sa as in alone_runs; kv2 keeps its own rule
    cfg["drafters"]["variants"][1]["train"]["eval_every"] = 1
    got = group(tiny, tiny_features, cfg, tmp_path / "group")
    assert got["kv2"]["stopped_by"] == "plateau" and got["kv2"]["steps"] == 2
    assert same(tmp_path / "alone_kv2", tmp_path / "group/kv2")
    for n in ("hyb", "sa"):
        assert got[n]["steps"] == 4 and got[n]["stopped_by"] == "max_steps"
        assert same(root / n, tmp_path / "group" / n), n


def test_kill_and_runtime_stop_resume_every_member(tiny, tiny_features, tmp_path, monkeypatch, alone_runs, capsys):
    """sa trains 2 steps, hyb and kv2 4. Killed in step 3: sa had finished (its final
    checkpoint kept), the others resume from step 2; then the runtime stop checkpoints both
    after one more step and exits; the last rerun ends with the weights of the runs alone."""
    root, _ = alone_runs
    cfg = small_cfg(tiny)
    cfg["drafters"]["variants"][2]["train"] = {"max_steps": 2}
    sa = alone(tiny, tiny_features, cfg, "sa", tmp_path / "alone_sa")
    assert sa["steps"] == 2
    die_at_call(monkeypatch, 8)   # steps 0-1: 3 members, step 2: hyb then kv2; die in kv2's step 2
    with pytest.raises(Killed):
        group(tiny, tiny_features, cfg, tmp_path / "g")
    monkeypatch.undo()
    ckpts = {n: torch.load(tmp_path / f"g/{n}.ckpt/checkpoint.pt", weights_only=False)["progress"] for n in NAMES}
    assert ckpts["sa"]["finished"] and ckpts["sa"]["step"] == 2 and ckpts["hyb"]["step"] == 2
    with pytest.raises(StoppedForRuntime, match="hyb at step 3 of 4, kv2 at step 3 of 4"):
        group(tiny, tiny_features, {**cfg, "drafters": {**cfg["drafters"], "train": {
            **cfg["drafters"]["train"], "stop_margin_minutes": 0}}}, tmp_path / "g", runtime_minutes=1e-9)
    got = group(tiny, tiny_features, cfg, tmp_path / "g")
    assert got["hyb"]["resumed_from"] == 3 and got["sa"]["resumed_from"] == 2
    assert same(tmp_path / "alone_sa", tmp_path / "g/sa")
    for n in ("hyb", "kv2"):
        assert same(root / n, tmp_path / "g" / n), n
        assert losses(root / n) == losses(tmp_path / "g" / n), n
    assert not any((tmp_path / f"g/{n}.ckpt").exists() for n in NAMES)


def test_members_must_share_one_stream_of_batches(tiny, tiny_features, tmp_path):
    from kvshot.config import ConfigError

    cfg = small_cfg(tiny)
    cfg["drafters"]["variants"][1]["train"] = {"max_len": 32}
    with pytest.raises(ConfigError, match="max_len 48 and 32"):
        group(tiny, tiny_features, cfg, tmp_path / "g", ["hyb", "kv2"])


def test_stage_configs_leave_the_groups_out():
    """A stage's config (its rule's params) holds no drafters.group_training: it names variants
    of sections the stage may not get (config/paper.yaml's block and drift groups: scaling_stepwise
    gets neither section and failed its check), and which job trains a drafter changes nothing in it."""
    from kvshot.config import read_config, stage_config, validate_config

    from ..conftest import REPO

    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])
    assert len(cfg["drafters"]["group_training"]) == 5
    part = stage_config(cfg, "target", "drafters", "eval")
    assert "group_training" not in part["drafters"]
    validate_config(part, "x", sections=("target", "drafters", "eval"))
