"""Block-wise training and drafting for a block drafter (`drafters.block`), in the TTT
objective's terms so that the trainer, the step-wise evaluation and the report treat a block
position as a chain step.

The objective: for many anchors t of every sequence in one call, the drafter's block after t
(slot 0 reads x_{t+1}, the mask slots predict x_{t+2} .. x_{t+S}); block position k is scored
against the target's distribution for x_{t+k+2} on the draft vocabulary, the same soft
cross-entropy and masks as TTT step k (`ttt.step_losses`), weighted position_decay ** k
(`drafters.block_position_decay`, default 1.0: uniform). There is no unroll: each position's
loss reaches every slot's W_K/W_V through the block's bidirectional attention. A drafter with
refinement passes (`refine_passes`) is scored on every pass while training, each pass's
predictions as rows of the same position, and drafts with its last.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .diagnostics import own_key_mass
from .drafters import Drafter
from .ttt import TTTUnroll, Unrolled, assistant_tokens, at_rows, context, labelled_rows, shift, unroll

DEFAULT_POSITION_DECAY = 1.0   # uniform position weights; 0.8 (EAGLE-3's step decay) is the ablation


def is_block(drafter: Drafter) -> bool:
    return getattr(drafter, "block_wise", False)


def block_unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int | None = None,
                 anchor_rows: Tensor | None = None, skip_unlabelled: bool = True) -> Unrolled:
    """The block after every anchor of every sequence in one forward, as an `Unrolled` whose
    step k is block position k. Anchors (flat b * T + t, ascending): `anchor_rows`, else those
    with a label at some position (skip_unlabelled), else all; packed into one row list
    (`StepState.pack`). skip_unlabelled (training): logits only where position k has a label,
    [1, R_k, N] for the rows `rows[k]`, as `ttt.one_pass` gives them; otherwise (evaluation)
    every anchor's logits at every position, [1, R, N], with `valid` saying which have a
    label. steps: positions scored (default: all of them)."""
    ids = batch["input_ids"].long()
    b, t = ids.shape
    steps = drafter.positions if steps is None else steps
    if steps > drafter.positions:
        raise ValueError(f"block drafter: {steps} steps asked, its block predicts {drafter.positions} positions "
                         f"(block_size {drafter.cfg.block_size})")
    loss_mask = assistant_tokens(batch)
    anchors = torch.arange(t, device=ids.device).expand(b, -1)
    state = drafter.begin(context(batch, drafter.compute_dtype()), anchors)
    rows = anchor_rows if anchor_rows is not None else labelled_rows(loss_mask, steps) if skip_unlabelled else None
    rows = torch.arange(b * t, device=ids.device) if rows is None else rows
    state.pack(rows)
    row_anchors = state.anchors                                               # [1, R]: t of each row
    earlier: list[Tensor] = []
    h = drafter.draft_block(state, at_rows(ids, rows, 1), row_anchors + 1, earlier)[0]  # [R, S, H]
    # training scores every refinement pass, as extra rows of the same position; otherwise the draft (last pass)
    scored = [p[0] for p in earlier] + [h] if drafter.training else [h]
    n = len(scored)
    valid = [at_rows(loss_mask, rows, k + 2, False)[0] for k in range(steps)]
    everyone = torch.arange(len(rows), device=ids.device)
    keep = [v.nonzero().view(-1) if skip_unlabelled else everyone for v in valid]
    logits = drafter.logits(torch.cat([x[r, k + 1] for k, r in enumerate(keep) for x in scored])[None])
    out = Unrolled([], [], [])
    for k, part in enumerate(logits.split([len(r) * n for r in keep], dim=1)):
        out.logits.append(part)
        out.valid.append(valid[k][keep[k]].repeat(n)[None])
        out.rows.append(rows[keep[k]].repeat(n))
        out.anchors.append(row_anchors[:, keep[k]].repeat(1, n))
    return out


def any_unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int, keep_queries: bool = False,
               own_tokens: bool = False, skip_unlabelled: bool = False, anchor_rows: Tensor | None = None) -> Unrolled:
    """`ttt.unroll`, or a block drafter's `block_unroll` (its drafts never feed back, so drafting
    on its own tokens is the teacher-forced block; it keeps no queries)."""
    if is_block(drafter):   # scoring rows only where `unroll` would (training's skip_unlabelled)
        return block_unroll(drafter, batch, steps, anchor_rows, skip_unlabelled and not (own_tokens or keep_queries))
    return unroll(drafter, batch, steps, keep_queries, own_tokens, skip_unlabelled, anchor_rows)


class BlockUnroll(nn.Module):
    """The trainer's forward for a block drafter, the module DDP wraps (`ttt.TTTUnroll`'s
    counterpart): every labelled anchor's block in one call."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict[str, Tensor], steps: int, keep_queries: bool = False) -> Unrolled:
        return block_unroll(self.drafter, batch, steps)


def training_forward(drafter: Drafter) -> nn.Module:
    return BlockUnroll(drafter) if is_block(drafter) else TTTUnroll(drafter)


def objective(drafter: Drafter, dcfg: dict, variant: dict | None = None) -> tuple[int, float]:
    """(steps scored, loss weight ratio per step): the block's positions and its position decay
    (the variant's own position_decay, else drafters.block_position_decay) for a block drafter,
    the TTT unroll's K and step_decay otherwise."""
    if is_block(drafter):
        decay = (variant or {}).get("position_decay", dcfg.get("block_position_decay"))
        return drafter.positions, DEFAULT_POSITION_DECAY if decay is None else float(decay)
    return dcfg["ttt_steps"], dcfg["step_decay"]


def block_key_share(valid: list[Tensor], anchors: list[Tensor], slots: int) -> float:
    """The chain's `train.kv_key_share` for a block: at anchor t every slot attends the block's
    S keys, which its own W_K/W_V project, beside the t + 1 copied target keys: S / (t + 1 + S),
    averaged over the scored (anchor, position) pairs."""
    num, den = 0.0, 0
    for v, a in zip(valid, anchors):
        share = slots / (a.to(torch.float32) + 1 + slots)
        num += float(share[v].sum())
        den += int(v.sum())
    return num / max(den, 1)


@torch.no_grad()
def block_attention_diagnostics(model: Drafter, batch: dict[str, Tensor], steps: int, sequences: int = 2,
                                max_anchors: int = 64) -> dict:
    """`diagnostics.attention_diagnostics` for a block drafter: per block position k, the
    attention probability its KV-path queries put on the block's own keys (which its W_K/W_V
    project) against the target's copied keys, averaged over heads, layers and the scored
    anchors of the first `sequences` sequences (at most `max_anchors`, evenly spread)."""
    if not model.kv_attentions():
        return {}
    labelled = shift(assistant_tokens(batch), 2, False).any(1)
    chosen = labelled.nonzero().view(-1)[:sequences]
    if len(chosen) == 0:
        return {}
    sub = {k: v[chosen] for k, v in batch.items()}
    b, t = sub["input_ids"].shape
    rows = labelled_rows(assistant_tokens(sub), steps)
    rows = torch.arange(b * t, device=chosen.device) if rows is None else rows
    rows = rows[torch.linspace(0, len(rows) - 1, min(max_anchors, len(rows))).round().long().unique()]
    masses: list[Tensor] = []

    def recorder(attn):
        def attend(q, prefix, mask, diag):
            masses.append(own_key_mass(q, prefix.k, mask.visible(), diag).mean(1)[0])   # [R * S], over heads
            return type(attn).attend(attn, q, prefix, mask, diag)
        return attend

    attns = [attn for _, attn in model.kv_attentions()]
    for attn in attns:
        attn.attend = recorder(attn)   # instance attribute: shadows the method for this module only
    try:
        un = block_unroll(model, sub, steps, anchor_rows=rows)
    finally:
        for attn in attns:
            del attn.attend
    mass = torch.stack(masses).mean(0).view(len(rows), -1)   # [R, S], over layers
    per_k = []
    for k in range(steps):
        at = torch.searchsorted(rows, un.rows[k])
        per_k.append(float(mass[at, k + 1].mean()) if len(at) else None)
    defined = [x for x in per_k if x is not None]
    return {"kv_own_key_mass_k": per_k, "kv_own_key_mass": sum(defined) / len(defined) if defined else None}
