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
        # before fc (each off by default): one norm over the concatenated aux states (norm_before_fc),
        # or one norm per aux state (fc_norm, EAGLE-3.1); DrafterConfig refuses both at once
        if cfg.norm_before_fc:
            self.fc_input_norm = RMSNorm(cfg.num_aux * h, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        # EAGLE-3 normalizes embedding and hidden separately, then concatenates them
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(2 * h if i == 0 else h, cfg) for i in range(cfg.num_layers))
        self.layers[0].attn_norm = nn.Identity()

    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        state = carried_state(anchors, len(self.layers), previous, ctx.get("anchor_valid"))
        state.hidden = self.fuse(ctx["aux_hidden"])   # the target's context: fused aux hidden states
        return state

    def fuse(self, aux: Tensor) -> Tensor:
        """aux [B, T, num_aux, H] -> fc's fusion [B, T, H], each aux state normed first under fc_norm."""
        if self.cfg.fc_norm:
            aux = torch.stack([norm(aux[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-2)
        x = aux.flatten(-2)
        if self.cfg.norm_before_fc:
            x = self.fc_input_norm(x)
        return self.fc(x)

    def logits(self, hidden: Tensor) -> Tensor:
        # vLLM's norm_output: `step` already returned norm(h), which the head reads as is (normed once);
        # SpecForge's norm_output false: the head reads h itself (`DrafterConfig.head_norm`)
        return super().logits(hidden) if self.cfg.head_norm() else self.lm_head(hidden)

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
        if self.cfg.carries_normed():   # vLLM's EAGLE-3.1: the next step (and the head) read the post-norm state
            h = self.norm(h)
        state.hidden = h
        return h
