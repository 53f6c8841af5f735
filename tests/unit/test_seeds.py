"""Training seeds and training length: a variant's seeds pooled in one evaluation with each
seed's own record, the held-out curve with its plateau stop, the live JSON-lines log, the
aux-layer rule, and the report's training table and time-cap warning."""
from __future__ import annotations

import json

import pytest
import torch

from kvshot.config import ConfigError, default_aux_layers
from kvshot.train.heldout import plateaued

from .test_train import run, small_cfg
from ..conftest import typed, section
from kvshot.settings import NaturalSettings, VariantSettings


def curve(*losses, acc0=None):
    acc0 = acc0 or [0.5] * len(losses)
    return [{"step": 10 * (i + 1), "heldout_loss": x, "heldout_acc_k": [a, a / 2]}
            for i, (x, a) in enumerate(zip(losses, acc0))]


def test_plateau_needs_patience_evaluations_without_a_real_gain():
    assert not plateaued(curve(3.0, 2.0, 1.5), 2, 0.01, 0.005)               # still falling
    assert plateaued(curve(3.0, 2.0, 1.5, 1.499, 1.51), 2, 0.01, 0.005)      # 0.07% and worse: flat
    assert not plateaued(curve(3.0, 2.0, 1.5, 1.6, 1.4), 2, 0.01, 0.005)     # the last beats the best by 6.7%
    assert not plateaued(curve(3.0, 3.0), 2, 0.01, 0.005)                    # too few points to judge
    assert not plateaued(curve(3.0, 3.0, 3.0), 0, 0.01, 0.005)               # patience 0: never


def test_plateau_waits_for_acc0_while_the_loss_sits_on_the_entropy_floor():
    # issue 28: the held-out loss falls 0.2-0.6% per point while acc_0 climbs 0.48 -> 0.68
    losses = (2.00, 1.995, 1.991, 1.988, 1.986)
    climbing = [0.48, 0.52, 0.56, 0.60, 0.64]
    assert not plateaued(curve(*losses, acc0=climbing), 2, 0.005, 0.005)    # loss flat, acc_0 +0.04 a point
    flat = [0.48, 0.52, 0.56, 0.562, 0.559]
    assert plateaued(curve(*losses, acc0=flat), 2, 0.005, 0.005)            # both flat: stop
    assert not plateaued(curve(*losses, acc0=[0.48, 0.52, 0.56, 0.56, 0.566]), 2, 0.005, 0.005)   # +0.006 > 0.005
    assert not plateaued(curve(3.0, 2.0, 1.5, 1.4, 1.3, acc0=[0.5] * 5), 2, 0.005, 0.005)        # acc_0 flat, loss falls


def test_heldout_curve_reads_the_validation_split(tiny, tiny_features, tmp_path):
    """The held-out curve (and so the plateau stop) reads the validation features, never the
    evaluation's: two runs that differ only in the curve's split train the same drafter (same
    final metrics on eval), and only the one without a val split has a curve equal to them."""
    from kvshot.capture.features import capture_split
    from kvshot.train.loop import train_variant

    from ..conftest import synthetic_conversations, write_jsonl

    val_jsonl = write_jsonl(tmp_path / "val.jsonl", synthetic_conversations(6, seed=3))
    val = tmp_path / "features_val"
    capture_split(typed(tiny["cfg"]), tiny["rt"], str(val_jsonl), str(tiny["model"]), str(val))
    cfg = small_cfg(tiny, max_steps=4, eval_every=4, eval_batches=2)
    args = (typed(cfg), tiny["rt"], "hyb", str(tiny_features["train"]), str(tiny_features["eval"]), str(tiny["model"]))
    with_val = train_variant(*args, str(tmp_path / "a"), val_dir=str(val))
    on_eval = train_variant(*args, str(tmp_path / "b"))
    assert (with_val["heldout_split"], on_eval["heldout_split"]) == ("val", "eval")
    assert with_val["eval"]["loss"] == on_eval["eval"]["loss"]                     # the same drafter
    assert on_eval["heldout_curve"][-1]["heldout_loss_k"] == pytest.approx(on_eval["eval"]["loss"])
    assert with_val["heldout_curve"][-1]["heldout_loss_k"] != pytest.approx(with_val["eval"]["loss"])


def test_heldout_curve_plateau_stop_and_live_log(tiny, tiny_features, tmp_path):
    # a 50% gain per evaluation is out of reach: the plateau stops training after patience + 1 points
    cfg = small_cfg(tiny, max_steps=40, eval_every=2, plateau={"patience": 2, "min_delta": 0.5, "min_acc_delta": 0.5},
                    log_every=1)
    metrics = run(tiny, tiny_features, cfg, tmp_path / "out")
    assert metrics["stopped_by"] == "plateau" and metrics["steps"] == 6
    assert [p["step"] for p in metrics["heldout_curve"]] == [2, 4, 6]
    assert all(len(p["heldout_loss_k"]) == cfg["drafters"]["ttt_steps"] for p in metrics["heldout_curve"])
    lines = [json.loads(x) for x in (tmp_path / "out/train_log.jsonl").read_text().splitlines()]
    assert sum("heldout_loss" in r for r in lines) == 3 and sum("loss" in r for r in lines) == 6
    assert [r["step"] for r in lines] == sorted(r["step"] for r in lines)
    # without a plateau rule the same run trains every step, and the curve is still recorded
    cfg = small_cfg(tiny, max_steps=6, eval_every=3)
    metrics = run(tiny, tiny_features, cfg, tmp_path / "full")
    assert metrics["stopped_by"] == "max_steps" and [p["step"] for p in metrics["heldout_curve"]] == [3, 6]


def test_seed_changes_the_drafter_and_is_recorded(tiny, tiny_features, tmp_path):
    cfg = small_cfg(tiny, max_steps=2)
    a = run(tiny, tiny_features, cfg | {"seed": 0}, tmp_path / "s0")
    other = dict(tiny["rt"].__dict__)
    other["seed"] = 1
    from kvshot.config import Runtime
    from kvshot.train.loop import train_variant

    b = train_variant(typed(cfg | {"seed": 1}), Runtime(**other), "hyb", str(tiny_features["train"]),
                      str(tiny_features["eval"]), str(tiny["model"]), str(tmp_path / "s1"))
    assert (a["seed"], b["seed"]) == (0, 1)
    from safetensors.torch import load_file

    wa, wb = load_file(str(tmp_path / "s0/model.safetensors")), load_file(str(tmp_path / "s1/model.safetensors"))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_seeds_pool_per_sequence_and_keep_each_seeds_record(tiny, tiny_features):
    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.data.tokenizer import load_tokenizer
    from kvshot.evaluate.branches import branch_items, natural_conversations, rollout
    from kvshot.evaluate.references import prompt_conversations
    from kvshot.evaluate.stepwise import stepwise, stepwise_seeds
    from kvshot.train.variants import draft_vocab

    from .test_drafters import K, make

    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    tok = load_tokenizer(tiny["tokenizer"])
    convs = natural_conversations(target, tok, prompt_conversations(tiny["eval"], 100), 16, 80, K + 1, 0, "cpu")
    items = [it | {"continuation": rollout(it["continuation"], K + 1, tok.eos_token_id)}   # as per-anchor items
             for c in convs for it in branch_items(c)]
    d2t = draft_vocab(src, 150, target.config.vocab_size)
    drafters = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        drafters.append((seed, make((src, target, d2t), "kv")))
    pooled = stepwise_seeds(drafters, target, items, src.spec.aux_layers, K, 8, "cpu", bootstrap_samples=20)
    own = [stepwise(d, target, items, src.spec.aux_layers, K, 8, "cpu", bootstrap_samples=20) for _, d in drafters]
    assert [s["seed"] for s in pooled["per_seed"]] == [3, 4]
    for k in range(K):
        assert pooled["rounds"][k] == own[0]["rounds"][k] + own[1]["rounds"][k]
        assert pooled["accepted"][k] == own[0]["accepted"][k] + own[1]["accepted"][k]
        assert pooled["per_seed"][1]["rounds"][k] == own[1]["rounds"][k]
    assert pooled["sequences"] == own[0]["sequences"]          # seeds share the sequences the bootstrap resamples
    mats = [o["mat"] for o in own]
    spread = pooled["across_seeds"]["mat"]
    assert spread["min"] == min(mats) and spread["max"] == max(mats)
    assert spread["mean"] == pytest.approx(sum(mats) / 2)


def test_aux_rule_puts_the_high_tap_at_eagle3s_relative_depth():
    assert default_aux_layers(36) == default_aux_layers(36, "eagle3") == (2, 18, 33)   # Qwen3-8B unchanged
    assert default_aux_layers(8) == (2, 4, 7) and default_aux_layers(8, "eagle3") == (2, 4, 5)
    assert default_aux_layers(40) == (2, 20, 37)
    with pytest.raises(ConfigError, match="features.aux_rule"):
        default_aux_layers(8, "top")


def test_training_table_and_time_cap_warning(tmp_path):
    from kvshot.report.claims import claims_markdown
    from kvshot.report.results import Variant
    from kvshot.report.tables import time_capped, training_rows, training_summary_rows

    seeds = [{"seed": 0, "steps": 300, "stopped_by": "plateau", "heldout_curve": curve(3.0, 2.5, 2.49)},
             {"seed": 1, "steps": 90, "stopped_by": "max_minutes", "heldout_curve": []}]
    v = Variant(name="kv-d2", paradigm="kv", layers=2, stepwise={}, train=seeds[0] | {"per_seed": seeds})
    rows = training_rows([v])
    assert [(r["seed"], r["stopped by"], r["held-out loss best"]) for r in rows] == [(0, "plateau", 2.49), (1, "max_minutes", None)]
    summary = training_summary_rows([v])[0]
    assert summary["seeds"] == 2 and summary["stopped by"] == "max_minutes x1, plateau x1"
    assert summary["last interval change (mean)"] == f"{100 * (2.49 - 2.5) / 2.5:+.2f}%" and summary["interval (steps)"] == 10
    capped = time_capped([v], {"stopped_by": "max_minutes", "train_steps": 98})
    assert capped == ["target (98 steps)", "kv-d2 seed 1 (90 steps)"]
    assert "kv-d2 seed 1" in claims_markdown([], capped) and "Warning" not in claims_markdown([], [])


def test_head_init_target_starts_from_the_targets_head_rows(tiny, tiny_features):
    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.train.variants import build_variant, draft_vocab, variant_config

    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    d2t = draft_vocab(src, 150, target.config.vocab_size)
    cfg = small_cfg(tiny)
    embed = target.model.embed_tokens.weight.detach()
    for head_init, same in (("target", True), ("random", False)):
        cfg["drafters"]["head_init"] = head_init
        v = variant_config(typed(cfg), "kv2")
        assert v.head_init == head_init
        model = build_variant(v, target.config, embed, d2t, target)
        assert torch.equal(model.lm_head.weight, target.lm_head.weight[d2t]) is same
        assert torch.equal(model.norm.weight, target.model.norm.weight) is same
