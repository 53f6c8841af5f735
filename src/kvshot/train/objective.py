"""The training objective every paradigm shares: the target's soft labels on the draft
vocabulary, the per-step soft cross-entropy of an unroll (`drafters.unroll`), and its
step-decayed sum.

TTT step k is scored against the target's distribution for x_{t+k+2}; a block drafter's
position k the same way, weighted position_decay ** k (`drafters.block_position_decay`,
default 1.0: uniform; 0.8, EAGLE-3's step decay, is the ablation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvshot.drafters import Drafter
from kvshot.drafters.fused import first_argmax, soft_cross_entropy
from kvshot.drafters.unroll import Unrolled, assistant_tokens, at_rows, is_block, shift
from kvshot.settings import DraftersSettings, VariantSettings

DEFAULT_POSITION_DECAY = 1.0   # uniform position weights; 0.8 (EAGLE-3's step decay) is the ablation


@dataclass
class TargetLabels:
    """The target's next-token view at every position, computed once per batch."""

    probs: Tensor     # [B, T, N] softmax of the target logits restricted to the draft vocab
    argmax: Tensor    # [B, T] the target's greedy token (full vocabulary)


@torch.no_grad()
def target_labels(last_hidden: Tensor, lm_head_weight: Tensor, d2t: Tensor, chunk: int = 1024,
                  positions: Tensor | None = None) -> TargetLabels:
    """Full-vocab argmax (for acc and the in-draft-vocab mask) and draft-vocab soft labels,
    chunked over positions so a 152k vocabulary never materializes for the whole batch.
    positions [B, T]: only these (`label_positions`); elsewhere probs 0 and argmax 0."""
    b, t, h = last_hidden.shape
    flat = last_hidden.reshape(-1, h).to(lm_head_weight.dtype)
    idx = None if positions is None else positions.flatten().nonzero().view(-1)
    src = flat if idx is None else flat.index_select(0, idx)
    probs, argmax = [], []
    for i in range(0, src.shape[0], chunk):
        logits = src[i: i + chunk] @ lm_head_weight.T
        argmax.append(first_argmax(logits))
        probs.append(torch.softmax(logits[:, d2t].float(), dim=-1))
    probs = torch.cat(probs) if probs else flat.new_zeros(0, len(d2t), dtype=torch.float32)
    argmax = torch.cat(argmax) if argmax else torch.zeros(0, dtype=torch.long, device=flat.device)
    if idx is not None:
        probs = probs.new_zeros(b * t, probs.shape[1]).index_copy_(0, idx, probs)
        argmax = argmax.new_zeros(b * t).index_copy_(0, idx, argmax)
    return TargetLabels(probs.view(b, t, -1), argmax.view(b, t))


def scored_tokens(batch: dict[str, Tensor], labels: TargetLabels, t2d: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Step k's masks at anchor t: `valid` (x_{t+k+2} exists and is an assistant token) and
    `scored` (also the target's greedy token is in the draft vocab: EAGLE-3's loss mask)."""
    valid = shift(assistant_tokens(batch), k + 2, False)
    return valid, valid & t2d[shift(labels.argmax, k + 1)]


def step_losses(drafter: Drafter, un: Unrolled, batch: dict[str, Tensor], labels: TargetLabels,
                denominators: list[float] | None = None):
    """Per step: soft cross-entropy to the target (sum over scored tokens / denominator, the
    local count by default), teacher-forced top-1 accuracy counts (`acc_k`, not alpha_k)."""
    if un.shared_logits:
        return shared_step_losses(drafter, un, labels, denominators)
    losses, correct, counts, acc_counts = [], [], [], []
    for k, logits in enumerate(un.logits):
        rows = un.rows[k] if un.rows else None
        probs = at_rows(labels.probs, rows, k + 1)
        greedy = at_rows(labels.argmax, rows, k + 1)
        valid = un.valid[k]
        mask = valid & drafter.t2d[greedy]
        ce, top = soft_cross_entropy(logits, probs)
        n = mask.sum()
        denom = denominators[k] if denominators is not None else n.clamp(min=1)
        losses.append((ce * mask).sum() / denom)
        counts.append(n)
        pred = drafter.d2t[top]
        correct.append(((pred == greedy) & valid).sum())
        acc_counts.append(valid.sum())
    return losses, counts, correct, acc_counts


def shared_step_losses(drafter: Drafter, un: Unrolled, labels: TargetLabels, denominators: list[float] | None):
    """`step_losses` for shared logits: the soft cross-entropy once per position s (step 0 at s,
    scored against the target at s + 1); step k sums it over s = t + k, i.e. over s >= k,
    with step 0's masks at s (x_{s+2} an assistant token, the target's token at s + 1)."""
    logits = un.logits[0]
    ce, top = soft_cross_entropy(logits[:, :-1], labels.probs[:, 1:])   # the last position has no label
    greedy = labels.argmax[:, 1:]
    valid = un.valid[0][:, :-1]
    mask = valid & drafter.t2d[greedy]
    weighted, hit = ce * mask, (drafter.d2t[top] == greedy) & valid
    losses, correct, counts, acc_counts = [], [], [], []
    for k in range(len(un.valid)):
        n = mask[:, k:].sum()
        denom = denominators[k] if denominators is not None else n.clamp(min=1)
        losses.append(weighted[:, k:].sum() / denom)
        counts.append(n)
        correct.append(hit[:, k:].sum())
        acc_counts.append(valid[:, k:].sum())
    return losses, counts, correct, acc_counts


def weighted_loss(losses: list[Tensor], decay: float) -> Tensor:
    return sum(decay ** k * l for k, l in enumerate(losses))


def query_cosine(un: Unrolled, target_queries: dict[int, Tensor], kv_layers: list[int]) -> list[float]:
    """Per step: mean cosine between the drafter's KV-path query and the target's own query
    (both pre-RoPE, after q-norm; RoPE rotates both alike) for the same future position."""
    out = []
    for k, per_attn in enumerate(un.queries):
        valid = un.valid[k]
        sims = []
        for layer, q in zip(kv_layers, per_attn):
            tq = shift(target_queries[layer].transpose(1, 2), k + 1).transpose(1, 2)  # position t+k+1
            cos = F.cosine_similarity(q.float(), tq.float(), dim=-1).mean(1)             # [B, T]
            sims.append((cos * valid).sum() / valid.sum().clamp(min=1))
        out.append(float(torch.stack(sims).mean()) if sims else float("nan"))
    return out


def objective(drafter: Drafter, dcfg: DraftersSettings, variant: VariantSettings | None = None) -> tuple[int, float]:
    """(steps scored, loss weight ratio per step): the block's positions and its position decay
    (the variant's own position_decay, else drafters.block_position_decay) for a block drafter,
    the TTT unroll's K and step_decay otherwise."""
    if is_block(drafter):
        own = variant.position_decay if variant is not None else None
        decay = own if own is not None else dcfg.block_position_decay
        return drafter.positions, DEFAULT_POSITION_DECAY if decay is None else float(decay)
    return dcfg.ttt_steps, dcfg.step_decay
