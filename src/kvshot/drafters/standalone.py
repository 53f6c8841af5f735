"""Standalone: a plain small causal LM over the tokens (the target's family: Qwen3 or Llama), the classic draft model. It
reads nothing of the target (no hidden states, no KV); its own step-0 keys are its KV cache,
as in the hidden-only paradigm. Token x_0 is no anchor's step-0 input, so `begin` adds its
keys (position 0, anchor -1: visible to every row) and the drafter is exactly a causal LM,
convertible to a transformers `Qwen3ForCausalLM` (q/k norm) or `LlamaForCausalLM` (`to_hf`)."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from .own_prefix import carried_state, self_attention
from .skeleton import DecoderLayer, Drafter, DrafterConfig, StepState

# our layer norms' names in a Qwen3 / Llama decoder layer; every other name is the same
_HF_RENAMES = {"attn_norm.": "input_layernorm.", "mlp_norm.": "post_attention_layernorm."}


class StandaloneDrafter(Drafter):
    paradigm = "standalone"
    causal_lm = True   # reads only tokens: teacher-forced training needs step 0 alone (`unroll`)

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg.hidden_size, cfg) for _ in range(cfg.num_layers))

    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        state = carried_state(anchors, len(self.layers), previous, ctx.get("anchor_valid"))
        if previous is None and "first_ids" in ctx:   # the only context it reads: the first token
            self.read_first_token(state, ctx["first_ids"])
        return state

    def read_first_token(self, state: StepState, first_ids: Tensor) -> None:
        """x_0 [B, 1] at position 0 joins the prefix as anchor -1, so every anchor sees it."""
        anchors, valid = state.anchors, state.extra["valid"]
        state.anchors, state.extra["valid"] = torch.full_like(first_ids, -1), None
        self.step(state, first_ids, torch.zeros_like(first_ids), 0)
        state.anchors, state.extra["valid"] = anchors, valid

    def step(self, state: StepState, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        h, rot = self.embed_tokens(input_ids), self.rotary(positions)
        for i, layer in enumerate(self.layers):
            h = h + self_attention(state, i, layer, h, rot, k)   # step 0: prefix keys
            h = layer.mlp_block(h)
        return h


def hf_name(name: str) -> str:
    """A drafter parameter's name in Qwen3ForCausalLM / LlamaForCausalLM."""
    if name.startswith("lm_head."):
        return name
    for ours, theirs in _HF_RENAMES.items():
        name = name.replace(ours, theirs)
    return f"model.{name}"


@torch.no_grad()
def init_from_target(drafter: StandaloneDrafter, target: PreTrainedModel) -> None:
    """Distillation's starting point: the target's embedding, first `num_layers` decoder
    layers, final norm and LM head."""
    theirs = target.state_dict()
    for name, p in drafter.named_parameters():
        src = theirs.get(hf_name(name))
        if src is None:
            raise ValueError(f"standalone drafter: {name} has no counterpart {hf_name(name)} in the target "
                             f"({type(target).__name__}; qk_norm={drafter.cfg.qk_norm})")
        if src.shape != p.shape:
            raise ValueError(f"standalone drafter: {name} {tuple(p.shape)} cannot start from the target's "
                             f"{hf_name(name)} {tuple(src.shape)}")
        p.copy_(src)


def to_hf(drafter: StandaloneDrafter, max_position_embeddings: int = 32768,
          attn_implementation: str = "sdpa") -> PreTrainedModel:
    """The same weights as a transformers Qwen3ForCausalLM (LlamaForCausalLM without q/k
    norm; untied head), e.g. as
    `generate(assistant_model=...)`."""
    cfg = drafter.cfg
    if cfg.draft_vocab_size != cfg.vocab_size or not torch.equal(drafter.d2t.cpu(), torch.arange(cfg.vocab_size)):
        raise ValueError("to_hf needs the full target vocabulary as draft vocabulary (d2t = arange(vocab))")
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if cfg.qk_norm else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                         attn_implementation=attn_implementation)
    weight = drafter.embed_tokens.weight
    model = model_cls(config).to(dtype=weight.dtype, device=weight.device)
    model.load_state_dict({hf_name(n): p for n, p in drafter.named_parameters()}, strict=True)
    return model.eval()
