"""Hand-written backward passes for the small per-row ops every drafter step runs many times.

On a CPU, autograd over the composed ops of an RMSNorm (square, mean, add, rsqrt, two
products) launches about twenty kernels per call, forward and backward; this keeps the
normalized input and the per-row scale, and the backward is the closed form."""
from __future__ import annotations

import functools

import torch
from torch import Tensor


def own_precision(fn):
    """A custom autograd Function's forward or backward runs in its inputs' own dtypes, with
    autocast off: the caller casts (`Attention.attend`), and the backward does not depend on
    whether backward() is called inside an autocast region. Free when autocast is off."""
    @functools.wraps(fn)
    def run(*args):
        if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                return fn(*args)
        return fn(*args)

    return run


def at_least_fp32(x: Tensor) -> Tensor:
    """x widened to fp32 when it is half precision (fp32 and fp64 stay as they are)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over the last dim (fp32)."""

    @staticmethod
    @own_precision
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        d = x.shape[-1]
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d).add_(eps).rsqrt_()
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat * weight

    @staticmethod
    @own_precision
    def backward(ctx, grad_y: Tensor):
        x_hat, rstd, weight = ctx.saved_tensors
        g = grad_y * weight
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
        # d x_hat: g - x_hat * mean(g * x_hat), scaled by rstd
        proj = (g * x_hat).mean(-1, keepdim=True)
        grad_x = g.sub_(x_hat * proj).mul_(rstd) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def first_argmax(x: Tensor, chunk: int = 64) -> Tensor:
    """x.argmax(-1) (the first maximum) for 2-D x, by way of per-chunk maxima: PyTorch's CPU
    argmax over a long last dim runs several times slower than a plain max reduction."""
    r, n = x.shape
    if n % chunk or n <= chunk or not x.is_contiguous():
        return x.argmax(-1)
    blocks = x.view(r, n // chunk, chunk)
    first = blocks.amax(-1).argmax(-1)                                   # the first chunk holding the max
    inner = blocks.gather(1, first.view(r, 1, 1).expand(r, 1, chunk)).view(r, chunk).argmax(-1)
    return first * chunk + inner


class SoftCrossEntropy(torch.autograd.Function):
    """Per row -sum_v p_v log softmax(z)_v = logsumexp(z) - <p, z> for labels p that sum to 1,
    in fp32 at least, and the argmax of z (for accuracy). The fused softmax kernel gives both
    the logsumexp (at the argmax, s = exp(z - lse)) and the backward, softmax(z) - p, so the
    [rows, vocab] tensor is exponentiated once and passed over a few times in all."""

    @staticmethod
    @own_precision
    def forward(ctx, logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
        z, probs = at_least_fp32(logits), at_least_fp32(probs)
        flat = z.reshape(-1, z.shape[-1])
        softmax = torch.softmax(flat, dim=-1)
        argmax = first_argmax(flat)
        at_top = argmax[:, None]
        lse = flat.gather(1, at_top).sub_(softmax.gather(1, at_top).log_()).view(z.shape[:-1])
        ce = lse - torch.linalg.vecdot(probs, z)
        ctx.save_for_backward(softmax, probs)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(argmax)
        return ce, argmax.view(z.shape[:-1])

    @staticmethod
    @own_precision
    def backward(ctx, grad_ce: Tensor, _grad_argmax):
        softmax, probs = ctx.saved_tensors
        grad = torch.sub(softmax.view(probs.shape), probs).mul_(grad_ce[..., None])
        return grad.to(ctx.logits_dtype), None


def soft_cross_entropy(logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    """(cross-entropy per row, argmax per row)."""
    return SoftCrossEntropy.apply(logits, probs)
