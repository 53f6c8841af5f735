"""Precision across stages: a bfloat16 runtime trains every paradigm under bf16 autocast with
fp32 parameters and optimizer state; bf16 features meet fp32 drafters at one cast; the bf16
unroll agrees with fp32 within bf16 rounding; evaluation and step-wise simulation run on
bf16 features and a bf16 target. bf16 matmuls are slow on a CPU: every shape here is tiny."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

import kvshot.drafters.attention as attention_backends
import kvshot.train.loop as train_mod
from kvshot.capture.features import capture_split, open_features
from kvshot.capture.target import load_target
from kvshot.config import Runtime, drafter_autocast
from kvshot.drafters.unroll import unroll
from kvshot.evaluate.stepwise import chain_correct, stepwise
from kvshot.train.heldout import evaluate
from kvshot.train.loop import train_variant

from ..conftest import build_test_drafter
from ..conftest import typed

K = 3
PARADIGMS = ["hidden", "kv", "hybrid", "standalone"]


def bf16_runtime(tiny) -> Runtime:
    return Runtime(device="cpu", dtype="bfloat16", threads=1, seed=tiny["rt"].seed)


@pytest.fixture(scope="module")
def bf16_features(tiny, tmp_path_factory):
    """The tiny target run in bf16, its features stored in bf16 (as paper.yaml sets both):
    offline for both splits, and the train split online."""
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["dtype"] = "bfloat16"
    cfg["features"].update(dtype="bfloat16", max_samples=8)
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for split in ("train", "eval"):
        out[split] = root / split
        capture_split(typed(cfg), bf16_runtime(tiny), str(tiny[split]), str(tiny["model"]), str(out[split]))
    cfg["features"]["mode"] = "online"
    out["online"] = root / "online"
    capture_split(typed(cfg), bf16_runtime(tiny), str(tiny["train"]), str(tiny["model"]), str(out["online"]))
    return out


def one_variant_cfg(tiny, paradigm: str, **train) -> dict:
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["dtype"] = "bfloat16"
    cfg["drafters"]["ttt_steps"] = K
    cfg["drafters"]["variants"] = [{"name": "v", "paradigm": paradigm, "layers": 1}]
    cfg["scaling"]["variants"] = ["v"]
    cfg["drafters"]["train"].update({"max_steps": 2, "ckpt_every": 1, "batch_size": 2, "max_len": 24,
                                     "eval_batches": 1, "log_every": 1, **train})
    return cfg


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_bf16_runtime_trains_in_bf16_with_fp32_state(tiny, bf16_features, tmp_path, monkeypatch, paradigm):
    """bf16 features, a bf16 target, runtime dtype bfloat16: training runs, the attention
    computes in bf16, parameters and optimizer state stay fp32, losses are finite."""
    seen = set()
    real = attention_backends.block_attention   # what the `block` backend calls (auto: CPU bf16)
    monkeypatch.setattr(attention_backends, "block_attention", lambda q, *a: seen.add(q.dtype) or real(q, *a))
    saved = []   # the checkpoint is removed once the drafter is saved: keep what was written
    real_save = train_mod.save_checkpoint
    monkeypatch.setattr(train_mod, "save_checkpoint",
                        lambda path, *a: (real_save(path, *a), saved.append(torch.load(path, weights_only=False))))
    cfg = one_variant_cfg(tiny, paradigm)
    out = tmp_path / "v"
    metrics = train_variant(typed(cfg), bf16_runtime(tiny), "v", str(bf16_features["train"]), str(bf16_features["eval"]),
                            str(tiny["model"]), str(out))
    assert seen == {torch.bfloat16}     # the portable attention, on bf16 operands (not the fp32 CPU kernel)
    log = json.loads((out / "train_log.json").read_text())
    assert len(log) == 2 and all(math.isfinite(r["loss"]) for r in log)
    assert all(math.isfinite(x) for x in metrics["eval"]["loss"]) and metrics["dtype"] == "bfloat16"
    ckpt = saved[-1]
    floats = {k: t for k, t in ckpt["model"].items() if t.is_floating_point()}
    assert floats and all(t.dtype == torch.float32 for t in floats.values())
    states = [t for s in ckpt["optimizer"]["state"].values() for k, t in s.items() if k != "step"]
    assert states and all(t.dtype == torch.float32 for t in states)
    assert all(t.dtype == torch.float32 for k, t in load_file(str(out / "model.safetensors")).items()
               if t.is_floating_point())


def test_online_bf16_features_hold_only_what_the_variant_reads(tiny, bf16_features, tmp_path):
    """Online features from a bf16 target: batches on the target's device in bf16, with only
    the variant's KV layers and no aux hidden states for a KV-only drafter; it trains on them."""
    rt = bf16_runtime(tiny)
    target = load_target(tiny["model"], rt)
    src = open_features(bf16_features["online"], rt, model=target, kv_layers=[3], aux_hidden=False)
    batch = src.batch([0, 1])
    assert set(batch) == {"input_ids", "loss_mask", "attention_mask", "last_hidden", "key_3", "value_3"}
    assert all(t.device == target.device for t in batch.values())
    assert batch["key_3"].dtype == torch.bfloat16
    pad = ~batch["attention_mask"].bool()
    assert pad.any() and not batch["key_3"][pad].any()          # padding is zero, as offline
    cfg = one_variant_cfg(tiny, "kv", max_steps=1)
    m = train_variant(typed(cfg), rt, "v", str(bf16_features["online"]), str(bf16_features["eval"]), str(tiny["model"]),
                      str(tmp_path / "v"))
    assert m["steps"] == 1 and all(math.isfinite(x) for x in m["eval"]["loss"])


def make(world, paradigm: str):
    return build_test_drafter(world, {"name": "p", "paradigm": paradigm, "layers": 2})


def short_batch(src, ids, length=32):
    return {k: v[:, :length] for k, v in src.batch(ids).items()}


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_bf16_autocast_unroll_agrees_with_fp32(drafter_world, paradigm):
    """The same fp32 drafter unrolled plainly and under the bf16 runtime's autocast: the logits
    agree within bf16 rounding, and the bf16 run really computed in bf16."""
    model = make(drafter_world, paradigm)
    batch = short_batch(drafter_world[0], [0, 1])
    with torch.no_grad():
        ref = unroll(model, batch, K).logits
        with drafter_autocast("cpu", "bfloat16"):
            low = unroll(model, batch, K).logits
    for r, l in zip(ref, low):
        assert l.dtype == torch.bfloat16 and not torch.equal(l.float(), r)
        scale = float(r.abs().max())
        torch.testing.assert_close(l.float(), r, atol=0.06 * scale, rtol=0.05)
        # the ranking is nearly the same: top-1 agrees on most rows
        assert float((l.float().argmax(-1) == r.argmax(-1)).float().mean()) > 0.8


def test_fp32_drafter_evaluates_bf16_features(tiny, drafter_world, bf16_features):
    """evaluate() on bf16 shards with an fp32 drafter and a bf16 target's head: plain fp32 and
    under the bf16 runtime's autocast; KV query error against the bf16 target too."""
    rt = bf16_runtime(tiny)
    target = load_target(tiny["model"], rt)
    src = open_features(bf16_features["eval"])
    assert src.sample(0)["aux_hidden"].dtype == torch.bfloat16
    for paradigm in ("hybrid", "kv"):
        model = make(drafter_world, paradigm)
        for dtype in ("float32", "bfloat16"):
            m = evaluate(model, src, target.lm_head.weight.detach(), K, 2, 1, target, dtype)
            assert all(math.isfinite(x) for x in m["loss"]) and all(-1 <= c <= 1 for c in m["query_cosine"])
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_stepwise_runs_an_fp32_drafter_on_a_bf16_target(tiny, drafter_world):
    """The step-wise simulation hands a bf16 target's raw features to an fp32 drafter (plain and
    under autocast): it runs, and its results come back on the CPU."""
    target = load_target(tiny["model"], bf16_runtime(tiny))
    src = drafter_world[0]
    items = []
    for i in range(3):
        ids = src.tokens(i)["input_ids"][:30].tolist()
        items.append({"prompt": ids[:8], "continuation": ids[8:]})
    model = make(drafter_world, "hybrid")
    aux = src.spec.aux_layers
    for dtype in ("float32", "bfloat16"):
        per_seq = list(chain_correct(model, target, items, aux, K, 2, "cpu", dtype))
        assert len(per_seq) == 3
        for rows, chain_ok, forced_ok in per_seq:
            assert chain_ok.shape == forced_ok.shape == (len(rows), K) and chain_ok.device.type == "cpu"
        result = stepwise(model, target, items, aux, K, 2, "cpu", bootstrap_samples=10, dtype=dtype)
        assert len(result["alpha"]) == K and all(0 <= a <= 1 for a in result["acc"])


@pytest.mark.parametrize("paradigm", ["hidden", "hybrid", "standalone"])
def test_e2e_drafts_in_the_training_precision(tiny, drafter_world, paradigm):
    """Decoding with the bf16 runtime's precision: the drafter computes under bf16 autocast, as
    in training and step-wise evaluation, while the target verifies in its own dtype; the
    output is still the target's greedy text."""
    from kvshot.evaluate.decode import plain_generate, speculative_generate
    from kvshot.evaluate.draft_tree import DraftSpec

    target = load_target(tiny["model"], tiny["rt"])
    model = make(drafter_world, paradigm).eval()
    src = drafter_world[0]
    ids = src.tokens(0)["input_ids"][:12].long()[None]
    aux = src.spec.aux_layers if model.reads_aux_hidden else None
    seen = {"drafter": set(), "target": set()}
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: seen["drafter"].add(o.dtype)),
             target.lm_head.register_forward_hook(lambda m, i, o: seen["target"].add(o.dtype))]
    try:
        out = {p: speculative_generate(target, model, ids, 10, None, aux, DraftSpec(depth=K), precision=p)
               for p in ("float32", "bfloat16")}
    finally:
        for h in hooks:
            h.remove()
    assert seen["drafter"] == {torch.float32, torch.bfloat16}   # one run each way
    assert seen["target"] == {target.dtype}
    plain = plain_generate(target, ids, 10, None).tokens
    assert out["float32"].tokens == out["bfloat16"].tokens == plain
