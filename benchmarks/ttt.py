"""TTT trainer throughput against an EAGLE-3-style reference, side by side in one run.

The reference trains the same drafter modules the way EAGLE-3's published trainer does: a
Python loop over the K steps, each step appending its keys/values to a per-step cache and
adding every diagonal attention term as its own tensor op, and the target's full-vocabulary
softmax computed at every step and then indexed to the draft vocabulary (renormalized, so
the loss is the same). Both must give the same loss and gradients before they are timed.
Also: the hidden-only drafter's achieved FLOP rate against this CPU's fp32 matmul peak
measured beside its timings (the median of measurements before every timed batch and after
the last, since the machine's speed drifts within minutes; the flop counter is given the CPU
flash kernel's formulas), and for every variant how much more matmul work the reference
does: the speedup is that work ratio times our FLOP rate over the reference's.

Targets: >= 2x the reference's tokens/s for every paradigm; >= 40% of the matmul peak for
the hidden-only drafter. Prints the ratios last; exits non-zero when a target is missed.

    python benchmarks/ttt.py [--config config/config.yaml] [--batches 4] [--iters 3] [--threads N] [--variants a,b]

With a finished default run it times the trainer's first batches of the real captured features
(user turns carry no label); otherwise random tokens with every position labelled.
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

from kvshot.core import numerics

numerics.apply_for_script()   # before torch: the pipeline's numerics (KVSHOT_NUMERICS=native: this machine's own)
import torch  # noqa: E402
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from kvshot.capture.features import open_features
from kvshot.capture.target import build_target, load_target, target_forward
from kvshot.config import runtime, typed_config
from kvshot.drafters.skeleton import Attention
from kvshot.drafters.unroll import TTTUnroll, label_positions, reference_unroll, shift
from kvshot.train.objective import step_losses, target_labels, weighted_loss
from kvshot.train.variants import build_variant
from kvshot.settings import Config

SPEEDUP_TARGET, PEAK_SHARE_TARGET = 2.0, 0.40


# the flop counter knows the CUDA flash kernels, not the CPU one the trainer uses on fp32
@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _flash_cpu_flop(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _flash_cpu_backward_flop(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


_REPEATED: dict[int, torch.Tensor] = {}   # EAGLE-3 caches its keys already repeated to every head


def repeated(x: torch.Tensor, group: int) -> torch.Tensor:
    """repeat_kv once per cached tensor (keys stay alive for the unroll, so ids are unique)."""
    if id(x) not in _REPEATED:
        _REPEATED[id(x)] = x.repeat_interleave(group, dim=1)
    return _REPEATED[id(x)]


def reference_attend(self, q, prefix, mask, diag):
    """EAGLE-3's attention over its per-step cache: q @ k0^T over every prefix key plus the
    precomputed additive mask, then one explicit term per earlier step's diagonal key, each
    its own op, and the output as the matching sum."""
    b, h, tq, d = q.shape
    group = h // self.n_kv
    k0, v0 = repeated(prefix.k, group), repeated(prefix.v, group)
    scores = (q @ k0.transpose(-1, -2)) / math.sqrt(d) + mask.bias[:, 0]
    for keys in diag:
        scores = torch.cat([scores, ((q * repeated(keys.k, group)).sum(-1) / math.sqrt(d))[..., None]], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    tp = k0.shape[2]
    out = probs[..., :tp] @ v0
    for j, keys in enumerate(diag):
        out = out + probs[..., tp + j: tp + j + 1] * repeated(keys.v, group)
    return self.o_proj(out.transpose(1, 2).reshape(b, tq, h * d))


@contextlib.contextmanager
def reference_trainer(model):
    """EAGLE-3's attention (the readable one is `attention.reference_attention`; this one is
    EAGLE-3's per-step cache, timed as that trainer runs it)."""
    fast = Attention.attend
    Attention.attend = reference_attend
    _REPEATED.clear()
    try:
        yield
    finally:
        Attention.attend = fast
        _REPEATED.clear()


def reference_loss(model, batch, head_w, steps, decay):
    """EAGLE-3's trainer: the target's full-vocabulary logits come with the batch; every step
    shifts them (padding), takes the full-vocabulary softmax and argmax, indexes the draft
    vocab (renormalized, so the loss is ours) and masks with t2d; the loss multiplies the
    position mask into p * log q before the vocabulary sum (`position_mask * plogp`), and is
    normalized by the scored count as ours is; the drafter runs every position of every
    step with the per-step cache attention."""
    target_logits = batch["last_hidden"] @ head_w.T                     # [B, T, V], as the target gives it
    with reference_trainer(model):
        un = reference_unroll(model, batch, steps)   # every step run explicitly, every anchor
    total, accs = 0.0, []
    for k in range(steps):
        logits_t = shift(target_logits, k + 1)
        p_full = torch.softmax(logits_t.float(), dim=-1)
        p = p_full[..., model.d2t]
        p = p / p.sum(-1, keepdim=True)
        greedy = p_full.argmax(-1)
        valid = shift(batch["loss_mask"].bool() & batch["attention_mask"].bool(), k + 2, False)
        mask = valid & model.t2d[greedy]
        plogp = p * F.log_softmax(un.logits[k].float(), dim=-1)
        ce = -(mask[..., None] * plogp).sum(-1)      # EAGLE-3 masks the [B, T, V] product
        total = total + decay ** k * ce.sum() / mask.sum().clamp(min=1)
        with torch.no_grad():   # EAGLE-3 logs acc at every step (ours: the trainer's acc_k)
            accs.append(((un.logits[k].argmax(-1) == p.argmax(-1)) & mask).sum().item() / (valid.sum().item() + 1e-6))
    return total


def ours_loss(model, batch, head_w, steps, decay):
    """The trainer's step: labels once per batch, the unroll DDP wraps (`unroll.TTTUnroll`)."""
    labels = target_labels(batch["last_hidden"], head_w, model.d2t, positions=label_positions(batch))
    losses, *_ = step_losses(model, TTTUnroll(model)(batch, steps), batch, labels)
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


def benchmark_batches(cfg: Config, results: Path, n_batches: int, batch_size: int, max_len: int):
    """The trained target and the trainer's first batches of the captured train features
    (real loss masks: user turns carry no label), truncated as the trainer does; without a
    default run, a random target and random tokens with every position labelled."""
    feats = results / "features/train"
    if (feats / "index.json").exists() and (results / "target/model").exists():
        target = load_target(results / "target/model", runtime(cfg)).eval().requires_grad_(False)
        src = open_features(feats)
        order = torch.randperm(len(src), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003)).tolist()
        batches = [{k: t[:, :max_len] for k, t in src.batch(order[i * batch_size: (i + 1) * batch_size]).items()}
                   for i in range(n_batches)]
        return target, batches, f"the trainer's first {n_batches} batches of {feats}"
    vocab = cfg.tokenizer.vocab_size
    target = build_target(cfg.target.arch, vocab, 0).eval().requires_grad_(False)
    n_layers = target.config.num_hidden_layers
    batches = []
    for _ in range(n_batches):
        ids = torch.randint(3, vocab, (batch_size, max_len))
        ctx = target_forward(target, ids, None, (2, n_layers // 2, n_layers - 3), tuple(range(n_layers)))
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
                        "aux_hidden": ctx.aux_hidden, "last_hidden": ctx.last_hidden,
                        **{f"key_{l}": ctx.keys[l] for l in range(n_layers)},
                        **{f"value_{l}": ctx.values[l] for l in range(n_layers)}})
    return target, batches, f"{n_batches} batches of random tokens, every position labelled (no default run found)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--iters", type=int, default=3, help="timings per batch (median)")
    ap.add_argument("--batches", type=int, default=4, help="training batches timed (sum)")
    ap.add_argument("--results", default="results", help="a default run's results: its target and a real batch")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's)")
    ap.add_argument("--variants", default=None, help="comma-separated drafter variants (default: every one of the config)")
    args = ap.parse_args()
    cfg = typed_config(args.config or ["config/config.yaml"])
    rt = runtime(cfg)
    torch.manual_seed(0)
    tc, dcfg = cfg.drafters.train, cfg.drafters
    steps, decay = dcfg.ttt_steps, dcfg.step_decay
    target, batches, source = benchmark_batches(cfg, Path(args.results), args.batches, tc.batch_size, tc.max_len)
    batch = batches[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    head_w = target.lm_head.weight
    vocab = target.config.vocab_size
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    peaks = []   # measured beside every timed batch: the machine's speed drifts within minutes
    rows = []
    names = args.variants.split(",") if args.variants else [v.name for v in dcfg.variants]
    unknown = sorted(set(names) - {v.name for v in dcfg.variants})
    if unknown:
        ap.error(f"--variants: {', '.join(unknown)} not in drafters.variants of {args.config or ['config/config.yaml']}")
    variants = [v for v in dcfg.variants if v.name in names]
    for v in variants:
        d2t = torch.arange(vocab if v.paradigm == "standalone" else min(dcfg.draft_vocab_size, vocab))
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
        t_ref = t_ours = 0.0
        beside = []
        for b in batches:   # interleaved, so a change in machine load hits both alike (and the peak)
            beside.append(matmul_peak())
            t_ref += timed(reference_loss, model, b, head_w, steps, decay, args.iters)
            t_ours += timed(ours_loss, model, b, head_w, steps, decay, args.iters)
        beside.append(matmul_peak())
        peaks += beside
        flops = {}
        for fn in (ours_loss, reference_loss):
            with FlopCounterMode(display=False) as fc:
                for b in batches:
                    fn(model, b, head_w, steps, decay).backward()
            flops[fn] = fc.get_total_flops()
        rate, ref_rate, beside_peak = flops[ours_loss] / t_ours, flops[reference_loss] / t_ref, statistics.median(beside)
        # speedup = (the reference's flops / ours) x (our flop rate / the reference's)
        rows.append({"variant": v.name, "same_loss_and_grads": bool(same), "ours_tokens_per_s": tokens / t_ours,
                     "reference_tokens_per_s": tokens / t_ref, "speedup": t_ref / t_ours, "gflops": rate / 1e9,
                     "reference_gflops": ref_rate / 1e9, "work_ratio": flops[reference_loss] / flops[ours_loss],
                     "matmul_peak_gflops": beside_peak / 1e9,   # each variant against the peak beside its own timings
                     "peak_share": rate / beside_peak, "reference_peak_share": ref_rate / beside_peak})
    labelled = sum(float((b["loss_mask"] * b["attention_mask"]).sum()) for b in batches) / sum(
        b["attention_mask"].numel() for b in batches)
    peak = statistics.median(peaks)
    ok = all(r["same_loss_and_grads"] and r["speedup"] >= SPEEDUP_TARGET for r in rows) and all(
        r["peak_share"] >= PEAK_SHARE_TARGET for r, v in zip(rows, variants) if v.paradigm == "hidden")
    out = {"batch": source, "labelled_share": labelled, "matmul_peak_gflops": peak / 1e9,
           "matmul_peak_gflops_measured": [p / 1e9 for p in peaks], "tokens": tokens, "batches": len(batches), "threads": torch.get_num_threads(),
           "device": rt.device, "rows": rows}
    Path("results/benchmarks").mkdir(parents=True, exist_ok=True)
    Path("results/benchmarks/ttt.json").write_text(json.dumps(out, indent=2))
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (median of {len(peaks)} measurements, one beside each timed "
          f"batch, {min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f}; each variant against those beside its own timings) "
          f"on {torch.get_num_threads()} threads; "
          f"{tokens} tokens in {len(batches)} steps, K = {steps}; {source}, {labelled:.0%} of positions labelled")
    print(f"{'variant':10s} {'same':>5s} {'ours tok/s':>11s} {'ref tok/s':>10s} {'GFLOP/s':>8s} {'of peak':>8s} "
          f"{'ref of peak':>12s} {'ref/ours flops':>15s}")
    for r in rows:
        print(f"{r['variant']:10s} {str(r['same_loss_and_grads']):>5s} {r['ours_tokens_per_s']:11.0f} "
              f"{r['reference_tokens_per_s']:10.0f} {r['gflops']:8.1f} {r['peak_share']:8.1%} "
              f"{r['reference_peak_share']:12.1%} {r['work_ratio']:15.2f}")
    print("speedup vs reference: " + ", ".join(f"{r['variant']} {r['speedup']:.2f}x" for r in rows)
          + f" (target >= {SPEEDUP_TARGET}x); hidden-only at "
          + ", ".join(f"{r['peak_share']:.0%}" for r, v in zip(rows, variants) if v.paradigm == "hidden")
          + f" of matmul peak (target >= {PEAK_SHARE_TARGET:.0%})  {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
