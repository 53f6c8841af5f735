"""The one autoregressive test-time-training (TTT) objective for every paradigm.

For every anchor t of a sequence at once, the drafter is unrolled K steps on its own
outputs (EAGLE-3's recipe: its hidden state is its own, the input tokens are the
sequence's). Step k reads token x_{t+k+1} and is scored against the target's
distribution for x_{t+k+2}, i.e. the target's logits at position t+k+1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .drafters import Drafter


def shift(x: Tensor, n: int, fill=0) -> Tensor:
    """x[:, t + n] at row t, padded with `fill` past the end (dim 1)."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], n, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class TargetLabels:
    """The target's next-token view at every position, computed once per batch."""

    probs: Tensor     # [B, T, N] softmax of the target logits restricted to the draft vocab
    argmax: Tensor    # [B, T] the target's greedy token (full vocabulary)


@torch.no_grad()
def target_labels(last_hidden: Tensor, lm_head_weight: Tensor, d2t: Tensor, chunk: int = 1024) -> TargetLabels:
    """Full-vocab argmax (for acc and the in-draft-vocab mask) and draft-vocab soft labels,
    chunked over positions so a 152k vocabulary never materializes for the whole batch."""
    b, t, h = last_hidden.shape
    flat = last_hidden.reshape(-1, h).to(lm_head_weight.dtype)
    probs, argmax = [], []
    for i in range(0, flat.shape[0], chunk):
        logits = flat[i: i + chunk] @ lm_head_weight.T
        argmax.append(logits.argmax(-1))
        probs.append(torch.softmax(logits[:, d2t].float(), dim=-1))
    return TargetLabels(torch.cat(probs).view(b, t, -1), torch.cat(argmax).view(b, t))


@dataclass
class Unrolled:
    logits: list[Tensor]       # per step [B, T, N]
    valid: list[Tensor]        # per step [B, T] bool: x_{t+k+2} exists and is an assistant token
    queries: list[list[Tensor]]  # per step, per KV attention: pre-RoPE normed query [B, H, T, D]


def context(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """What a drafter may read of the target: activations at anchor positions + padding mask."""
    ctx = {k: v for k, v in batch.items() if k == "aux_hidden" or k.startswith(("key_", "value_"))}
    ctx["valid"] = batch["attention_mask"].bool()          # prefix keys (training: one per position)
    ctx["anchor_valid"] = ctx["valid"]                      # query rows (training: every position)
    return ctx


def unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int, keep_queries: bool = False,
           own_tokens: bool = False) -> Unrolled:
    """K steps for every anchor at once. Inputs are the sequence's tokens (training, as EAGLE-3)
    or, with own_tokens, the drafter's own greedy drafts from step 1 on (chain simulation)."""
    ids = batch["input_ids"].long()
    b, t = ids.shape
    anchors = torch.arange(t, device=ids.device).expand(b, -1)
    state = drafter.begin(context(batch), anchors)
    loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    out = Unrolled([], [], [])
    for k in range(steps):
        tokens = drafter.d2t[out.logits[-1].argmax(-1)] if own_tokens and k > 0 else shift(ids, k + 1)
        h = drafter.step(state, tokens, anchors + k + 1, k)
        out.logits.append(drafter.logits(h))
        out.valid.append(shift(loss_mask, k + 2, False))
        if keep_queries:
            out.queries.append([attn.last_query for _, attn in drafter.kv_attentions()])
    return out


def scored_tokens(batch: dict[str, Tensor], labels: TargetLabels, t2d: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Step k's masks at anchor t: `valid` (x_{t+k+2} exists and is an assistant token) and
    `scored` (also the target's greedy token is in the draft vocab: EAGLE-3's loss mask)."""
    valid = shift(batch["loss_mask"].bool() & batch["attention_mask"].bool(), k + 2, False)
    return valid, valid & t2d[shift(labels.argmax, k + 1)]


def step_losses(drafter: Drafter, un: Unrolled, batch: dict[str, Tensor], labels: TargetLabels,
                denominators: list[float] | None = None):
    """Per step: soft cross-entropy to the target (sum over scored tokens / denominator, the
    local count by default), teacher-forced top-1 accuracy counts (`acc_k`, not alpha_k)."""
    losses, correct, counts, acc_counts = [], [], [], []
    for k, logits in enumerate(un.logits):
        probs = shift(labels.probs, k + 1)
        greedy = shift(labels.argmax, k + 1)
        valid, mask = scored_tokens(batch, labels, drafter.t2d, k)
        ce = -(probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
        n = mask.sum()
        denom = denominators[k] if denominators is not None else n.clamp(min=1)
        losses.append((ce * mask).sum() / denom)
        counts.append(n)
        pred = drafter.d2t[logits.argmax(-1)]
        correct.append(((pred == greedy) & valid).sum())
        acc_counts.append(valid.sum())
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
