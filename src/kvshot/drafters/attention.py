"""The drafter's attention: one plainly written reference, and the backends that compute it fast.

A query row (an anchor at some TTT step) sees two kinds of keys (see `skeleton`):
  prefix  keys shared by every row, visible where `visible[b, row, key]` (the prefix key's
          anchor is no later than the row's, same sequence, not padding);
  diag    the row's own keys from the steps of its anchor: step-major, [B, Hkv, S, Tq, D]
          (row r sees its key of each earlier step s), or with steps in rows (`steps` > 0,
          rows (anchor, step) anchor-major) [B, Hkv, Tq, D] (row (a, i) sees the keys of its
          anchor's rows (a, j), j <= i).
`reference_attention` is that algorithm in a few lines; every backend computes the same and
is tested against it (tests/unit/test_attention_backends.py). Backends, by name:
  reference  the reference itself (holds every [heads, rows, keys] tensor: for reading and tests)
  flash_cpu  fp32 on CPU: PyTorch's fused CPU flash kernel per row block, diagonal merged by
             logsumexp, hand-written backward (`block_attention.FlashAttention`)
  block      any device/dtype: one scores tensor per row block, hand-written backward
             (saves each block's probabilities for the backward)
  sdpa       SDPA per row block over the block's prefix span and its own diagonal keys, one
             boolean mask from `ttt_mask_mod`; on CUDA only the memory-efficient kernel is
             allowed (no silent fallback to the math kernel that keeps probabilities)
  flex       flex_attention over [prefix; diagonal] keys with `ttt_mask_mod` as a BlockMask,
             compiled on CUDA; on CPU PyTorch runs it eagerly and forward only
`auto` (the config's default, `drafters.attention`): flash_cpu for fp32 on CPU, block for other
CPU dtypes, flex for training on CUDA and sdpa for decoding there (few rows, no backward).

`cuda_branches()` makes CPU tensors take every branch CUDA's take (the backend `auto` picks,
compiled block masks, compiled flex, SDPA's CUDA layout), so CI runs the GPU path on CPU; what
CPU cannot run (inductor's flex backward, SDPA's memory-efficient kernel) is listed in docs/gpu.md.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .block_attention import block_attention, flash_attention

BACKENDS = ("reference", "flash_cpu", "block", "sdpa", "flex")
CHOICES = ("auto",) + BACKENDS
_chosen = "auto"
_as_cuda = False   # set by cuda_branches()


@contextlib.contextmanager
def cuda_branches():
    """Within: CPU tensors take the branches CUDA tensors take, in everything this module
    decides by device. Two differ because CPU has no kernel for them: flex compiles through
    dynamo and AOTAutograd without inductor's code generation (`aot_eager`, PyTorch's CPU
    device check lifted: its eager backward is the dense reference of the compiled one), and SDPA allows CPU's
    kernels in CUDA's layout (keys repeated per head). Block masks compile with inductor, as on
    CUDA. For tests and `benchmarks/gpu.py --dry`."""
    global _as_cuda
    from torch.nn.attention import flex_attention as flex_module

    saved, check = _as_cuda, flex_module._validate_device
    _as_cuda = True
    flex_module._validate_device = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _as_cuda, flex_module._validate_device = saved, check


def branch_device(device_type: str) -> str:
    """The device whose branches a tensor on `device_type` takes ("cuda" under cuda_branches)."""
    return "cuda" if _as_cuda and device_type == "cpu" else device_type


def reference_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, dk: Tensor | None = None,
                        dv: Tensor | None = None, steps: int = 0, scale: float | None = None) -> Tensor:
    """q [B, H, Tq, D]; prefix keys and values k, v [B, Hkv, Tp, D] seen where visible
    [B, Tq, Tp]; diagonal keys dk, dv as in the module docstring (or None). Returns
    [B, H, Tq, D]. Scores, the TTT visibility mask, softmax (fp32 at least), values."""
    b, h, tq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = h // k.shape[1]                                   # GQA: each KV head serves `group` query heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale                # [B, H, Tq, Tp]
    seen = visible[:, None]                                   # [B, 1, Tq, Tp]
    if dk is not None:
        dk, dv = dk.repeat_interleave(group, 1), dv.repeat_interleave(group, 1)
        if steps:   # row (a, i) reads the keys of rows (a, 0..steps-1), sees those with j <= i
            anchors = tq // steps
            own = lambda x: x.view(b, h, anchors, 1, steps, d).expand(-1, -1, -1, steps, -1, -1).reshape(b, h, tq, steps, d)
            dk, dv = own(dk), own(dv)                         # [B, H, Tq, S, D]
            sees = torch.ones(steps, steps, dtype=torch.bool, device=q.device).tril().repeat(anchors, 1)
        else:       # row r reads its own key of every earlier step, sees them all
            dk, dv = dk.transpose(2, 3), dv.transpose(2, 3)   # [B, H, Tq, S, D]
            sees = torch.ones(tq, dk.shape[3], dtype=torch.bool, device=q.device)
        scores = torch.cat([scores, (q[..., None, :] * dk).sum(-1) * scale], dim=-1)
        seen = torch.cat([seen.expand(b, 1, tq, -1), sees.expand(b, 1, tq, -1)], dim=-1)
    scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    sees_any = seen.any(-1, keepdim=True)                     # a row that sees no key outputs zeros
    probs = torch.softmax(scores.masked_fill(~seen & sees_any, float("-inf")), dim=-1)
    probs = probs.masked_fill(~sees_any, 0.0).to(v.dtype)
    tp = k.shape[2]
    out = probs[..., :tp] @ v
    if dk is not None:
        out = out + (probs[..., tp:, None] * dv).sum(-2)
    return out


def ttt_mask_mod(visible: Tensor, steps: int):
    """The TTT visibility as a flex-attention mask function over keys laid out as [prefix
    (Tp); diagonal keys flattened]: step-major key Tp + s * Tq + r belongs to row r, with
    steps in rows key Tp + r is row r's own key. visible [B, Tq, Tp]. Indices may be tensors
    of any broadcastable shapes (flex's vmap, or the index grids `sdpa` evaluates it on).
    Sizes are read from `visible` inside, so a compiled kernel does not specialize on them."""

    def mask_mod(b, h, q_idx, kv_idx):
        tq, tp = visible.shape[1], visible.shape[2]
        in_prefix = kv_idx < tp
        seen = visible[b, q_idx, kv_idx.clamp(max=tp - 1)]
        # Written for the compiler (create_block_mask compiles on CUDA): `(kv_idx - tp).clamp(min=0)`
        # before // or % fails inductor's range analysis ("vr must not be None"), and
        # `(in_prefix & seen) | (~in_prefix & own)` hits a CPU codegen bug (mixed mask types in
        # the padded tail); a where() for each compiles and means the same.
        j = torch.where(in_prefix, 0, kv_idx - tp)
        if steps:
            own = (j // steps == q_idx // steps) & (j % steps <= q_idx % steps)
        else:
            own = j % tq == q_idx
        return torch.where(in_prefix, seen, own)

    return mask_mod


# ---------------------------------------------------------------- backends
# Each: (q [B, H, Tq, D], k, v [B, Hkv, Tp, D], mask: skeleton.PrefixMask, dk, dv, steps, scale)
# -> [B, H, Tq, D] in any strides.

def _reference(q, k, v, mask, dk, dv, steps, scale):
    return reference_attention(q, k, v, mask.visible(), dk, dv, steps, scale)


def _flash_cpu(q, k, v, mask, dk, dv, steps, scale):
    return flash_attention(q, k, v, dk, dv, mask.flash_blocks(), steps, scale)


def _block(q, k, v, mask, dk, dv, steps, scale):
    b, h, tq, d = q.shape
    n = k.shape[1]
    qg = (q * scale).view(b, n, h // n, tq, d)
    rows = (slice(None),) * (2 if steps else 3)   # the diagonal keys' row dim
    outs = []
    for r0, r1, k0, k1 in mask.blocks:   # with steps in rows, blocks hold whole anchors
        outs.append(block_attention(qg[:, :, :, r0:r1], k[:, :, k0:k1], v[:, :, k0:k1],
                                    mask.bias[:, :, :, r0:r1, k0:k1], None if dk is None else dk[rows + (slice(r0, r1),)],
                                    None if dv is None else dv[rows + (slice(r0, r1),)], steps))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(b, h, tq, d)


def _diag_keys(x: Tensor, steps: int, r0: int, r1: int) -> Tensor:
    """Rows r0..r1's diagonal keys as a key sequence [B, Hkv, n, D] (step-major: s-major)."""
    return x[:, :, r0:r1] if steps else x[:, :, :, r0:r1].flatten(2, 3)


def _sdpa_blocks(mask, q: Tensor, dk: Tensor | None, steps: int) -> list:
    """Per row block: (r0, r1, k0, k1, bool mask [B, 1, R, Tk]) from `ttt_mask_mod`
    evaluated on the block's (row, key) index grid; cached for every layer of a step."""
    tq, s = q.shape[2], 0 if dk is None else (1 if steps else dk.shape[2])
    key = ("sdpa", s, steps)
    if key not in mask.cache:
        visible, dev = mask.visible(), q.device
        tp = visible.shape[-1]
        mod = ttt_mask_mod(visible, steps)
        blocks = []
        for r0, r1, k0, k1 in mask.blocks:
            kv = torch.arange(k0, k1, device=dev)
            if s:
                rows = torch.arange(r0, r1, device=dev)
                kv = torch.cat([kv, tp + (rows if steps else (torch.arange(s, device=dev)[:, None] * tq + rows).flatten())])
            b_idx = torch.arange(visible.shape[0], device=dev)[:, None, None]
            grid = mod(b_idx, None, torch.arange(r0, r1, device=dev)[None, :, None], kv[None, None, :])
            blocks.append((r0, r1, k0, k1, grid[:, None]))
        mask.cache[key] = blocks
    return mask.cache[key]


def _sdpa(q, k, v, mask, dk, dv, steps, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, tq, d = q.shape
    cuda = branch_device(q.device.type) == "cuda"
    # CUDA: only the memory-efficient kernel (the flash one takes no mask; the math one would
    # keep [heads, rows, keys] probabilities), with keys repeated per head (GQA, its layout)
    allowed = [SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    outs = []
    with sdpa_kernel(allowed):
        for r0, r1, k0, k1, allow in _sdpa_blocks(mask, q, dk, steps):
            kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
            if dk is not None:
                kb = torch.cat([kb, _diag_keys(dk, steps, r0, r1)], dim=2)
                vb = torch.cat([vb, _diag_keys(dv, steps, r0, r1)], dim=2)
            if cuda:
                kb, vb = kb.repeat_interleave(h // k.shape[1], 1), vb.repeat_interleave(h // k.shape[1], 1)
            outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], kb, vb, attn_mask=allow, scale=scale,
                                                       enable_gqa=not cuda))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


_compiled_flex: dict = {}
_compiled_block_mask = None


def _block_mask(mask_mod, batch: int, rows: int, keys: int, device: torch.device):
    """The BlockMask of `mask_mod`; on CUDA compiled once with dynamic shapes (one graph per
    layout: packed row and key counts change every batch, and `create_block_mask(_compile=True)`
    recompiled for each new shape until the recompile limit, then ran eagerly, which at paper
    shapes materializes [rows, keys] int64 index grids of ~17 GB)."""
    global _compiled_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if branch_device(device.type) != "cuda":
        return create_block_mask(mask_mod, batch, None, rows, keys, device=device)
    if _compiled_block_mask is None:
        _compiled_block_mask = torch.compile(create_block_mask, dynamic=True)
    return _compiled_block_mask(mask_mod, batch, None, rows, keys, device=device)


def _flex_function(device_type: str):
    """flex_attention, compiled on CUDA (dynamic shapes: packed row counts change every batch).
    CPU: eager, forward only; under cuda_branches compiled as on CUDA up to code generation
    (dynamo and AOTAutograd, `aot_eager`): inductor's CPU flex kernel has no backward, and its
    forward template fails to build the steps-in-rows mask; CUDA generates Triton instead."""
    from torch.nn.attention.flex_attention import flex_attention

    if branch_device(device_type) != "cuda":
        return flex_attention   # eager: materializes the scores, forward only on CPU (tests)
    backend = "inductor" if device_type == "cuda" else "aot_eager"
    if backend not in _compiled_flex:
        _compiled_flex[backend] = torch.compile(flex_attention, dynamic=True, backend=backend)
    return _compiled_flex[backend]


def _flex(q, k, v, mask, dk, dv, steps, scale):
    tq, device = q.shape[2], branch_device(q.device.type)
    if dk is not None:
        k = torch.cat([k, dk if steps else dk.flatten(2, 3)], dim=2)
        v = torch.cat([v, dv if steps else dv.flatten(2, 3)], dim=2)
    key = ("flex", k.shape[2], steps)
    if key not in mask.cache:
        visible = mask.visible()
        mask.cache[key] = _block_mask(ttt_mask_mod(visible, steps), visible.shape[0], tq, k.shape[2], q.device)
    if device != "cuda":   # PyTorch's flex_attention has no backward on CPU
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise RuntimeError("drafters.attention=flex: flex_attention has no backward on CPU; "
                               "use flash_cpu, block or sdpa there")
        q, k, v = q.detach(), k.detach(), v.detach()
    return _flex_function(q.device.type)(q, k, v, block_mask=mask.cache[key], scale=scale, enable_gqa=True)


_BACKEND_FUNCTIONS = {"reference": _reference, "flash_cpu": _flash_cpu, "block": _block, "sdpa": _sdpa,
                      "flex": _flex}


def use_attention(name: str, where: str = "drafters.attention") -> None:
    """Set the backend every drafter attention runs (`auto`: per device and dtype)."""
    global _chosen
    if name not in CHOICES:
        raise ValueError(f"{where}: unknown attention backend {name!r} (one of {', '.join(CHOICES)})")
    _chosen = name


def chosen_attention() -> str:
    return _chosen


def pick_backend(device_type: str, dtype: torch.dtype, training: bool | None = None, choice: str | None = None) -> str:
    """The backend that runs on this device and dtype: the configured one, or `auto`'s pick."""
    choice = choice or _chosen
    if choice != "auto":
        return choice
    if device_type == "cpu":
        return "flash_cpu" if dtype == torch.float32 else "block"
    if device_type == "cuda":
        training = torch.is_grad_enabled() if training is None else training
        return "flex" if training else "sdpa"
    return "block"


def attention(q: Tensor, k: Tensor, v: Tensor, mask, dk: Tensor | None, dv: Tensor | None, steps: int,
              scale: float, backend: str | None = None) -> Tensor:
    """The drafter attention through `backend` (default: `pick_backend` for q's device/dtype)."""
    name = backend or pick_backend(branch_device(q.device.type), q.dtype)
    if name == "flash_cpu" and (q.device.type != "cpu" or q.dtype != torch.float32):
        raise ValueError(f"drafters.attention=flash_cpu runs fp32 on CPU only, not {q.dtype} on {q.device.type}")
    return _BACKEND_FUNCTIONS[name](q, k, v, mask, dk, dv, steps, scale)
