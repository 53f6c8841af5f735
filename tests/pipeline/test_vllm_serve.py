"""kvshot's EAGLE-3 and DFlash-layout block drafters in vLLM, end to end (`python -m kvshot serve`,
kvshot.serve): a tiny Qwen3 target, an EAGLE-3 drafter and a block-dflash drafter trained here by
kvshot's trainer, exported (`kvshot export --format eagle3 | dflash`), then loaded by vLLM's own
loaders and served by its CPU build in its own venv (built once per machine and cached,
kvshot.serve.environment; .ci/run starts the build in the background). vLLM's speculative output
must equal its plain output, token for token, at every K; vLLM's acceptance per verify step must
equal kvshot's per round on the same prompts (for the block drafter: kvshot's decoder drafting
K tokens with a block of K + 1, as vLLM does); its Prometheus counters must equal its per-request
counts; and any difference between vLLM's plain decoding and kvshot's must be a near-tie of the
target's top two logits. In the pipeline tier: it starts three vLLM engines (~2 min of CPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshot.config import stage_config
from kvshot.serve import environment
from ..conftest import REPO, synthetic_conversations, tiny_config, typed, write_jsonl

pytestmark = pytest.mark.pipeline
KS = [3]        # one K (the stage's K list is unit-tested): the test's engines cost CI time
PROMPTS = 3
DRAFTERS = ("eagle3", "block-dflash")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from kvshot.capture.features import capture_split
    from kvshot.capture.target import run_target_stage
    from kvshot.config import runtime
    from kvshot.data.tokenizer import build_tokenizer
    from kvshot.evaluate.references import run_continuations_stage
    from kvshot.train.loop import train_variant
    from kvshot.__main__ import main

    python = environment.ensure_venv()   # first: a failed build fails here, in one message with its log
    root = tmp_path_factory.mktemp("serve")
    cfg = tiny_config()
    cfg["target"]["arch"]["head_dim"] = 32       # vLLM's CPU attention takes head sizes 32, 64, ... (not 16)
    cfg["target"]["pretrain"]["max_steps"] = 40  # a target with some structure for the drafter to learn
    cfg["drafters"]["train"].update(max_steps=60, eval_every=30, ckpt_every=30)
    cfg["serve"] = {"ks": KS, "prompts": PROMPTS, "max_new_tokens": 16, "repeats": 1, "compile": False}
    if all(v["name"] != "block-dflash" for v in cfg["blockwise"]["variants"]):   # the smoke's list has none
        cfg["blockwise"]["variants"].append({"name": "block-dflash", "paradigm": "block", "context": "dflash", "layers": 1})
    tcfg = typed(cfg)
    rt = runtime(tcfg)
    train = write_jsonl(root / "data/train.jsonl", synthetic_conversations(60, seed=1))
    evals = write_jsonl(root / "data/eval.jsonl", synthetic_conversations(12, seed=2))
    build_tokenizer(tcfg.tokenizer, train, root / "tokenizer")
    model = root / "model"
    run_target_stage(tcfg, rt, str(train), str(evals), str(root / "tokenizer"), str(model), str(root / "metrics.json"))
    feats = {s: root / "features" / s for s in ("train", "eval")}
    for split, jsonl in (("train", train), ("eval", evals)):
        capture_split(tcfg, rt, str(jsonl), str(model), str(feats[split]))
    drafters, exports = [], []
    for name, fmt in zip(DRAFTERS, ("eagle3", "dflash")):
        drafter, export = root / f"drafters/{name}/seed0", root / f"export/{name}"
        train_variant(tcfg, rt, name, str(feats["train"]), str(feats["eval"]), str(model), str(drafter))
        assert main(["export", "--format", fmt, str(drafter), str(export), "--target", str(model),
                     "--config", json.dumps(stage_config(cfg, "features"))]) == 0
        drafters.append(str(drafter))
        exports.append(str(export))
    natural = root / "eval/natural.json"
    run_continuations_stage(tcfg, rt, str(evals), str(model), str(root / "eval/continuations.json"), str(natural))
    out = root / "serve/vllm.json"
    cmd = [sys.executable, "-m", "kvshot", "serve", "--threads", "1",
           "--config", json.dumps(stage_config(cfg, "target", "drafters", "eval", "serve")),
           "--target", str(model), "--export", *exports, "--drafter", *drafters, "--prompts", str(natural),
           "--features-index", str(feats["eval"] / "index.json"), "--out", str(out), "--table", str(out.with_suffix(".md"))]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"running the stage in {python.parent.parent}" in done.stdout   # the project env re-ran it in vLLM's
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_vllm_speculative_output_equals_vllm_plain_at_every_k(served):
    result, _ = served
    assert not result["refused"]
    spec = result["check"]["spec_vs_vllm_plain"]
    assert sorted(spec) == sorted(f"vllm {d} K={k}" for d in DRAFTERS for k in KS)
    assert all(v == [] for v in spec.values()), spec
    for name, row in result["throughput"].items():   # the whole set in one batch: the same outputs
        assert row["mismatches_vs_batch1_plain"] == [], name


def test_vllm_acceptance_equals_kvshots_round_by_round(served):
    result, md = served
    for d in DRAFTERS:
        for k in KS:
            row = result["check"]["acceptance"][f"{d} K={k}"]
            assert row["prompts_differing"] == [], (d, row["prompts_differing"])
            assert row["vllm"] == row["kvshot"]
            assert row["vllm"]["drafts"] > 0 and row["vllm"]["draft_tokens"] == k * row["vllm"]["drafts"]
        assert sum(result["check"]["acceptance"][f"{d} K={k}"]["vllm"]["accepted"] for k in KS) > 0, \
            f"the trained {d} drafter accepted nothing: the comparison would be vacuous"
    assert result["check"]["prometheus_cross_check"]["equal"], result["check"]["prometheus_cross_check"]
    assert "prompts whose rounds differ | 0 |" in md


def test_vllm_plain_differs_from_kvshot_plain_only_at_near_ties(served):
    result, _ = served
    vp = result["check"]["vllm_plain_vs_kvshot_plain"]
    assert all(d["near_tie"] for d in vp["divergences"]), vp["divergences"]
    assert result["check"]["vs_kvshot_plain"]["hf generate"] == []
    assert all(v == [] for n, v in result["check"]["vs_kvshot_plain"].items() if n.startswith("kvshot"))
    assert set(result["timed"]) >= {"hf generate", "vllm plain", "kvshot eagle3 chain K=3", "kvshot block-dflash block K=3",
                                    "vllm block-dflash K=3"}
