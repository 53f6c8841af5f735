"""Published EAGLE-3 heads into kvshot, in every layout family they ship in (`kvshot.interop.head_config`
reads the config.json, this module the tensors; docs/published-heads.md has the table):

  eagle3       a flat Llama config with `draft_vocab_size`, optional `eagle_config`, tensors
               `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` (offsets), `t2d`; safetensors or
               pytorch_model.bin. Families by `architectures`: SpecForge's LlamaForCausalLMEagle3,
               vLLM's Eagle3LlamaForCausalLM (AngelSlim), EAGLE's LlamaForCausalLM (traineagle3).
  speculators  vLLM's `speculators` (`Eagle3Speculator`, RedHatAI/Qwen3-8B-speculator.eagle3): the
               layer's config nested in `transformer_layer_config`, the head's switches at the top,
               tensors `layers.0.*`.

The traps, each handled explicitly: aux layer ids (vLLM counts layer inputs, SGLang outputs),
norm_output (SpecForge: the head's norm only; vLLM: the carried state too), a missing
norm_before_residual (vLLM's speculators reader: true), d2t offsets (t2d must mark exactly their
targets), and an embedding of the head's own (kept, saved with the drafter, when it differs from
the target's). Any config field or tensor not known is refused in one line naming the file and
the field: a head that silently loads with a switch ignored drafts badly without any error.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from kvshot.core.io import read_json
from kvshot.core.taps import eagle3_aux_layers
from kvshot.drafters import DrafterConfig, build_drafter
from kvshot.drafters.hidden import HiddenDrafter
from kvshot.interop.export import (EAGLE3_NAMES, FC_NORM_NAMES, FormatError, read_eagle3, target_config,
                                   target_embedding)
from kvshot.interop.head_stage import head_stage_config, head_variant  # noqa: F401 (re-exported)
from kvshot.interop.head_config import AUX_CONVENTIONS, NORM_OUTPUT_CONVENTIONS, layout_of, read_head_config
from kvshot.settings import Config

LAYOUTS = ("eagle3", "speculators")
detect_layout = layout_of

# kvshot HiddenDrafter parameter -> speculators tensor (Eagle3DraftModel, one layer)
SPECULATORS_NAMES = {ours: theirs.replace("midlayer.", "layers.0.") for ours, theirs in EAGLE3_NAMES.items()}
QK_NORM_NAMES = {"layers.0.self_attn.q_norm.weight": "layers.0.self_attn.q_norm.weight",
                 "layers.0.self_attn.k_norm.weight": "layers.0.self_attn.k_norm.weight"}
# the verifier's own final norm and LM head, which speculators may keep beside the head: not the head's
VERIFIER_TENSORS = {"verifier_norm.weight", "verifier_lm_head.weight"}


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


def aux_layers_of(meta: dict, num_layers: int) -> list[int]:
    """The hidden_states indices a head fuses, from its resolved config."""
    if meta["aux_ids"] is None:
        return list(eagle3_aux_layers(num_layers))
    return hf_aux_layers(meta["aux_ids"], meta["resolved"]["aux_convention"]["value"])


# ---------------------------------------------------------------- tensors

def head_from_tensors(cfg: DrafterConfig, layout: str, tensors: dict[str, Tensor], embed: Tensor | None,
                      where: str) -> HiddenDrafter:
    """A kvshot HiddenDrafter with the head's weights; `embed`: the target's embedding unless the
    head carries its own `embed_tokens.weight`, which then wins (as in the engines that load it:
    vLLM's Eagle3 load_weights keeps a checkpoint's embed_tokens)."""
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
    fc = tuple(tensors["fc.weight"].shape)
    if fc != (cfg.hidden_size, cfg.num_aux * cfg.hidden_size):
        raise FormatError(f"{where}: tensor 'fc.weight' {list(fc)}: an EAGLE-3 head fuses {cfg.num_aux} target "
                          f"states, [{cfg.hidden_size}, {cfg.num_aux * cfg.hidden_size}] (EAGLE-1/2 reads 2H)")
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


def own_embedding(tensors: dict[str, Tensor], meta: dict, target: Tensor, where: str) -> tuple[bool, dict]:
    """Whether the head runs on an embedding of its own: one it carries that differs from the target's.
    A speculators head that trained its embedding (`embed_requires_grad: true`) must carry it."""
    theirs = tensors.get("embed_tokens.weight", tensors.get("model.embed_tokens.weight"))
    trained = meta.get("embed_requires_grad")
    if theirs is None:
        if trained:
            raise FormatError(f"{where}/config.json: field 'embed_requires_grad' true: the head trained its own "
                              "embedding, but its weights hold no embed_tokens.weight; refusing to run it on the "
                              "target's")
        return False, {"value": "target", "rule": "the weights hold no embed_tokens.weight: the target's"}
    same = tuple(theirs.shape) == tuple(target.shape) and torch.equal(theirs.float(), target.float())
    how = "equal to the target's" if same else "differs from the target's: kept, saved with the drafter"
    return not same, {"value": "target" if same else "own", "rule": f"embed_tokens.weight {how}",
                      "embed_requires_grad": trained}


def import_head(ckpt_dir: str | Path, target_dir: str | Path, out_dir: str | Path, layout: str = "auto",
                aux_convention: str | None = None, extra_files: dict | None = None,
                overrides: dict | None = None) -> dict:
    """Read a published head (any layout family, `kvshot.interop.head_config`) into a kvshot drafter folder.
    import.json records the layout and family, how each engine-ambiguous field was resolved
    (`resolved`), the keys accepted without effect (`inert`) and the aux layers as HF
    hidden_states indices (`aux_layers`). `overrides`: aux_convention, norm_output_convention,
    norm_before_residual (the import CLI's flags)."""
    config, tensors = read_eagle3(ckpt_dir)
    where = f"{ckpt_dir}/config.json"
    over = {**(overrides or {}), **({"aux_convention": aux_convention} if aux_convention else {})}
    found, cfg, meta = read_head_config(config, where, over)
    if layout not in ("auto", found):
        raise FormatError(f"{where}: a {found}-layout head, not {layout} (use --format {found})")
    tc = target_config(target_dir)
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if tc.get(key) != ours:
            raise FormatError(f"{where}: field {key!r} {ours} is not the target's {tc.get(key)} ({target_dir})")
    aux = aux_layers_of(meta, tc["num_hidden_layers"])
    if len(set(aux)) != 3 or not all(0 < a <= tc["num_hidden_layers"] for a in aux):
        raise FormatError(f"{where}: aux layers {aux} (hidden_states indices) are not three distinct layers of the "
                          f"{tc['num_hidden_layers']}-layer target")
    target_embed = target_embedding(target_dir)
    own, embedding = own_embedding(tensors, meta, target_embed, str(ckpt_dir))
    cfg.own_embedding = own
    if not own:   # a copy of the target's: the folder shares it, as every kvshot drafter does
        tensors = {k: v for k, v in tensors.items() if k.removeprefix("model.") != "embed_tokens.weight"}
    model = head_from_tensors(cfg, found, tensors, target_embed, str(ckpt_dir))
    resolved = {**meta["resolved"], "embedding": embedding}
    source = {"imported_from": str(ckpt_dir), "format": found, "family": meta["family"], "aux_layers": aux,
              "aux_ids": meta["aux_ids"], "aux_convention": resolved["aux_convention"]["value"],
              "norm_before_residual": cfg.norm_before_residual, "qk_norm": cfg.qk_norm,
              "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
              "norm_output_convention": cfg.norm_output_convention, "resolved": resolved, "inert": meta["inert"],
              "verifier": meta["verifier"], "speculative_tokens": meta["speculative_tokens"], "own_embedding": own}
    model.save(out_dir, {"import.json": source, **(extra_files or {})})
    return {"out": str(out_dir), **source, "draft_vocab_size": cfg.draft_vocab_size}


def head_aux_layers(ckpt_dir: str | Path, num_layers: int, aux_convention: str | None = None,
                    overrides: dict | None = None) -> list[int]:
    """The hidden_states indices a head fuses, from its config alone (for checking the features)."""
    where = f"{ckpt_dir}/config.json"
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: missing (not an EAGLE-3 head folder)")
    over = {**(overrides or {}), **({"aux_convention": aux_convention} if aux_convention else {})}
    _, _, meta = read_head_config(json.loads(path.read_text()), where, over)
    return aux_layers_of(meta, num_layers)


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


# ---------------------------------------------------------------- the import entry points

def drafter_from_eagle3(config: dict, tensors: dict[str, Tensor], embed: Tensor | None,
                        where: str = "checkpoint") -> HiddenDrafter:
    """A kvshot HiddenDrafter with a head's weights (either layout, `kvshot.interop.published`). `embed`:
    the target's embedding, unless the head carries its own (`embed_tokens.weight`, which then wins)."""
    layout, cfg, _ = read_head_config(config, f"{where}/config.json")
    return head_from_tensors(cfg, layout, tensors, embed, where)


def import_eagle3(ckpt_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                  extra_files: dict | None = None, layout: str = "auto", aux_convention: str | None = None,
                  overrides: dict | None = None) -> dict:
    """Read an EAGLE-3 head folder (SpecForge/SGLang's eagle3 layout or vLLM's speculators
    layout, `kvshot.interop.published`) into a kvshot drafter folder (`load_drafter` reads it)."""
    return import_head(ckpt_dir, target_dir, out_dir, layout, aux_convention, extra_files, overrides)


def import_variant(cfg: Config, name: str, target_dir: str, features_dir: str, out_dir: str) -> dict:
    """The `train-drafter` stage for a variant whose weights come from a path: import, no
    training. The head must fuse the target layers the features hold (eval reads those)."""
    from kvshot.train.variants import variant_config, variant_record

    v = variant_config(cfg, name)
    where = f"config: drafters.variants.{name}"
    layout = v.format
    if layout not in LAYOUTS or v.paradigm != "hidden" or v.layers != 1:
        raise FormatError(f"{where}: weights: only a one-layer hidden-paradigm head in format eagle3 or speculators "
                          "can be imported")
    index = Path(features_dir) / "index.json"
    held = read_json(index)["spec"]["aux_layers"] if index.is_file() else None
    weights = resolve_weights(v.weights)   # a path, or hub:REPO@REVISION from the HF cache
    overrides = {} if v.norm_output_convention is None else {"norm_output_convention": v.norm_output_convention}
    aux = head_aux_layers(weights, target_config(target_dir)["num_hidden_layers"], v.aux_convention, overrides)
    if held is not None and list(aux) != list(held):
        raise FormatError(f"{where}.weights: the head fuses target layers {list(aux)} (hidden_states indices), the "
                          f"features hold {list(held)} (set features.aux_layers to match)")
    metrics = {"variant": name, "paradigm": "hidden", "layers": 1, "steps": 0, "stopped_by": "imported",
               "imported_from": v.weights, "train_seconds": 0.0}
    # the files a trained drafter's folder has (the report reads them); no training log
    summary = import_eagle3(weights, target_dir, out_dir,
                            {"metrics.json": metrics, "train_log.json": [], "variant.json": variant_record(v)},
                            layout, v.aux_convention, overrides)
    return {**metrics, "draft_vocab_size": summary["draft_vocab_size"]}


__all__ = ["LAYOUTS", "AUX_CONVENTIONS", "NORM_OUTPUT_CONVENTIONS", "own_embedding", "hf_aux_layers", "detect_layout", "read_head_config", "head_from_tensors",
           "import_head", "head_aux_layers", "eagle_aux_ids", "resolve_weights", "head_variant",
           "head_stage_config", "drafter_from_eagle3", "import_eagle3",
           "import_variant"]
