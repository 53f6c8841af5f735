"""Drafters that leave the lab (kvshot.interop.export): the EAGLE-3 checkpoint serving engines load,
checked against the names SGLang's and vLLM's loaders look up, against an independent library
(vLLM's `speculators`, in its own venv), and back into kvshot: round trip, and a published head
scored by the pipeline's step-wise and end-to-end evaluation."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from kvshot.__main__ import main
from kvshot.capture.features import open_features
from kvshot.capture.target import load_target
from kvshot.config import stage_config
from kvshot.drafters import DrafterConfig, build_drafter, load_drafter
from kvshot.drafters.unroll import unroll
from kvshot.interop.export import EAGLE3_TENSORS, FormatError, export_eagle3
from kvshot.interop.published import import_eagle3
from kvshot.train.variants import build_variant, draft_vocab
from ..conftest import typed, section
from kvshot.settings import VariantSettings

REPO = Path(__file__).resolve().parents[2]
K = 7
EAGLE3 = {"name": "eagle3", "paradigm": "hidden", "layers": 1, "qk_norm": False}


@pytest.fixture(scope="module")
def world(tiny, tiny_features):
    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    d2t = draft_vocab(src, 150, target.config.vocab_size)
    return {"src": src, "target": target, "d2t": d2t, "aux": list(tiny["cfg"]["features"]["aux_layers"])}


def perturbed(model, seed: int = 0):
    """Fresh norms are all ones: move every trained tensor so each name matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def saved_drafter(world, variant: dict, folder):
    """A perturbed drafter of `variant` on the tiny target, saved in `folder`."""
    t = world["target"]
    perturbed(build_variant(section(VariantSettings, variant), t.config, t.model.embed_tokens.weight.detach(), world["d2t"])).save(folder)
    return folder


def exported_folder(drafter_dir, tiny):
    """`kvshot export --format eagle3` of a saved drafter, beside it."""
    out = drafter_dir.parent / "export"
    assert main(["export", "--format", "eagle3", str(drafter_dir), str(out), "--target", str(tiny["model"]),
                 "--config", json.dumps(stage_config(tiny["cfg"], "features"))]) == 0
    return out


@pytest.fixture(scope="module")
def eagle3_dir(world, tmp_path_factory):
    return saved_drafter(world, EAGLE3, tmp_path_factory.mktemp("eagle3") / "drafter")


@pytest.fixture(scope="module")
def exported(eagle3_dir, tiny, world):
    return exported_folder(eagle3_dir, tiny)


# ---------------------------------------------------------------- what serving engines load

# The parameters of SGLang's LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py, one
# layer, untied head): its load_weights stacks q/k/v into qkv_proj and gate/up into gate_up_proj,
# looks a name up as-is or under "model.", reads d2t as offsets (hot_token_id = d2t + arange),
# skips t2d and silently drops any other name. The embedding is the target's (set by the worker).
SGLANG_PARAMS = {
    "model.fc.weight", "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.post_attention_layernorm.weight", "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
}
SGLANG_STACKED = [(".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                  (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")]


def sglang_destination(name: str) -> str | None:
    """Where SGLang's loader puts a checkpoint tensor (None: skipped or dropped)."""
    if "d2t" in name or "t2d" in name:
        return None
    for shard, stacked in SGLANG_STACKED:
        if shard in name:
            name = name.replace(shard, stacked)
            break
    for candidate in (name, f"model.{name}"):
        if candidate in SGLANG_PARAMS:
            return candidate
    return None


def test_export_has_the_names_sglang_and_vllm_load(exported, eagle3_dir):
    drafter = load_drafter(eagle3_dir, need_embedding=False)   # the export reads no embedding
    tensors = load_file(str(exported / "model.safetensors"))
    assert sorted(tensors) == EAGLE3_TENSORS
    loaded = {sglang_destination(n) for n in tensors} - {None}
    assert loaded == SGLANG_PARAMS, "every SGLang parameter but the shared embedding is filled"
    assert [n for n in tensors if sglang_destination(n) is None] == ["d2t", "t2d"]
    # vLLM (Eagle3LlamaForCausalLM.load_weights): midlayer. -> layers.0., "model." unless lm_head
    vllm = {("" if n.startswith("lm_head") else "model.") + n.replace("midlayer.", "layers.0.") for n in tensors
            if n not in ("d2t", "t2d")}
    assert {n for n in vllm if not n.startswith("model.layers.0.")} == {"model.fc.weight", "model.norm.weight",
                                                                       "lm_head.weight"}
    cfg = drafter.cfg
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    stacked_q = sum(tensors[f"midlayer.self_attn.{p}_proj.weight"].shape[0] for p in "qkv")
    assert stacked_q == qkv_rows and tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * cfg.hidden_size
    assert tensors["fc.weight"].shape == (cfg.hidden_size, 3 * cfg.hidden_size)
    assert tensors["lm_head.weight"].shape == (cfg.draft_vocab_size, cfg.hidden_size)
    # d2t as offsets, t2d as a boolean mask: what the engines turn back into target ids
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"] + torch.arange(cfg.draft_vocab_size), drafter.d2t)
    assert torch.equal(torch.nonzero(tensors["t2d"]).view(-1), drafter.d2t)


def test_export_config_is_a_llama_eagle3_config(exported, eagle3_dir, tiny):
    drafter = load_drafter(eagle3_dir, need_embedding=False)
    raw = json.loads((exported / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is False
    assert raw["target_hidden_size"] == raw["hidden_size"] == drafter.cfg.hidden_size
    assert raw["draft_vocab_size"] == drafter.cfg.draft_vocab_size and raw["vocab_size"] == drafter.cfg.vocab_size
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == tiny["cfg"]["features"]["aux_layers"]
    # transformers reads it as the LlamaConfig both engines build from it
    cfg = LlamaConfig.from_pretrained(exported)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        drafter.cfg.hidden_size, drafter.cfg.num_attention_heads, drafter.cfg.num_key_value_heads, drafter.cfg.head_dim)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == drafter.cfg.rope_theta
    assert cfg.intermediate_size == drafter.cfg.intermediate_size and cfg.rms_norm_eps == drafter.cfg.rms_norm_eps


def test_export_refuses_what_the_format_cannot_hold(world, tmp_path):
    t = world["target"]
    embed = t.model.embed_tokens.weight.detach()
    for variant, why in (({**EAGLE3, "qk_norm": True}, "qk_norm"), ({**EAGLE3, "layers": 2}, "num_layers"),
                         ({"name": "k", "paradigm": "kv", "layers": 1}, "paradigm"),
                         ({"name": "y", "paradigm": "hybrid", "layers": 1}, "paradigm")):
        folder = tmp_path / variant["name"] / why
        build_variant(section(VariantSettings, variant), t.config, embed, world["d2t"]).save(folder)
        with pytest.raises(FormatError, match=why) as err:
            export_eagle3(folder, tmp_path / "out")
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------- back into kvshot

def round_trip(exported_dir, drafter_dir, world, tiny, out):
    """`kvshot import` of an exported folder: the drafter before and after, with equal configs and
    bit-identical tensors."""
    assert main(["import", "--format", "eagle3", str(exported_dir), str(out), "--target", str(tiny["model"])]) == 0
    embed = world["target"].model.embed_tokens.weight
    before, after = load_drafter(drafter_dir, embed=embed), load_drafter(out, embed=embed)
    assert after.cfg == before.cfg
    for name, tensor in before.state_dict().items():
        assert torch.equal(after.state_dict()[name], tensor), name
    return before, after


def test_round_trip_gives_identical_logits(exported, eagle3_dir, world, tiny, tmp_path):
    before, after = round_trip(exported, eagle3_dir, world, tiny, tmp_path / "imported")
    batch = world["src"].batch([0, 1])
    with torch.no_grad():
        a, b = unroll(before, batch, K), unroll(after, batch, K)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_import_rejects_a_checkpoint_with_absolute_d2t(exported, tiny, tmp_path):
    """A naive copy of kvshot's absolute ids into d2t loads in every engine and drafts wrong
    tokens; t2d gives it away."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((exported / "config.json").read_text())
    tensors = load_file(str(exported / "model.safetensors"))
    tensors["d2t"] = torch.nonzero(tensors["t2d"]).view(-1)   # absolute ids, not offsets
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(FormatError, match="d2t"):
        import_eagle3(bad, tiny["model"], tmp_path / "out")


def test_an_imported_head_is_scored_by_stepwise_and_e2e_losslessly(exported, eagle3_dir, world, tiny,
                                                                    tiny_features, tmp_path):
    from kvshot.evaluate.e2e import run_e2e_stage
    from kvshot.evaluate.references import run_continuations_stage
    from kvshot.evaluate.stepwise import run_stepwise_stage

    cfg = json.loads(json.dumps(tiny["cfg"]))
    cfg["drafters"]["variants"] = [{"name": "published", "paradigm": "hidden", "layers": 1,
                                    "weights": str(exported), "format": "eagle3"}]
    drafter_dir = tmp_path / "drafters" / "published"
    # the train-drafter stage imports it: no training, and the schema accepts the variant
    assert main(["train-drafter", "--config", json.dumps(stage_config(cfg, "drafters")), "--variant", "published",
                 "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
                 "--target", str(tiny["model"]), "--out", str(drafter_dir)]) == 0
    assert json.loads((drafter_dir / "metrics.json").read_text())["stopped_by"] == "imported"
    assert json.loads((drafter_dir / "train_log.json").read_text()) == []   # the report reads it
    embed = world["target"].model.embed_tokens.weight
    original, imported = load_drafter(eagle3_dir, embed=embed), load_drafter(drafter_dir, embed=embed)
    assert all(torch.equal(imported.state_dict()[n], t) for n, t in original.state_dict().items())
    index = str(tiny_features["eval"] / "index.json")
    cont = tmp_path / "continuations.json"
    run_continuations_stage(typed(cfg), tiny["rt"], str(tiny["eval"]), str(tiny["model"]), str(cont))
    step = run_stepwise_stage(typed(cfg), tiny["rt"], str(drafter_dir), str(tiny["model"]), str(cont), index,
                              str(tmp_path / "stepwise.json"))
    assert len(json.loads((tmp_path / "stepwise.json").read_text())["acc"]) == cfg["drafters"]["ttt_steps"]
    assert step["alpha"] is not None
    run_e2e_stage(typed(cfg), tiny["rt"], str(drafter_dir), str(tiny["model"]), str(cont), index, str(tmp_path / "e2e.json"))
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["lossless"] and all(m["real_errors"] == 0 for m in e2e["modes"].values())


def test_a_head_that_fuses_other_layers_than_the_features_is_refused(exported, tiny, tiny_features, tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    config = json.loads((exported / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]
    (head / "config.json").write_text(json.dumps(config))
    (head / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    cfg = json.loads(json.dumps(tiny["cfg"]))
    cfg["drafters"]["variants"] = [{"name": "other", "paradigm": "hidden", "layers": 1, "weights": str(head),
                                    "format": "eagle3"}]
    assert main(["train-drafter", "--config", json.dumps(stage_config(cfg, "drafters")), "--variant", "other",
                 "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
                 "--target", str(tiny["model"]), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- kvshot's own folder format

def documented_names(paradigm: str) -> set[str]:
    """The tensor names docs/drafter_format.md lists for a paradigm, for 2 layers ({i}: 0 and 1,
    {j}: layers after the first)."""
    text = (REPO / "docs/drafter_format.md").read_text()
    block = re.search(rf"```text\n# tensors: {paradigm}\n(.*?)```", text, re.S)
    assert block, f"docs/drafter_format.md lists no tensors for {paradigm}"
    names = set()
    for line in block.group(1).splitlines():
        if line.strip():
            name = line.split()[0]
            layers = ["0", "1"] if "{i}" in name else ["1"] if "{j}" in name else [""]
            names |= {name.replace("{i}", n).replace("{j}", n) for n in layers}
    return names


@pytest.mark.parametrize("paradigm", ["hidden", "kv", "hybrid", "standalone"])
def test_kvshot_folder_is_the_documented_format(paradigm, tmp_path):
    cfg = DrafterConfig(paradigm=paradigm, hidden_size=16, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, intermediate_size=24, vocab_size=40, draft_vocab_size=40 if paradigm == "standalone"
                        else 10, kv_layers=[0, 1] if paradigm in ("kv", "hybrid") else [])
    model = perturbed(build_drafter(cfg))
    model.save(tmp_path / "d")
    raw = json.loads((tmp_path / "d/config.json").read_text())
    assert raw["model_type"] == "kvshot_drafter" and raw["format_version"] == 1
    assert raw["architectures"] == [f"KVShot{paradigm.capitalize()}Drafter"] and raw["qk_norm"] is True
    with safe_open(str(tmp_path / "d/model.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == documented_names(paradigm)
    back = load_drafter(tmp_path / "d", embed=model.embed_tokens.weight)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in model.state_dict().items())


def test_old_config_files_load_with_qk_norm(tmp_path):
    """Folders written before the format's metadata and the qk_norm field: q/k norm on, as trained."""
    old = {"paradigm": "kv", "hidden_size": 16, "num_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 8, "intermediate_size": 24, "vocab_size": 40, "draft_vocab_size": 10, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "num_aux": 3, "kv_layers": [0], "gate_shape": "scalar", "gate_init": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = DrafterConfig.load(tmp_path / "config.json")
    assert cfg.qk_norm is True and isinstance(build_drafter(cfg).layers[0].self_attn.q_norm, torch.nn.Module)
    (tmp_path / "config.json").write_text(json.dumps({**old, "colour": "red"}))
    with pytest.raises(ValueError, match="colour"):
        DrafterConfig.load(tmp_path / "config.json")


# ---------------------------------------------------------------- an independent library

def speculators_and_ours(exported_dir, drafter_dir, world, tiny, tmp_path) -> tuple[dict, torch.Tensor]:
    """speculators (tests/speculators_eagle3.py in its own venv) converts and loads the exported
    folder and drafts K TTT steps on one sample; kvshot's drafter drafts the same steps on the
    same target hidden states, tokens and positions: (their tensors, our logits)."""
    from ..speculators_env import run_script, write_inputs

    drafter = load_drafter(drafter_dir, embed=world["target"].model.embed_tokens.weight)
    sample = world["src"].batch([3])
    n = sample["input_ids"].shape[1]
    write_inputs(sample, tmp_path / "inputs.safetensors")
    done = run_script(str(exported_dir), str(tiny["model"]), str(tmp_path / "inputs.safetensors"), str(tmp_path),
                      str(tmp_path / "theirs.safetensors"), str(K), ",".join(map(str, world["aux"])))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    batch = {**sample, "attention_mask": torch.ones_like(sample["input_ids"]),
             "loss_mask": torch.ones_like(sample["input_ids"])}
    with torch.no_grad():
        ours = torch.stack([l[0, : n - 1] for l in unroll(drafter, batch, K).logits])
    return load_file(str(tmp_path / "theirs.safetensors")), ours


def test_speculators_converts_loads_and_matches_kvshot_logits(exported, eagle3_dir, world, tiny, tmp_path):
    """vLLM's `speculators` converts our export (its EAGLE-3 converter), loads it (its Eagle3
    model, the embedding from the target folder as serving does) and drafts K TTT steps on the
    same target hidden states, tokens and positions: its logits are kvshot's."""
    theirs, ours = speculators_and_ours(exported, eagle3_dir, world, tiny, tmp_path)
    with safe_open(str(tmp_path / "theirs.safetensors"), framework="pt") as fh:
        assert fh.metadata()["model_class"] == "Eagle3DraftModel"
    assert theirs["logits"].shape == ours.shape
    delta = (theirs["logits"] - ours).abs().max().item()
    print(f"speculators vs kvshot, {K} TTT steps: max |dlogit| {delta:.2e}")
    assert delta <= 1e-4, f"max |dlogit| {delta}"
    drafter = load_drafter(eagle3_dir, embed=world["target"].model.embed_tokens.weight)
    assert torch.equal(theirs["d2t"] + torch.arange(len(theirs["d2t"])), drafter.d2t)
    assert torch.equal(theirs["t2d"], drafter.t2d)
    assert torch.equal(theirs["embed"], drafter.embed_tokens.weight)


def test_export_reads_a_gguf_targets_own_folder(eagle3_dir, tiny, tmp_path):
    """config/smollm2.yaml's target (source gguf) keeps its weights in the target stage's folder, as a
    pretrained-here target does: the export reads its config there, not from a hub snapshot."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny["model"], folder)
    meta = json.loads((folder / "kvshot_target.json").read_text())
    (folder / "kvshot_target.json").write_text(json.dumps({**meta, "source": "gguf", "name": None}))
    out = tmp_path / "export"
    assert main(["export", "--format", "eagle3", str(eagle3_dir), str(out), "--target", str(folder),
                 "--config", json.dumps(stage_config(tiny["cfg"], "features"))]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == json.loads((folder / "config.json").read_text())["max_position_embeddings"]
