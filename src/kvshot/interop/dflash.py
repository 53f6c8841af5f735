"""A block drafter in DFlash's layout, as vLLM serves it (`DFlashDraftModel`), both ways.

vLLM's DFlash drafter (vllm/model_executor/models/qwen3_dflash.py, proposer v1/spec_decode/dflash.py)
computes what kvshot's `block-dflash` variant computes (drafters/block.py, block_context "dflash"):
  context  the target's aux hidden states of every verified token, concatenated -> `fc` -> one
           `hidden_norm` -> each layer's k/v projection, `k_norm`, RoPE at the token's position,
           into the drafter's own cache (keys and values, not an input);
  queries  the bonus token and K mask slots at the next K + 1 positions, through Qwen3 decoder
           layers (q/k norm), attending to the context and to the whole block (not causal);
           the K mask slots' outputs, through `norm` and `lm_head`, are the K drafts.
The folder: a Qwen3-style `config.json` (architectures DFlashDraftModel, `dflash_config` with
`mask_token_id`, `target_layer_ids` (0-based: HF hidden_states index - 1) and `causal: false`),
`model.safetensors` with the names below, and `mask_embedding.pt`: vLLM embeds a mask slot as
`embed_tokens[mask_token_id]` unless this file gives the trained mask embedding. The token
embedding is absent (vLLM shares the target's); `lm_head` is the draft vocabulary's with `d2t`
as offsets (as EAGLE-3's), or, with the whole vocabulary, its rows in the target's order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvshot.core.io import atomic_dir, write_json
from kvshot.drafters import DrafterConfig, load_drafter
from kvshot.drafters.block import BlockDrafter

from .export import DTYPES, FormatError, against_target, target_embedding

DFLASH_ARCHITECTURE = "DFlashDraftModel"
MASK_FILE = "mask_embedding.pt"
SHARED = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
PER_LAYER = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
             **{f"self_attn.{p}.weight": f"self_attn.{p}.weight"
                for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
             **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}


def dflash_names(num_layers: int) -> dict[str, str]:
    """kvshot parameter -> vLLM DFlash checkpoint tensor (lm_head and d2t aside)."""
    names = dict(SHARED)
    for i in range(num_layers):
        names |= {f"layers.{i}.{ours}": f"layers.{i}.{theirs}" for ours, theirs in PER_LAYER.items()}
    return names


def check_dflash_exportable(drafter, where: str) -> None:
    cfg = drafter.cfg
    if not isinstance(drafter, BlockDrafter) or cfg.block_context != "dflash":
        raise FormatError(f"{where}: paradigm {cfg.paradigm!r}, context {cfg.block_context!r}: the dflash format "
                          "holds block drafters in DFlash's layout only (block_context: dflash, the block-dflash variant)")
    if not cfg.qk_norm:
        raise FormatError(f"{where}: qk_norm false: vLLM's DFlash layers are Qwen3's, with q/k norm")
    if cfg.block_refine:
        raise FormatError(f"{where}: block_refine {cfg.block_refine}: vLLM drafts a DFlash block in one pass")
    if cfg.own_embedding:
        raise FormatError(f"{where}: own_embedding true: the dflash export shares the target's embedding")


def default_mask_token_id(vocab_size: int) -> int:
    """The id whose input slots vLLM embeds with the trained mask embedding: the last id of the
    vocabulary (a bonus token with this id would be read as a mask: acceptance, never output, changes)."""
    return vocab_size - 1


def dflash_tensors(drafter: BlockDrafter, dtype: torch.dtype) -> dict[str, Tensor]:
    own = drafter.state_dict()
    out = {theirs: own[ours].detach().to(dtype).contiguous().cpu()
           for ours, theirs in dflash_names(drafter.cfg.num_layers).items()}
    head, d2t = own["lm_head.weight"].detach().to(dtype).cpu(), drafter.d2t.detach().cpu().long()
    if drafter.cfg.draft_vocab_size == drafter.cfg.vocab_size:   # vLLM then has no d2t: rows in the target's order
        full = torch.empty_like(head)
        full[d2t] = head
        out["lm_head.weight"] = full.contiguous()
    else:
        out["lm_head.weight"] = head.contiguous()
        out["d2t"] = d2t - torch.arange(len(d2t))
    return out


def dflash_config(cfg: DrafterConfig, dtype: str, max_position_embeddings: int, aux_layers: list[int],
                  mask_token_id: int) -> dict:
    """`aux_layers`: the HF hidden_states indices the drafter fuses (kvshot's convention);
    DFlash's target_layer_ids count from 0 (a layer's output)."""
    return {
        "architectures": [DFLASH_ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "max_position_embeddings": max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": dtype, "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [a - 1 for a in aux_layers],
                          "causal": False},
    }


def export_dflash(drafter_dir: str | Path, out_dir: str | Path, target_dir: str | Path | None = None,
                  aux_layers: list[int] | None = None, dtype: str = "float32",
                  max_position_embeddings: int | None = None, aux_rule: str = "relative",
                  mask_token_id: int | None = None) -> dict:
    """Write `drafter_dir` (a block-dflash drafter folder) as vLLM's DFlash folder."""
    drafter = load_drafter(drafter_dir, need_embedding=False)
    check_dflash_exportable(drafter, f"{drafter_dir}/config.json")
    cfg = drafter.cfg
    if dtype not in DTYPES:
        raise FormatError(f"--dtype {dtype}: one of {sorted(DTYPES)}")
    aux_layers, max_position_embeddings = against_target(cfg, target_dir, aux_layers, aux_rule, max_position_embeddings)
    if aux_layers is None:
        raise FormatError(f"{drafter_dir}: the target layers it fuses are unknown: give --target or features.aux_layers")
    if len(aux_layers) != cfg.num_aux or min(aux_layers) < 1:
        raise FormatError(f"aux layers {list(aux_layers)}: the drafter fuses {cfg.num_aux} target layers' outputs "
                          "(hidden_states indices >= 1)")
    mask_id = default_mask_token_id(cfg.vocab_size) if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask_id < cfg.vocab_size:
        raise FormatError(f"--mask-token-id {mask_id}: not an id of the {cfg.vocab_size}-token vocabulary")
    torch_dtype = DTYPES[dtype]
    config = dflash_config(cfg, dtype, int(max_position_embeddings or 32768), list(aux_layers), mask_id)
    mask = drafter.mask_embed.detach()[0].to(torch_dtype).contiguous().cpu()
    with atomic_dir(out_dir) as tmp:
        write_json(tmp / "config.json", config)
        save_file(dflash_tensors(drafter, torch_dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save({"mask_token_id": mask_id, "embedding": mask}, tmp / MASK_FILE)
    return {"out": str(out_dir), "architecture": DFLASH_ARCHITECTURE, "dtype": dtype, "block_size": cfg.block_size,
            "draft_vocab_size": cfg.draft_vocab_size, "aux_layers": list(aux_layers), "mask_token_id": mask_id}


def read_dflash(ckpt_dir: str | Path) -> tuple[dict, dict[str, Tensor], Tensor]:
    """config.json, the tensors and the mask embedding [H] of a DFlash folder."""
    folder = Path(ckpt_dir)
    for name in ("config.json", "model.safetensors", MASK_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}/{name}: missing (not a DFlash folder written by kvshot export)")
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != [DFLASH_ARCHITECTURE]:
        raise FormatError(f"{folder}/config.json: architectures {config.get('architectures')}: not {DFLASH_ARCHITECTURE}")
    mask = torch.load(folder / MASK_FILE, map_location="cpu", weights_only=True)
    return config, load_file(str(folder / "model.safetensors")), (mask["embedding"] if isinstance(mask, dict) else mask)


def drafter_from_dflash(ckpt_dir: str | Path, target_dir: str | Path) -> tuple[BlockDrafter, list[int]]:
    """A kvshot block-dflash drafter (fp32, the target's embedding) from a DFlash folder, and the
    HF hidden_states indices it fuses."""
    config, tensors, mask = read_dflash(ckpt_dir)
    where = f"{ckpt_dir}/config.json"
    dc = config.get("dflash_config") or {}
    if dc.get("causal"):
        raise FormatError(f"{where}: dflash_config.causal true: kvshot's block attends to the whole block")
    aux = [i + 1 for i in dc.get("target_layer_ids") or []]
    if not aux:
        raise FormatError(f"{where}: dflash_config.target_layer_ids: missing")
    vocab, draft_vocab = int(config["vocab_size"]), int(config.get("draft_vocab_size") or config["vocab_size"])
    cfg = DrafterConfig(paradigm="block", hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                        num_attention_heads=config["num_attention_heads"],
                        num_key_value_heads=config["num_key_value_heads"],
                        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                        intermediate_size=config["intermediate_size"], vocab_size=vocab, draft_vocab_size=draft_vocab,
                        rope_theta=float(config.get("rope_theta", 1e6)), rms_norm_eps=config["rms_norm_eps"],
                        num_aux=len(aux), qk_norm=True, block_context="dflash",
                        block_size=int(config.get("block_size") or 16))
    drafter = BlockDrafter(cfg)
    own = {ours: tensors[theirs].float() for ours, theirs in dflash_names(cfg.num_layers).items()}
    own["mask_embed"] = mask.float().view(1, -1)
    own["lm_head.weight"] = tensors["lm_head.weight"].float()
    # offsets to target ids; without d2t the head covers the whole vocabulary in the target's order
    d2t = tensors["d2t"].long() + torch.arange(draft_vocab) if "d2t" in tensors else torch.arange(vocab)
    missing = drafter.load_state_dict(own, strict=False)
    left = [k for k in missing.missing_keys if k not in ("embed_tokens.weight", "d2t", "t2d")]
    if left or missing.unexpected_keys:
        raise FormatError(f"{ckpt_dir}: tensors missing {left}, unexpected {missing.unexpected_keys}")
    drafter.set_vocab(target_embedding(target_dir), d2t)
    return drafter.eval(), aux


def import_dflash(ckpt_dir: str | Path, target_dir: str | Path, out_dir: str | Path) -> dict:
    """Read a DFlash folder into a kvshot drafter folder (`load_drafter` reads it)."""
    drafter, aux = drafter_from_dflash(ckpt_dir, target_dir)
    drafter.save(out_dir, {"imported.json": {"from": str(ckpt_dir), "format": "dflash", "aux_layers": aux}})
    return {"out": str(out_dir), "block_size": drafter.cfg.block_size, "aux_layers": aux,
            "draft_vocab_size": drafter.cfg.draft_vocab_size}
