"""Hybrid: the hidden-only path is the anchor; after each layer a KV cross-attention
branch computes a correction delta, mixed in by a learned gate: h + g * delta."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .hidden import HiddenDrafter
from .kv import kv_attention, kv_state
from .skeleton import Attention, DrafterConfig, RMSNorm, StepState


class HybridDrafter(HiddenDrafter):
    paradigm = "hybrid"

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.kv_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(cfg.num_layers))
        self.kv_attns = nn.ModuleList(Attention(h, cfg) for _ in range(cfg.num_layers))
        shape = (1,) if cfg.gate_shape == "scalar" else (h,)
        init = min(max(cfg.gate_init, 1e-6), 1 - 1e-6)
        # g = sigmoid(gate_logit): once g -> 0 the branch's gradient vanishes with it
        self.gate_logit = nn.Parameter(torch.full((cfg.num_layers, *shape), math.log(init / (1 - init))))
        self.gate_probe = None   # diagnostics: called as (layer, h, g * delta) when set (`diagnostics`)

    def gate(self) -> Tensor:
        return torch.sigmoid(self.gate_logit)

    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        state = super().begin(ctx, anchors, previous)              # slots 0..n-1: the hidden path's own prefix
        return kv_state(ctx, anchors, self.cfg.kv_layers, state)   # slots n..2n-1: the target's KV

    def step(self, state: StepState, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        emb, rot = self.embed_tokens(input_ids), self.rotary(positions)
        h = state.hidden
        gates = self.gate()
        n = len(self.layers)
        for i in range(n):
            h, rot = self.hidden_layer(state, i, emb, h, rot, k)
            delta = kv_attention(state, n + i, self.kv_attns[i], self.kv_norms[i](h), rot)
            correction = gates[i] * delta
            if self.gate_probe is not None:
                self.gate_probe(i, h, correction)
            h = h + correction
        state.hidden = h
        return h

    def kv_attentions(self) -> list[tuple[int, Attention]]:
        return list(zip(self.cfg.kv_layers, self.kv_attns))
