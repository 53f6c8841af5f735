"""Block-wise drafting (as DFlash drafts): one forward predicts a whole block after anchor t.

Query slots j = 0..S-1 (S = cfg.block_size) sit at positions t+1+j. Slot 0 reads the known
token x_{t+1} (while decoding: the target's bonus token), slots 1..S-1 a learned mask
embedding each; slot j >= 1 predicts x_{t+1+j}. Block position k = j - 1 is therefore the
chain's step k (x_{t+k+2}), and the default S = K + 1 drafts as far as a K-step chain does.
Attention within a block is bidirectional: every slot sees all S slots of its anchor (their
keys are laid out as each row's `Diagonal` keys) and the context keys of anchors <= t.
No slot reads a drafted token, so the block's positions share no sequential unroll: training
scores all of them in one call and every slot's W_K/W_V key is in every slot's attention.

Refinement (`cfg.block_refine` passes, default 0): the block is run again with each mask slot
j >= 1 reading its mask embedding plus the embedding of the previous pass's greedy token for
x_{t+j} (slot j - 1's prediction), so a slot sees a guess of every token before it; the last
pass's outputs are the draft. The guesses are argmax tokens (no gradient flows through them);
training scores every pass (`unroll.block_unroll`).

How it reads the target is the one thing the variants differ in (`cfg.block_context`):
  kv      the target's KV cache of the mapped layers, the KV-only paradigm's context (`kv_state`);
  hidden  the fused aux hidden states of every anchor, projected by each layer's own W_K/W_V to
          context keys at the anchor's position (DFlash's injection). While decoding they carry
          over between rounds, as the hidden paradigm's own prefix does (`own_prefix`);
  dflash  DFlash's layout as vLLM serves it (`interop.dflash`): the same injection, but the fused
          states pass one `hidden_norm` straight into each layer's W_K/W_V (no per-layer
          `attn_norm` on the context), and every mask slot reads one shared mask embedding, so
          a block may have any number of slots up to the trained block_size (vLLM drafts K
          tokens with K + 1 slots: `draft_block(slots=K + 1)`).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .kv import kv_state
from .own_prefix import add_own_keys, carried_state
from .skeleton import Attention, DecoderLayer, Diagonal, Drafter, DrafterConfig, RMSNorm, StepState

BLOCK_CONTEXTS = ("kv", "hidden", "dflash")


def block_keys(x: Tensor, slots: int) -> Tensor:
    """Rows (anchor a, slot i) anchor-major, x [B, Hkv, R * S, D] -> every row's keys of its
    whole block, [B, Hkv, S, R * S, D]: out[:, :, j, a * S + i] = x[:, :, a * S + j]."""
    b, n, rs, d = x.shape
    per_slot = x.view(b, n, rs // slots, slots, d).transpose(2, 3)            # [B, Hkv, S, R, D]
    return per_slot[:, :, :, :, None].expand(b, n, slots, rs // slots, slots, d).reshape(b, n, slots, rs, d)


class BlockDrafter(Drafter):
    paradigm = "block"
    block_wise = True           # drafts a block per forward (`draft_block`); no per-step `step`
    prefix_from_step0 = False   # the context is the target's, read in `begin`

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        if cfg.block_size < 2:
            raise ValueError(f"block drafter: block_size {cfg.block_size}: needs x_{{t+1}} and at least one mask slot")
        if cfg.block_context not in BLOCK_CONTEXTS:
            raise ValueError(f"block drafter: context {cfg.block_context!r} (one of {', '.join(BLOCK_CONTEXTS)})")
        h = cfg.hidden_size
        self.reads_aux_hidden = cfg.block_context in ("hidden", "dflash")
        self.shared_mask = cfg.block_context == "dflash"
        self.layers = nn.ModuleList(DecoderLayer(h, cfg) for _ in range(cfg.num_layers))
        # one embedding per mask slot, or (DFlash) one for every slot
        self.mask_embed = nn.Parameter(0.02 * torch.randn(1 if self.shared_mask else cfg.block_size - 1, h))
        if self.reads_aux_hidden:
            self.fc = nn.Linear(cfg.num_aux * h, h, bias=False)
            if self.shared_mask:
                self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
            else:
                self.context_norm = RMSNorm(h, cfg.rms_norm_eps)

    @property
    def positions(self) -> int:
        """Block positions predicted per forward: x_{t+2} .. x_{t+S}."""
        return self.cfg.block_size - 1

    # -------------------------------------------------------------- how it reads the target
    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        if self.cfg.block_context == "kv":
            return kv_state(ctx, anchors, self.cfg.kv_layers)
        state = carried_state(anchors, len(self.layers), previous, ctx.get("anchor_valid"))
        fused = self.fc(ctx["aux_hidden"].flatten(-2))                   # the target's context at each anchor
        x = self.hidden_norm(fused) if self.shared_mask else self.context_norm(fused)
        rot = self.rotary(anchors)                                       # anchor t's hidden state sits at t
        for i, layer in enumerate(self.layers):
            _, keys = layer.self_attn.project(x if self.shared_mask else layer.attn_norm(x), rot)
            add_own_keys(state, i, keys, 0, state.extra.get("valid"))   # prefix keys, visible to anchors >= t
        return state

    def kv_attentions(self) -> list[tuple[int, Attention]]:
        if self.cfg.block_context != "kv":
            return []
        return [(l, layer.self_attn) for l, layer in zip(self.cfg.kv_layers, self.layers)]

    # -------------------------------------------------------------- the block forward
    def draft_block(self, state: StepState, first_ids: Tensor, positions: Tensor,
                    passes: list[Tensor] | None = None, slots: int | None = None) -> Tensor:
        """One forward (plus cfg.block_refine refinement passes) for every anchor row of `state`:
        first_ids [B, R] the token x_{t+1} of each row and positions [B, R] its position t+1.
        Returns the last pass's slot output hidden states [B, R, S, H] (slot j at position t+1+j);
        `passes`, if given, receives every earlier pass's. The state's rows become (anchor, slot) rows.
        `slots`: a shorter block (shared mask only), S = slots <= cfg.block_size."""
        b, r = first_ids.shape
        s = slots or self.cfg.block_size
        if s != self.cfg.block_size and not (self.shared_mask and 2 <= s <= self.cfg.block_size):
            raise ValueError(f"block drafter: {s} slots: this drafter drafts blocks of {self.cfg.block_size}"
                             + (" or fewer (at least 2)" if self.shared_mask else " (one mask embedding per slot)"))
        first = self.embed_tokens(first_ids)[:, :, None]
        masks = self.mask_embed.to(first.dtype).expand(b, r, s - 1, -1)
        slots = torch.arange(s, device=positions.device)
        rot = self.rotary((positions[..., None] + slots).reshape(b, r * s))
        state.spread_steps(s)   # rows (anchor, slot), anchor-major: each slot sees its anchor's context
        h = self._block_pass(state, torch.cat([first, masks], dim=2), rot)
        for _ in range(self.cfg.block_refine):
            if passes is not None:
                passes.append(h)
            with torch.no_grad():   # slot j's guess of x_{t+j}: slot j - 1's greedy token
                guess = self.d2t[self.logits(h[:, :, :-1]).argmax(-1)]
            h = self._block_pass(state, torch.cat([first, masks + self.embed_tokens(guess)], dim=2), rot)
        return h

    def _block_pass(self, state: StepState, slot_inputs: Tensor, rot) -> Tensor:
        b, r, s, _ = slot_inputs.shape
        h = slot_inputs.reshape(b, r * s, -1)
        for i, layer in enumerate(self.layers):
            q, keys = layer.self_attn.project(layer.attn_norm(h), rot)
            own = Diagonal(block_keys(keys.k, s), block_keys(keys.v, s))   # bidirectional: all slots seen
            h = h + layer.self_attn.attend(q, state.prefix[i], state.mask(i, q.dtype), own)
            h = layer.mlp_block(h)
        return h.view(b, r, s, -1)

    def step(self, state: StepState, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        raise NotImplementedError("a block drafter has no draft step: it drafts a block per forward "
                                  "(`draft_block`; training: kvshot.drafters.unroll)")
