"""A variant's settings and a fresh drafter for it: its draft vocabulary, its head's start,
and which of its parameters train when (held back, gradient-norm groups)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from kvshot.capture.features import FeatureSource
from kvshot.capture.target import has_qk_norm, rope_theta
from kvshot.config import ConfigError
from kvshot.core.taps import reads_target_kv
from kvshot.drafters import Drafter, DrafterConfig, build_drafter
from kvshot.drafters.standalone import init_from_target
from kvshot.settings import Config, TrainOverrides, TrainSettings, VariantSettings, to_dict


@dataclass(frozen=True)
class Variant(VariantSettings):
    """A variant as it trains: its entry, drafters' block_size and head_init where it sets none,
    and its train overrides over drafters.train."""
    train: TrainSettings


def merged_train(base: TrainSettings, overrides: TrainOverrides | None) -> TrainSettings:
    """drafters.train with a variant's own fields (those it sets) in their place."""
    if overrides is None:
        return base
    return replace(base, **{f.name: getattr(overrides, f.name) for f in fields(overrides)
                            if getattr(overrides, f.name) is not None})


def variant_config(cfg: Config, name: str) -> Variant:
    """A variant's settings: its own entry, the drafters' defaults and its train overrides."""
    dcfg = cfg.drafters
    entries = {v.name: v for v in cfg.all_variants()}   # with the block variants and gate remedies
    if name not in entries:
        raise ConfigError(f"config: drafters.variants: no variant named {name!r} (have {sorted(entries)})")
    entry = entries[name]
    own = {f.name: getattr(entry, f.name) for f in fields(entry)}
    if entry.paradigm == "block" and entry.block_size is None:   # K mask slots after x_{t+1}, as far as the chain drafts
        own["block_size"] = dcfg.block_size or dcfg.ttt_steps + 1
    if entry.paradigm != "standalone" and entry.head_init is None:   # the standalone LM starts from the target's head
        own["head_init"] = dcfg.head_init
    return Variant(**{**own, "train": merged_train(dcfg.train, entry.train)})


def variant_record(v: Variant) -> dict:
    """The variant as plain data: its variant.json and what its checkpoint's fingerprint hashes.
    Its entry's fields as set, and every train field, null ones too, as the filled config held
    them (so a checkpoint written before the typed config keeps its fingerprint)."""
    record = to_dict(v)
    record["train"] = {f.name: to_dict(getattr(v.train, f.name)) for f in fields(v.train)}
    return record


def draft_vocab(source: FeatureSource, size: int, vocab_size: int, samples: int | None = None) -> torch.Tensor:
    """The `size` most frequent assistant-side tokens of the (first `samples`) train samples
    (ties: lower id), as sorted target ids (d2t)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(samples or len(source)):
        s = source.tokens(i)
        counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()].long(), minlength=vocab_size)
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


# variant field -> DrafterConfig field. A field the variant leaves out takes the drafter format's
# default (DrafterConfig), the value a saved drafter without that field is read with.
VARIANT_FIELDS = {"gate_shape": "gate_shape", "gate_init": "gate_init", "block_size": "block_size",
                  "refine_passes": "block_refine", "context": "block_context", "norm_before_fc": "norm_before_fc",
                  "fc_norm": "fc_norm", "norm_output": "norm_output", "norm_output_convention": "norm_output_convention"}


def build_variant(v: VariantSettings, target_cfg, embed: torch.Tensor, d2t: torch.Tensor, target=None) -> Drafter:
    """A fresh drafter for variant `v`. The standalone LM drafts over the full vocabulary and,
    given the `target` model, starts from its first layers (then TTT distills it)."""
    n_target = target_cfg.num_hidden_layers
    depth, paradigm = v.layers, v.paradigm
    own = {field: getattr(v, key) for key, field in VARIANT_FIELDS.items() if getattr(v, key) is not None}
    block_context = own.get("block_context", DrafterConfig.block_context)
    reads_kv = reads_target_kv(paradigm, block_context)
    kv_layers = v.kv_layers or list(range(n_target - depth, n_target))  # the top target layers
    if reads_kv and len(kv_layers) != depth:
        raise ConfigError(f"config: drafters.variants.{v.name}.kv_layers: {len(kv_layers)} layers for depth {depth}")
    if paradigm == "standalone":
        d2t = torch.arange(target_cfg.vocab_size)
    # default: the target's own attention (Qwen3: q/k norm; Llama: none); the standalone LM starts
    # from the target's layers, so it always has the target's; DFlash's layers are Qwen3's whatever
    # the target is (vLLM serves no other), so block-dflash has q/k norm unless it says otherwise
    qk_norm = has_qk_norm(target_cfg)
    if paradigm != "standalone" and v.qk_norm is not None:
        qk_norm = v.qk_norm
    elif paradigm == "block" and block_context == "dflash":
        qk_norm = True
    dc = DrafterConfig(
        paradigm=paradigm, hidden_size=target_cfg.hidden_size, num_layers=depth,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim, intermediate_size=v.intermediate_size or target_cfg.intermediate_size,
        vocab_size=target_cfg.vocab_size, draft_vocab_size=len(d2t), rope_theta=rope_theta(target_cfg),
        rms_norm_eps=target_cfg.rms_norm_eps, kv_layers=list(kv_layers) if reads_kv else [], qk_norm=qk_norm, **own)
    model = build_drafter(dc)
    model.set_vocab(embed, d2t)
    if paradigm == "standalone" and target is not None:
        init_from_target(model, target)
    elif v.head_init == "target" and target is not None:
        init_head_from_target(model, target, d2t)
    return model


@torch.no_grad()
def init_head_from_target(model: Drafter, target, d2t: torch.Tensor) -> None:
    """Start the drafter's output norm and LM head from the target's (its rows for the draft
    vocabulary), as EAGLE-1/2 reuse the target's head and the standalone LM starts from it:
    the head need not be learned from scratch in a short training budget."""
    model.lm_head.weight.copy_(target.lm_head.weight[d2t.to(target.lm_head.weight.device)].to(model.lm_head.weight))
    model.norm.weight.copy_(target.model.norm.weight.to(model.norm.weight))


KV_BRANCH = ("kv_attns.", "kv_norms.", "gate_logit")   # the hybrid's KV branch and its gate


def held_back(model: Drafter, v: VariantSettings) -> list[torch.nn.Parameter]:
    """The parameters a variant's kv_warmup_steps hold back (the hybrid-warm gate remedy):
    everything outside the hybrid's KV branch, so that the branch learns alone at first."""
    if not v.kv_warmup_steps:
        return []
    if v.paradigm != "hybrid":
        raise ConfigError(f"config: drafters.variants.{v.name}.kv_warmup_steps: a hybrid setting "
                          f"(paradigm {v.paradigm} has no gated KV branch)")
    return [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(KV_BRANCH)]


def param_groups(model: Drafter) -> dict[str, list[torch.nn.Parameter]]:
    """Groups for gradient norms; the KV path's drafter-side W_K/W_V stand alone."""
    kv_modules = {id(attn) for _, attn in model.kv_attentions()}
    kv_names = {f"{name}." for name, mod in model.named_modules() if id(mod) in kv_modules}
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prefix = next((k for k in kv_names if name.startswith(k)), None)
        if prefix is not None:
            g = "kv_wk_wv" if name[len(prefix):].startswith(("k_proj", "v_proj")) else "kv_query_out"
        elif name.startswith("gate"):
            g = "gate"
        elif name.startswith(("fc.", "fc_norm.", "fc_input_norm.")):
            g = "fusion"
        elif name.startswith("lm_head"):
            g = "lm_head"
        else:
            g = "body"
        groups.setdefault(g, []).append(p)
    return groups
