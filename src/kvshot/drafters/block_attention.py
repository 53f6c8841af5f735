"""Attention of one row block over prefix keys plus per-row diagonal keys, with a hand-written
backward.

The drafter's attention has two kinds of keys (see `skeleton`): a span of prefix keys shared
by the block's rows, seen through an additive mask, and one diagonal key per earlier step that
belongs to a single row. Autograd over the composed ops (scores, mask add, concatenation with
the diagonal scores, softmax, slicing, two products) materializes the [rows, keys] score
tensor several times in each direction; this function keeps one scores tensor, normalizes it
in place, and in the backward reuses the one gradient buffer, so the work is the matmuls plus
a few passes. The scores and the softmax are computed in fp32 whatever the input dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _diag_scores(q: Tensor, dk: Tensor) -> Tensor:
    """q [B, N, G, R, D] . dk [B, N, R, S, D] -> [B, N, G, R, S]."""
    return torch.einsum("bngrd,bnrsd->bngrs", q, dk)


class BlockAttention(torch.autograd.Function):
    """q [B, N, G, R, D] (already scaled by 1/sqrt(D)); k, v [B, N, Tk, D]; bias broadcastable
    to [B, N, G, R, Tk]; dk, dv [B, N, R, S, D] or None. Returns [B, N, G, R, D]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dk: Tensor | None, dv: Tensor | None) -> Tensor:
        b, n, g, r, d = q.shape
        tk = k.shape[2]
        q2 = q.reshape(b, n, g * r, d)
        probs = torch.matmul(q2, k.transpose(-1, -2)).float().view(b, n, g, r, tk)
        probs.add_(bias)
        top = probs.amax(-1, keepdim=True)
        diag = None
        if dk is not None:
            diag = _diag_scores(q, dk).float()
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
            out = out + torch.einsum("bngrs,bnrsd->bngrd", diag.to(dv.dtype), dv)
        ctx.save_for_backward(q, k, v, dk, dv, p, diag, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, dk, dv, p, diag, out = ctx.saved_tensors
        b, n, g, r, d = q.shape
        tk = k.shape[2]
        need_q, need_k, need_v, _, need_dk, need_dv = ctx.needs_input_grad
        go = grad_out.contiguous()
        go2 = go.view(b, n, g * r, d)
        p2 = p.view(b, n, g * r, tk)
        grad_v = torch.matmul(p2.transpose(-1, -2), go2) if need_v else None
        # d softmax: ds = p * (dp - <dp, p>), and <dp, p> = <grad_out, out> per row
        row_dot = (go.float() * out.float()).sum(-1, keepdim=True)                  # [B, N, G, R, 1]
        ds = torch.matmul(go2, v.transpose(-1, -2)).float().view(b, n, g, r, tk)
        ds.sub_(row_dot).mul_(p)
        ds = ds.to(q.dtype).view(b, n, g * r, tk)
        grad_q = torch.matmul(ds, k).view(b, n, g, r, d) if need_q else None
        grad_k = torch.matmul(ds.transpose(-1, -2), q.reshape(b, n, g * r, d)) if need_k else None
        grad_dk = grad_dv = None
        if diag is not None:
            d_diag = _diag_scores(go, dv).float().sub_(row_dot).mul_(diag).to(q.dtype)   # [B, N, G, R, S]
            if need_q:
                grad_q = grad_q + torch.einsum("bngrs,bnrsd->bngrd", d_diag, dk)
            if need_dk:
                grad_dk = torch.einsum("bngrs,bngrd->bnrsd", d_diag, q)
            if need_dv:
                grad_dv = torch.einsum("bngrs,bngrd->bnrsd", diag.to(go.dtype), go)
        return grad_q, grad_k, grad_v, None, grad_dk, grad_dv


def block_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dk: Tensor | None = None,
                    dv: Tensor | None = None) -> Tensor:
    return BlockAttention.apply(q, k, v, bias, dk, dv)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _flash_block_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, blind: Tensor | None,
                         dk: Tensor | None, dv: Tensor | None):
    """One block: q [B, N, G * R, D], k, v [B, N, Tk, D], dk, dv [B, N, R, S, D] -> the joint
    output, the joint logsumexp, and the diagonal keys' probabilities [B, N, G, R, S]."""
    out, lse = _flash(q, k, v, attn_mask=bias, scale=1.0)             # lse [B, N, G * R]
    if dk is None:
        return out, lse, None
    b, n, rows, d = q.shape
    r = dk.shape[2]
    if blind is not None:   # the kernel gives a row that sees no prefix key lse 0 and output 0
        lse = lse.masked_fill(blind, float("-inf"))
    # a few keys per row: broadcast products beat batched tiny matmuls here
    diag = (q.view(b, n, rows // r, r, 1, d) * dk[:, :, None]).sum(-1)   # [B, N, G, R, S]
    lse5 = lse.view(b, n, rows // r, r, 1)
    top = torch.maximum(diag.amax(-1, keepdim=True), lse5)
    diag.sub_(top).exp_()
    prefix_share = lse5.sub(top).exp_()
    total = diag.sum(-1, keepdim=True).add_(prefix_share)
    diag.div_(total)
    prefix_share.div_(total)
    out = (out.view(b, n, rows // r, r, d) * prefix_share).add_((diag[..., None] * dv[:, :, None]).sum(-2))
    return out.view(b, n, rows, d), total.log_().add_(top).view_as(lse), diag


class FlashAttention(torch.autograd.Function):
    """Every row block of one attention call through PyTorch's fused CPU flash kernel for the
    prefix keys, which also returns their logsumexp; the diagonal keys are merged in by
    logsumexp. The backward hands the kernel the joint output and logsumexp, so its
    probabilities are the joint ones and it returns the prefix keys' share of the joint
    gradient; the diagonal share is added here. One autograd node for all blocks, so no
    block pays for zero-filled gradients of the whole tensors.
    q [B, N, G, Tq, D] (scaled), k, v [B, N, Tp, D], dk, dv [B, N, Tq, S, D] or None;
    blocks: (first row, end row, first key, end key, bias [B, 1, G * R, Tk], blind or None)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, dk: Tensor | None, dv: Tensor | None, blocks: list) -> Tensor:
        b, n, g, tq, d = q.shape
        out = q.new_empty(b, n, g, tq, d)
        saved = []
        for r0, r1, k0, k1, bias, blind in blocks:
            qb = q[:, :, :, r0:r1].reshape(b, n, g * (r1 - r0), d)
            kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
            dkb = None if dk is None else dk[:, :, r0:r1]
            dvb = None if dv is None else dv[:, :, r0:r1]
            ob, lse, diag = _flash_block_forward(qb, kb, vb, bias, blind, dkb, dvb)
            out[:, :, :, r0:r1] = ob.view(b, n, g, r1 - r0, d)
            saved.append((qb, ob, lse, diag))
        ctx.blocks, ctx.saved = blocks, saved
        ctx.save_for_backward(k, v, dk, dv)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        k, v, dk, dv = ctx.saved_tensors
        b, n, g, tq, d = grad_out.shape
        need_q, need_k, need_v, need_dk, need_dv, _ = ctx.needs_input_grad
        grad_q = grad_out.new_empty(b, n, g, tq, d)
        grad_k = torch.zeros_like(k) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
        grad_dk = torch.empty_like(dk) if dk is not None and need_dk else None
        grad_dv = torch.empty_like(dv) if dv is not None and need_dv else None
        for (r0, r1, k0, k1, bias, blind), (qb, ob, lse, diag) in zip(ctx.blocks, ctx.saved):
            rows = r1 - r0
            go = grad_out[:, :, :, r0:r1].reshape(b, n, g * rows, d)
            gq, gk, gv = _flash_backward(go, qb, k[:, :, k0:k1], v[:, :, k0:k1], ob, lse, 0.0, False,
                                         attn_mask=bias, scale=1.0)
            if diag is not None:
                go6, q6 = go.view(b, n, g, rows, 1, d), qb.view(b, n, g, rows, 1, d)
                row_dot = (go * ob).sum(-1).view(b, n, g, rows, 1)
                d_diag = (go6 * dv[:, :, None, r0:r1]).sum(-1).sub_(row_dot).mul_(diag)[..., None]   # [B, N, G, R, S, 1]
                gq = gq.view(b, n, g, rows, d).add_((d_diag * dk[:, :, None, r0:r1]).sum(-2))
                if grad_dk is not None:
                    grad_dk[:, :, r0:r1] = (d_diag * q6).sum(2)
                if grad_dv is not None:
                    grad_dv[:, :, r0:r1] = (diag[..., None] * go6).sum(2)
            grad_q[:, :, :, r0:r1] = gq.view(b, n, g, rows, d)
            if grad_k is not None:
                grad_k[:, :, k0:k1] += gk
            if grad_v is not None:
                grad_v[:, :, k0:k1] += gv
        ctx.saved = None
        return grad_q if need_q else None, grad_k, grad_v, grad_dk, grad_dv, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, dk: Tensor | None, dv: Tensor | None, blocks: list) -> Tensor:
    return FlashAttention.apply(q, k, v, dk, dv, blocks)
