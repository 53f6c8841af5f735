"""The project's decoder against HuggingFace's assisted generation, same draft model.

The standalone drafter (a small Qwen3 LM distilled from the target, no context reuse) drafts
for both: kvshot's `speculative_generate` with a chain of K = drafters.ttt_steps, and
`target.generate(assistant_model=to_hf(drafter))` set to draft the same constant K tokens per
round (no confidence early-stop, no schedule). Same prompts (results/eval/continuations.json),
greedy, and the outputs must be identical token for token. Timings are wall clock around each
call, interleaved per prompt, repeated; tokens/s is the median over repeats of total tokens /
total seconds. Target: ours >= 1.0x HF's tokens/s. Prints the ratio last; exits non-zero when
the target is missed.

    python benchmarks/assisted.py [--prompts 8] [--max-new 64] [--repeats 5]

Needs a finished default run with the standalone variant (results/target/model,
results/drafters/standalone, results/eval/continuations.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvshot.core import numerics

numerics.apply_for_script()   # before torch: the pipeline's numerics (KVSHOT_NUMERICS=native: this machine's own)
import torch  # noqa: E402

from kvshot.capture.target import load_target
from kvshot.config import runtime, typed_config
from kvshot.core.io import read_json
from kvshot.drafters import load_drafter
from kvshot.drafters.standalone import to_hf
from kvshot.evaluate.decode import speculative_generate
from kvshot.evaluate.draft_tree import DraftSpec

RATIO_TARGET = 1.0


def constant_drafts(hf_draft, k: int) -> None:
    """HF's assistant drafts exactly k tokens every round: no heuristic schedule, and a zero
    confidence threshold switches off both the early stop and its ROC-based adaptation."""
    gc = hf_draft.generation_config
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0


class ForwardCounter:
    """Counts a module's forward calls (target forwards per generation) while active."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls, self.handle = module, 0, None

    def __enter__(self):
        self.calls = 0
        self.handle = self.module.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--results", default="results")
    ap.add_argument("--variant", default="standalone")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's)")
    args = ap.parse_args()
    cfg = typed_config(args.config or ["config/config.yaml"])
    rt = runtime(cfg)
    if args.threads:   # e.g. 1 when another job holds a core: spinning intra-op threads distort both
        torch.set_num_threads(args.threads)
    res = Path(args.results)
    target = load_target(res / "target/model", rt, cfg.target.attn_implementation)
    drafter = load_drafter(res / "drafters" / args.variant, rt.device, embed=target.model.embed_tokens.weight).eval()
    hf_draft = to_hf(drafter, target.config.max_position_embeddings, target.config._attn_implementation)
    steps = cfg.drafters.ttt_steps
    constant_drafts(hf_draft, steps)
    cont = read_json(res / "eval/continuations.json")
    eos, pad = cont["eos_id"], target.config.pad_token_id
    prompts = [torch.tensor([it["prompt"]], device=rt.device) for it in cont["items"][: args.prompts]]
    spec = DraftSpec(depth=steps, topk=1)

    def ours(x, n):
        return speculative_generate(target, drafter, x, n, eos, None, spec).tokens

    def hf(x, n):
        out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=hf_draft, do_sample=False,
                              max_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
        return out[0, x.shape[1]:].tolist()

    methods = {"kvshot speculative_generate": ours, "HF generate(assistant_model=)": hf}
    for x in prompts[:2]:                                    # warm-up: allocator, kernels, caches
        for fn in methods.values():
            fn(x, 8)
    # untimed pass: identical outputs, and how many target forwards each needs
    tokens, forwards = {}, {}
    for name, fn in methods.items():
        with ForwardCounter(target.model) as counter:
            tokens[name] = [fn(x, args.max_new) for x in prompts]
        forwards[name] = counter.calls
    ours_tokens, hf_tokens = tokens.values()
    mismatch = [i for i, (x, y) in enumerate(zip(ours_tokens, hf_tokens)) if x != y]
    assert not mismatch, f"outputs differ on prompts {mismatch}"
    n_tokens = sum(len(t) for t in ours_tokens)

    seconds = {name: [] for name in methods}
    for _ in range(args.repeats):
        total = dict.fromkeys(methods, 0.0)
        for x in prompts:                                    # interleaved: drift hits both alike
            for name, fn in methods.items():
                start = time.perf_counter()
                fn(x, args.max_new)
                total[name] += time.perf_counter() - start
        for name in methods:
            seconds[name].append(total[name])
    rows = []
    for name in methods:
        s = statistics.median(seconds[name])
        rows.append({"method": name, "tokens": n_tokens, "target_forwards": forwards[name],
                     "tokens_per_forward": n_tokens / forwards[name], "seconds_median": s,
                     "seconds_all": seconds[name], "tokens_per_s": n_tokens / s})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    ok = ratio >= RATIO_TARGET
    out = {"variant": args.variant, "draft_layers": drafter.cfg.num_layers, "draft_tokens_per_round": steps,
           "prompts": len(prompts), "max_new_tokens": args.max_new, "repeats": args.repeats, "identical": True,
           "device": rt.device, "threads": torch.get_num_threads(), "rows": rows, "ratio": ratio,
           "target": RATIO_TARGET, "met": ok}
    Path(res, "benchmarks").mkdir(parents=True, exist_ok=True)
    Path(res, "benchmarks/assisted.json").write_text(json.dumps(out, indent=2))
    print(f"draft model: {args.variant} ({drafter.cfg.num_layers} layers), K = {steps} per round; "
          f"{len(prompts)} prompts x {args.max_new} tokens, greedy, outputs identical; "
          f"median of {args.repeats} interleaved repeats; {rt.device}, {torch.get_num_threads()} threads")
    print(f"{'method':30s} {'tokens':>7s} {'target fwd':>10s} {'tok/fwd':>7s} {'seconds':>8s} {'tokens/s':>9s}")
    for r in rows:
        print(f"{r['method']:30s} {r['tokens']:7d} {r['target_forwards']:10d} {r['tokens_per_forward']:7.2f} "
              f"{r['seconds_median']:8.3f} {r['tokens_per_s']:9.1f}")
    print(f"ours / HF tokens/s: {ratio:.2f}x (target >= {RATIO_TARGET:.1f}x) {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
