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
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fused import at_least_fp32


def _diag_scores(q: Tensor, dk: Tensor) -> Tensor:
    """q [B, N, G, R, D] . dk [B, N, S, R, D] -> [B, N, G, R, S]."""
    return torch.einsum("bngrd,bnsrd->bngrs", q, dk)


class BlockAttention(torch.autograd.Function):
    """q [B, N, G, R, D] (already scaled by 1/sqrt(D)); k, v [B, N, Tk, D]; bias broadcastable
    to [B, N, G, R, Tk]; dk, dv [B, N, S, R, D] or None. Returns [B, N, G, R, D]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dk: Tensor | None, dv: Tensor | None) -> Tensor:
        b, n, g, r, d = q.shape
        tk = k.shape[2]
        q2 = q.reshape(b, n, g * r, d)
        probs = at_least_fp32(torch.matmul(q2, k.transpose(-1, -2))).view(b, n, g, r, tk)
        probs.add_(bias)
        top = probs.amax(-1, keepdim=True)
        diag = None
        if dk is not None:
            diag = at_least_fp32(_diag_scores(q, dk))
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
            out = out + torch.einsum("bngrs,bnsrd->bngrd", diag.to(dv.dtype), dv)
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
        row_dot = (at_least_fp32(go) * at_least_fp32(out)).sum(-1, keepdim=True)   # [B, N, G, R, 1]
        ds = at_least_fp32(torch.matmul(go2, v.transpose(-1, -2))).view(b, n, g, r, tk)
        ds.sub_(row_dot).mul_(p)
        ds = ds.to(q.dtype).view(b, n, g * r, tk)
        grad_q = torch.matmul(ds, k).view(b, n, g, r, d) if need_q else None
        grad_k = torch.matmul(ds.transpose(-1, -2), q.reshape(b, n, g * r, d)) if need_k else None
        grad_dk = grad_dv = None
        if diag is not None:
            d_diag = at_least_fp32(_diag_scores(go, dv)).sub_(row_dot).mul_(diag).to(q.dtype)   # [B, N, G, R, S]
            if need_q:
                grad_q = grad_q + torch.einsum("bngrs,bnsrd->bngrd", d_diag, dk)
            if need_dk:
                grad_dk = torch.einsum("bngrs,bngrd->bnsrd", d_diag, q)
            if need_dv:
                grad_dv = torch.einsum("bngrs,bngrd->bnsrd", diag.to(go.dtype), go)
        return grad_q, grad_k, grad_v, None, grad_dk, grad_dv


def block_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dk: Tensor | None = None,
                    dv: Tensor | None = None) -> Tensor:
    return BlockAttention.apply(q, k, v, bias, dk, dv)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class FlashAttention(torch.autograd.Function):
    """Every row block of one attention call through PyTorch's fused CPU flash kernel for the
    prefix keys, which also returns their logsumexp; the diagonal keys (per row, so done once
    for all blocks) are merged in by logsumexp. The backward hands the kernel the joint
    output and logsumexp, so its probabilities are the joint ones and it returns the prefix
    keys' share of the joint gradient; the diagonal share is added here. One autograd node
    for all blocks, so no block pays for zero-filled gradients of the whole tensors.
    q [B, N, G, Tq, D] (scaled), k, v [B, N, Tp, D], dk, dv [B, N, S, Tq, D] or None;
    blocks: (first row, end row, first key, end key, bias [B, 1, G * R, Tk], blind or None)
    with blind [B, 1, G * R] the rows that see no prefix key."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, dk: Tensor | None, dv: Tensor | None, blocks: list) -> Tensor:
        b, n, g, tq, d = q.shape
        whole = len(blocks) == 1
        out = None if whole else q.new_empty(b, n, g, tq, d)
        lse = None if whole else q.new_empty(b, n, g, tq)
        for r0, r1, k0, k1, bias, blind in blocks:
            rows = r1 - r0
            ob, lb = _flash(q[:, :, :, r0:r1].reshape(b, n, g * rows, d), k[:, :, k0:k1], v[:, :, k0:k1],
                            attn_mask=bias, scale=1.0)
            if blind is not None and dk is not None:   # the kernel gives such a row lse 0 and output 0
                lb = lb.masked_fill(blind, float("-inf"))
            if whole:
                out, lse = ob.view(b, n, g, tq, d), lb.view(b, n, g, tq)
            else:
                out[:, :, :, r0:r1] = ob.view(b, n, g, rows, d)
                lse[:, :, :, r0:r1] = lb.view(b, n, g, rows)
        diag = None
        if dk is not None:
            # a few keys per row, step-major: broadcast products over whole [G, Tq, D] slabs
            diag = (q[:, :, None] * dk[:, :, :, None]).sum(-1)                   # [B, N, S, G, Tq]
            top = torch.maximum(diag.amax(2), lse)                               # [B, N, G, Tq]
            diag.sub_(top[:, :, None]).exp_()
            prefix_share = lse.sub(top).exp_()
            total = diag.sum(2).add_(prefix_share)
            diag.div_(total[:, :, None])
            prefix_share.div_(total)
            out = (out * prefix_share[..., None]).add_((diag[..., None] * dv[:, :, :, None]).sum(2))
            lse = total.log_().add_(top)
        ctx.blocks = blocks
        ctx.save_for_backward(q, k, v, dk, dv, out, lse, diag)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, dk, dv, out, lse, diag = ctx.saved_tensors
        b, n, g, tq, d = q.shape
        need_q, need_k, need_v, need_dk, need_dv, _ = ctx.needs_input_grad
        go = grad_out.contiguous()
        whole = len(ctx.blocks) == 1
        grad_q = None if whole else go.new_empty(b, n, g, tq, d)
        grad_k = torch.zeros_like(k) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
        for r0, r1, k0, k1, bias, _ in ctx.blocks:
            rows = r1 - r0
            as_rows = lambda x: x[:, :, :, r0:r1].reshape(b, n, g * rows, *x.shape[4:])
            gq, gk, gv = _flash_backward(as_rows(go), as_rows(q), k[:, :, k0:k1], v[:, :, k0:k1], as_rows(out),
                                         as_rows(lse), 0.0, False, attn_mask=bias, scale=1.0)
            if whole:
                grad_q = gq.view(b, n, g, tq, d)
            else:
                grad_q[:, :, :, r0:r1] = gq.view(b, n, g, rows, d)
            if grad_k is not None:
                grad_k[:, :, k0:k1] += gk
            if grad_v is not None:
                grad_v[:, :, k0:k1] += gv
        grad_dk = grad_dv = None
        if diag is not None:
            go6 = go[:, :, None]                                                   # [B, N, 1, G, Tq, D]
            row_dot = (go * out).sum(-1)                                           # [B, N, G, Tq]
            d_diag = (go6 * dv[:, :, :, None]).sum(-1).sub_(row_dot[:, :, None]).mul_(diag)[..., None]   # [B, N, S, G, Tq, 1]
            grad_q = grad_q.add_((d_diag * dk[:, :, :, None]).sum(2))
            grad_dk = (d_diag * q[:, :, None]).sum(3) if need_dk else None
            grad_dv = (diag[..., None] * go6).sum(3) if need_dv else None
        return grad_q if need_q else None, grad_k, grad_v, grad_dk, grad_dv, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, dk: Tensor | None, dv: Tensor | None, blocks: list) -> Tensor:
    return FlashAttention.apply(q, k, v, dk, dv, blocks)
