"""Impossible configurations are rejected before any job runs, in one line naming the file
and the field (issue 18's list, case by case)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvshot.config import ConfigError, validate_config

from ..conftest import REPO, tiny_config
from ..conftest import section
from kvshot.settings import DataSource, VariantSettings


def _variant(cfg: dict, name: str) -> dict:
    return next(v for v in cfg["drafters"]["variants"] if v["name"] == name)


def _set(cfg: dict, path: str, value) -> None:
    *head, last = path.split(".")
    node = cfg
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value


# (case, edit of the tiny config, field named, words of the problem); the tiny target has 4 layers,
# 2 heads, 1 KV head, a 320-token vocabulary; 48 train / 8 eval samples; train max_len 64.
CASES = [
    ("kv_layers beyond depth", lambda c: _set(c, "features.kv_layers", [0, 4]), "features.kv_layers", "beyond"),
    ("aux_layers out of range", lambda c: _set(c, "features.aux_layers", [1, 2, 9]), "features.aux_layers", "outside"),
    ("aux_layers duplicated", lambda c: _set(c, "features.aux_layers", [1, 2, 2]), "features.aux_layers", "repeats"),
    ("variant kv_layers not captured",
     lambda c: (_set(c, "features.kv_layers", [3]), _variant(c, "kv-d1").update(kv_layers=[2])),
     "drafters.variants.1.kv_layers", "do not hold"),
    ("default kv layers not captured", lambda c: _set(c, "features.kv_layers", [0]), "features.kv_layers",
     "do not hold"),
    ("draft vocab above vocabulary", lambda c: _set(c, "drafters.draft_vocab_size", 5000),
     "drafters.draft_vocab_size", "larger than the target's vocabulary"),
    ("eval prompts above eval samples", lambda c: _set(c, "eval.prompts", 9), "eval.prompts", "eval samples"),
    ("heads not divisible", lambda c: _set(c, "target.arch.num_key_value_heads", 3),
     "target.arch.num_key_value_heads", "do not divide"),
    ("ttt_steps longer than sequences", lambda c: _set(c, "drafters.ttt_steps", 63), "drafters.ttt_steps",
     "at least"),
    ("natural branches shorter than K + 1", lambda c: _set(c, "eval.natural", {"rollout_tokens": 2}),
     "eval.natural.rollout_tokens", "needs K + 1"),
    ("duplicate variant names", lambda c: c["drafters"]["variants"].append(
        {"name": "eagle3", "paradigm": "kv", "layers": 2}), "drafters.variants.6.name", "defined twice"),
    ("batch above train samples", lambda c: _set(c, "drafters.train.batch_size", 49),
     "drafters.train.batch_size", "training samples"),
    ("scaling point below a batch", lambda c: _set(c, "scaling.train_samples", [1, 16]), "scaling.train_samples.0",
     "no batch"),
    ("scaling point above the data", lambda c: _set(c, "scaling.train_samples", [8, 100]),
     "scaling.train_samples.1", "more than"),
    ("deep KV drafter on a shallow target", lambda c: _variant(c, "kv-d4").update(layers=5),
     "drafters.variants.3.layers", "4-layer target"),
    ("block variant named as a drafter", lambda c: c.setdefault("blockwise", {}).setdefault("variants", []).append(
        {"name": "kv-d1", "paradigm": "block", "context": "kv", "layers": 1}), "blockwise.variants.2.name", "defined twice"),
    ("block-KV variant deeper than the target", lambda c: c.setdefault("blockwise", {}).setdefault("variants", []).append(
        {"name": "bk5", "paradigm": "block", "context": "kv", "layers": 5}), "blockwise.variants.2.layers", "4-layer target"),
    ("block setting on a chain drafter", lambda c: _variant(c, "kv-d2").update(refine_passes=1),
     "drafters.variants.2.refine_passes", "a block setting, and variant kv-d2 is kv"),
    ("block-KV layers not captured", lambda c: (
        _set(c, "features.kv_layers", [2, 3]), c["drafters"]["variants"].remove(_variant(c, "kv-d4")),
        c.setdefault("blockwise", {}).setdefault("variants", []).append(
            {"name": "bk4", "paradigm": "block", "context": "kv", "layers": 4})),
     "features.kv_layers", "variant bk4 reads target layers [0, 1]"),
]


@pytest.mark.parametrize("case,edit,field,words", CASES, ids=[c[0] for c in CASES])
def test_impossible_config_is_one_line(case, edit, field, words):
    cfg = copy.deepcopy(tiny_config())
    validate_config(cfg, ["my.yaml"])   # the untouched config passes
    edit(cfg)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, ["my.yaml"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"my.yaml: {field}: ") and words in msg, msg


def test_pretrained_target_shape_read_from_its_config(tmp_path):
    """A local pretrained target: depth and vocabulary come from its config.json."""
    cfg = copy.deepcopy(tiny_config())
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300}))
    cfg["target"] = {"source": "pretrained", "name": str(tmp_path), "attn_implementation": "sdpa"}
    cfg["features"]["aux_layers"] = [1, 2, 3]
    with pytest.raises(ConfigError, match=r"features.aux_layers: \[1, 2, 3\] outside 1..2 for a 2-layer target"):
        validate_config(cfg, ["my.yaml"])


# ---------------------------------------------------------------- one-line failures of a stage

def _stage(*args: str) -> subprocess.CompletedProcess:
    """`python -m kvshot <args>` run in this process: the same `main` and its error handling, its
    stdout and stderr captured, without a 5 s interpreter start per case (torch, transformers).
    test_a_stage_error_is_one_line_from_a_fresh_interpreter runs one case as a real process."""
    import contextlib
    import io

    from kvshot.__main__ import main

    out, err, env = io.StringIO(), io.StringIO(), dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:   # quiet_library_bars sets HF_* variables for the process
        os.environ.clear()
        os.environ.update(env)
    return subprocess.CompletedProcess(["kvshot", *args], code, out.getvalue(), err.getvalue())


def _stage_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshot", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})


def test_a_stage_error_is_one_line_from_a_fresh_interpreter(tmp_path):
    """The in-process `_stage` reads what a process prints: one case as `python -m kvshot`,
    exit code 2, the same one line last on stderr, no traceback."""
    cont = tmp_path / "continuations.json"
    _continuations(cont, cut=True)
    args = ("eval-stepwise", "--config", str(REPO / "config/config.yaml"), "--drafter", str(tmp_path / "d"),
            "--target", str(tmp_path / "t"), "--continuations", str(cont), "--features-index",
            str(tmp_path / "index.json"), "--out", str(tmp_path / "out.json"))
    proc, inproc = _stage_process(*args), _stage(*args)
    assert _last_line(proc) == _last_line(inproc) and "Traceback" not in proc.stderr
    assert _last_line(proc).startswith(f"kvshot eval-stepwise: error: {cont}: not a complete JSON file")


def _last_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def test_deeply_nested_json_is_one_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text("[" * 200_000 + "\n")
    line = _last_line(_stage("train-tokenizer", "--config", str(REPO / "config/config.yaml"),
                             "--train", str(bad), "--out", str(tmp_path / "tok")))
    assert line.startswith("kvshot train-tokenizer: error: ") and "nested too deeply" in line, line


def test_deeply_nested_data_file_names_the_file_and_field_in_one_line(tmp_path):
    """A damaged or hostile ShareGPT file (one record nested 100,000 deep): prepare-data's one
    line names the file, the record and its field, and prints no traceback."""
    deep = "[" * 100_000 + "]" * 100_000
    data = tmp_path / "deep.json"
    data.write_text('[{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}, '
                    '{"id": "b", "conversations": ' + deep + "}]")
    overlay = tmp_path / "deep.yaml"
    overlay.write_text(yaml.safe_dump({"data": {"sources": [{"kind": "sharegpt_file", "path": str(data)}]}}))
    proc = _stage("prepare-data", "--config", str(REPO / "config/config.yaml"), "--config", str(REPO / "config/smoke.yaml"),
                  "--config", str(overlay), "--out", str(tmp_path / "data"))
    line = _last_line(proc)
    assert line.startswith(f"kvshot prepare-data: error: {data}: record 1 (field 'conversations') is nested too deeply"), line
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "messages": ' + deep + "}\n")
    from kvshot.core.io import DataError
    from kvshot.data.sources import read_jsonl

    with pytest.raises(DataError, match=rf"{rows}:1: \(field 'messages'\) nested too deeply"):
        read_jsonl(rows)


def test_unwritable_output_is_one_line(tmp_path):
    line = _last_line(_stage("prepare-data", "--config", str(REPO / "config/config.yaml"),
                             "--config", str(REPO / "config/smoke.yaml"), "--out", "/sys/kvshot/data"))
    assert line.startswith("kvshot prepare-data: error: /sys/kvshot") and "writable folder" in line, line


def test_full_disk_is_one_line(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        line = _last_line(_stage("prepare-data", "--config", str(REPO / "config/config.yaml"),
                                 "--out", str(small / "data")))
        assert "No space left on device; free disk space" in line and str(small / "data") in line, line
        assert not list((small / "data").glob("*")), "a half-written output was left"
    finally:
        subprocess.run(["umount", str(small)])


def test_leftover_scratch_of_a_killed_writer_is_removed(tmp_path):
    from kvshot.core.io import atomic_dir, write_json

    out = tmp_path / "drafter"
    dead_dir, dead_file = tmp_path / ".drafter.abc123.tmp", tmp_path / ".metrics.json.xyz.tmp"
    (dead_dir / "sub").mkdir(parents=True)
    (dead_dir / "sub" / "w.bin").write_bytes(b"x" * 1000)
    dead_file.write_text("{")
    other = tmp_path / ".other.abc.tmp"   # another output's scratch is not touched
    other.mkdir()
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    write_json(tmp_path / "metrics.json", {"a": 1})
    assert not dead_dir.exists() and not dead_file.exists() and other.exists()
    assert (out / "a").read_text() == "1"


def test_json_outputs_null_non_finite_numbers_and_keep_large_panels_compact(tmp_path):
    """write_json: NaN and inf become null whether or not the file is indented; past
    INDENT_MAX_CHARS (per-anchor panels) the text is compact, and reads back the same."""
    from kvshot.core.io import INDENT_MAX_CHARS, read_json, write_json

    small = {"alpha": [0.5, float("nan")], "mat": float("inf"), "n": (1, 2)}
    write_json(tmp_path / "small.json", small)
    assert read_json(tmp_path / "small.json") == {"alpha": [0.5, None], "mat": None, "n": [1, 2]}
    assert (tmp_path / "small.json").read_text().startswith("{\n  ")            # indented for reading
    big = {"lengths": list(range(INDENT_MAX_CHARS // 6)) + [float("-inf")], "k": 7}
    write_json(tmp_path / "big.json", big)
    text = (tmp_path / "big.json").read_text()
    assert "\n  " not in text and read_json(tmp_path / "big.json") == {**big, "lengths": big["lengths"][:-1] + [None]}


# ---------------------------------------------------------------- integrity of stored files

def _flip(path, offset: int, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[offset: offset + n] = bytes(b ^ 0xFF for b in data[offset: offset + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "flip", "zero"])
def test_damaged_shard_is_one_line(tiny, tiny_features, tmp_path, damage):
    import shutil

    from kvshot.capture.features import open_features
    from kvshot.core.integrity import IntegrityError

    folder = tmp_path / "eval"
    shutil.copytree(tiny_features["eval"], folder)
    shard = folder / json.loads((folder / "index.json").read_text())["shards"][0]
    size = shard.stat().st_size
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: size // 2])
    elif damage == "flip":
        _flip(shard, size // 2)
    else:   # zeroed hidden states: same size, valid safetensors, wrong numbers
        data = bytearray(shard.read_bytes())
        data[size - 4096:] = bytes(4096)
        shard.write_bytes(bytes(data))
    src = open_features(folder)
    with pytest.raises(IntegrityError) as err:
        src.sample(0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(shard)) and "rerun the stage" in msg, msg


def test_damaged_weights_are_one_line(tiny, tiny_features, tmp_path):
    import shutil

    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.core.integrity import IntegrityError
    from kvshot.drafters import load_drafter
    from kvshot.train.variants import build_variant, draft_vocab

    target_dir = tmp_path / "target"
    shutil.copytree(tiny["model"], target_dir)
    target = load_target(target_dir, tiny["rt"])
    d2t = draft_vocab(open_features(tiny_features["train"]), 64, target.config.vocab_size)
    drafter = build_variant(section(VariantSettings, {"name": "kv", "paradigm": "kv", "layers": 1}), target.config,
                            target.model.embed_tokens.weight.detach(), d2t)
    drafter.save(tmp_path / "drafter")
    load_drafter(tmp_path / "drafter", need_embedding=False)   # intact: loads
    _flip(tmp_path / "drafter/model.safetensors", 200)
    with pytest.raises(IntegrityError, match=r"drafter/model.safetensors: checksum mismatch"):
        load_drafter(tmp_path / "drafter", need_embedding=False)
    weights = target_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(IntegrityError, match=r"target/model.safetensors: \d+ bytes where \d+ were written"):
        load_target(target_dir, tiny["rt"])


# ---------------------------------------------------------------- data as a real input, without duplicates

def _sharegpt(path, n: int, extra: int = 0) -> None:
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]
    path.write_text(json.dumps(rows + rows[:extra]))


def test_packaged_sharegpt_split_has_no_shared_conversation(tmp_path):
    """The default config's split of the packaged ShareGPT file: duplicates (743 exact copies
    among its 17,322 kept records, a few more near-exact) removed before the split."""
    from kvshot.data.sources import LoadStats, iter_sharegpt_file, read_jsonl, sharegpt_package_path
    from kvshot.data.split import conversation_key, normalize_text, prepare_data

    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())["data"]
    stats = prepare_data(section(DataSource, cfg["sources"]), cfg["train_samples"], cfg["eval_samples"], 0, tmp_path)
    exact: set[str] = set()
    for messages in iter_sharegpt_file(sharegpt_package_path(), LoadStats("package")):
        exact.add(json.dumps(messages))
    kept = stats["sources"][0]["kept"]
    print(f"\npackaged ShareGPT: {kept} kept, {kept - len(exact)} exact copies, "
          f"{stats['duplicates_removed']} duplicates removed (normalized)")
    assert kept - len(exact) == 743 and stats["duplicates_removed"] >= 743
    assert stats["duplicates_removed"] == stats["sources"][0]["duplicates_removed"]
    assert stats["available"] == kept - stats["too_short"] - stats["duplicates_removed"]
    train, evals = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "eval.jsonl")
    assert (len(train), len(evals)) == (3000, 100)

    def texts(rows):
        return {tuple((m["role"], normalize_text(m["content"])) for m in r["messages"]) for r in rows}

    assert not texts(train) & texts(evals) and len(texts(train)) == 3000 and len(texts(evals)) == 100
    assert not {conversation_key(r["messages"]) for r in train} & {conversation_key(r["messages"]) for r in evals}


# ---------------------------------------------------------------- one-line errors (issue 18, item 7)

def _continuations(path, cut: bool) -> None:
    text = json.dumps({"target": "t", "max_new_tokens": 4, "eos_id": 2,
                       "items": [{"prompt": [5, 6, 7], "continuation": [8, 9, 10, 2]}] * 4}, indent=2)
    path.write_text(text[: len(text) // 2] if cut else text.replace('"items"', '"itemz"'))


@pytest.mark.parametrize("stage", ["eval-stepwise", "eval-e2e"])
@pytest.mark.parametrize("cut", [True, False], ids=["truncated", "wrong-shape"])
def test_damaged_continuations_is_one_line(tmp_path, stage, cut):
    cont = tmp_path / "continuations.json"
    _continuations(cont, cut)
    proc = _stage(stage, "--config", str(REPO / "config/config.yaml"), "--config", str(REPO / "config/smoke.yaml"),
                  "--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target"),
                  "--prompts" if stage == "eval-e2e" else "--continuations", str(cont),
                  "--features-index", str(tmp_path / "index.json"),
                  "--out", str(tmp_path / "out.json"))
    line = _last_line(proc)
    what = "not a complete JSON file" if cut else "expected {'eos_id', 'items'"
    assert line.startswith(f"kvshot {stage}: error: {cont}: {what}") and "rerun" in line, line
    assert "Traceback" not in proc.stderr


def test_missing_local_pretrained_path_is_one_line(tmp_path):
    missing = tmp_path / "models" / "Qwen3-8B"
    overlay = tmp_path / "pre.yaml"
    overlay.write_text(yaml.safe_dump({"target": {"source": "pretrained", "name": str(missing)},
                                       "tokenizer": {"source": "pretrained", "name": "Qwen/Qwen3-8B"}}))
    proc = _stage("target", "--config", str(REPO / "config/config.yaml"), "--config", str(REPO / "config/smoke.yaml"),
                  "--config", str(overlay), "--train", "t.jsonl", "--eval", "e.jsonl", "--tokenizer", "tok",
                  "--out", str(tmp_path / "model"), "--metrics", str(tmp_path / "m.json"))
    line = _last_line(proc)
    assert line == (f"kvshot target: error: {overlay}: target.name: {missing} does not exist (a local path; "
                    "a hub id is 'owner/name'): fix the path, or download the model there"), line
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr   # was a 71-line traceback
    cfg = copy.deepcopy(tiny_config())
    for name in ("./models/x", "~/nowhere/x", "a/b/c"):   # only a local path can be spelled so
        cfg["tokenizer"].update(source="pretrained", name=name)
        with pytest.raises(ConfigError, match=r"my.yaml: tokenizer.name: .* does not exist"):
            validate_config(cfg, ["my.yaml"])
    cfg["tokenizer"].update(name="Owner/not-in-the-cache")   # a hub id: the stage loads it
    validate_config(cfg, ["my.yaml"])


@pytest.mark.parametrize("text,what", [("data:\n  train_samples: [1,\n", "not valid YAML"),
                                       ("", "<top level>: expected a mapping"),
                                       ("data:\n\ttrain_samples: 3\n", "not valid YAML")],
                         ids=["syntax", "empty", "tab"])
def test_broken_config_file_is_one_line_for_a_stage(tmp_path, text, what):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    line = _last_line(_stage("prepare-data", "--config", str(REPO / "config/config.yaml"), "--config", str(bad),
                             "--out", str(tmp_path / "data")))
    assert line.startswith(f"kvshot prepare-data: error: {bad}: ") and what in line, line


def test_nan_stop_is_one_line_naming_the_checkpoint(tiny, tiny_features, tmp_path, monkeypatch, capsys):
    import kvshot.train.loop as train_mod
    from kvshot.__main__ import main

    from .test_train import small_cfg

    real, calls = train_mod.weighted_loss, {"n": 0}

    def poisoned(losses, decay):
        calls["n"] += 1
        return real(losses, decay) * (float("nan") if calls["n"] == 4 else 1.0)

    monkeypatch.setattr(train_mod, "weighted_loss", poisoned)
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(small_cfg(tiny)))
    args = ["train-drafter", "--config", str(cfg_file), "--variant", "hyb", "--train-features",
            str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]), "--target", str(tiny["model"]),
            "--out", str(tmp_path / "out")]
    def error_line() -> str:   # tqdm's bar may redraw around it
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvshot train-drafter: error:")]
        assert len(lines) == 1, lines
        return lines[0]

    assert main(args) == 2
    line = error_line()
    ckpt = tmp_path / "out.ckpt/checkpoint.pt"
    assert line == f"kvshot train-drafter: error: train hyb: loss is nan at step 3; last good checkpoint: step 2 at {ckpt}"
    assert ckpt.is_file()   # the checkpoint it names exists
    monkeypatch.setattr(train_mod, "weighted_loss", lambda losses, decay: losses[0] * float("inf"))
    ckpt.unlink()
    assert main(args) == 2
    assert error_line().endswith("train hyb: loss is inf at step 0; no checkpoint yet")


# ---------------------------------------------------------------- kill during a checkpoint write

class _Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs."""


@pytest.mark.parametrize("moment", ["half-written", "before-rename"])
def test_kill_during_checkpoint_write_keeps_the_previous_and_resumes_bit_identically(
        tiny, tiny_features, tmp_path, monkeypatch, moment):
    import io

    import torch
    from safetensors.torch import load_file

    import kvshot.train.checkpoint as checkpoint_mod

    from .test_train import run, small_cfg

    cfg = small_cfg(tiny)   # 6 steps, checkpoints after steps 2 and 4
    run(tiny, tiny_features, cfg, tmp_path / "whole")
    real_save, real_replace, saves = torch.save, os.replace, {"n": 0}

    def dying_save(obj, f, *a, **kw):
        saves["n"] += 1
        if saves["n"] == 2 and moment == "half-written":   # the step-4 checkpoint, cut mid-write
            buf = io.BytesIO()
            real_save(obj, buf, *a, **kw)
            Path(f).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
            raise _Killed
        return real_save(obj, f, *a, **kw)

    def dying_replace(src, dst):
        if str(src).endswith("checkpoint.tmp") and saves["n"] == 2:   # written in full, not yet renamed
            raise _Killed
        return real_replace(src, dst)

    monkeypatch.setattr(torch, "save", dying_save)
    monkeypatch.setattr(checkpoint_mod.os, "replace", dying_replace)
    with pytest.raises(_Killed):
        run(tiny, tiny_features, cfg, tmp_path / "out")
    monkeypatch.setattr(torch, "save", real_save)
    monkeypatch.setattr(checkpoint_mod.os, "replace", real_replace)
    ckpt = tmp_path / "out.ckpt/checkpoint.pt"
    assert (tmp_path / "out.ckpt/checkpoint.tmp").exists() and not (tmp_path / "out").exists()
    assert torch.load(ckpt, weights_only=False)["progress"]["step"] == 2   # the previous one, intact
    metrics = run(tiny, tiny_features, cfg, tmp_path / "out")
    assert metrics["resumed_from"] == 2 and metrics["steps"] == 6
    a, b = load_file(str(tmp_path / "whole/model.safetensors")), load_file(str(tmp_path / "out/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "out.ckpt").exists()   # removed once the drafter is saved
