"""The drafter's attention with hand-written backward passes.

A query row sees two kinds of keys (see `skeleton`): a span of prefix keys shared by the
rows of its block, seen through an additive mask, and one diagonal key per earlier step that
belongs to that row alone. Autograd over the composed ops (scores, mask add, concatenation
with the diagonal scores, softmax, slicing, two products) materializes the [rows, keys]
scores several times in each direction and zero-fills whole-tensor gradients for every
block. Two versions of one function:
  `flash_attention`  fp32 on CPU: PyTorch's fused flash kernel for the prefix keys, the
                     diagonal keys merged in by logsumexp; one autograd node for all blocks.
  `block_attention`  any device and dtype: one block, one scores tensor normalized in place,
                     the softmax in fp32 at least.
Both run in their inputs' dtype with autocast off (`own_precision`): `Attention.attend` casts
q, keys and values to the compute dtype (bf16 under a bf16 runtime's autocast).
The plain algorithm they compute, and the registry that picks a backend: `attention`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fused import at_least_fp32, own_precision


def _diag_scores(q: Tensor, dk: Tensor, steps: int = 0) -> Tensor:
    """Each row's scores against its diagonal keys, [B, N, G, R, S]. q [B, N, G, R, D]; dk
    [B, N, S, R, D], or with steps in rows [B, N, R, D] (S = steps: the keys of the row's
    anchor; a later step's score is what it is here, `hide_later_steps` masks it)."""
    if not steps:
        return torch.einsum("bngrd,bnsrd->bngrs", q, dk)
    b, n, g, rs, d = q.shape
    return torch.einsum("bngrkd,bnrjd->bngrkj", q.reshape(b, n, g, rs // steps, steps, d),
                        dk.reshape(b, n, rs // steps, steps, d)).reshape(b, n, g, rs, steps)


def hide_later_steps(scores: Tensor, steps: int) -> Tensor:
    """Steps in rows: row (anchor, k) sees its anchor's keys of steps j <= k only."""
    if steps:
        b, n, g, rs, s = scores.shape
        later = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu_(1)    # [k, j]: j > k
        scores = scores.reshape(b, n, g, rs // s, s, s).masked_fill(later, float("-inf")).view(b, n, g, rs, s)
    return scores


def _diag_mix(p: Tensor, dv: Tensor, steps: int = 0) -> Tensor:
    """sum_s p[..., r, s] dv[s, r]: p [B, N, G, R, S] -> [B, N, G, R, D]."""
    if not steps:
        return torch.einsum("bngrs,bnsrd->bngrd", p, dv)
    b, n, g, rs, s = p.shape
    return torch.einsum("bngrkj,bnrjd->bngrkd", p.reshape(b, n, g, rs // s, s, s),
                        dv.reshape(b, n, rs // s, s, -1)).reshape(b, n, g, rs, -1)


def _diag_key_grad(p: Tensor, x: Tensor, steps: int = 0) -> Tensor:
    """The diagonal keys' (values') gradient from p [B, N, G, R, S] and x [B, N, G, R, D]:
    [B, N, S, R, D], or [B, N, R, D] with steps in rows."""
    if not steps:
        return torch.einsum("bngrs,bngrd->bnsrd", p, x)
    b, n, g, rs, s = p.shape
    return torch.einsum("bngrkj,bngrkd->bnrjd", p.reshape(b, n, g, rs // s, s, s),
                        x.reshape(b, n, g, rs // s, s, -1)).reshape(b, n, rs, -1)


class BlockAttention(torch.autograd.Function):
    """q [B, N, G, R, D] (already scaled by 1/sqrt(D)); k, v [B, N, Tk, D]; bias broadcastable
    to [B, N, G, R, Tk]; dk, dv [B, N, S, R, D] or None, or with steps in rows (`steps` > 0,
    whole anchors) [B, N, R, D] (`_diag_scores`). Returns [B, N, G, R, D]."""

    @staticmethod
    @own_precision
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dk: Tensor | None, dv: Tensor | None,
                steps: int = 0) -> Tensor:
        b, n, g, r, d = q.shape
        tk = k.shape[2]
        q2 = q.reshape(b, n, g * r, d)
        probs = at_least_fp32(torch.matmul(q2, k.transpose(-1, -2))).view(b, n, g, r, tk)
        probs.add_(bias)
        top = probs.amax(-1, keepdim=True)
        diag = None
        if dk is not None:
            diag = hide_later_steps(at_least_fp32(_diag_scores(q, dk, steps)), steps)
            top = torch.maximum(top, diag.amax(-1, keepdim=True))
            diag.sub_(top).exp_()
        probs.sub_(top).exp_()
        total = probs.sum(-1, keepdim=True)
        if diag is not None:
            total.add_(diag.sum(-1, keepdim=True))
        inv = total.reciprocal_()
        probs.mul_(inv)
        p = probs.to(v.dtype)
        out = torch.matmul(p.view(b, n, g * r, tk), v).view(b, n, g, r, d)
        if diag is not None:
            diag.mul_(inv)
            out = out + _diag_mix(diag.to(dv.dtype), dv, steps)
        ctx.steps = steps
        ctx.save_for_backward(q, k, v, dk, dv, p, diag, out)
        return out

    @staticmethod
    @own_precision
    def backward(ctx, grad_out: Tensor):
        q, k, v, dk, dv, p, diag, out = ctx.saved_tensors
        b, n, g, r, d = q.shape
        tk = k.shape[2]
        need_q, need_k, need_v, _, need_dk, need_dv, _ = ctx.needs_input_grad
        steps = ctx.steps
        go = grad_out.to(q.dtype).contiguous()   # the caller's ops may have widened it
        go2 = go.view(b, n, g * r, d)
        p2 = p.view(b, n, g * r, tk)
        grad_v = torch.matmul(p2.transpose(-1, -2), go2) if need_v else None
        # d softmax: ds = p * (dp - <dp, p>), and <dp, p> = <grad_out, out> per row
        row_dot = (at_least_fp32(go) * at_least_fp32(out)).sum(-1, keepdim=True)   # [B, N, G, R, 1]
        ds = at_least_fp32(torch.matmul(go2, v.transpose(-1, -2))).view(b, n, g, r, tk)
        ds.sub_(row_dot).mul_(p)
        ds = ds.to(q.dtype).view(b, n, g * r, tk)
        grad_q = torch.matmul(ds, k).view(b, n, g, r, d) if need_q else None
        grad_k = torch.matmul(ds.transpose(-1, -2), q.reshape(b, n, g * r, d)) if need_k else None
        grad_dk = grad_dv = None
        if diag is not None:
            d_diag = at_least_fp32(_diag_scores(go, dv, steps)).sub_(row_dot).mul_(diag).to(q.dtype)   # [B, N, G, R, S]
            if need_q:
                grad_q = grad_q + _diag_mix(d_diag, dk, steps)
            if need_dk:
                grad_dk = _diag_key_grad(d_diag, q, steps)
            if need_dv:
                grad_dv = _diag_key_grad(diag.to(go.dtype), go, steps)
        return grad_q, grad_k, grad_v, None, grad_dk, grad_dv, None


def block_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dk: Tensor | None = None,
                    dv: Tensor | None = None, steps: int = 0) -> Tensor:
    return BlockAttention.apply(q, k, v, bias, dk, dv, steps)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _merge_diagonal(out: Tensor, lse: Tensor, diag: Tensor, dim: int, mix) -> tuple[Tensor, Tensor]:
    """Join the prefix keys' output and logsumexp [B, N, G, Tq] with the diagonal scores `diag`
    (one per diagonal key along `dim`) by logsumexp. `diag` becomes the diagonal keys' share of
    the probabilities (in place); `mix(diag)` is their output. Returns the joint (out, lse)."""
    top = torch.maximum(diag.amax(dim), lse)
    diag.sub_(top.unsqueeze(dim)).exp_()
    prefix_share = lse.sub(top).exp_()
    total = diag.sum(dim).add_(prefix_share)
    diag.div_(total.unsqueeze(dim))
    prefix_share.div_(total)
    return (out * prefix_share[..., None]).add_(mix(diag)), total.log_().add_(top)


class FlashAttention(torch.autograd.Function):
    """Every row block of one attention call through PyTorch's fused CPU flash kernel for the
    prefix keys, which also returns their logsumexp; the diagonal keys (per row, so done once
    for all blocks) are merged in by logsumexp. The backward hands the kernel the joint
    output and logsumexp, so its probabilities are the joint ones and it returns the prefix
    keys' share of the joint gradient; the diagonal share is added here. One autograd node
    for all blocks, so no block pays for zero-filled gradients of the whole tensors.
    q [B, H, Tq, D] in any strides (the kernel does GQA itself: H = N * G query heads over
    k, v [B, N, Tp, D], so a block's rows are a view and nothing is repeated per head);
    dk, dv [B, N, S, Tq, D] or None, or with steps in rows (`steps` > 0) [B, N, Tq, D], as
    `_diag_scores` reads them; blocks: (first row, end row, first key, end key, bias
    [B, 1, R, Tk], blind [B, 1, R] (rows that see no prefix key) or None); scores are
    scaled by `scale`. Returns [B, H, Tq, D] laid out as [B, Tq, H, D], the o_proj's input."""

    @staticmethod
    @own_precision
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, dk: Tensor | None, dv: Tensor | None, blocks: list,
                steps: int = 0, scale: float = 1.0) -> Tensor:
        b, h, tq, d = q.shape
        n = k.shape[1]
        whole = len(blocks) == 1
        out = None if whole else q.new_empty(b, tq, h, d).transpose(1, 2)
        lse = None if whole else q.new_empty(b, h, tq)
        for r0, r1, k0, k1, bias, blind in blocks:
            ob, lb = _flash(q[:, :, r0:r1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=bias, scale=scale)
            if blind is not None and dk is not None:   # the kernel gives such a row lse 0 and output 0
                lb = lb.masked_fill(blind, float("-inf"))
            if whole:
                out, lse = ob, lb
            else:
                out[:, :, r0:r1] = ob
                lse[:, :, r0:r1] = lb
        diag = None
        if dk is not None:
            qg, og, lg = q.unflatten(1, (n, -1)), out.unflatten(1, (n, -1)), lse.unflatten(1, (n, -1))
            if steps:
                # rows (anchor, step): per anchor, one small product of its step rows and step keys
                diag = hide_later_steps(_diag_scores(qg, dk, steps).mul_(scale), steps)   # [B, N, G, Tq, S]
                og, lg = _merge_diagonal(og, lg, diag, -1, lambda p: _diag_mix(p, dv, steps))
            else:
                # a few keys per row, step-major: broadcast products over whole [G, Tq, D] slabs
                diag = (qg[:, :, None] * dk[:, :, :, None]).sum(-1).mul_(scale)           # [B, N, S, G, Tq]
                og, lg = _merge_diagonal(og, lg, diag, 2, lambda p: (p[..., None] * dv[:, :, :, None]).sum(2))
            out = og.permute(0, 3, 1, 2, 4).reshape(b, tq, h, d).transpose(1, 2)   # the o_proj's layout
            lse = lg.flatten(1, 2)
        ctx.blocks, ctx.steps, ctx.scale = blocks, steps, scale
        ctx.save_for_backward(q, k, v, dk, dv, out, lse, diag)
        return out

    @staticmethod
    @own_precision
    def backward(ctx, grad_out: Tensor):
        q, k, v, dk, dv, out, lse, diag = ctx.saved_tensors
        b, h, tq, d = q.shape
        n = k.shape[1]
        need_q, need_k, need_v, need_dk, need_dv, *_ = ctx.needs_input_grad
        go, scale = grad_out.to(q.dtype), ctx.scale
        whole = len(ctx.blocks) == 1
        grad_q = None if whole else go.new_empty(b, tq, h, d).transpose(1, 2)
        every_key = whole and ctx.blocks[0][2] == 0 and ctx.blocks[0][3] == k.shape[2]
        grad_k = torch.zeros_like(k) if need_k and not every_key else None
        grad_v = torch.zeros_like(v) if need_v and not every_key else None
        for r0, r1, k0, k1, bias, _ in ctx.blocks:
            gq, gk, gv = _flash_backward(go[:, :, r0:r1], q[:, :, r0:r1], k[:, :, k0:k1], v[:, :, k0:k1],
                                         out[:, :, r0:r1], lse[:, :, r0:r1], 0.0, False, attn_mask=bias, scale=scale)
            if whole:
                grad_q = gq
            else:
                grad_q[:, :, r0:r1] = gq
            if every_key:
                grad_k, grad_v = (gk if need_k else None), (gv if need_v else None)
                continue
            if grad_k is not None:
                grad_k[:, :, k0:k1] += gk
            if grad_v is not None:
                grad_v[:, :, k0:k1] += gv
        grad_dk = grad_dv = None
        if diag is not None:
            split = lambda x: x.unflatten(1, (n, -1))                              # [B, N, G, Tq, ...]
            gog, og, qg = split(go), split(out), split(q)
            gqg = split(grad_q)
            if ctx.steps:
                row_dot = (gog * og).sum(-1, keepdim=True)                             # [B, N, G, Tq, 1]
                d_diag = _diag_scores(gog, dv, ctx.steps).sub_(row_dot).mul_(diag)      # [B, N, G, Tq, S]
                grad_dv = _diag_key_grad(diag, gog, ctx.steps) if need_dv else None
                d_diag.mul_(scale)
                gqg.add_(_diag_mix(d_diag, dk, ctx.steps))
                grad_dk = _diag_key_grad(d_diag, qg, ctx.steps) if need_dk else None
            else:
                go6 = gog[:, :, None]                                                  # [B, N, 1, G, Tq, D]
                row_dot = (gog * og).sum(-1)                                           # [B, N, G, Tq]
                d_diag = (go6 * dv[:, :, :, None]).sum(-1).sub_(row_dot[:, :, None]).mul_(diag)   # [B, N, S, G, Tq]
                grad_dv = (diag[..., None] * go6).sum(3) if need_dv else None
                d_diag = d_diag.mul_(scale)[..., None]
                gqg.add_((d_diag * dk[:, :, :, None]).sum(2))
                grad_dk = (d_diag * qg[:, :, None]).sum(3) if need_dk else None
        return grad_q if need_q else None, grad_k, grad_v, grad_dk, grad_dv, None, None, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, dk: Tensor | None, dv: Tensor | None, blocks: list,
                    steps: int = 0, scale: float = 1.0) -> Tensor:
    return FlashAttention.apply(q, k, v, dk, dv, blocks, steps, scale)
