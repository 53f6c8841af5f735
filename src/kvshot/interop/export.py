"""Drafters that leave the lab: the EAGLE-3 checkpoint format serving engines load, both ways.

An EAGLE-3 checkpoint, as SGLang (`LlamaForCausalLMEagle3`) and vLLM (`Eagle3LlamaForCausalLM`)
load it, is a folder with a Llama-style `config.json` and `model.safetensors` holding one
decoder layer named `midlayer.*`, the fusion `fc`, the final `norm`, the draft-vocabulary
`lm_head`, `d2t` and `t2d`. Two conventions differ from kvshot's own folder
(docs/drafter_format.md):
  - `d2t` holds OFFSETS, d2t[i] = target_id(i) - i; kvshot stores the target ids themselves.
    A verbatim copy would load without error and draft the wrong tokens.
  - the token embedding is not in the checkpoint: engines share the target's, as kvshot's
    frozen embedding is the target's; importing needs the target to fill it.
Only kvshot's hidden-only drafter with one layer and no q/k norm (the `eagle3` variant) has
this form; `export_eagle3` refuses anything else in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvshot.capture.target import LOCAL_SOURCES
from kvshot.core.io import DataError, atomic_dir, read_json, write_json
from kvshot.drafters import DrafterConfig, load_drafter
from kvshot.drafters.hidden import HiddenDrafter

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_ARCHITECTURE = "Eagle3LlamaForCausalLM"   # vLLM's class name for the same head

# kvshot HiddenDrafter parameter -> EAGLE-3 checkpoint tensor (one decoder layer)
EAGLE3_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "midlayer.input_layernorm.weight",      # the token embedding's norm
    "hidden_norm.weight": "midlayer.hidden_norm.weight",          # the carried hidden state's norm
    "layers.0.self_attn.q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "layers.0.mlp_norm.weight": "midlayer.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "midlayer.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
EAGLE3_TENSORS = sorted([*EAGLE3_NAMES.values(), "d2t", "t2d"])
# EAGLE-3.1 (fc_norm: true): one norm per aux state, the names vLLM and speculators load (a ModuleList)
FC_NORM_NAMES = {f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(3)}


def switch_names(cfg: DrafterConfig) -> dict[str, str]:
    """The checkpoint names a drafter has beyond EAGLE3_NAMES (its switches' tensors)."""
    return dict(FC_NORM_NAMES) if cfg.fc_norm else {}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FormatError(DataError, ValueError):
    """A drafter or checkpoint that the requested format cannot hold (one line, naming it)."""


# ---------------------------------------------------------------- the target's side

def target_folder(target_dir: str | Path) -> Path:
    """A folder with the target's config.json and weights: what the `target` stage wrote, or
    the hub snapshot it names (from the local HF cache, as every stage loads it)."""
    target_dir = Path(target_dir)
    meta_file = target_dir / "kvshot_target.json"
    if not meta_file.is_file() or read_json(meta_file).get("source") in LOCAL_SOURCES:   # weights in the folder
        return target_dir
    from huggingface_hub import snapshot_download

    meta = read_json(meta_file)
    return Path(snapshot_download(meta["name"], revision=meta.get("revision"),
                                  allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"]))


def target_config(target_dir: str | Path) -> dict:
    path = target_folder(target_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no target config.json")
    return json.loads(path.read_text())


def target_embedding(target_dir: str | Path) -> Tensor:
    """The target's input embedding [V, H] in fp32, read alone from its safetensors."""
    folder = target_folder(target_dir)
    name = "model.embed_tokens.weight"
    index = folder / "model.safetensors.index.json"
    shard = folder / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")
    with safe_open(str(shard), framework="pt") as fh:
        if name not in fh.keys():
            raise FormatError(f"{shard}: no {name} (the target's embedding)")
        return fh.get_tensor(name).float()


# ---------------------------------------------------------------- export

def against_target(cfg: DrafterConfig, target_dir, aux_layers, aux_rule: str, max_position_embeddings):
    """With a target folder: the drafter checked against its config, and the aux layers (its default
    under `aux_rule` unless given) and max positions it implies. Returns (aux_layers, max positions)."""
    from kvshot.config import default_aux_layers

    if target_dir is None:
        return aux_layers, max_position_embeddings
    tc = target_config(target_dir)
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if tc.get(key) != ours:
            raise FormatError(f"{target_dir}/config.json: {key} {tc.get(key)} is not the drafter's {ours}")
    if aux_layers is None:
        aux_layers = list(default_aux_layers(tc["num_hidden_layers"], aux_rule))
    return aux_layers, max_position_embeddings or tc.get("max_position_embeddings")


def check_exportable(drafter, where: str) -> None:
    cfg = drafter.cfg
    if type(drafter) is not HiddenDrafter:
        raise FormatError(f"{where}: paradigm {cfg.paradigm!r}: the eagle3 format holds hidden-only drafters only "
                          "(KV-path drafters keep kvshot's folder format, docs/drafter_format.md)")
    if cfg.num_layers != 1:
        raise FormatError(f"{where}: num_layers {cfg.num_layers}: the eagle3 format holds one decoder layer "
                          "(SGLang and vLLM name further layers differently)")
    if cfg.qk_norm:
        raise FormatError(f"{where}: qk_norm true: LlamaForCausalLMEagle3 has no q/k norm; train the variant "
                          "with qk_norm: false")
    if cfg.num_aux != 3:
        raise FormatError(f"{where}: num_aux {cfg.num_aux}: EAGLE-3 fuses three target hidden states")
    if cfg.norm_before_fc:
        raise FormatError(f"{where}: norm_before_fc true: not exported (its tensor's name in the engines is unchecked "
                          "here); EAGLE-3.1's per-state fc_norm is")
    if cfg.norm_output_convention == "specforge" and not cfg.norm_output:
        raise FormatError(f"{where}: norm_output false under SpecForge's convention (the head reads the raw state): "
                          "vLLM has no such head; not exported")


def eagle3_tensors(drafter: HiddenDrafter, dtype: torch.dtype) -> dict[str, Tensor]:
    """The checkpoint's tensors: weights renamed and cast, d2t as offsets, t2d as a bool mask."""
    own = drafter.state_dict()
    names = {**EAGLE3_NAMES, **switch_names(drafter.cfg)}
    out = {theirs: own[ours].detach().to(dtype).contiguous().cpu() for ours, theirs in names.items()}
    d2t = drafter.d2t.detach().cpu().long()
    out["d2t"] = d2t - torch.arange(len(d2t))
    out["t2d"] = drafter.t2d.detach().cpu().bool().contiguous()
    if drafter.cfg.own_embedding:   # a head's own embedding (vLLM loads a checkpoint's embed_tokens)
        out["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().to(dtype).contiguous().cpu()
    return out


def eagle3_config(cfg: DrafterConfig, dtype: str, max_position_embeddings: int,
                  aux_layers: list[int] | None) -> dict:
    """A Llama-style HF config as SpecForge writes it for a Qwen3 target (SGLang and vLLM read
    the same keys); `eagle_config` names the target layers the head fuses (HF hidden_states
    indices, vLLM's convention), omitted when unknown (engines then use EAGLE-3's default)."""
    # vLLM's norm_output carries the post-norm state; under SpecForge's class name
    # (LlamaForCausalLMEagle3) SpecForge reads the key as the head's norm only: such a head names
    # vLLM's class, which is how `kvshot import` tells the two apart (docs/published-heads.md)
    config = {
        "architectures": [VLLM_ARCHITECTURE if cfg.carries_normed() else EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if cfg.norm_before_residual:   # vLLM reads it from this config too; SGLang has no such switch
        config["norm_before_residual"] = True
    if cfg.fc_norm:   # EAGLE-3.1: vLLM and speculators read it here (absent: off)
        config["fc_norm"] = True
    if cfg.carries_normed():   # SpecForge's norm_output true is standard EAGLE-3: no key
        config["norm_output"] = True
    if aux_layers is not None:
        config["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(aux_layers)}
        # vLLM's own key, which it reads first: the ids are inputs of layer i (`kvshot import` reads this
        # count from it; without it, eagle_config ids under LlamaForCausalLMEagle3 are SGLang's count)
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    return config


def export_eagle3(drafter_dir: str | Path, out_dir: str | Path, target_dir: str | Path | None = None,
                  aux_layers: list[int] | None = None, dtype: str = "float32",
                  max_position_embeddings: int | None = None, aux_rule: str = "relative") -> dict:
    """Write `drafter_dir` (a kvshot drafter folder) as an EAGLE-3 checkpoint. With `target_dir`
    the config takes the target's max_position_embeddings and the default aux layers for its
    depth under `aux_rule` (config.default_aux_layers; unless `aux_layers` are given), and the drafter is checked against it."""
    drafter = load_drafter(drafter_dir, need_embedding=False)   # the checkpoint holds no embedding
    check_exportable(drafter, f"{drafter_dir}/config.json")
    if dtype not in DTYPES:
        raise FormatError(f"--dtype {dtype}: one of {sorted(DTYPES)}")
    aux_layers, max_position_embeddings = against_target(drafter.cfg, target_dir, aux_layers, aux_rule,
                                                         max_position_embeddings)
    max_position_embeddings = max_position_embeddings or 32768
    if aux_layers is not None and len(set(aux_layers)) != 3:
        raise FormatError(f"aux layers {list(aux_layers)}: EAGLE-3 fuses three distinct target layers "
                          "(set features.aux_layers)")
    tensors = eagle3_tensors(drafter, DTYPES[dtype])
    config = eagle3_config(drafter.cfg, dtype, int(max_position_embeddings), aux_layers)
    with atomic_dir(out_dir) as tmp:
        write_json(tmp / "config.json", config)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return {"out": str(out_dir), "architecture": EAGLE3_ARCHITECTURE, "tensors": len(tensors), "dtype": dtype,
            "draft_vocab_size": drafter.cfg.draft_vocab_size, "aux_layers": aux_layers}


# ---------------------------------------------------------------- import

def read_eagle3(ckpt_dir: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """config.json and every tensor of an EAGLE-3 checkpoint folder: model.safetensors (one file
    or index-sharded) or pytorch_model.bin (as EAGLE's own published heads ship)."""
    folder = Path(ckpt_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}/config.json: missing (not an EAGLE-3 checkpoint folder)")
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        tensors = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(load_file(str(folder / shard)))
    elif (folder / "model.safetensors").is_file():
        tensors = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin")
    return config, tensors
