"""The GPU path, run on CPU: every branch `device: cuda` selects in the drafter attention
(`auto`'s flex for training, sdpa for decoding, block masks and flex compiled, SDPA's CUDA
layout) taken by CPU tensors under `attention.cuda_branches()`, with bf16 autocast as a bf16
runtime runs it. What CPU cannot run is listed in docs/gpu.md.

The training-step test is the one that would have caught the first GPU run's crash: the
mask function failed to compile (`vr must not be None`), and no CPU test compiled it."""
from __future__ import annotations

import copy

import pytest
import torch

import kvshot.drafters.attention as attn
from kvshot.config import Runtime
from kvshot.train.loop import setup, train_step

from .test_attention_backends import case, rel_err, run
from ..conftest import typed

VARIANTS = [   # every paradigm, and both block contexts
    {"name": "eagle3", "paradigm": "hidden", "layers": 1, "qk_norm": False},
    {"name": "kv-d2", "paradigm": "kv", "layers": 2},
    {"name": "hybrid", "paradigm": "hybrid", "layers": 1, "gate_shape": "scalar", "gate_init": 0.5},
    {"name": "standalone", "paradigm": "standalone", "layers": 1},
    {"name": "block-kv-d1", "paradigm": "block", "context": "kv", "layers": 1},
    {"name": "block-hidden", "paradigm": "block", "context": "hidden", "layers": 1},
]
LAYOUTS = [  # (diagonal keys, steps in rows): hidden step 0, hidden step k, KV one pass / block
    ("none", 0), ("steps", 0), ("rows", 3)]


def block_mask_tensors(bm) -> list[torch.Tensor]:
    return [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]


@pytest.mark.parametrize("diag,steps", LAYOUTS)
def test_compiled_block_masks_equal_the_eager_ones(diag, steps):
    """The mask as CUDA builds it (compiled once, dynamic shapes) equals the eager one, block
    for block, for every key layout, at sizes that span several 128-blocks with a padded tail
    and two batch sizes through one compiled graph."""
    torch.manual_seed(0)
    for b, tq, tp in [(1, 150, 180), (2, 140, 190)]:
        visible = torch.rand(b, tq, tp) < 0.6
        keys = tp + (3 * tq if diag == "steps" else tq if diag == "rows" else 0)
        mod = attn.ttt_mask_mod(visible, steps)
        eager = attn._block_mask(mod, b, tq, keys, torch.device("cpu"))
        with attn.cuda_branches():
            compiled = attn._block_mask(mod, b, tq, keys, torch.device("cpu"))
        assert attn._compiled_block_mask is not None
        for e, c in zip(block_mask_tensors(eager), block_mask_tensors(compiled)):
            assert torch.equal(e, c)


@pytest.mark.parametrize("diag", ["none", "steps", "rows"])
def test_flex_as_compiled_on_cuda_matches_the_reference(diag):
    """Under cuda_branches, `auto` picks flex with a gradient (compiled with dynamic shapes,
    through AOTAutograd) and sdpa (CUDA's layout) without one. Outputs and gradients equal the
    reference's."""
    inputs, mask, steps = case(torch.float32, diag)
    ref_out, ref_grads = run("reference", inputs, mask, steps)
    with attn.cuda_branches():
        assert attn.pick_backend(attn.branch_device("cpu"), torch.float32, training=True) == "flex"
        assert attn.pick_backend(attn.branch_device("cpu"), torch.float32, training=False) == "sdpa"
        out, grads = run("flex", inputs, mask, steps)
        with torch.no_grad():
            sdpa = attn.attention(*inputs[:3], mask, *inputs[3:], steps, inputs[0].shape[-1] ** -0.5)   # auto: sdpa
    assert "aot_eager" in attn._compiled_flex
    assert rel_err(out, ref_out) < 1e-5 and rel_err(sdpa, ref_out) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


def one_step(tiny, tiny_features, tmp_path, variant: dict, dtype: str, cuda: bool):
    """One real trainer step (`train.train_step`: unroll, loss, backward, clip, AdamW) from the
    seeded initial drafter: the step's losses, its pre-clip gradient norms, the clipped
    gradients AdamW reads, the parameters after, and the attention backends that ran."""
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["drafters"].update(ttt_steps=3, attention="auto" if cuda else "reference")
    cfg["drafters"]["variants"] = [variant] if variant["paradigm"] != "block" else cfg["drafters"]["variants"]
    cfg["blockwise"]["variants"] = [variant] if variant["paradigm"] == "block" else []
    cfg["blockwise"]["remedies"] = []
    cfg["drafters"]["train"].update(batch_size=2, max_len=40, max_steps=4, eval_batches=1, log_every=1,
                                    diagnostic_sequences=1)
    rt = Runtime(device="cpu", dtype=dtype, threads=1, seed=0)
    ran = []
    spies = {n: (lambda f, n: lambda *a: ran.append(n) or f(*a))(f, n) for n, f in attn._BACKEND_FUNCTIONS.items()}
    saved = dict(attn._BACKEND_FUNCTIONS)
    attn._BACKEND_FUNCTIONS.update(spies)
    try:
        r = setup(typed(cfg), rt, variant["name"], str(tiny_features["train"]), str(tiny_features["eval"]),
                  str(tiny["model"]), str(tmp_path / variant["name"]), None, None)
        grads = {}
        r.opt.register_step_pre_hook(lambda opt, args, kwargs: grads.update(
            {n: p.grad.detach().clone() for n, p in r.model.named_parameters() if p.grad is not None}))
        if cuda:
            with attn.cuda_branches():
                s = train_step(r, logging=True)
        else:
            s = train_step(r, logging=True)
    finally:
        attn._BACKEND_FUNCTIONS.update(saved)
        attn.use_attention("auto")
    params = {n: p.detach().clone() for n, p in r.model.named_parameters() if p.requires_grad}
    return s.totals, s.norms, grads, params, set(ran)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v["name"] for v in VARIANTS])
def test_a_training_step_through_the_cuda_branches_equals_the_reference(tiny, tiny_features, tmp_path, variant):
    """Each paradigm and block kind: one full training step, bf16 autocast over fp32
    parameters as a bf16 runtime trains, through the branches CUDA takes (flex with compiled
    block masks) against the same step through the reference attention. bf16 products differ
    in their rounding between the two algorithms: losses to 1%, gradients to 3% in norm (the
    bf16 tolerance of tests/unit/test_attention_backends.py, summed over a layer's backward)."""
    ref_totals, ref_norms, ref_grads, ref_params, ref_ran = one_step(tiny, tiny_features, tmp_path / "ref", variant,
                                                                     "bfloat16", cuda=False)
    totals, norms, grads, params, ran = one_step(tiny, tiny_features, tmp_path / "cuda", variant, "bfloat16", cuda=True)
    assert ref_ran == {"reference"} and ran == {"flex"}
    assert grads.keys() == ref_grads.keys() and grads
    k = (len(ref_totals) - 1) // 4   # the objective, then ce_sum_k, correct_k, acc_n_k, scored_k (Step.totals)
    for a, b in zip(totals[: 1 + k], ref_totals[: 1 + k]):
        assert abs(a - b) <= 1e-2 * abs(b), (totals, ref_totals)
    for g in ref_norms:
        assert abs(norms[g] - ref_norms[g]) <= 3e-2 * ref_norms[g] + 1e-6, (g, norms, ref_norms)
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < 3e-2, n
    assert all(torch.isfinite(p).all() for p in params.values())


@pytest.mark.parametrize("paradigm", ["hidden", "kv", "block"])
def test_decoding_through_the_cuda_branches_is_lossless(tiny, drafter_world, paradigm):
    """Speculative decoding as CUDA runs it (`auto` picks sdpa for the drafter's rows, in
    CUDA's layout; bf16 autocast): the output is the target's greedy text."""
    from kvshot.capture.target import load_target
    from kvshot.evaluate.decode import plain_generate, speculative_generate
    from kvshot.evaluate.draft_tree import DraftSpec

    from ..conftest import build_test_drafter

    variant = {"name": "v", "paradigm": paradigm, "layers": 1, "block_size": 4,
               **({"context": "kv"} if paradigm == "block" else {})}
    target = load_target(tiny["model"], tiny["rt"])
    model = build_test_drafter(drafter_world, variant)
    src = drafter_world[0]
    ids = src.tokens(0)["input_ids"][:12].long()[None]
    aux = src.spec.aux_layers if model.reads_aux_hidden else None
    ran = []
    real = attn._BACKEND_FUNCTIONS["sdpa"]
    attn._BACKEND_FUNCTIONS["sdpa"] = lambda *a: ran.append("sdpa") or real(*a)
    try:
        with attn.cuda_branches():
            out = speculative_generate(target, model, ids, 10, None, aux, DraftSpec(depth=3), precision="bfloat16")
    finally:
        attn._BACKEND_FUNCTIONS["sdpa"] = real
    assert ran and out.tokens == plain_generate(target, ids, 10, None).tokens
