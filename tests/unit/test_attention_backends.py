"""Every attention backend and every optimized unroll against the plain references
(`attention.reference_attention`, `unroll.reference_unroll`): outputs, losses and gradients,
fp32 to 1e-5 relative, bf16 within its rounding; `auto`'s choice; the GPU backends' mask
function; and what the memory-bound backend keeps for its backward."""
from __future__ import annotations

import pytest
import torch

from kvshot.drafters import attention as attn
from kvshot.drafters.skeleton import prefix_mask

FP32_REL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (relative in norm: elementwise ratios of near-zero entries mean nothing)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def case(dtype=torch.float32, diag: str = "none", blind_rows: int = 0, block_rows: int = 4, seed: int = 0):
    """Two packed sequences (rows 0..5 and 6..11, keys 0..6 and 7..11), causal-style visibility,
    2 KV heads x 2 query heads each; diag: none | steps (3 earlier steps per row, step-major) |
    rows (steps in rows: 4 anchors x 3 steps, each row's own key). Returns the inputs (leaves),
    the PrefixMask, and the step count for steps in rows."""
    g = torch.Generator().manual_seed(seed)
    b, n, grp, t, tp, d = 1, 2, 2, 12, 12, 8
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    q, k, v = mk(b, n * grp, t, d), mk(b, n, tp, d), mk(b, n, tp, d)
    steps = 3 if diag == "rows" else 0
    if diag == "steps":
        dk, dv = mk(b, n, 3, t, d), mk(b, n, 3, t, d)
    elif diag == "rows":
        dk, dv = mk(b, n, t, d), mk(b, n, t, d)
    else:
        dk = dv = None
    if steps:   # per anchor (4 anchors: 2 per sequence), then spread to its step rows
        visible = torch.zeros(b, t // steps, tp, dtype=torch.bool)
        visible[0, 0, :3], visible[0, 1, :7], visible[0, 2, 7:9], visible[0, 3, 7:]= True, True, True, True
        visible[0, :blind_rows] = False
        mask = prefix_mask(visible, dtype, [(0, 2), (2, 4)], max(1, block_rows // steps)).spread(steps)
    else:
        visible = torch.zeros(b, t, tp, dtype=torch.bool)
        for r in range(6):
            visible[0, r, : r + 2] = True
        for r in range(6, 12):
            visible[0, r, 7: 7 + r - 5] = True
        visible[0, :blind_rows] = False
        mask = prefix_mask(visible, dtype, [(0, 6), (6, 12)], block_rows)
    return (q, k, v, dk, dv), mask, steps


def run(backend, inputs, mask, steps, weights=None):
    """Output and the gradients of <output, weights> for every input."""
    q, k, v, dk, dv = inputs
    out = attn.attention(q, k, v, mask, dk, dv, steps, q.shape[-1] ** -0.5, backend=backend)
    leaves = [x for x in inputs if x is not None]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype) if weights is None else weights
    return out, torch.autograd.grad((out * weights).sum(), leaves)


CASES = [("none", 0), ("steps", 0), ("steps", 2), ("rows", 0), ("rows", 1)]


@pytest.mark.parametrize("backend", ["flash_cpu", "block", "sdpa"])
@pytest.mark.parametrize("diag,blind_rows", CASES)
@pytest.mark.parametrize("block_rows", [4, 512])
def test_backends_match_the_reference_fp32(backend, diag, blind_rows, block_rows):
    inputs, mask, steps = case(torch.float32, diag, blind_rows, block_rows)
    ref, ref_grads = run("reference", inputs, mask, steps)
    out, grads = run(backend, inputs, mask, steps)
    assert rel_err(out, ref) < FP32_REL
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < FP32_REL


@pytest.mark.parametrize("diag,blind_rows", CASES)
def test_reference_matches_float64_and_flex_forward(diag, blind_rows):
    """The reference in fp64 against the fused kernel in fp64 (both exact up to rounding), and
    flex_attention's forward (PyTorch runs it eagerly on CPU, forward only) against it."""
    inputs, mask, steps = case(torch.float64, diag, blind_rows)
    ref, _ = run("reference", inputs, mask, steps)
    fused, _ = run("block", inputs, mask, steps)
    assert rel_err(fused, ref) < 1e-12
    inputs32, mask32, _ = case(torch.float32, diag, blind_rows)
    with torch.no_grad():
        q, k, v, dk, dv = inputs32
        flex = attn.attention(q, k, v, mask32, dk, dv, steps, q.shape[-1] ** -0.5, backend="flex")
    assert rel_err(flex, ref) < FP32_REL


def test_flex_refuses_a_cpu_backward_in_one_line():
    inputs, mask, steps = case(torch.float32, "steps")
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        run("flex", inputs, mask, steps)


@pytest.mark.parametrize("diag", ["none", "steps", "rows"])
def test_mask_function_is_the_reference_visibility(diag):
    """`ttt_mask_mod` over [prefix; diagonal] keys is exactly what the reference lets each row see."""
    from torch.nn.attention.flex_attention import create_mask

    (q, k, v, dk, dv), mask, steps = case(torch.float32, diag, blind_rows=1)
    visible = mask.visible()
    tq, tp = visible.shape[1:]
    n_diag = 0 if dk is None else (tq if steps else dk.shape[2] * tq)
    dense = create_mask(attn.ttt_mask_mod(visible, steps), 1, None, tq, tp + n_diag, device="cpu")[0, 0]
    assert torch.equal(dense[:, :tp], visible[0])
    own = dense[:, tp:]
    if diag == "steps":
        assert torch.equal(own, torch.eye(tq, dtype=torch.bool).repeat(1, 3))          # row r: key (s, r) for every s
    elif diag == "rows":
        tril = torch.ones(3, 3, dtype=torch.bool).tril()
        assert torch.equal(own, torch.block_diag(*[tril] * (tq // 3)))                 # (a, i) sees (a, j <= i)


# bf16: inputs are exact in bf16 and compared to the fp64 reference on the same values. A
# bf16 rounding costs at most 2^-8 = 0.39% relative; the output is rounded once and the
# probabilities once before the value product (the block kernel also rounds them, flash and
# SDPA keep fp32 accumulators), so ~2-3 roundings bound the forward near 1%; the backward
# rounds the score gradient once more: 2%. (Measured on these cases: outputs <= 0.4%,
# gradients <= 1.1%, the largest SDPA's value gradient with steps in rows.)
BF16_OUT, BF16_GRAD = 1e-2, 2e-2


@pytest.mark.parametrize("backend", ["reference", "block", "sdpa"])
@pytest.mark.parametrize("diag", ["steps", "rows"])
def test_backends_in_bf16_within_rounding(backend, diag):
    inputs, mask, steps = case(torch.bfloat16, diag)
    exact = [None if x is None else x.detach().double().requires_grad_() for x in inputs]
    _, mask64, _ = case(torch.float64, diag)
    weights = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(7))
    ref, ref_grads = run("reference", exact, mask64, steps, weights.double())
    out, grads = run(backend, inputs, mask, steps, weights.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < BF16_OUT
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and rel_err(g, r) < BF16_GRAD
    if backend == "sdpa":
        with torch.no_grad():
            q, k, v, dk, dv = inputs
            flex = attn.attention(q, k, v, mask, dk, dv, steps, q.shape[-1] ** -0.5, backend="flex")
        assert rel_err(flex, ref) < BF16_OUT


def test_auto_picks_per_device_and_dtype():
    """CPU fp32: the fused kernel; other CPU dtypes: the block kernel; CUDA: flex to train,
    SDPA to decode (few rows, no backward); a configured backend wins over auto."""
    assert attn.pick_backend("cpu", torch.float32, choice="auto") == "flash_cpu"
    assert attn.pick_backend("cpu", torch.bfloat16, choice="auto") == "block"
    assert attn.pick_backend("cuda", torch.bfloat16, training=True, choice="auto") == "flex"
    assert attn.pick_backend("cuda", torch.bfloat16, training=False, choice="auto") == "sdpa"
    assert attn.pick_backend("cuda", torch.bfloat16, training=True, choice="sdpa") == "sdpa"
    try:
        attn.use_attention("reference")
        assert attn.pick_backend("cpu", torch.float32) == "reference"
    finally:
        attn.use_attention("auto")
    assert attn.pick_backend("cpu", torch.float32) == "flash_cpu"
    with pytest.raises(ValueError, match="drafters.attention: unknown attention backend 'fast'"):
        attn.use_attention("fast")
    inputs, mask, steps = case(torch.bfloat16, "steps")
    with pytest.raises(ValueError, match="flash_cpu runs fp32 on CPU only"):
        run("flash_cpu", inputs, mask, steps)


def saved_float_sizes(backend, inputs, mask, steps) -> list[int]:
    """numel of every floating tensor the autograd graph keeps for the backward."""
    sizes = []

    def pack(x):
        if x.is_floating_point():
            sizes.append(x.numel())
        return x

    q, k, v, dk, dv = inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        attn.attention(q, k, v, mask, dk, dv, steps, q.shape[-1] ** -0.5, backend=backend)
    return sizes


def test_sdpa_keeps_no_probabilities_for_the_backward():
    """The memory-bound backend keeps operands, output and logsumexp, nothing of [heads, rows,
    keys]; the reference (which does) shows the check can fail."""
    inputs, mask, steps = case(torch.float32, "steps", block_rows=512)
    heads, rows = inputs[0].shape[1:3]
    keys = mask.visible().shape[-1] + 3          # prefix + the row's 3 diagonal keys
    assert max(saved_float_sizes("reference", inputs, mask, steps)) >= heads * rows * keys
    assert max(saved_float_sizes("sdpa", inputs, mask, steps)) < heads * rows * keys


def unroll_case(paradigm: str):
    from kvshot.drafters import DrafterConfig, build_drafter

    torch.manual_seed(0)
    h, layers, vocab, b, t = 32, 4, 64, 3, 40
    cfg = DrafterConfig(paradigm=paradigm, hidden_size=h, num_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=vocab,
                        draft_vocab_size=48, kv_layers=[2] if paradigm in ("kv", "hybrid") else [])
    model = build_drafter(cfg)
    model.set_vocab(torch.randn(vocab, h), torch.arange(48))
    attention_mask = torch.ones(b, t, dtype=torch.long)
    attention_mask[2, 30:] = 0
    loss_mask = (torch.rand(b, t) < 0.5).long() * attention_mask
    batch = {"input_ids": torch.randint(0, vocab, (b, t)), "attention_mask": attention_mask, "loss_mask": loss_mask,
             "aux_hidden": torch.randn(b, t, 3, h), "last_hidden": torch.randn(b, t, h),
             **{f"key_{l}": torch.randn(b, t, 2, 8) for l in range(layers)},
             **{f"value_{l}": torch.randn(b, t, 2, 8) for l in range(layers)}}
    return model, batch, torch.randn(vocab, h)


def loss_and_grads(model, batch, head, backend: str, reference_loop: bool):
    """The TTT loss (K = 4) and every parameter's gradient: the plain K-step loop on every
    anchor, or the trainer's unroll (packing; one call for every step of the KV-only drafter;
    one pass for the standalone LM), with the attention backend `backend`."""
    from kvshot.drafters.unroll import label_positions, reference_unroll, unroll
    from kvshot.train.objective import step_losses, target_labels, weighted_loss

    attn.use_attention(backend)
    try:
        model.zero_grad(set_to_none=True)
        if reference_loop:
            labels = target_labels(batch["last_hidden"], head, model.d2t)
            un = reference_unroll(model, batch, 4)
        else:
            labels = target_labels(batch["last_hidden"], head, model.d2t, positions=label_positions(batch))
            un = unroll(model, batch, 4, skip_unlabelled=True)
        loss = weighted_loss(step_losses(model, un, batch, labels)[0], 0.8)
        if torch.is_grad_enabled():
            loss.backward()
    finally:
        attn.use_attention("auto")
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("block_rows", [512, 12])   # 12: blocks of a few anchors (KV-only: 12 // K rows x K steps)
@pytest.mark.parametrize("paradigm", ["hidden", "kv", "hybrid", "standalone"])
def test_optimized_unroll_and_backends_match_the_reference_loop(paradigm, block_rows, monkeypatch):
    """The plain loop with the reference attention against the trainer's unroll under every
    backend that trains on CPU: fp32 loss and every gradient to 1e-5 relative; flex (forward
    only on CPU): the loss."""
    from kvshot.drafters import skeleton

    monkeypatch.setattr(skeleton, "BLOCK_ROWS", block_rows)
    model, batch, head = unroll_case(paradigm)
    ref_loss, ref_grads = loss_and_grads(model, batch, head, "reference", reference_loop=True)
    assert torch.isfinite(ref_loss) and len(ref_grads) > 5
    for backend in ("reference", "flash_cpu", "block", "sdpa"):
        loss, grads = loss_and_grads(model, batch, head, backend, reference_loop=False)
        assert rel_err(loss, ref_loss) < FP32_REL, backend
        assert grads.keys() == ref_grads.keys(), backend
        for name in grads:
            assert rel_err(grads[name], ref_grads[name]) < FP32_REL, (backend, name)
    with torch.no_grad():
        loss, _ = loss_and_grads(model, batch, head, "flex", reference_loop=False)
    assert rel_err(loss, ref_loss) < FP32_REL


def test_gpu_benchmark_dry_run(tmp_path):
    """benchmarks/gpu.py --dry: every figure of the GPU check on CPU at tiny sizes, one JSON
    line each and no errors; the config line shows `auto`'s CUDA choice (flex to train, SDPA
    to decode) and the CPU fp32 one (the fused kernel). compiled_step runs for the hidden
    paradigm only: the same step through CUDA's branches for every paradigm and block kind is
    test_cuda_branches.py's (issue 48: the four other compiles cost ~25 s here). The smoke DAG
    with device cuda (`--skip-dag` here, ~11 s of `snakemake -n`) is dry-run by
    tests/pipeline/test_gpu_dag.py through the same function."""
    import json
    import subprocess
    import sys

    from ..conftest import REPO

    out = tmp_path / "gpu.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry", "--compiled", "hidden", "--skip-dag", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert not [x for x in lines if "error" in x or "skipped" in x]
    config = lines[0]
    assert config["figure"] == "config" and config["configured_attention"] == "auto"
    assert (config["cuda_training_backend"], config["cuda_decoding_backend"]) == ("flex", "sdpa")
    assert config["cpu_fp32_training_backend"] == "flash_cpu"
    compiled = {x["paradigm"]: x for x in lines if x["figure"] == "compiled_step"}   # CUDA's branches, on CPU
    assert set(compiled) == {"hidden"}
    for x in compiled.values():
        assert x["backend"] == ["flex"] and x["cpu_as_cuda"] and x["loss_rel_err"] < 1e-2 and x["grad_norm_rel_err"] < 3e-2
    steps = {(x["paradigm"], x["backend"]): x for x in lines if x["figure"] == "train_step"}
    assert set(steps) == {(p, b) for p in ("hidden", "kv", "hybrid", "standalone") for b in ("flex", "sdpa")}
    assert all(x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1 for x in steps.values())
    assert all(x["backward"] == (b == "sdpa") for (_, b), x in steps.items())   # no flex backward on CPU
    figures = {x["figure"] for x in lines}
    assert {"online_features", "online_features_overhead", "decode_round"} <= figures and "smoke_dag" not in figures
    # --dry runs the per-paradigm rows at --shape small: the rows of benchmarks/paper_shapes.py
    costs = {x["row"]: x for x in lines if x["figure"] == "rule_cost"}
    paradigms = ("hidden", "kv", "hybrid", "standalone", "block")
    assert set(costs) == {f"{rule}/{p}" for rule in ("train_drafter", "evaluate", "eval_stepwise") for p in paradigms}
    assert all(x["shape"] == "small" and x["seconds"] > 0 and x["peak_memory_gb"] is None for x in costs.values())
    assert all(costs[f"eval_stepwise/{p}"]["anchors"] == costs[f"eval_stepwise/{p}"]["prefixes"] for p in paradigms)
    assert all(costs[f"evaluate/{p}"]["tokens"] > 0 for p in paradigms)
    assert costs["train_drafter/hidden"]["seconds_vs_hidden"] == 1.0 and "seconds_vs_hidden" in costs["evaluate/kv"]
