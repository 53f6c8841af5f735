"""What a user would pick instead of kvshot's decoder, as transformers ships it: `generate` plain,
assisted generation with a small draft model (the standalone drafter as an HF model), at HF's own
defaults and at a constant K, and prompt lookup decoding. Greedy, batch 1; each returns the
generated ids (eos kept, as kvshot's decoder keeps it)."""
from __future__ import annotations

import torch

from kvshot.drafters.standalone import to_hf


def _generate(target, prompt: list[int], max_new_tokens: int, eos_token_id: int | None, **kwargs) -> list[int]:
    x = torch.tensor([prompt], device=target.device)
    out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=eos_token_id, pad_token_id=target.config.pad_token_id
                          if target.config.pad_token_id is not None else eos_token_id, **kwargs)
    return out[0, x.shape[1]:].tolist()


def hf_generate(target, prompt: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    return _generate(target, prompt, max_new_tokens, eos_token_id)


def hf_assistant(drafter, target):
    """The standalone drafter as a transformers causal LM (ValueError where its vocabulary is cut)."""
    return to_hf(drafter, target.config.max_position_embeddings, target.config._attn_implementation)


def hf_assisted(target, assistant, prompt: list[int], max_new_tokens: int, eos_token_id: int | None,
                k: int | None) -> list[int]:
    """k None: HF's defaults (its draft length schedule and confidence early stop, as a user gets
    them); k: exactly k draft tokens a round (constant schedule, no early stop)."""
    gc = assistant.generation_config
    if not hasattr(assistant, "_kvshot_defaults"):   # the draft model's own defaults, kept once
        assistant._kvshot_defaults = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule,
                                      gc.assistant_confidence_threshold)
    if k is None:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = \
            assistant._kvshot_defaults
    else:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = k, "constant", 0.0
    return _generate(target, prompt, max_new_tokens, eos_token_id, assistant_model=assistant)


def hf_prompt_lookup(target, prompt: list[int], max_new_tokens: int, eos_token_id: int | None,
                     tokens: int) -> list[int]:
    """Prompt lookup decoding: drafts copied from the prompt's n-gram matches (no draft model)."""
    return _generate(target, prompt, max_new_tokens, eos_token_id, prompt_lookup_num_tokens=tokens)
