"""The seven cases of issue 39, each on a published config's field set (tests/unit/test_published_heads.py
builds the heads and the reference forward). Every test here fails on a8c3ac6."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kvshot.drafters import DrafterConfig, build_drafter, load_drafter
from kvshot.interop.export import FormatError

from .test_published_heads import (TARGET_LAYERS, fixture_config, head_tensors, import_cli, imported_logits, inputs,
                                   kvshot_logits, make_target, max_delta, reference_for, target_embed, write_head)

REPO = Path(__file__).resolve().parents[2]


def imported(tmp_path, name, config=None, tensors=None, *flags, bin_file=False):
    config = config or fixture_config(name)
    tensors = tensors if tensors is not None else head_tensors(config)
    head = write_head(tmp_path / "head", config, tensors, bin_file)
    target = make_target(tmp_path / "target", TARGET_LAYERS[name])
    return config, tensors, target, import_cli(head, tmp_path / "out", target, *flags)


def test_case1_angelslim_training_config_imports_and_records_target_model_type(tmp_path):
    config, tensors, target, meta = imported(tmp_path, "angelslim-qwen3-8b-eagle3", bin_file=True)
    assert "target_model_type" in meta["inert"] and meta["family"] == "vllm"
    assert max_delta(imported_logits(tmp_path / "out", target), reference_for(config, tensors, target_embed(target))) <= 1e-4


def test_case2_eagle_traineagle3_heads_import(tmp_path):
    config, tensors, target, meta = imported(tmp_path, "eagle-traineagle3", bin_file=True)
    assert meta["family"] == "eagle" and meta["aux_layers"] == [2, 16, 29]
    assert max_delta(imported_logits(tmp_path / "out", target), reference_for(config, tensors, target_embed(target))) <= 1e-4
    # an EAGLE-1/2 head (fc reads [embedding; feature], 2H) under the same architecture is refused in one line
    bad = head_tensors(config)
    bad["fc.weight"] = bad["fc.weight"][:, :64]
    write_head(tmp_path / "e2", config, bad)
    with pytest.raises(FormatError, match="fc.weight") as err:
        from kvshot.interop.published import import_head

        import_head(tmp_path / "e2", target, tmp_path / "o2")
    assert "\n" not in str(err.value)


def test_case3_specforge_eagle_config_ids_are_sglangs_count(tmp_path):
    config, tensors, target, meta = imported(tmp_path, "specforge-kimi-k25-eagle3")
    assert meta["aux_ids"] == [2, 30, 58] and meta["aux_layers"] == [3, 31, 59]
    assert meta["resolved"]["aux_convention"]["value"] == "sglang" and "SpecForge" in meta["resolved"]["aux_convention"]["rule"]
    # the override flag, recorded as one
    meta = import_cli(tmp_path / "head", tmp_path / "o2", target, "--aux-convention", "vllm")
    assert meta["aux_layers"] == [2, 30, 58] and meta["resolved"]["aux_convention"]["override"] is True
    # no evidence (EAGLE's LlamaForCausalLM with eagle_config ids): refused in one line naming file and field
    eagle = {**fixture_config("eagle-traineagle3"), "eagle_config": config["eagle_config"]}
    write_head(tmp_path / "e", eagle, head_tensors(eagle))
    from kvshot.interop.published import import_head

    with pytest.raises(FormatError, match="eagle_config.eagle_aux_hidden_state_layer_ids") as err:
        import_head(tmp_path / "e", target, tmp_path / "o3")
    assert "\n" not in str(err.value) and "e/config.json" in str(err.value) and "--aux-convention" in str(err.value)


def test_case4_newer_speculators_and_flat_vllm_fields_import(tmp_path):
    for name in ("speculators-0.5", "speculators-0.7"):   # base_model_ep_plan (top / layer), dtype, qwen3 layer
        config, tensors, target, meta = imported(tmp_path / name, name, tensors=head_tensors(
            fixture_config(name), own_embedding=bool(fixture_config(name).get("embed_requires_grad"))))
        assert any("base_model_ep_plan" in k for k in meta["inert"])
    # a flat config with vLLM's top-level ids
    flat = {**fixture_config("specforge-qwen3-8b-eagle3"), "eagle_aux_hidden_state_layer_ids": [1, 17, 32]}
    _, _, _, meta = imported(tmp_path / "flat", "specforge-qwen3-8b-eagle3", flat)
    assert meta["aux_layers"] == [1, 17, 32] and meta["resolved"]["aux_convention"]["value"] == "vllm"
    # AngelSlim's 1.7B head: model_type qwen3 under LlamaForCausalLMEagle3 (the engines build a Llama layer)
    config, tensors, target, meta = imported(tmp_path / "a17", "angelslim-qwen3-1.7b-eagle3")
    assert load_drafter(tmp_path / "a17" / "out", need_embedding=False).cfg.qk_norm is False
    assert max_delta(imported_logits(tmp_path / "a17" / "out", target),
                     reference_for(config, tensors, target_embed(target))) <= 1e-4


def test_case5_a_heads_own_embedding_is_kept_and_used_at_load(tmp_path):
    name = "speculators-0.7"   # embed_requires_grad: true, its own embed_tokens.weight
    config = fixture_config(name)
    del config["transformer_layer_config"]["base_model_ep_plan"]   # case 4's field aside: this case alone
    tensors = head_tensors(config, own_embedding=True)
    _, _, target, meta = imported(tmp_path, name, config, tensors)
    ref = reference_for(config, tensors, tensors["embed_tokens.weight"], norm_before_residual=True, carry_normed=True)
    assert max_delta(imported_logits(tmp_path / "out", target), ref) <= 1e-4
    drafter = load_drafter(tmp_path / "out", embed=target_embed(target))   # the target's is offered: the head's wins
    assert torch.equal(drafter.embed_tokens.weight, tensors["embed_tokens.weight"])
    assert meta["own_embedding"] is True and meta["resolved"]["embedding"]["value"] == "own"
    # a copy equal to the target's is not kept; a trained embedding that is missing is refused
    same = {**tensors, "embed_tokens.weight": target_embed(target)}
    write_head(tmp_path / "same", config, same)
    assert import_cli(tmp_path / "same", tmp_path / "o2", target)["own_embedding"] is False
    write_head(tmp_path / "none", config, {k: v for k, v in tensors.items() if k != "embed_tokens.weight"})
    from kvshot.interop.published import import_head

    with pytest.raises(FormatError, match="embed_requires_grad"):
        import_head(tmp_path / "none", target, tmp_path / "o3")


def test_case6_norm_output_follows_the_publishers_definition(tmp_path):
    name = "specforge-qwen3-30b-a3b-eagle3.1"   # SpecForge: fc_norm and norm_output true
    config, tensors, target, meta = imported(tmp_path, name)
    assert meta["norm_output_convention"] == "specforge" and meta["resolved"]["norm_output"]["value"] == "specforge"
    embed = target_embed(target)
    specforge = reference_for(config, tensors, embed)                         # head reads norm(h), state raw
    vllm = reference_for(config, tensors, embed, carry_normed=True)           # the post-norm state carried
    ours = imported_logits(tmp_path / "out", target)
    assert max_delta(ours, specforge) <= 1e-4 and max_delta(ours, vllm) > 1e-2
    # SpecForge's norm_output false: the head reads h itself
    write_head(tmp_path / "raw", {**config, "norm_output": False}, tensors)
    import_cli(tmp_path / "raw", tmp_path / "o2", target)
    assert max_delta(imported_logits(tmp_path / "o2", target), reference_for(config, tensors, embed, head_norm=False)) <= 1e-4
    # the override flag: vLLM's meaning for the same file
    meta = import_cli(tmp_path / "head", tmp_path / "o3", target, "--norm-output-convention", "vllm")
    assert meta["resolved"]["norm_output"]["override"] and max_delta(imported_logits(tmp_path / "o3", target), vllm) <= 1e-4


def test_case6_both_meanings_train_and_the_drift_variants_name_theirs():
    """Train side: a drafter built with either convention has gradients everywhere it should; the
    drift variants of config/config.yaml each name the convention they reproduce (vLLM's)."""
    from kvshot.config import validate_config

    base = dict(paradigm="hidden", hidden_size=H_, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, vocab_size=64, draft_vocab_size=24, qk_norm=False, norm_output=True)
    aux, ids = inputs()
    outs = {}
    for conv in ("vllm", "specforge"):
        torch.manual_seed(0)
        model = build_drafter(DrafterConfig(**base, norm_output_convention=conv))
        model.set_vocab(torch.randn(64, H_), torch.arange(24))
        outs[conv] = kvshot_logits(model, aux, ids)
        with torch.enable_grad():
            from kvshot.drafters.unroll import unroll

            batch = {"input_ids": ids[None], "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                     "loss_mask": torch.ones(1, len(ids), dtype=torch.long), "aux_hidden": aux[None]}
            sum(lg.sum() for lg in unroll(model.train(), batch, 3).logits).backward()
        assert model.fc.weight.grad.abs().max() > 0 and model.norm.weight.grad.abs().max() > 0
    assert (outs["vllm"][1] - outs["specforge"][1]).abs().max() > 1e-3   # step 1 reads another carried state
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    assert all(v.get("norm_output_convention") == "vllm" for v in cfg["drift"]["variants"])
    validate_config(cfg, ["config/config.yaml"])


H_ = 32


def test_case7_missing_norm_before_residual_in_a_speculators_config_is_true(tmp_path):
    config = fixture_config("speculators-0.1")
    del config["norm_before_residual"]
    config, tensors, target, meta = imported(tmp_path, "speculators-0.1", config)
    assert meta["norm_before_residual"] is True and "vLLM" in meta["resolved"]["norm_before_residual"]["rule"]
    assert max_delta(imported_logits(tmp_path / "out", target),
                     reference_for(config, tensors, target_embed(target), norm_before_residual=True)) <= 1e-4
    meta = import_cli(tmp_path / "head", tmp_path / "o2", target, "--norm-before-residual", "false")
    assert meta["norm_before_residual"] is False and meta["resolved"]["norm_before_residual"]["override"]
    # absent in a flat config: false, as vLLM's Eagle3 layer reads it
    assert imported(tmp_path / "flat", "specforge-qwen3-8b-eagle3")[3]["norm_before_residual"] is False


def test_the_resolution_is_in_the_imported_folder_and_export_round_trips(tmp_path):
    """import.json holds each resolution; a vLLM-meaning norm_output head exports under vLLM's class
    name with vLLM's top-level ids, and imports back with the same meaning and layers."""
    from kvshot.interop.export import export_eagle3

    config = {**fixture_config("speculators-0.7"),   # a Llama layer (the eagle3 format has no q/k norm)
              "transformer_layer_config": fixture_config("speculators-0.5")["transformer_layer_config"]}
    config, tensors, target, meta = imported(tmp_path, "speculators-0.7", config,
                                             head_tensors(config, own_embedding=True))
    export_eagle3(tmp_path / "out", tmp_path / "exp", aux_layers=[2, 18, 33])
    raw = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3LlamaForCausalLM"] and raw["eagle_aux_hidden_state_layer_ids"] == [2, 18, 33]
    meta = import_cli(tmp_path / "exp", tmp_path / "back", target)
    assert meta["aux_layers"] == [2, 18, 33] and meta["norm_output_convention"] == "vllm" and meta["own_embedding"]
    embed = target_embed(target)
    a, b = load_drafter(tmp_path / "out", embed=embed), load_drafter(tmp_path / "back", embed=embed)
    assert a.cfg == b.cfg
    assert all(torch.equal(b.state_dict()[n], t) for n, t in a.state_dict().items())
