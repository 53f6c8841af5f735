"""The target stage and feature capture: cached features equal a fresh target forward."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from kvshot.capture.features import OfflineFeatures, batches, capture_split, open_features
from kvshot.capture.target import load_target, target_forward
from kvshot.config import feature_spec
from kvshot.core.io import read_json
from kvshot.data.tokenizer import load_tokenizer
from ..conftest import typed, section
from kvshot.settings import FeaturesSettings


def test_target_stage_records_heldout_loss_and_generations(tiny):
    m = read_json(tiny["metrics"])
    assert m["num_hidden_layers"] == 4 and m["source"] == "pretrain"
    assert math.isfinite(m["heldout_loss"]) and m["heldout_ppl"] == pytest.approx(math.exp(m["heldout_loss"]))
    assert m["heldout_loss"] < m["initial_heldout_loss"]  # three steps of training already help
    assert len(m["generations"]) == 2 and all(isinstance(g["greedy"], str) for g in m["generations"])
    # the saved folder is a HF model + tokenizer that loads back
    tok = load_tokenizer(tiny["model"])
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id


def test_target_pretraining_is_deterministic(tiny, tmp_path):
    from kvshot.capture.target import run_target_stage

    run_target_stage(typed(tiny["cfg"]), tiny["rt"], str(tiny["train"]), str(tiny["eval"]), str(tiny["tokenizer"]),
                     str(tmp_path / "model"), str(tmp_path / "metrics.json"))
    a = load_target(tiny["model"], tiny["rt"]).state_dict()
    b = load_target(tmp_path / "model", tiny["rt"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def captured(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("feat") / "train"
    summary = capture_split(typed(tiny["cfg"]), tiny["rt"], str(tiny["train"]), str(tiny["model"]), str(out))
    return out, summary


def _rope_keys(model, hidden_in, layer: int):
    """Keys recomputed by hand from a layer's input: k_norm(k_proj(ln(h))) then RoPE."""
    attn = model.model.layers[layer].self_attn
    x = model.model.layers[layer].input_layernorm(hidden_in)
    b, t, _ = x.shape
    k = attn.k_norm(attn.k_proj(x).view(b, t, -1, attn.head_dim)).transpose(1, 2)
    pos = torch.arange(t).unsqueeze(0)
    cos, sin = model.model.rotary_emb(x, pos)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k * cos + rotated * sin).transpose(1, 2)


def test_cached_features_equal_fresh_forward(tiny, captured):
    folder, _ = captured
    source = open_features(folder)
    assert isinstance(source, OfflineFeatures)
    model = load_target(tiny["model"], tiny["rt"])
    spec = source.spec
    assert spec.kv_layers == (0, 1, 2, 3) and spec.aux_layers == (1, 2, 3)
    for i in range(len(source)):
        s = source.sample(i)
        ids = s["input_ids"].long().unsqueeze(0)
        fresh = target_forward(model, ids, None, spec.aux_layers, spec.kv_layers)
        out = model.model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(s["aux_hidden"], fresh.aux_hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["last_hidden"], fresh.last_hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["aux_hidden"][:, 0], out.hidden_states[1][0], atol=1e-5, rtol=1e-5)
        for l in spec.kv_layers:
            torch.testing.assert_close(s[f"key_{l}"], fresh.keys[l][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s[f"value_{l}"], fresh.values[l][0], atol=1e-5, rtol=1e-5)
            # keys are the RoPE-rotated ones the target attends with
            torch.testing.assert_close(s[f"key_{l}"], _rope_keys(model, out.hidden_states[l], l)[0],
                                       atol=1e-5, rtol=1e-4)


def test_final_hidden_gives_target_logits(tiny, captured):
    source = open_features(captured[0])
    model = load_target(tiny["model"], tiny["rt"])
    s = source.sample(0)
    logits = model(input_ids=s["input_ids"].long().unsqueeze(0)).logits[0]
    torch.testing.assert_close(model.lm_head(s["last_hidden"]), logits, atol=1e-5, rtol=1e-5)


def test_bytes_per_token_is_the_sum_of_parts(captured):
    folder, summary = captured
    spec = open_features(folder).spec
    per_token = sum(summary["bytes_per_token_by_tensor"].values())
    assert summary["bytes_per_token"] == pytest.approx(per_token)
    # no padding: every tensor holds exactly one row per token
    on_disk = sum(p.stat().st_size for p in folder.glob("shard-*.safetensors"))
    assert summary["bytes_written"] <= on_disk < summary["bytes_written"] + 4096 * len(summary["shards"])
    h, kvh, d = summary["hidden_size"], summary["num_key_value_heads"], summary["head_dim"]
    expect = 4 + 1 + 4 * (3 * h + h + 2 * len(spec.kv_layers) * kvh * d)
    assert per_token == expect
    assert summary["feature_bytes_per_token"] == expect - 5


def test_loss_mask_marks_assistant_tokens(captured, tiny):
    source = open_features(captured[0])
    tok = load_tokenizer(tiny["model"])
    s = source.sample(0)
    masked = tok.decode(s["input_ids"][s["loss_mask"].bool()].tolist())
    assert masked.endswith("<|im_end|>") and "<|im_start|>" not in masked


def test_online_source_matches_offline(tiny, captured, tmp_path, monkeypatch):
    """Online capture tokenizes and reads the target's config, never its weights (at paper
    scale: a booked GPU and 16 GB loaded for nothing); the online source then matches offline."""
    import kvshot.capture.features as features_mod

    cfg = copy.deepcopy(tiny["cfg"])
    cfg["features"]["mode"] = "online"
    with monkeypatch.context() as m:
        m.setattr(features_mod, "load_target", lambda *a, **k: pytest.fail("online capture loaded the target"))
        index = capture_split(typed(cfg), tiny["rt"], str(tiny["train"]), str(tiny["model"]), str(tmp_path / "online"))
    assert index["hidden_size"] == open_features(captured[0]).index["hidden_size"]
    assert index["feature_bytes_per_token"] == open_features(captured[0]).index["feature_bytes_per_token"]
    online = open_features(tmp_path / "online", tiny["rt"])
    offline = open_features(captured[0])
    assert online.index["bytes_per_token"] == 5  # tokens only: features are recomputed
    b_on = next(batches(online, 4, shuffle=True, seed=3))
    b_off = next(batches(offline, 4, shuffle=True, seed=3))
    assert b_on.keys() == b_off.keys()
    for k in b_on:
        torch.testing.assert_close(b_on[k], b_off[k], atol=1e-5, rtol=1e-5)


def test_sources_read_only_the_layers_a_drafter_needs(tiny, captured, tmp_path):
    """Both modes can hold just some KV layers and no aux hidden states (online: the target's
    other layers never leave it); what they hold equals the full read."""
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["features"]["mode"] = "online"
    capture_split(typed(cfg), tiny["rt"], str(tiny["train"]), str(tiny["model"]), str(tmp_path / "online"))
    full = next(batches(open_features(captured[0]), 3))
    for folder in (captured[0], tmp_path / "online"):
        src = open_features(folder, tiny["rt"], kv_layers=[1, 3], aux_hidden=False)
        part = next(batches(src, 3))
        assert set(part) == {"input_ids", "loss_mask", "attention_mask", "last_hidden",
                             "key_1", "value_1", "key_3", "value_3"}
        for k in part:
            torch.testing.assert_close(part[k], full[k], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"spec.kv_layers: layers \[7\] are not captured"):
        open_features(captured[0], kv_layers=[1, 7])


def test_batches_pad_and_mask(captured):
    source = open_features(captured[0])
    seen = []
    for b in batches(source, 5, shuffle=True, seed=0, epoch=1):
        lengths = b["attention_mask"].sum(1)
        assert b["input_ids"].shape[:2] == b["attention_mask"].shape
        assert (b["loss_mask"].bool() & ~b["attention_mask"].bool()).sum() == 0
        seen += lengths.tolist()
    assert sorted(seen) == sorted(s[2] for s in source.index["samples"])


def test_failed_capture_leaves_nothing(tiny, tmp_path):
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["features"]["kv_layers"] = [0, 9]  # a 4-layer target has no layer 9
    with pytest.raises(Exception, match="kv_layers"):
        capture_split(typed(cfg), tiny["rt"], str(tiny["train"]), str(tiny["model"]), str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


def test_feature_spec_convention():
    from kvshot.config import ConfigError, eagle3_aux_layers, fill_defaults

    assert eagle3_aux_layers(36) == (2, 18, 33)  # Qwen3-8B
    def features(**given) -> dict:   # as the stages get them: the schema's defaults filled in
        return fill_defaults({"features": {"aux_layers": None, "kv_layers": "all", "dtype": "float32", **given}})["features"]

    assert feature_spec(section(FeaturesSettings, features()), 8).aux_layers == (2, 4, 7)   # aux_rule: the schema's default, relative
    assert feature_spec(section(FeaturesSettings, features(aux_rule="eagle3")), 8).aux_layers == (2, 4, 5)
    with pytest.raises(ConfigError, match="features.aux_layers"):
        feature_spec(section(FeaturesSettings, features()), 4)  # (2, 2, 1) is not three layers
