"""KV-only reuse: no target hidden states. Queries come from token embeddings through
the drafter's own layers; each layer re-attends to one target layer's KV cache of the
prefix plus the keys its own W_K, W_V project from the drafted tokens."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .skeleton import Attention, DecoderLayer, Drafter, DrafterConfig, Keys, Rotary, StepState


def target_prefix(ctx: dict[str, Tensor], layer: int) -> Keys:
    """Captured target keys/values [B, T, H_kv, D] -> [B, H_kv, T, D]."""
    return Keys(ctx[f"key_{layer}"].transpose(1, 2), ctx[f"value_{layer}"].transpose(1, 2))


def kv_state(ctx: dict[str, Tensor], anchors: Tensor, kv_layers: list[int], state: StepState | None = None) -> StepState:
    """New slots after `state`'s (a hybrid's own-key slots; None: a fresh state), one per
    mapped target layer, whose prefix is that layer's KV cache."""
    t_prefix = ctx[f"key_{kv_layers[0]}"].shape[1]
    prefix_anchor = ctx.get("prefix_anchor")
    if prefix_anchor is None:  # training: prefix key j was computed by the target at anchor j
        prefix_anchor = torch.arange(t_prefix, device=anchors.device).expand(anchors.shape[0], -1)
    if state is None:
        state = StepState(anchors=anchors, prefix=[], prefix_anchor=[], prefix_valid=[])
    first = state.add_slots(len(kv_layers))
    for j, layer in enumerate(kv_layers):
        state.prefix[first + j] = target_prefix(ctx, layer)
        state.prefix_anchor[first + j] = prefix_anchor
        state.prefix_valid[first + j] = ctx.get("valid")
    return state


def kv_attention(state: StepState, slot: int, attn: Attention, x: Tensor, rot: Rotary) -> Tensor:
    """Every step's own keys are diagonals: the prefix is the target's, never the drafter's."""
    q, keys = attn.project(x, rot)
    state.diag[slot].append(keys)
    return attn.attend(q, state.prefix[slot], state.mask(slot, q.dtype), state.diagonal(slot))


class KVDrafter(Drafter):
    paradigm = "kv"
    prefix_from_step0 = False   # the prefix is the target's: each anchor row stands alone
    steps_in_one_pass = True    # teacher-forced, step k reads a token and earlier steps' keys, no carried state

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg.hidden_size, cfg) for _ in range(cfg.num_layers))

    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        return kv_state(ctx, anchors, self.cfg.kv_layers)

    def step(self, state: StepState, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        h, rot = self.embed_tokens(input_ids), self.rotary(positions)
        for i, layer in enumerate(self.layers):
            h = h + kv_attention(state, i, layer.self_attn, layer.attn_norm(h), rot)
            h = layer.mlp_block(h)
        return h

    def kv_attentions(self) -> list[tuple[int, Attention]]:
        return [(l, layer.self_attn) for l, layer in zip(self.cfg.kv_layers, self.layers)]
