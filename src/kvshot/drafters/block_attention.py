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


class FlashBlockAttention(torch.autograd.Function):
    """The same attention on CPU through PyTorch's fused flash kernel for the prefix keys, which
    returns their logsumexp; the diagonal keys are merged in by logsumexp. The backward hands
    the kernel the joint output and logsumexp, so its probabilities are the joint ones and
    it returns the prefix keys' share of the joint gradient; the diagonal share is added here.
    q [B, N, G * R, D] (scaled), k, v [B, N, Tk, D], bias [B, 1, G * R, Tk] or None,
    blind [B, 1, G * R] (rows that see no prefix key) or None, dk, dv [B, N, R, S, D] or None."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, blind: Tensor | None,
                dk: Tensor | None, dv: Tensor | None):
        out, lse = _flash(q, k, v, attn_mask=bias, scale=1.0)             # lse [B, N, G * R]
        diag = None
        if dk is not None:
            b, n, rows, d = q.shape
            r = dk.shape[2]
            if blind is not None:   # the kernel gives such a row lse 0 and output 0
                lse = lse.masked_fill(blind, float("-inf"))
            diag_scores = _diag_scores(q.view(b, n, rows // r, r, d), dk)   # [B, N, G, R, S]
            joint = torch.logaddexp(lse.view(b, n, rows // r, r), torch.logsumexp(diag_scores, -1))
            prefix_share = torch.exp(lse.view_as(joint) - joint)
            diag = torch.exp(diag_scores - joint[..., None])
            out = (out.view(b, n, rows // r, r, d) * prefix_share[..., None]
                   + torch.einsum("bngrs,bnrsd->bngrd", diag, dv)).view(b, n, rows, d)
            lse = joint.view_as(lse)
        ctx.save_for_backward(q, k, v, bias, dk, dv, diag, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, bias, dk, dv, diag, out, lse = ctx.saved_tensors
        go = grad_out.contiguous()
        grad_q, grad_k, grad_v = _flash_backward(go, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=1.0)
        grad_dk = grad_dv = None
        if diag is not None:
            b, n, rows, d = q.shape
            r = dk.shape[2]
            go5, q5 = go.view(b, n, rows // r, r, d), q.view(b, n, rows // r, r, d)
            row_dot = (go * out).sum(-1).view(b, n, rows // r, r, 1)
            d_diag = (_diag_scores(go5, dv) - row_dot) * diag
            grad_q = grad_q + torch.einsum("bngrs,bnrsd->bngrd", d_diag, dk).reshape(b, n, rows, d)
            grad_dk = torch.einsum("bngrs,bngrd->bnrsd", d_diag, q5)
            grad_dv = torch.einsum("bngrs,bngrd->bnrsd", diag, go5)
        return grad_q, grad_k, grad_v, None, None, grad_dk, grad_dv


def flash_block_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, blind: Tensor | None = None,
                          dk: Tensor | None = None, dv: Tensor | None = None) -> Tensor:
    return FlashBlockAttention.apply(q, k, v, bias, blind, dk, dv)
