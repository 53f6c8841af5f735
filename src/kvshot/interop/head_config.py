"""A published EAGLE-3 head's config.json, read as its publisher's code reads it (kvshot.interop.published).

Layout families (docs/published-heads.md has the table with the publishers' source lines):
  specforge    flat Llama config, `architectures: [LlamaForCausalLMEagle3]`: SpecForge's class, the one
               SGLang serves; SpecForge and hub heads it trained (AQ-MedAI/Kimi-K25-eagle3)
  vllm         flat, `[Eagle3LlamaForCausalLM]`: vLLM's class name; AngelSlim's training configs
  eagle        flat, `[LlamaForCausalLM]` with `draft_vocab_size`: EAGLE's traineagle3 heads, which vLLM
               serves as EAGLE-3 by the speculative method (checked on the tensors: fc reads 3H)
  speculators  `speculators_model_type: eagle3`, the layer in `transformer_layer_config` (0.1 ... 0.9)

Three fields mean different things in different engines; each is resolved from the family and
the evidence in the file, the rule recorded (import.json `resolved`), and each can be overridden:
  aux ids              vLLM counts id i as the input of layer i (hidden_states[i]); SGLang as its
                       output (hidden_states[i + 1]). Top-level `eagle_aux_hidden_state_layer_ids`
                       is vLLM's own key (read first there): vllm. `eagle_config` ids alone: the
                       family's engine (specforge: sglang; vllm: vllm); the eagle family gives no
                       evidence: refused unless --aux-convention is given.
  norm_output          specforge family: SpecForge's meaning (the head reads norm(h) when true, h
                       when false; the carried state stays raw); vllm and speculators: vLLM's
                       (true: the post-norm state is carried); eagle: EAGLE's code has no such key,
                       refused unless --norm-output-convention is given. Absent: standard EAGLE-3.
  norm_before_residual absent in a speculators config: true (vLLM's speculators reader); absent in a
                       flat config: false (vLLM's Eagle3 layer; SpecForge and SGLang have no switch).
"""
from __future__ import annotations

from kvshot.drafters import DrafterConfig
from kvshot.interop.export import FormatError

FAMILIES = {"LlamaForCausalLMEagle3": "specforge", "Eagle3LlamaForCausalLM": "vllm", "LlamaForCausalLM": "eagle"}
AUX_CONVENTIONS = ("vllm", "sglang")
NORM_OUTPUT_CONVENTIONS = ("vllm", "specforge")

# config keys that do not change the head's computation (metadata, training, serving), accepted and recorded
INERT = {"architectures", "model_type", "_name_or_path", "auto_map", "torch_dtype", "dtype", "transformers_version",
         "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "pretraining_tp",
         "attention_dropout", "max_position_embeddings", "max_window_layers", "layer_types", "output_hidden_states",
         "output_attentions", "return_dict", "use_return_dict", "tie_word_embeddings", "sliding_window",
         "use_sliding_window", "has_no_defaults_at_init", "modules_to_not_convert", "chunk_size_feed_forward",
         "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "quantization_config",
         # AngelSlim: names the target's family, for its embedding-key lookup (models/model_utils.py)
         "target_model_type",
         # transformers 5 parallelism plans (null in the heads; sharding only)
         "base_model_ep_plan", "base_model_tp_plan", "base_model_pp_plan"}
LAYER_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
              "attention_bias", "mlp_bias", "vocab_size"}
FLAT_HEAD_KEYS = {"draft_vocab_size", "target_hidden_size", "eagle_config", "norm_before_residual", "fc_norm",
                  "norm_output", "eagle_aux_hidden_state_layer_ids"}
SPECULATORS_TOP_KEYS = {"speculators_model_type", "speculators_version", "speculators_config",
                        "transformer_layer_config", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                        "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output",
                        "embed_requires_grad"}

SOURCES = {   # the publisher code each rule follows (docs/published-heads.md gives the lines)
    "aux-top": "vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (top-level key first)",
    "aux-sglang": "SpecForge specforge/algorithms/model_providers.py resolve_eagle_capture_layers -> SGLang "
                  "set_eagle3_layers_to_capture (val + 1)",
    "aux-vllm": "vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (eagle_config, as is)",
    "aux-default": "EAGLE traineagle3/modeling_llama_kv.py (inputs of layers 2, L//2, L-3); SGLang and vLLM default",
    "no-specforge": "SpecForge specforge/modeling/draft/llama3_eagle.py compute_logits; algorithms/eagle3/model.py",
    "no-vllm": "speculators models/eagle3/core.py (norm_output); vLLM llama_eagle3.py LlamaModel.forward",
    "nbr-spec": "vllm/transformers_utils/configs/speculators/algos.py update_eagle3 (default True)",
    "nbr-flat": "vllm/model_executor/models/llama_eagle3.py getattr(config, 'norm_before_residual', False)",
}


def layout_of(config: dict) -> str:
    return "speculators" if "speculators_model_type" in config or "transformer_layer_config" in config else "eagle3"


def refuse_unknown(config: dict, known: set, where: str) -> list[str]:
    """The inert keys present; any key neither read nor inert is refused in one line."""
    unknown = sorted(set(config) - known - INERT)
    if unknown:
        raise FormatError(f"{where}: field {unknown[0]!r} is not one kvshot knows how to honour "
                          f"(unknown: {unknown}); refusing rather than ignoring it")
    return sorted(set(config) & INERT)


def boolean(config: dict, key: str, where: str, default: bool | None = False) -> bool | None:
    value = config.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise FormatError(f"{where}: field {key!r} {value!r}: expected true or false")
    return value


def ids_of(value, where: str, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise FormatError(f"{where}: field {key!r} {value!r}: expected a list of layer ids")
    return list(value)


def layer_config(c: dict, where: str, draft_vocab_size: int, qk_norm: bool, **switched) -> DrafterConfig:
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
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"], draft_vocab_size=draft_vocab_size,
        rope_theta=float(theta), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm, **switched)


def check_width(top: dict, h: int, where: str) -> None:
    if top.get("target_hidden_size") not in (None, h):
        raise FormatError(f"{where}: field 'target_hidden_size' {top['target_hidden_size']} differs from hidden_size "
                          f"{h}: kvshot's drafter shares the target's width")


def rule(value, how: str, source: str | None, override: bool = False) -> dict:
    return {"value": value, "rule": how, "source": SOURCES.get(source, source), "override": override}


def resolve_aux(family: str, top_ids, eagle_ids, where: str, override: str | None) -> tuple[list | None, dict]:
    """(the ids the aux layers come from, their resolution: value = the convention)."""
    if override is not None:
        if override not in AUX_CONVENTIONS:
            raise FormatError(f"aux convention {override!r}: one of {list(AUX_CONVENTIONS)}")
        ids = top_ids if top_ids is not None else eagle_ids
        return ids, rule(override if ids is not None else "eagle3-default", "given (--aux-convention)", None, True)
    if top_ids is not None:
        if eagle_ids is not None and eagle_ids not in (top_ids, [i - 1 for i in top_ids]):
            raise FormatError(f"{where}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' {eagle_ids} names "
                              f"other layers than the top-level 'eagle_aux_hidden_state_layer_ids' {top_ids} in "
                              "either engine's count; refusing to pick one (pass --aux-convention)")
        return top_ids, rule("vllm", "top-level eagle_aux_hidden_state_layer_ids: vLLM's key, read first by vLLM "
                             "as inputs of layer i", "aux-top")
    if eagle_ids is not None:
        if family == "specforge":
            return eagle_ids, rule("sglang", "eagle_config ids in a LlamaForCausalLMEagle3 config: written by "
                                   "SpecForge for SGLang, which captures the output of layer i", "aux-sglang")
        if family in ("vllm", "speculators"):
            return eagle_ids, rule("vllm", "eagle_config ids in an Eagle3LlamaForCausalLM config: vLLM's class, "
                                   "which reads them as inputs of layer i", "aux-vllm")
        raise FormatError(f"{where}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' {eagle_ids}: "
                          f"architectures {family!r} give no evidence of the engine it was written for (vLLM "
                          "counts layer inputs, SGLang outputs); pass --aux-convention vllm or sglang")
    return None, rule("eagle3-default", "no ids: EAGLE-3's default (2, L//2, L-3), the same hidden_states in "
                      "SGLang and vLLM", "aux-default")


def resolve_norm_output(family: str, value: bool | None, where: str, override: str | None) -> dict:
    if override is not None:
        if override not in NORM_OUTPUT_CONVENTIONS:
            raise FormatError(f"norm_output convention {override!r}: one of {list(NORM_OUTPUT_CONVENTIONS)}")
        return rule(override, "given (--norm-output-convention)", None, True)
    if value is None:
        return rule("vllm", "absent: standard EAGLE-3 in every engine (head reads norm(h), state carried raw)",
                    "no-vllm")
    if family == "specforge":
        return rule("specforge", "LlamaForCausalLMEagle3 is SpecForge's class: norm_output only chooses whether "
                    "the head reads norm(h); the carried state stays raw", "no-specforge")
    if family in ("vllm", "speculators"):
        return rule("vllm", f"{family}: vLLM's and speculators' norm_output, the post-norm state is carried",
                    "no-vllm")
    raise FormatError(f"{where}: field 'norm_output' {value}: EAGLE's LlamaForCausalLM heads have no such switch "
                      "and SpecForge and vLLM read it differently; pass --norm-output-convention vllm or specforge")


def resolve_nbr(layout: str, value: bool | None, override: bool | None) -> tuple[bool, dict]:
    if override is not None:
        return override, rule(override, "given (--norm-before-residual)", None, True)
    if value is not None:
        return value, rule(value, "read from the config", None)
    if layout == "speculators":
        return True, rule(True, "absent in a speculators config: vLLM's speculators reader defaults it to true",
                          "nbr-spec")
    return False, rule(False, "absent in a flat config: vLLM's Eagle3 layer defaults it to false; SpecForge "
                       "and SGLang have no such switch", "nbr-flat")


def read_head_config(config: dict, where: str, overrides: dict | None = None) -> tuple[str, DrafterConfig, dict]:
    """(layout, DrafterConfig, meta) of a head's config.json. meta: family, aux ids as written,
    `resolved` (each engine-ambiguous field: value, rule, source, override), `inert` (keys accepted
    without effect), the verifier the head names and the proposal length it ships with."""
    over = overrides or {}
    layout = layout_of(config)
    if layout == "eagle3":
        arch = config.get("architectures") or []
        family = next((FAMILIES[a] for a in arch if a in FAMILIES), None)
        if family is None:
            raise FormatError(f"{where}: field 'architectures' {arch}: not an EAGLE-3 head (want one of "
                              f"{sorted(FAMILIES)})")
        if family == "eagle" and "draft_vocab_size" not in config:
            raise FormatError(f"{where}: field 'architectures' {arch} without 'draft_vocab_size': an EAGLE-1/2 head "
                              "or a plain Llama model, not an EAGLE-3 head")
        if config.get("model_type", "llama") not in ("llama", "qwen3"):
            raise FormatError(f"{where}: field 'model_type' {config['model_type']!r}: the engines build a Llama "
                              "layer for these architectures")
        inert = refuse_unknown(config, LAYER_KEYS | FLAT_HEAD_KEYS, where)
        eagle = config.get("eagle_config") or {}
        refuse_unknown(eagle, {"use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids"}, f"{where} eagle_config")
        if eagle.get("use_aux_hidden_state") is False:
            raise FormatError(f"{where}: field 'eagle_config.use_aux_hidden_state' false: an EAGLE-1/2 head, not EAGLE-3")
        check_width(config, config["hidden_size"], where)
        top = ids_of(config.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_aux_hidden_state_layer_ids")
        below = ids_of(eagle.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_config.eagle_aux_hidden_state_layer_ids")
        layer, top_level, meta = config, config, {"verifier": None, "speculative_tokens": None}
        qk_norm = False   # the engines dispatch on architectures: a Llama layer, whatever model_type says
    else:
        family = "speculators"
        if config.get("speculators_model_type") != "eagle3":
            raise FormatError(f"{where}: field 'speculators_model_type' {config.get('speculators_model_type')!r}: "
                              "kvshot imports eagle3 speculators only")
        inert = refuse_unknown(config, SPECULATORS_TOP_KEYS, where)
        if config.get("norm_before_fc"):
            raise FormatError(f"{where}: field 'norm_before_fc' true: kvshot's hidden drafter does not import it")
        layer = config.get("transformer_layer_config") or {}
        lwhere = f"{where} transformer_layer_config"
        if layer.get("model_type", "qwen3") not in ("llama", "qwen3"):   # speculators' default layer is Qwen3's
            raise FormatError(f"{lwhere}: field 'model_type' {layer['model_type']!r}: kvshot implements llama and "
                              "qwen3 layers")
        inert += [f"transformer_layer_config.{k}" for k in refuse_unknown(layer, LAYER_KEYS, lwhere)]
        check_width(config, layer["hidden_size"], where)
        top = ids_of(config.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_aux_hidden_state_layer_ids")
        below, top_level = None, config
        qk_norm = layer.get("model_type", "qwen3") == "qwen3"
        spec = config.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        meta = {"verifier": (spec.get("verifier") or {}).get("name_or_path"),
                "speculative_tokens": methods[0].get("speculative_tokens"),
                "embed_requires_grad": boolean(config, "embed_requires_grad", where)}
    ids, aux = resolve_aux(family, top, below, where, over.get("aux_convention"))
    norm_output = boolean(top_level, "norm_output", where, None)
    nout = resolve_norm_output(family, norm_output, where, over.get("norm_output_convention"))
    nbr, nbr_rule = resolve_nbr(layout, boolean(top_level, "norm_before_residual", where, None),
                                over.get("norm_before_residual"))
    vocab = layer["vocab_size"]
    cfg = layer_config(layer, f"{where} transformer_layer_config" if layout == "speculators" else where,
                       top_level.get("draft_vocab_size") or vocab, qk_norm, norm_before_residual=nbr,
                       fc_norm=bool(boolean(top_level, "fc_norm", where)), norm_output=bool(norm_output),
                       norm_output_convention=nout["value"])
    meta.update({"family": family, "aux_ids": ids, "inert": inert,
                 "resolved": {"aux_convention": aux, "norm_output": nout, "norm_before_residual": nbr_rule}})
    return layout, cfg, meta
