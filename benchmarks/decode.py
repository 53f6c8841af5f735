"""Speculative decoding against what theory predicts, in one run.

For each drafter, chain drafting (K steps) and plain decoding run on the same prompts in the
same harness, alternating prompt by prompt. From that run: the per-step acceptance alpha_k (rounds that reached step k and
accepted it), the draft/target cost ratio c (drafting time per draft step over the plain
decoder's time per token), and the measured speedup (plain time / speculative time for the
same tokens). Theory (Leviathan et al. 2023, per-step alphas): speedup = MAT / (K c + 1),
MAT = 1 + sum_k prod_{j<=k} alpha_j. Target: measured >= 0.85 x predicted for chain drafting.
Theory counts the verify forward over K + 1 tokens as one plain step; it also prints the
run's own cost of it (v, in plain steps) and what the ratio comes to when that is all that
differs: (K c + 1) / (K c + v), for information (the target stays measured / predicted).
Prints the ratios last; exits non-zero when the target is missed.

    python benchmarks/decode.py [--variants eagle3 kv-d2] [--prompts 8] [--max-new 64]

Needs a finished default run (results/target/model, results/drafters/*, results/eval/continuations.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvshot.core import numerics

numerics.apply_for_script()   # before torch: the pipeline's numerics (KVSHOT_NUMERICS=native: this machine's own)
import torch  # noqa: E402

from kvshot.capture.target import load_target
from kvshot.config import runtime, typed_config
from kvshot.core.io import read_json
from kvshot.drafters import load_drafter
from kvshot.evaluate.decode import plain_generate, speculative_generate
from kvshot.evaluate.draft_tree import DraftSpec
from kvshot.stats.metrics import mat

RATIO_TARGET = 0.85


def alphas_from_rounds(accepted: list[int], steps: int) -> list[float]:
    """alpha_k from chain rounds: a round that accepted a tokens reached steps 0..a (capped)."""
    reached = [sum(1 for a in accepted if a >= k) for k in range(steps)]
    took = [sum(1 for a in accepted if a > k) for k in range(steps)]
    return [t / r if r else float("nan") for t, r in zip(took, reached)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--results", default="results")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    cfg = typed_config(args.config or ["config/config.yaml"])
    rt = runtime(cfg)
    res = Path(args.results)
    target = load_target(res / "target/model", rt)
    cont = read_json(res / "eval/continuations.json")
    items, eos = cont["items"][: args.prompts], cont["eos_id"]
    aux = tuple(read_json(res / "features/eval/index.json")["spec"]["aux_layers"])
    steps = cfg.drafters.ttt_steps
    names = args.variants or [v.name for v in cfg.drafters.variants]
    prompts = [torch.tensor([it["prompt"]]) for it in items]
    plain_generate(target, prompts[0], 8, eos)                                   # warm-up
    rows, ok, plain_ms = [], True, []
    for name in names:
        drafter = load_drafter(res / "drafters" / name, embed=target.model.embed_tokens.weight).eval()
        a = aux if drafter.reads_aux_hidden else None
        spec = DraftSpec(depth=steps, topk=1)
        speculative_generate(target, drafter, prompts[0], 8, eos, a, spec)          # warm-up
        # plain and speculative alternate prompt by prompt: a drift in machine speed hits both
        plain, runs = [], []
        for p in prompts:
            plain.append(plain_generate(target, p, args.max_new, eos))
            runs.append(speculative_generate(target, drafter, p, args.max_new, eos, a, spec))
        t_token = sum(r.total_s - r.prefill_s for r in plain) / sum(len(r.tokens) - 1 for r in plain)
        plain_ms.append(1e3 * t_token)
        assert all(r.tokens == b.tokens for r, b in zip(runs, plain)), f"{name}: not lossless"
        accepted = [x for r in runs for x in r.accepted]
        alphas = alphas_from_rounds(accepted, steps)
        rounds = sum(r.rounds for r in runs)
        c = sum(r.draft_s for r in runs) / (rounds * steps) / t_token
        predicted = mat(alphas) / (steps * c + 1)
        # same tokens, after the prefill both share: plain time over speculative time
        measured = sum(b.total_s - b.prefill_s for b in plain) / sum(r.total_s - r.prefill_s for r in runs)
        verify_ratio = sum(r.verify_s for r in runs) / rounds / t_token
        verify_bound = (steps * c + 1) / (steps * c + verify_ratio)   # a round costs K c + v steps, not K c + 1
        rows.append({"variant": name, "plain_ms_per_token": 1e3 * t_token, "alpha": alphas, "mat": mat(alphas), "cost_ratio": c,
                     "verify_over_token": verify_ratio, "verify_bound": verify_bound, "predicted_speedup": predicted,
                     "measured_speedup": measured, "ratio": measured / predicted, "rounds": rounds})
        ok &= measured / predicted >= RATIO_TARGET
    out = {"prompts": len(items), "max_new_tokens": args.max_new,
           "steps": steps, "device": rt.device, "threads": torch.get_num_threads(), "rows": rows}
    Path(res, "benchmarks").mkdir(parents=True, exist_ok=True)
    Path(res, "benchmarks/decode.json").write_text(json.dumps(out, indent=2))
    print(f"plain decoding {min(plain_ms):.2f}-{max(plain_ms):.2f} ms/token (measured beside each drafter); "
          f"chain K = {steps}; {len(items)} prompts x {args.max_new} tokens")
    print(f"{'variant':8s} {'MAT':>6s} {'c':>6s} {'verify/tok':>10s} {'predicted':>9s} {'measured':>9s} {'ratio':>6s} {'(Kc+1)/(Kc+v)':>14s}")
    for r in rows:
        print(f"{r['variant']:8s} {r['mat']:6.3f} {r['cost_ratio']:6.3f} {r['verify_over_token']:10.2f} "
              f"{r['predicted_speedup']:9.3f} {r['measured_speedup']:9.3f} {r['ratio']:6.3f} {r['verify_bound']:14.3f}")
    print("measured / predicted speedup (chain): " + ", ".join(f"{r['variant']} {r['ratio']:.2f}" for r in rows)
          + f" (target >= {RATIO_TARGET})  {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
