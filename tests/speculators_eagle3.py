"""Runs inside the speculators venv (tests/speculators_env.py), never imports kvshot.

Converts an EAGLE-3 checkpoint with speculators' own converter, loads the result with its
Eagle3DraftModel (the token embedding comes from the verifier folder, as in serving), runs
its TTT forward on the given inputs and saves the draft logits of every step.

usage: speculators_eagle3.py CHECKPOINT VERIFIER INPUTS WORKDIR OUT STEPS AUX_IDS [NORM_BEFORE_RESIDUAL]
  NORM_BEFORE_RESIDUAL: 1 converts with norm_before_residual on (RedHatAI's heads); the converted
  folder (WORKDIR/speculators) is speculators' own layout and config, kept for kvshot to import
  INPUTS: safetensors with hidden_states [1, T, 3H], input_ids [1, T], position_ids [1, T]
  OUT: safetensors with logits [STEPS, T, N], d2t, t2d, embed; metadata: the converted names,
  where the fc_norm weights came from (EAGLE-3.1: the converter drops them), the switches it built
"""
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from speculators.convert.eagle import Eagle3Converter
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(checkpoint, verifier, inputs, workdir, out, steps, aux_ids, norm_before_residual="0"):
    converted = Path(workdir) / "speculators"
    # the converter does not read the checkpoint's eagle_config: the aux layers are an argument
    Eagle3Converter().convert(checkpoint, converted, base_model=verifier, validate=True,
                              norm_before_residual=norm_before_residual == "1",
                              eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_ids.split(",")])
    config = Eagle3SpeculatorConfig.from_pretrained(converted)
    config.transformer_layer_config._attn_implementation = "eager"   # dense masks on CPU, no flex kernels
    model = Eagle3DraftModel.from_pretrained(converted, config=config).float().eval()
    # speculators 0.9.0 bug: a checkpoint without embed_tokens (SGLang's and vLLM's format: the
    # engines share the target's) gets the verifier's embedding only if the uninitialized memory
    # holds a NaN. _init_vocab fills NaN as its "not loaded" sentinel, but transformers 5.x builds
    # the model on the meta device, so the fill never happens and the missing tensor is
    # materialized from torch.empty. Load it from the verifier unconditionally, as intended.
    embedding_was_loaded = verifier_embedding_equals(model, verifier)
    model._load_verifier_weights(overwrite_embed_tokens=True)
    # speculators 0.9.0's converter rebuilds the head in its legacy Eagle3Speculator, which has no
    # fc_norm: the per-state norms (EAGLE-3.1) are dropped from the converted file, and its
    # Eagle3DraftModel (which has them, config fc_norm) would start them at ones. Take them from
    # the checkpoint under their own names, as vLLM's loader reads them (fc_norm.{i}.weight).
    fc_norm_from = "none"
    if getattr(model, "fc_norm", None) is not None:
        with safe_open(str(converted / "model.safetensors"), framework="pt") as fh:
            in_converted = "fc_norm.0.weight" in fh.keys()
        fc_norm_from = "converted"
        if not in_converted:
            source = load_file(str(Path(checkpoint) / "model.safetensors"))
            with torch.no_grad():
                for i, norm in enumerate(model.fc_norm):
                    norm.weight.copy_(source[f"fc_norm.{i}.weight"].float())
            fc_norm_from = "checkpoint"
    x = load_file(inputs)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output.detach().float()))
    with torch.no_grad():
        model(hidden_states=x["hidden_states"].float(), input_ids=x["input_ids"].long(),
              document_ids=torch.zeros_like(x["input_ids"]), position_ids=x["position_ids"].long(),
              ttt_steps=int(steps))
    hook.remove()
    with safe_open(str(converted / "model.safetensors"), framework="pt") as fh:
        names = sorted(fh.keys())
    save_file({"logits": torch.cat(logits).contiguous(), "d2t": model.d2t.contiguous(), "t2d": model.t2d.contiguous(),
               "embed": model.embed_tokens.weight.detach().contiguous()},
              out, metadata={"converted_names": json.dumps(names), "model_class": type(model).__name__,
                             "embedding_loaded_by_from_pretrained": str(embedding_was_loaded),
                             "fc_norm_from": fc_norm_from, "config": json.dumps({k: bool(getattr(model.config, k, False))
                                                                                for k in ("fc_norm", "norm_output")})})


def verifier_embedding_equals(model, verifier) -> bool:
    with safe_open(str(Path(verifier) / "model.safetensors"), framework="pt") as fh:
        return torch.equal(model.embed_tokens.weight.detach(), fh.get_tensor("model.embed_tokens.weight").float())


if __name__ == "__main__":
    main(*sys.argv[1:9])
