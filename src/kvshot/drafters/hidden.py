"""Hidden-only reuse (EAGLE-3): fuse the target's low/middle/high hidden states
into the drafter's state; after step 0 the drafter carries its own output forward."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .skeleton import DecoderLayer, Drafter, DrafterConfig, Keys, RMSNorm, Rotary, StepState


def extend(old: Tensor | None, new: Tensor, dim: int) -> Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def add_own_keys(state: StepState, slot: int, keys: Keys, k: int, valid: Tensor | None) -> None:
    """Step 0's keys join the prefix (this round's anchors); later steps add diagonals."""
    if k == 0:
        old = state.prefix[slot]
        state.prefix[slot] = keys if old is None else Keys(torch.cat([old.k, keys.k], 2), torch.cat([old.v, keys.v], 2))
        old_anchor = state.prefix_anchor[slot]
        state.prefix_anchor[slot] = extend(old_anchor, state.anchors, 1)
        old_valid = state.prefix_valid[slot]
        if valid is not None or old_valid is not None:
            ones = torch.ones_like(state.anchors, dtype=torch.bool)
            valid = ones if valid is None else valid.bool()
            if old_anchor is not None:
                old_valid = torch.ones_like(old_anchor, dtype=torch.bool) if old_valid is None else old_valid
            state.prefix_valid[slot] = extend(old_valid if old_anchor is not None else None, valid, 1)
    else:
        state.diag[slot].append(keys)


def self_attention(state: StepState, slot: int, layer: DecoderLayer, x: Tensor, rot: Rotary, k: int,
                   valid: Tensor | None) -> Tensor:
    """A layer's attention over its own keys: step 0's join the prefix, later steps' the diagonals."""
    q, keys = layer.self_attn.project(layer.attn_norm(x), rot)
    add_own_keys(state, slot, keys, k, valid)
    return layer.self_attn.attend(q, state.prefix[slot], state.mask(slot, q.dtype), state.diag[slot])


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
        n = len(self.layers)
        keep = (lambda xs: list(xs[:n])) if previous is not None else (lambda xs: [None] * n)
        return StepState(anchors=anchors, prefix=keep(previous.prefix if previous else []),
                         prefix_anchor=keep(previous.prefix_anchor if previous else []),
                         prefix_valid=keep(previous.prefix_valid if previous else []), diag=[[] for _ in range(n)],
                         hidden=self.fc(ctx["aux_hidden"].flatten(-2)), extra={"valid": ctx.get("anchor_valid")})

    def hidden_layer(self, state: StepState, i: int, emb: Tensor, h: Tensor, rot: Rotary,
                     k: int) -> tuple[Tensor, Rotary]:
        layer = self.layers[i]
        x = torch.cat([self.input_norm(emb), self.hidden_norm(h)], dim=-1) if i == 0 else h
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
