"""Hidden-only reuse (EAGLE-3): fuse the target's low/middle/high hidden states
into the drafter's state; after step 0 the drafter carries its own output forward."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .own_prefix import add_own_keys, carried_state
from .skeleton import DecoderLayer, Drafter, DrafterConfig, RMSNorm, Rotary, StepState


class HiddenDrafter(Drafter):
    paradigm = "hidden"
    reads_aux_hidden = True

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_aux * h, h, bias=False)
        # EAGLE-3 normalizes embedding and hidden separately, then concatenates them
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(2 * h if i == 0 else h, cfg) for i in range(cfg.num_layers))
        self.layers[0].attn_norm = nn.Identity()

    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        state = carried_state(anchors, len(self.layers), previous, ctx.get("anchor_valid"))
        state.hidden = self.fc(ctx["aux_hidden"].flatten(-2))   # the target's context: fused aux hidden states
        return state

    def hidden_layer(self, state: StepState, i: int, emb: Tensor, h: Tensor, rot: Rotary,
                     k: int) -> tuple[Tensor, Rotary]:
        layer = self.layers[i]
        x = h
        if i == 0:
            normed = self.hidden_norm(h)
            x = torch.cat([self.input_norm(emb), normed], dim=-1)
            if self.cfg.norm_before_residual:   # speculators/vLLM: the residual is the normed hidden state
                h = normed
        q, keys = layer.self_attn.project(layer.attn_norm(x), rot)
        add_own_keys(state, i, keys, k, state.extra.get("valid"))
        if state.pack_after_prefix is not None and i == len(self.layers) - 1:
            # every row's step-0 keys are in; only the packed rows are queried from here on
            take = state.pack(state.pack_after_prefix)
            q, h, rot = take(q, 2), take(h, 1), Rotary(take(rot.cos, 2), take(rot.sin, 2))
        h = h + layer.self_attn.attend(q, state.prefix[i], state.mask(i, q.dtype), state.diag[i])
        return layer.mlp_block(h), rot

    def step(self, state: StepState, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        emb, rot = self.embed_tokens(input_ids), self.rotary(positions)
        h = state.hidden
        for i in range(len(self.layers)):
            h, rot = self.hidden_layer(state, i, emb, h, rot, k)
        state.hidden = h
        return h
