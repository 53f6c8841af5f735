"""Run fingerprints and the stage-by-stage comparison of two runs (kvshot.report.fingerprint), on
results folders in the pipeline's layout, with one known change planted in the second."""
from __future__ import annotations

import json
import shutil
import struct

import pytest

from kvshot.report.fingerprint import compare_runs, comparison_text, fingerprints, write_fingerprints


def safetensors_bytes(tensors: dict[str, list[float]]) -> bytes:
    """A safetensors file of F32 vectors, written by hand (the reader under test reads no torch)."""
    header, data = {}, b""
    for name, values in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def write(path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.fixture()
def run(tmp_path):
    root = tmp_path / "a" / "results"
    for split in ("train", "eval", "val"):
        write(root / f"data/{split}.jsonl", "".join(json.dumps({"id": f"{split}{i}"}) + "\n" for i in range(3)))
    write(root / "target/tokenizer/tokenizer.json", '{"model": "bpe"}')
    write(root / "target/model/model.safetensors",
          safetensors_bytes({"embed": [0.5, 1.5, 2.5], "norm": [1.0, 1.0], "lm_head": [3.0, 4.0]}))
    write(root / "target/model/checksums.json", "{}")
    write(root / "target/metrics.json", json.dumps({"heldout_loss": 2.5, "train_seconds": 91.2}))
    write(root / "features/train/shard-00000.safetensors", safetensors_bytes({"aux_hidden": [1.0, 2.0]}))
    for variant in ("eagle3", "kv-d2"):
        for seed in (0, 1):
            write(root / f"drafters/{variant}/seed{seed}/model.safetensors",
                  safetensors_bytes({"fc": [float(seed), 2.0, 3.0], "head": [1.0]}))
            write(root / f"drafters/{variant}/seed{seed}/metrics.json", json.dumps({"steps": 250, "seconds": 60.0}))
        write(root / f"eval/{variant}/e2e.json",
              json.dumps({"tau": 2.25, "modes": {"chain": {"tau": 2.25, "tokens_per_s": 812.5, "speedup": 1.4}}}))
    write(root / "claims.json", json.dumps([{"claim": "P1", "verdict": "inconclusive"}]))
    return root


def twin(run):
    other = run.parent.parent / "b" / "results"
    shutil.copytree(run, other)
    return other


def test_identical_runs_have_one_fingerprint_and_no_difference(run):
    prints = fingerprints(run)
    assert list(prints["stages"]) == ["data", "tokenizer", "target", "features", "drafter eagle3/seed0",
                                      "drafter eagle3/seed1", "drafter kv-d2/seed0", "drafter kv-d2/seed1",
                                      "evaluation eagle3", "evaluation kv-d2", "claims"]
    assert "target/model/checksums.json" not in prints["files"]   # a manifest repeats its folder
    report = compare_runs(run, twin(run))
    assert report["first"] is None and report["run"][0] == report["run"][1] == prints["run"]
    assert comparison_text(report, "a", "b").endswith("identical\n")


def test_clock_fields_do_not_change_a_fingerprint(run):
    other = twin(run)
    write(other / "target/metrics.json", json.dumps({"heldout_loss": 2.5, "train_seconds": 47.0}))
    write(other / "eval/kv-d2/e2e.json",
          json.dumps({"tau": 2.25, "modes": {"chain": {"tau": 2.25, "tokens_per_s": 1404.0, "speedup": 2.1}}}))
    assert fingerprints(other)["run"] == fingerprints(run)["run"]
    write(other / "eval/kv-d2/e2e.json",
          json.dumps({"tau": 2.5, "modes": {"chain": {"tau": 2.25, "tokens_per_s": 1404.0, "speedup": 2.1}}}))
    report = compare_runs(run, other)
    assert report["first"] == {"stage": "evaluation kv-d2", "where": "eval/kv-d2/e2e.json: field tau: 2.25 against 2.5"}


def test_the_first_differing_stage_and_tensor_are_named(run):
    """A one-ulp change in the target's lm_head and a changed drafter downstream: the comparison
    names the target (the earlier stage), its file and the tensor, with the count and size."""
    other = twin(run)
    bumped = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", 4.0))[0] + 1))[0]
    write(other / "target/model/model.safetensors",
          safetensors_bytes({"embed": [0.5, 1.5, 2.5], "norm": [1.0, 1.0], "lm_head": [3.0, bumped]}))
    write(other / "drafters/kv-d2/seed1/model.safetensors", safetensors_bytes({"fc": [1.0, 2.0, 3.5], "head": [1.0]}))
    report = compare_runs(run, other)
    assert report["first"]["stage"] == "target"
    assert report["first"]["where"] == ("target/model/model.safetensors: tensor lm_head F32[2]: 1 of 2 elements "
                                        "differ (first at 1), max |diff| 4.77e-07")
    status = {r["stage"]: r["status"] for r in report["stages"]}
    assert status["data"] == status["tokenizer"] == status["drafter eagle3/seed0"] == "same"
    assert status["target"] == status["drafter kv-d2/seed1"] == "differs"
    kv = next(r for r in report["stages"] if r["stage"] == "drafter kv-d2/seed1")
    assert kv["first"].endswith("tensor fc F32[3]: 1 of 3 elements differ (first at 2), max |diff| 0.5")
    assert "first difference: target: target/model/model.safetensors: tensor lm_head" in comparison_text(report, "a", "b")


def test_a_data_line_and_a_missing_stage(run):
    other = twin(run)
    write(other / "data/eval.jsonl", "".join(json.dumps({"id": f"eval{i}"}) + "\n" for i in (0, 2, 1)))
    shutil.rmtree(other / "drafters/eagle3/seed1")
    report = compare_runs(run, other)
    assert report["first"] == {"stage": "data", "where": "data/eval.jsonl: line 2 differs"}
    assert {"stage": "drafter eagle3/seed1", "status": "missing in the second"} in report["stages"]


def test_the_written_file_carries_the_machine(run, tmp_path):
    machine = {"numerics": "portable", "cpu": "test CPU", "kernels": "AVX2"}
    digest = write_fingerprints(run, tmp_path / "fingerprints.json", machine)
    saved = json.loads((tmp_path / "fingerprints.json").read_text())
    assert saved["run"] == digest == fingerprints(run)["run"] and saved["machine"] == machine
    assert saved["stages"]["target"] == fingerprints(run)["stages"]["target"]
