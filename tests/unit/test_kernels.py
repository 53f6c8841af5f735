"""The trainer's hand-written backward passes against autograd over the plain formulas:
the attention (fused CPU flash kernel and the portable version), RMSNorm and the soft
cross-entropy (the losses of whole unrolls under every backend: test_attention_backends.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvshot.drafters.block_attention import block_attention, flash_attention
from kvshot.drafters.fused import first_argmax, rms_norm, soft_cross_entropy


def plain_attention(q, k, v, bias, dk, dv, diag_bias=0.0):
    """softmax over [prefix scores + bias, one score per diagonal key + diag_bias] (q already
    scaled). q [B, N, G, R, D], k, v [B, N, Tk, D], bias [B, 1, 1, R, Tk], dk, dv [B, N, S, R, D]."""
    scores = torch.einsum("bngrd,bnkd->bngrk", q, k) + bias
    if dk is not None:
        scores = torch.cat([scores, torch.einsum("bngrd,bnsrd->bngrs", q, dk) + diag_bias], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    tk = k.shape[2]
    out = torch.einsum("bngrk,bnkd->bngrd", probs[..., :tk], v)
    if dk is not None:
        out = out + torch.einsum("bngrs,bnsrd->bngrd", probs[..., tk:], dv)
    return out


def attention_case(dtype, steps: int, blind_rows: int = 0, seed: int = 0):
    """Two packed sequences of rows 0..5 and 6..11 with 7 and 5 keys, causal-style masks."""
    g = torch.Generator().manual_seed(seed)
    b, n, grp, t, tp, d = 1, 2, 2, 12, 12, 4
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    q, k, v = mk(b, n, grp, t, d), mk(b, n, tp, d), mk(b, n, tp, d)
    dk, dv = (mk(b, n, steps, t, d), mk(b, n, steps, t, d)) if steps else (None, None)
    visible = torch.zeros(t, tp, dtype=torch.bool)
    for r in range(6):
        visible[r, : r + 2] = True                 # sequence 1: keys 0..6
    for r in range(6, 12):
        visible[r, 7: 7 + r - 5] = True            # sequence 2: keys 7..11
    visible[:blind_rows] = False                   # rows that see no prefix key (diagonal keys only)
    bias = torch.zeros(t, tp, dtype=dtype).masked_fill(~visible, float("-inf"))[None, None, None]
    blocks = []
    for r0, r1, k0, k1 in [(0, 6, 0, 7), (6, 12, 7, 12)]:
        rows = bias[:, 0, :, r0:r1, k0:k1]                                   # [B, 1, R, Tk]: every head alike
        blind = torch.isinf(rows).all(-1)
        blocks.append((r0, r1, k0, k1, rows, blind if bool(blind.any()) else None))
    return (q, k, v, dk, dv), bias, blocks


def flash(q, k, v, dk, dv, blocks, steps=0):
    """`flash_attention` on the [B, N, G, R, D] layout the plain reference uses (q scaled):
    its queries are [B, H, R, D] heads, here in the [B, R, H, D] memory the drafter gives it."""
    b, n, g, r, d = q.shape
    heads = q.permute(0, 3, 1, 2, 4).reshape(b, r, n * g, d).transpose(1, 2)
    return flash_attention(heads, k, v, dk, dv, blocks, steps).unflatten(1, (n, g))


@pytest.mark.parametrize("steps,blind_rows", [(0, 0), (3, 0), (3, 2)])
def test_flash_attention_matches_autograd(steps, blind_rows):
    """Output and every gradient equal autograd through the plain softmax (float64)."""
    inputs, bias, blocks = attention_case(torch.float64, steps, blind_rows)
    q, k, v, dk, dv = inputs
    leaves = [x for x in inputs if x is not None]
    weights = torch.randn(q.shape, dtype=torch.float64)
    ours = flash(q, k, v, dk, dv, blocks)
    grads = torch.autograd.grad((ours * weights).sum(), leaves)
    ref = plain_attention(q, k, v, bias, dk, dv)
    ref_grads = torch.autograd.grad((ref * weights).sum(), leaves)
    torch.testing.assert_close(ours, ref)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("steps", [0, 3])
def test_block_attention_gradcheck(steps):
    """The portable attention (one block, every key) passes gradcheck."""
    inputs, bias, _ = attention_case(torch.float64, steps)
    q, k, v, dk, dv = inputs
    fn = lambda q, k, v, *diag: block_attention(q, k, v, bias, *(diag or (None, None)))
    assert torch.autograd.gradcheck(fn, tuple(x for x in inputs if x is not None))
    torch.testing.assert_close(block_attention(q, k, v, bias, dk, dv), plain_attention(q, k, v, bias, dk, dv))


@pytest.mark.parametrize("blind_rows", [0, 2])
def test_steps_in_rows_attention_is_the_spread_diagonal(blind_rows):
    """Rows (anchor, step) anchor-major with each row's own key (one call for every step):
    both kernels equal the plain attention over each row's spread diagonal, where row
    (anchor, k) sees the anchor's keys of steps j <= k; outputs and every gradient."""
    (q, k, v, _, _), bias, blocks = attention_case(torch.float64, 0, blind_rows)
    steps, (b, n, _, t, d) = 3, q.shape                       # 4 anchors x 3 steps, blocks of whole anchors
    g = torch.Generator().manual_seed(1)
    own_k, own_v = (torch.randn(b, n, t, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    spread = lambda x: x.view(b, n, t // steps, steps, d).transpose(2, 3)[:, :, :, :, None].expand(
        b, n, steps, t // steps, steps, d).reshape(b, n, steps, t, d)   # [B, N, S(j), rows (anchor, k), D]
    later = torch.zeros(steps, steps, dtype=torch.float64).masked_fill(
        torch.ones(steps, steps, dtype=torch.bool).triu(1), float("-inf"))        # [k, j]
    leaves = [q, k, v, own_k, own_v]
    weights = torch.randn(q.shape, dtype=torch.float64, generator=g)
    ref = plain_attention(q, k, v, bias, spread(own_k), spread(own_v), later.repeat(t // steps, 1))
    ref_grads = torch.autograd.grad((ref * weights).sum(), leaves)
    for ours in (flash(q, k, v, own_k, own_v, blocks, steps),
                 block_attention(q, k, v, bias, own_k, own_v, steps)):
        torch.testing.assert_close(ours, ref)
        for name, a, r in zip("q k v own_k own_v".split(), torch.autograd.grad((ours * weights).sum(), leaves), ref_grads):
            torch.testing.assert_close(a, r, msg=name)


def test_flash_attention_gradcheck():
    inputs, _, blocks = attention_case(torch.float64, 2, blind_rows=1)
    fn = lambda q, k, v, dk, dv: flash(q, k, v, dk, dv, blocks)
    assert torch.autograd.gradcheck(fn, inputs)


def test_rms_norm_and_soft_cross_entropy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, w))
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))
    z = torch.randn(6, 20, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(6, 20, dtype=torch.float64, generator=g), -1)
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, p)[0], (z,))
    ce, top = soft_cross_entropy(z, p)
    torch.testing.assert_close(ce, -(p * torch.log_softmax(z, -1)).sum(-1))
    assert torch.equal(top, z.argmax(-1))
    wide = torch.randn(5, 256, generator=g)
    wide[1, 200] = wide[1, 70] = wide[1].max() + 1                      # a tie: the first one wins
    wide[3, 0] = wide[3, 255] = wide[3].max() + 1
    assert torch.equal(first_argmax(wide), wide.argmax(-1)) and first_argmax(wide)[1] == 70


# the whole TTT loss and gradients under every backend: tests/unit/test_attention_backends.py


def _custom_functions(inputs, bias, blocks):
    """Every hand-written Function on fp32 inputs: outputs and input gradients."""
    q, k, v, dk, dv = inputs
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    z = torch.randn(4, 20, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(4, 20, generator=g), -1)
    outs = [flash(q, k, v, dk, dv, blocks), block_attention(q, k, v, bias, dk, dv), rms_norm(x, w, 1e-6),
            soft_cross_entropy(z, p)[0]]
    leaves = [q, k, v, dk, dv, x, w, z]
    return outs, torch.autograd.grad(sum(o.sum() for o in outs), leaves)


def test_custom_functions_keep_their_precision_under_autocast():
    """Inside a bf16 autocast region (forward and backward), the hand-written Functions compute
    in their inputs' dtype, bit for bit as outside: the caller decides the precision."""
    inputs, bias, blocks = attention_case(torch.float32, 2)
    plain_outs, plain_grads = _custom_functions(inputs, bias, blocks)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs, grads = _custom_functions(inputs, bias, blocks)
    for a, b in zip(outs + list(grads), plain_outs + list(plain_grads)):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_block_attention_in_bf16_matches_fp64_within_rounding():
    """The portable attention on bf16 operands (what a bf16 runtime runs on CUDA): softmax in
    fp32, output and gradients bf16, close to the float64 reference."""
    inputs, bias, _ = attention_case(torch.float64, 3)
    low = [x.detach().to(torch.bfloat16).requires_grad_() for x in inputs]
    out = block_attention(*low[:3], bias.to(torch.bfloat16), *low[3:])
    grads = torch.autograd.grad(out.float().sum(), low)
    ref = plain_attention(*[x.detach().to(torch.bfloat16).double().requires_grad_() for x in inputs[:3]],
                          bias, *[x.detach().to(torch.bfloat16).double() for x in inputs[3:]])
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    ref_q = [x.detach().to(torch.bfloat16).double().requires_grad_() for x in inputs]
    ref_grads = torch.autograd.grad(plain_attention(*ref_q[:3], bias, *ref_q[3:]).sum(), ref_q)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), r, atol=6e-2, rtol=6e-2)
