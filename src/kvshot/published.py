"""Published EAGLE-3 heads into kvshot: the two layouts Qwen3-8B heads ship in.

  eagle3       SpecForge's / SGLang's `LlamaForCausalLMEagle3` (AngelSlim/Qwen3-8B_eagle3): a flat
               Llama config with `draft_vocab_size`, optional `eagle_config`, tensors `midlayer.*`,
               `fc`, `norm`, `lm_head`, `d2t` (offsets), `t2d`; safetensors or pytorch_model.bin.
  speculators  vLLM's `speculators` (`Eagle3Speculator`, RedHatAI/Qwen3-8B-speculator.eagle3): the
               layer's config nested in `transformer_layer_config`, the head's switches at the top
               (`norm_before_residual`, `eagle_aux_hidden_state_layer_ids`, ...), tensors `layers.0.*`.

The traps, each handled explicitly (docs/published-heads.md):
  - `norm_before_residual` (speculators; vLLM reads it in both layouts): the first layer's residual
    is hidden_norm(h) instead of h. kvshot's DrafterConfig field of that name does the same.
  - aux layer ids: kvshot's `features.aux_layers` index HF `hidden_states` (0: the embeddings).
    vLLM and speculators capture the INPUT of decoder layer i, i.e. hidden_states[i] (the same
    numbers); SGLang captures the output of layer i, hidden_states[i + 1] (`aux_convention: sglang`).
    No ids: EAGLE-3's default (2, L//2, L-3) in hidden_states indices, both engines' default.
  - d2t: offsets (target = draft + d2t[draft]) in both layouts; t2d must mark exactly their targets.
Any config field or tensor this module does not know is refused in one line naming the file and
the field: a head that silently loads with a switch ignored drafts badly without any error.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from .drafters import DrafterConfig, build_drafter
from .drafters.hidden import HiddenDrafter
from .export import EAGLE3_NAMES, FC_NORM_NAMES, FormatError, read_eagle3, target_config, target_embedding
from .io import read_json
from .taps import eagle3_aux_layers

LAYOUTS = ("eagle3", "speculators")
AUX_CONVENTIONS = ("vllm", "sglang")

# kvshot HiddenDrafter parameter -> speculators tensor (Eagle3DraftModel, one layer)
SPECULATORS_NAMES = {ours: theirs.replace("midlayer.", "layers.0.") for ours, theirs in EAGLE3_NAMES.items()}
QK_NORM_NAMES = {"layers.0.self_attn.q_norm.weight": "layers.0.self_attn.q_norm.weight",
                 "layers.0.self_attn.k_norm.weight": "layers.0.self_attn.k_norm.weight"}
# the verifier's own final norm and LM head, which speculators may keep beside the head: not the head's
VERIFIER_TENSORS = {"verifier_norm.weight", "verifier_lm_head.weight"}

# Llama/Qwen3 config keys that do not change the head's computation (metadata, training, serving)
INERT = {"architectures", "model_type", "_name_or_path", "auto_map", "torch_dtype", "dtype", "transformers_version",
         "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "pretraining_tp",
         "attention_dropout", "max_position_embeddings", "max_window_layers", "layer_types", "output_hidden_states",
         "output_attentions", "return_dict", "use_return_dict", "tie_word_embeddings", "sliding_window",
         "use_sliding_window", "has_no_defaults_at_init", "modules_to_not_convert", "chunk_size_feed_forward",
         "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "quantization_config"}
# keys read (and checked) into the DrafterConfig
LAYER_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
              "attention_bias", "mlp_bias", "vocab_size"}
EAGLE3_HEAD_KEYS = {"draft_vocab_size", "target_hidden_size", "eagle_config", "norm_before_residual", "fc_norm",
                    "norm_output"}
SPECULATORS_TOP_KEYS = {"speculators_model_type", "speculators_version", "speculators_config",
                        "transformer_layer_config", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                        "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output",
                        "embed_requires_grad"}
# speculators switches kvshot does not import: a head with one on is refused (kvshot's drafter has
# norm_before_fc, but its tensor's name in the engines is unchecked; EAGLE-3.1's fc_norm and
# norm_output are read: `switches`)
UNSUPPORTED_SWITCHES = ("norm_before_fc",)
SWITCHES = ("fc_norm", "norm_output")   # EAGLE-3.1 (arXiv 2605.09992), top-level keys in both layouts


# ---------------------------------------------------------------- aux layers

def hf_aux_layers(ids: list[int], convention: str) -> list[int]:
    """A head's aux layer ids as HF hidden_states indices (kvshot's features.aux_layers).
    vllm (and speculators): id i is the input of decoder layer i = hidden_states[i];
    sglang (SpecForge's eagle_config as SGLang reads it): the output of layer i = hidden_states[i + 1]."""
    if convention not in AUX_CONVENTIONS:
        raise FormatError(f"aux convention {convention!r}: one of {list(AUX_CONVENTIONS)}")
    return [int(i) + (1 if convention == "sglang" else 0) for i in ids]


def eagle_aux_ids(hf_layers: list[int], convention: str) -> list[int]:
    """The inverse of hf_aux_layers."""
    if convention not in AUX_CONVENTIONS:
        raise FormatError(f"aux convention {convention!r}: one of {list(AUX_CONVENTIONS)}")
    return [int(i) - (1 if convention == "sglang" else 0) for i in hf_layers]


# ---------------------------------------------------------------- configs

def detect_layout(config: dict) -> str:
    return "speculators" if "speculators_model_type" in config or "transformer_layer_config" in config else "eagle3"


def _refuse_unknown(config: dict, known: set, where: str) -> None:
    unknown = sorted(set(config) - known - INERT)
    if unknown:
        raise FormatError(f"{where}: field {unknown[0]!r} is not one kvshot knows how to honour "
                          f"(unknown: {unknown}); refusing rather than ignoring it")


def switches(config: dict, where: str) -> dict:
    """A head's EAGLE-3.1 switches (absent: off), each a boolean."""
    out = {}
    for key in SWITCHES:
        value = config.get(key, False)
        if not isinstance(value, bool):
            raise FormatError(f"{where}: field {key!r} {value!r}: expected true or false")
        out[key] = value
    return out


def _layer_config(c: dict, where: str, vocab_size: int, draft_vocab_size: int, qk_norm: bool,
                  norm_before_residual: bool, **switched) -> DrafterConfig:
    """A DrafterConfig from a Llama/Qwen3 layer config, every field that changes the math checked."""
    if c.get("num_hidden_layers", 1) != 1:
        raise FormatError(f"{where}: field 'num_hidden_layers' {c['num_hidden_layers']}: kvshot imports one-layer heads")
    if c.get("hidden_act", "silu") != "silu":
        raise FormatError(f"{where}: field 'hidden_act' {c['hidden_act']!r}: kvshot's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if c.get(key):
            raise FormatError(f"{where}: field {key!r} true: kvshot's layer has no biases and no sliding window")
    if c.get("tie_word_embeddings"):
        raise FormatError(f"{where}: field 'tie_word_embeddings' true: an EAGLE-3 head has its own draft lm_head")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise FormatError(f"{where}: field 'rope_scaling' type {rope.get('rope_type', rope.get('type'))!r}: "
                          "kvshot implements default RoPE")
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    h, heads = c["hidden_size"], c["num_attention_heads"]
    return DrafterConfig(
        paradigm="hidden", hidden_size=h, num_layers=1, num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or h // heads,
        intermediate_size=c["intermediate_size"], vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
        rope_theta=float(theta), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm,
        norm_before_residual=bool(norm_before_residual), **switched)


def _check_width(top: dict, h: int, where: str) -> None:
    if top.get("target_hidden_size") not in (None, h):
        raise FormatError(f"{where}: field 'target_hidden_size' {top['target_hidden_size']} differs from hidden_size "
                          f"{h}: kvshot's drafter shares the target's width")


def read_head_config(config: dict, where: str) -> tuple[str, DrafterConfig, dict]:
    """(layout, DrafterConfig, meta) of a head's config.json; meta: aux ids as written, their
    convention, the verifier named by the head (speculators), the proposal length it ships with."""
    layout = detect_layout(config)
    if layout == "eagle3":
        arch = config.get("architectures") or []
        if not any("Eagle3" in a for a in arch):
            raise FormatError(f"{where}: field 'architectures' {arch}: not an EAGLE-3 head (want LlamaForCausalLMEagle3)")
        if config.get("model_type", "llama") != "llama":
            raise FormatError(f"{where}: field 'model_type' {config['model_type']!r}: the eagle3 layout is a Llama layer")
        _refuse_unknown(config, LAYER_KEYS | EAGLE3_HEAD_KEYS, where)
        eagle = config.get("eagle_config") or {}
        _refuse_unknown(eagle, {"use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids"}, f"{where} eagle_config")
        if eagle.get("use_aux_hidden_state") is False:
            raise FormatError(f"{where}: field 'eagle_config.use_aux_hidden_state' false: an EAGLE-1/2 head, not EAGLE-3")
        _check_width(config, config["hidden_size"], where)
        vocab = config["vocab_size"]
        cfg = _layer_config(config, where, vocab, config.get("draft_vocab_size") or vocab, False,
                            config.get("norm_before_residual", False), **switches(config, where))
        return layout, cfg, {"aux_ids": eagle.get("eagle_aux_hidden_state_layer_ids"), "verifier": None,
                             "speculative_tokens": None}
    if config.get("speculators_model_type") != "eagle3":
        raise FormatError(f"{where}: field 'speculators_model_type' {config.get('speculators_model_type')!r}: "
                          "kvshot imports eagle3 speculators only")
    _refuse_unknown(config, SPECULATORS_TOP_KEYS, where)
    for key in UNSUPPORTED_SWITCHES:
        if config.get(key):
            raise FormatError(f"{where}: field {key!r} true: kvshot's hidden drafter does not implement it")
    layer = config.get("transformer_layer_config") or {}
    lwhere = f"{where} transformer_layer_config"
    if layer.get("model_type", "qwen3") not in ("llama", "qwen3"):   # speculators' default layer is Qwen3's
        raise FormatError(f"{lwhere}: field 'model_type' {layer['model_type']!r}: kvshot implements llama and qwen3 layers")
    _refuse_unknown(layer, LAYER_KEYS, lwhere)
    _check_width(config, layer["hidden_size"], where)
    vocab = layer["vocab_size"]
    cfg = _layer_config(layer, lwhere, vocab, config.get("draft_vocab_size") or vocab,
                        layer.get("model_type", "qwen3") == "qwen3", config.get("norm_before_residual", False),
                        **switches(config, where))
    spec = config.get("speculators_config") or {}
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    methods = spec.get("proposal_methods") or [{}]
    return layout, cfg, {"aux_ids": config.get("eagle_aux_hidden_state_layer_ids"), "verifier": verifier,
                         "speculative_tokens": methods[0].get("speculative_tokens")}


# ---------------------------------------------------------------- tensors

def head_from_tensors(cfg: DrafterConfig, layout: str, tensors: dict[str, Tensor], embed: Tensor | None,
                      where: str) -> HiddenDrafter:
    """A kvshot HiddenDrafter with the head's weights; `embed`: the target's embedding unless the
    head carries its own `embed_tokens.weight`, which then wins (as in the engines that load it)."""
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}   # some heads prefix every name
    names = dict(EAGLE3_NAMES if layout == "eagle3" else SPECULATORS_NAMES)
    if cfg.qk_norm:
        names.update(QK_NORM_NAMES)
    if cfg.fc_norm:   # the same names in both layouts
        names.update(FC_NORM_NAMES)
    expected = set(names.values()) | {"d2t", "t2d", "embed_tokens.weight"} | VERIFIER_TENSORS
    unknown = sorted(set(tensors) - expected)
    if unknown:
        raise FormatError(f"{where}: tensor {unknown[0]!r} is not part of a one-layer {layout} EAGLE-3 head "
                          f"(unknown: {unknown[:5]})")
    missing = sorted(set(names.values()) - set(tensors))
    if missing:
        raise FormatError(f"{where}: tensors {missing} missing (a {layout} head has {sorted(names.values())})")
    if "d2t" in tensors:
        d2t = tensors["d2t"].long() + torch.arange(len(tensors["d2t"]))   # offsets -> target ids
    elif cfg.draft_vocab_size == cfg.vocab_size:
        d2t = torch.arange(cfg.vocab_size)
    else:
        raise FormatError(f"{where}: no d2t for a draft vocabulary of {cfg.draft_vocab_size} < {cfg.vocab_size}")
    if len(d2t) != cfg.draft_vocab_size or int(d2t.min()) < 0 or int(d2t.max()) >= cfg.vocab_size:
        raise FormatError(f"{where}: d2t does not map {cfg.draft_vocab_size} draft ids into 0..{cfg.vocab_size - 1} "
                          "(d2t holds offsets: target = draft + d2t[draft])")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool(), t2d):
        raise FormatError(f"{where}: t2d does not mark exactly the targets of d2t (d2t written as absolute ids?)")
    embed = tensors.get("embed_tokens.weight", embed)
    if embed is None or tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        shape = None if embed is None else tuple(embed.shape)
        raise FormatError(f"{where}: the embedding is {shape}, the head needs ({cfg.vocab_size}, {cfg.hidden_size})")
    model = build_drafter(cfg)
    own = {ours: tensors[theirs].float() for ours, theirs in names.items()}
    result = model.load_state_dict({**own, "embed_tokens.weight": embed.float(), "d2t": d2t, "t2d": t2d}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model.eval()


def import_head(ckpt_dir: str | Path, target_dir: str | Path, out_dir: str | Path, layout: str = "auto",
                aux_convention: str | None = None, extra_files: dict | None = None) -> dict:
    """Read a published head (either layout) into a kvshot drafter folder. import.json records the
    layout, the switches honoured and the aux layers as HF hidden_states indices (`aux_layers`)."""
    config, tensors = read_eagle3(ckpt_dir)
    where = f"{ckpt_dir}/config.json"
    found, cfg, meta = read_head_config(config, where)
    if layout not in ("auto", found):
        raise FormatError(f"{where}: a {found}-layout head, not {layout} (use --format {found})")
    tc = target_config(target_dir)
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if tc.get(key) != ours:
            raise FormatError(f"{where}: field {key!r} {ours} is not the target's {tc.get(key)} ({target_dir})")
    convention = aux_convention or "vllm"
    if meta["aux_ids"] is not None:
        aux = hf_aux_layers(meta["aux_ids"], convention)
    else:   # EAGLE-3's default, the same hidden_states in SGLang and vLLM
        aux = list(eagle3_aux_layers(tc["num_hidden_layers"]))
    if len(set(aux)) != 3 or not all(0 < a <= tc["num_hidden_layers"] for a in aux):
        raise FormatError(f"{where}: aux layers {aux} (hidden_states indices) are not three distinct layers of the "
                          f"{tc['num_hidden_layers']}-layer target")
    embed = None if "embed_tokens.weight" in tensors else target_embedding(target_dir)
    model = head_from_tensors(cfg, found, tensors, embed, str(ckpt_dir))
    source = {"imported_from": str(ckpt_dir), "format": found, "aux_layers": aux, "aux_ids": meta["aux_ids"],
              "aux_convention": convention if meta["aux_ids"] is not None else "eagle3-default",
              "norm_before_residual": cfg.norm_before_residual, "qk_norm": cfg.qk_norm,
              "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
              "verifier": meta["verifier"], "speculative_tokens": meta["speculative_tokens"],
              "own_embedding": "embed_tokens.weight" in tensors}
    model.save(out_dir, {"import.json": source, **(extra_files or {})})
    return {"out": str(out_dir), **source, "draft_vocab_size": cfg.draft_vocab_size}


def head_aux_layers(ckpt_dir: str | Path, num_layers: int, aux_convention: str | None = None) -> list[int]:
    """The hidden_states indices a head fuses, from its config alone (for checking the features)."""
    where = f"{ckpt_dir}/config.json"
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: missing (not an EAGLE-3 head folder)")
    _, _, meta = read_head_config(json.loads(path.read_text()), where)
    if meta["aux_ids"] is None:
        return list(eagle3_aux_layers(num_layers))
    return hf_aux_layers(meta["aux_ids"], aux_convention or "vllm")


# ---------------------------------------------------------------- the published-head target

def resolve_weights(spec: str) -> str:
    """A head's folder: a path, or `hub:REPO@REVISION` read from the local HF cache (the pinned
    commit scripts/predownload_hub.py fetched; offline runs set HF_HUB_OFFLINE=1)."""
    if not spec.startswith("hub:"):
        return spec
    repo, _, revision = spec[4:].partition("@")
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, revision=revision or None, allow_patterns=[
        "config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model.bin"])


def head_variant(head: dict) -> dict:
    """The drafters.variants entry that imports a published head (train-drafter's `weights:`)."""
    v = {"name": head["name"], "paradigm": "hidden", "layers": 1, "weights": f"hub:{head['repo']}@{head['revision']}",
         "format": head["format"]}
    return {**v, "aux_convention": head["aux_convention"]} if head.get("aux_convention") else v


def head_stage_config(cfg: dict, head: dict) -> dict:
    """A stage config for one published head: its variant alone, and the publisher's decoding
    (a chain of `depth` drafts is drafters.ttt_steps; a tree is eval.e2e.tree)."""
    cfg = json.loads(json.dumps(cfg))
    dec = head["decoding"]
    if "drafters" in cfg:
        cfg["drafters"]["variants"] = [head_variant(head)]
        if dec["mode"] == "chain":
            cfg["drafters"]["ttt_steps"] = dec.get("depth", cfg["drafters"]["ttt_steps"])
    if "eval" in cfg:
        if dec["mode"] == "tree":
            cfg["eval"]["e2e"]["tree"] = {k: dec[k] for k in ("depth", "topk", "total_tokens")}
        if dec.get("max_new_tokens"):
            cfg["eval"]["e2e"]["max_new_tokens"] = dec["max_new_tokens"]
        bench = cfg["eval"]["e2e"].get("benchmarks")
        if bench:   # the publisher's shape only, at the temperatures it reports
            bench["modes"] = [dec["mode"]]
            bench["temperatures"] = sorted({float(t[1:]) for t in head["published"]}) or bench["temperatures"]
            if dec.get("max_new_tokens"):
                bench["max_new_tokens"] = dec["max_new_tokens"]
    return cfg


# ---------------------------------------------------------------- the import entry points

def drafter_from_eagle3(config: dict, tensors: dict[str, Tensor], embed: Tensor | None,
                        where: str = "checkpoint") -> HiddenDrafter:
    """A kvshot HiddenDrafter with a head's weights (either layout, `kvshot.published`). `embed`:
    the target's embedding, unless the head carries its own (`embed_tokens.weight`, which then wins)."""
    layout, cfg, _ = read_head_config(config, f"{where}/config.json")
    return head_from_tensors(cfg, layout, tensors, embed, where)


def import_eagle3(ckpt_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                  extra_files: dict | None = None, layout: str = "auto", aux_convention: str | None = None) -> dict:
    """Read an EAGLE-3 head folder (SpecForge/SGLang's eagle3 layout or vLLM's speculators
    layout, `kvshot.published`) into a kvshot drafter folder (`load_drafter` reads it)."""
    return import_head(ckpt_dir, target_dir, out_dir, layout, aux_convention, extra_files)


def import_variant(cfg: dict, name: str, target_dir: str, features_dir: str, out_dir: str) -> dict:
    """The `train-drafter` stage for a variant whose weights come from a path: import, no
    training. The head must fuse the target layers the features hold (eval reads those)."""
    from .variants import variant_config

    v = variant_config(cfg, name)
    where = f"config: drafters.variants.{name}"
    layout = v.get("format", "eagle3")
    if layout not in LAYOUTS or v["paradigm"] != "hidden" or v["layers"] != 1:
        raise FormatError(f"{where}: weights: only a one-layer hidden-paradigm head in format eagle3 or speculators "
                          "can be imported")
    index = Path(features_dir) / "index.json"
    held = read_json(index)["spec"]["aux_layers"] if index.is_file() else None
    weights = resolve_weights(v["weights"])   # a path, or hub:REPO@REVISION from the HF cache
    aux = head_aux_layers(weights, target_config(target_dir)["num_hidden_layers"], v.get("aux_convention"))
    if held is not None and list(aux) != list(held):
        raise FormatError(f"{where}.weights: the head fuses target layers {list(aux)} (hidden_states indices), the "
                          f"features hold {list(held)} (set features.aux_layers to match)")
    metrics = {"variant": name, "paradigm": "hidden", "layers": 1, "steps": 0, "stopped_by": "imported",
               "imported_from": v["weights"], "train_seconds": 0.0}
    # the files a trained drafter's folder has (the report reads them); no training log
    summary = import_eagle3(weights, target_dir, out_dir,
                            {"metrics.json": metrics, "train_log.json": [], "variant.json": v},
                            layout, v.get("aux_convention"))
    return {**metrics, "draft_vocab_size": summary["draft_vocab_size"]}


__all__ = ["LAYOUTS", "AUX_CONVENTIONS", "hf_aux_layers", "detect_layout", "read_head_config", "head_from_tensors",
           "import_head", "head_aux_layers", "eagle_aux_ids", "resolve_weights", "head_variant",
           "head_stage_config", "drafter_from_eagle3", "import_eagle3",
           "import_variant"]
