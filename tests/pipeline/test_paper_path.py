"""The paper path end to end on CPU: `config/paper.yaml` overlaid only with sizes and
`device: cpu`, against an offline hub cache holding a tiny random Qwen3 (bf16, saved with
`save_pretrained`, Qwen3's special tokens and thinking switch) and the three hub datasets in
their own schemas. It covers the pretrained target and tokenizer, the hub loaders, online
features, bf16 target and drafters, DDP with 2 processes, tree-mode e2e and the data-scaling
sweep with 2 points (of one variant): the code a paper run executes, at toy sizes."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import yaml

from kvshot.config import merge

from ..conftest import REPO
from ..dag import snakemake, workdir
from ..paper_fixture import CPU_SIZES, build_hub_cache, offline_env


# Sizes only (and the device): everything else is paper.yaml as a researcher runs it.
OVERLAY = merge(CPU_SIZES, {
    "drafters": {"draft_vocab_size": 256,
                 "train": {"batch_size": 4, "max_len": 96, "max_steps": 4, "warmup_steps": 1, "log_every": 1,
                           "ckpt_every": 2, "eval_batches": 2, "num_processes": 2}},
    "eval": {"max_new_tokens": 16, "natural": {"anchors": 64}, "e2e": {"max_new_tokens": 12}},
    # two points of one variant: scaling_train is train_drafter's rule with an overlay, the same for every variant
    "scaling": {"train_samples": [40, 80], "variants": ["kv-d1"]},
})
VARIANTS = ("eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone")


def _failure(log) -> str:
    """A failed job's log, shortened: its error lines (a DDP rank's error sits above the
    launcher's own traceback) and its end."""
    text = log.read_text(errors="replace")
    if "Traceback" not in text:
        return ""
    errors = [line for line in text.splitlines() if re.search(r"Error|error:", line)][:20]
    return f"\n--- {log.name}\n" + "\n".join(errors) + "\n...\n" + text[-1500:]


@pytest.mark.slow
def test_paper_config_runs_end_to_end_on_cpu(tmp_path):
    (tmp_path / "run").mkdir()
    wd = workdir(tmp_path / "run")
    home = tmp_path / "hf_home"
    env = {**os.environ, **offline_env(build_hub_cache(home), home)}
    overlay = tmp_path / "paper_cpu.yaml"
    overlay.write_text(yaml.safe_dump(OVERLAY))
    paper = yaml.safe_load((REPO / "config/paper.yaml").read_text())
    assert paper["device"] == "cuda" and paper["dtype"] == "bfloat16" and paper["features"]["mode"] == "online"

    proc = snakemake(wd, "all", "figures/scaling.pdf", "--cores", "2", "--configfile", "config/paper.yaml",
                     str(overlay), timeout=1800, env=env)
    logs = "".join(_failure(p) for p in sorted((wd / "logs").glob("*.log"))) if (wd / "logs").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + logs

    stats = json.loads((wd / "results/data/stats.json").read_text())
    sources = [s["source"] for s in stats["sources"]]
    assert sources == ["hub:Aeala/ShareGPT_Vicuna_unfiltered", "hub:HuggingFaceH4/ultrachat_200k"]
    assert all(s["kept"] > 0 for s in stats["sources"]) and stats["train"] > 0 and stats["eval"] == 16

    target = json.loads((wd / "results/target/metrics.json").read_text())
    assert target["source"] == "pretrained" and target["dtype"] == "bfloat16"
    assert target["num_hidden_layers"] == 8 and math.isfinite(target["heldout_loss"])
    for split in ("train", "eval"):
        assert json.loads((wd / f"results/features/{split}/index.json").read_text())["mode"] == "online"

    for name in VARIANTS:
        folder = wd / f"results/drafters/{name}/seed0"
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and metrics["steps"] == 4, metrics
        assert metrics["dtype"] == "bfloat16" and metrics["device"] == "cpu", metrics
        assert all(math.isfinite(l) for l in metrics["eval"]["loss"])
        log = json.loads((folder / "train_log.json").read_text())
        assert all(math.isfinite(r["loss"]) for r in log)
        stepwise = json.loads((wd / f"results/eval/{name}/stepwise.json").read_text())
        assert len(stepwise["alpha"]) == 7 and stepwise["rounds"][0] > 0
        e2e = json.loads((wd / f"results/eval/{name}/e2e.json").read_text())
        assert "tree" in e2e["modes"], e2e.keys()
        assert e2e["lossless"] is True, {k: e2e[k] for k in e2e if "lossless" in k or "exact" in k}

    # the eval prompts were rendered with Qwen3's template, thinking off
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(wd / "results/target/model"))
    continuations = json.loads((wd / "results/eval/continuations.json").read_text())["items"]
    prompt = tokenizer.decode(continuations[0]["prompt"])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), prompt[-80:]

    scaling = (wd / "results/scaling/scaling.csv").read_text()
    assert {int(n) for n in re.findall(r"^(\d+),", scaling, re.M)} >= {40, 80}, scaling
    for n in (40, 80):
        m = json.loads((wd / f"results/scaling/n{n}/drafters/kv-d1/seed0/metrics.json").read_text())
        assert m["train_samples"] == n and m["world_size"] == 2
    assert (wd / "figures/scaling.pdf").read_bytes()[:4] == b"%PDF"
    for log in (wd / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
