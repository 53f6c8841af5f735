"""TTT trainer throughput against an EAGLE-3-style reference, side by side in one run.

The reference trains the same drafter modules the way EAGLE-3's published trainer does: a
Python loop over the K steps, each step appending its keys/values to a per-step cache and
adding every diagonal attention term as its own tensor op, and the target's full-vocabulary
softmax computed at every step and then indexed to the draft vocabulary (renormalized, so
the loss is the same). Both must give the same loss and gradients before they are timed.
Also: the hidden-only drafter's achieved FLOP rate against this CPU's fp32 matmul peak
measured in the same run.

Targets: >= 2x the reference's tokens/s for every paradigm; >= 40% of the matmul peak for
the hidden-only drafter. Prints the ratios last; exits non-zero when a target is missed.

    python benchmarks/ttt.py [--config config/config.yaml] [--iters 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from kvshot.config import read_config, runtime
from kvshot.drafters.skeleton import Attention
from kvshot.target import build_target, target_forward
from kvshot.train import build_variant
from kvshot.ttt import shift, step_losses, target_labels, unroll, weighted_loss

SPEEDUP_TARGET, PEAK_SHARE_TARGET = 2.0, 0.40


def reference_attend(self, q, prefix, prefix_visible, diag):
    """EAGLE-3's attention over its per-step cache: the causal block, then one explicit
    term per earlier step's diagonal key, each its own op."""
    b, h, tq, d = q.shape
    group = h // self.n_kv
    k0 = prefix.k.repeat_interleave(group, dim=1)
    v0 = prefix.v.repeat_interleave(group, dim=1)
    scores = (q @ k0.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~prefix_visible[:, None], float("-inf"))
    for keys in diag:
        kj = keys.k.repeat_interleave(group, dim=1)
        scores = torch.cat([scores, ((q * kj).sum(-1) / math.sqrt(d))[..., None]], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    tp = k0.shape[2]
    out = probs[..., :tp] @ v0
    for j, keys in enumerate(diag):
        out = out + probs[..., tp + j: tp + j + 1] * keys.v.repeat_interleave(group, dim=1)
    return self.o_proj(out.transpose(1, 2).reshape(b, tq, h * d))


@contextlib.contextmanager
def reference_attention():
    fast = Attention.attend
    Attention.attend = reference_attend
    try:
        yield
    finally:
        Attention.attend = fast


def reference_loss(model, batch, head_w, steps, decay):
    """Per step: full-vocabulary target softmax, indexed to the draft vocab and renormalized,
    labels shifted by padding, drafter unrolled with the per-step cache attention."""
    with reference_attention():
        un = unroll(model, batch, steps)
    total = 0.0
    for k in range(steps):
        logits_t = batch["last_hidden"] @ head_w.T                       # [B, T, V] every step
        p_full = torch.softmax(logits_t.float(), dim=-1)
        p = p_full[..., model.d2t]
        p = p / p.sum(-1, keepdim=True)
        greedy = shift(logits_t.argmax(-1), k + 1)
        valid = shift(batch["loss_mask"].bool() & batch["attention_mask"].bool(), k + 2, False)
        mask = valid & model.t2d[greedy]
        ce = -(shift(p, k + 1) * F.log_softmax(un.logits[k].float(), dim=-1)).sum(-1)
        total = total + decay ** k * (ce * mask).sum() / mask.sum().clamp(min=1)
    return total


def ours_loss(model, batch, head_w, steps, decay):
    labels = target_labels(batch["last_hidden"], head_w, model.d2t)
    losses, *_ = step_losses(model, unroll(model, batch, steps), batch, labels)
    return weighted_loss(losses, decay)


def timed(fn, model, batch, head_w, steps, decay, iters):
    out = []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn(model, batch, head_w, steps, decay).backward()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def matmul_peak(n: int = 1024, iters: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n ** 3 * iters / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    cfg = read_config(args.config or ["config/config.yaml"])
    rt = runtime(cfg)
    torch.manual_seed(0)
    tc, dcfg = cfg["drafters"]["train"], cfg["drafters"]
    vocab = cfg["tokenizer"]["vocab_size"]
    target = build_target(cfg["target"]["arch"], vocab, 0).eval().requires_grad_(False)
    n_layers = target.config.num_hidden_layers
    ids = torch.randint(3, vocab, (tc["batch_size"], tc["max_len"]))
    aux = (2, n_layers // 2, n_layers - 3)
    ctx = target_forward(target, ids, None, aux, tuple(range(n_layers)))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "aux_hidden": ctx.aux_hidden, "last_hidden": ctx.last_hidden,
             **{f"key_{l}": ctx.keys[l] for l in range(n_layers)}, **{f"value_{l}": ctx.values[l] for l in range(n_layers)}}
    head_w = target.lm_head.weight
    d2t = torch.arange(min(dcfg["draft_vocab_size"], vocab))
    steps, decay = dcfg["ttt_steps"], dcfg["step_decay"]
    tokens = ids.numel()
    peak = matmul_peak()
    rows, ok = [], True
    for v in dcfg["variants"]:
        model = build_variant(v, target.config, target.model.embed_tokens.weight, d2t)
        # same loss and gradients first
        model.zero_grad()
        l_ref = reference_loss(model, batch, head_w, steps, decay)
        l_ref.backward()
        g_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        l_ours = ours_loss(model, batch, head_w, steps, decay)
        l_ours.backward()
        same = torch.allclose(l_ref, l_ours, rtol=1e-5, atol=1e-6) and all(
            torch.allclose(g_ref[n], p.grad, rtol=1e-3, atol=1e-6) for n, p in model.named_parameters() if n in g_ref)
        t_ref = timed(reference_loss, model, batch, head_w, steps, decay, args.iters)
        t_ours = timed(ours_loss, model, batch, head_w, steps, decay, args.iters)
        with FlopCounterMode(display=False) as fc:
            ours_loss(model, batch, head_w, steps, decay).backward()
        rate = fc.get_total_flops() / t_ours
        row = {"variant": v["name"], "same_loss_and_grads": bool(same), "ours_tokens_per_s": tokens / t_ours,
               "reference_tokens_per_s": tokens / t_ref, "speedup": t_ref / t_ours, "gflops": rate / 1e9,
               "peak_share": rate / peak}
        rows.append(row)
        ok &= same and row["speedup"] >= SPEEDUP_TARGET
        if v["paradigm"] == "hidden":
            ok &= row["peak_share"] >= PEAK_SHARE_TARGET
    out = {"matmul_peak_gflops": peak / 1e9, "tokens_per_step": tokens, "threads": torch.get_num_threads(),
           "device": rt.device, "rows": rows}
    Path("results/benchmarks").mkdir(parents=True, exist_ok=True)
    Path("results/benchmarks/ttt.json").write_text(json.dumps(out, indent=2))
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s on {torch.get_num_threads()} threads; "
          f"{tokens} tokens per step, K = {steps}")
    print(f"{'variant':10s} {'same':>5s} {'ours tok/s':>11s} {'ref tok/s':>10s} {'GFLOP/s':>8s} {'of peak':>8s}")
    for r in rows:
        print(f"{r['variant']:10s} {str(r['same_loss_and_grads']):>5s} {r['ours_tokens_per_s']:11.0f} "
              f"{r['reference_tokens_per_s']:10.0f} {r['gflops']:8.1f} {r['peak_share']:8.1%}")
    print("speedup vs reference: " + ", ".join(f"{r['variant']} {r['speedup']:.2f}x" for r in rows)
          + f" (target >= {SPEEDUP_TARGET}x); hidden-only at "
          + ", ".join(f"{r['peak_share']:.0%}" for r, v in zip(rows, dcfg["variants"]) if v["paradigm"] == "hidden")
          + f" of matmul peak (target >= {PEAK_SHARE_TARGET:.0%})  {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
